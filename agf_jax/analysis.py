"""Filter analysis for AGF (Wi, Choi, Park, IJCAI 2025): pure functions usable from notebooks.

* The learned graph filter g(s) = sum_k c_k P_k(s) of every AGF layer over s in [0, 1] and its
    coefficients c_k, read from a params tree (`filter_coefficients_of`, `filter_response`).
* The implicit T x T attention matrix H_tj = sum_k U_tk g_tk V_jk of a layer for small T
    (`implicit_attention`), and the same-projection softmax matrix softmax(Z_U Z_V^T / sqrt(D)) for
    comparison (`softmax_attention_matrix`).
* Frequency content along the sequence: the energy of the low DFT components (the DC term by
    default) versus the rest, of the values and of the AGF / softmax outputs (`frequency_energy`,
    `frequency_comparison`). This is the quantity of the paper's Theorem 1 / Fig. 3: a
    row-stochastic, positive softmax matrix is a low-pass filter (it damps the high-frequency part
    of its input), while AGF's signed, token-specific spectrum can keep or amplify it.
* Over-smoothing: the mean pairwise cosine similarity of token representations, per layer of a
    model (`token_cosine_similarity`, `oversmoothing_profile`).

Everything returns numpy arrays; shapes use B batch, T sequence, H heads, D head width, L layers.
"""
from __future__ import annotations

__all__ = ["agf_layers", "filter_coefficients_of", "filter_response", "implicit_attention", "softmax_attention_matrix",
           "frequency_energy", "high_frequency_fraction", "frequency_comparison", "token_cosine_similarity",
           "oversmoothing_profile", "attention_probes", "operator_oversmoothing"]

from typing import Any, Mapping, Optional

import jax.numpy as jnp
import numpy as np

from agf_jax import ops, softmax
from zoo_core import moved

_AGF_KEYS = frozenset({"query", "key", "sigma", "value", "out"})


def agf_layers(params: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Finds the AGF attention layers in a params tree.

    Args:
        params: a params tree (with or without the top-level 'params' key).

    Returns:
        {'encoder/block_00/attention': layer params, ...} in tree order.
    """
    if "params" in params and isinstance(params["params"], Mapping):
        params = params["params"]
    found: dict[str, Mapping[str, Any]] = {}

    def walk(tree, path):
        if not isinstance(tree, Mapping):
            return
        if _AGF_KEYS <= set(tree):
            found["/".join(path)] = tree
            return
        for k in sorted(tree):
            walk(tree[k], path + (str(k),))

    walk(params, ())
    return found


def filter_coefficients_of(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Effective coefficients c_0..c_K of every AGF layer of a params tree: `ops.filter_coefficients`
    of each layer's theta (c_0 = 1 if frozen, else tanh(theta_0)).

    Args:
        params: a params tree.

    Returns:
        {layer path: `[K+1]`}.
    """
    return {path: np.asarray(ops.filter_coefficients(p.get("theta"), p.get("theta_0")))
            for path, p in agf_layers(params).items()}


def filter_response(params: Mapping[str, Any], *, basis: str = "jacobi",
                    alpha: Optional[float] = None, beta: Optional[float] = None,
                    num_points: int = 101,
                    s: Optional[np.ndarray] = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The learned filter g(s) = sum_k c_k P_k(s) of every AGF layer on a grid of s in [0, 1].

    The basis is not stored in the params, so pass the model's `basis`, `alpha`, `beta`.

    Args:
        params: a params tree.
        basis, alpha, beta: the layers' polynomial basis (see `agf_jax.ops.resolve_basis`).
        num_points: grid size on [0, 1] when `s` is None.
        s: `[P]` explicit evaluation points.

    Returns:
        (s `[P]`, {layer path: g `[P]`}).
    """
    s = np.linspace(0.0, 1.0, num_points) if s is None else np.asarray(s)
    grid = jnp.asarray(s, jnp.float32)
    out = {path: np.asarray(ops.graph_filter(grid, jnp.asarray(c), basis=basis, alpha=alpha,
                                             beta=beta))
           for path, c in filter_coefficients_of(params).items()}
    return s, out


def implicit_attention(layer, variables, x, *, mask=None) -> np.ndarray:
    """The T x T matrix AGF applies to the values: O = H @ Val per head (O(T^2 D), small T only).

    Args:
        layer: an `AGFAttention` (its `causal` flag selects the prefix-normalised matrix).
        variables: its variables ({'params': ...}).
        x: `[B, T, E]` layer input.
        mask: `[B, T]` or None.

    Returns:
        `[B, H, T, T]` (query t, key j).
    """
    f = layer.apply(variables, x, mask=mask, method="factors")
    return np.asarray(ops.agf_attention_matrix(
        f["zu"], f["zv"], f["zs"], f["coeffs"], basis=layer.basis, alpha=layer.alpha,
        beta=layer.beta, mask=mask, causal=layer.causal))


def softmax_attention_matrix(layer, variables, x, *, mask=None) -> np.ndarray:
    """softmax(Z_U Z_V^T / sqrt(D)) built from the same layer's query/key projections.

    This is the vanilla-attention counterpart of `implicit_attention` for frequency comparisons.

    Args:
        layer: an `AGFAttention`.
        variables: its variables.
        x: `[B, T, E]`.
        mask: `[B, T]` or None (key padding).

    Returns:
        `[B, H, T, T]`, row-stochastic.
    """
    f = layer.apply(variables, x, mask=mask, method="factors")
    return np.asarray(softmax.softmax_attention_weights(f["zu"], f["zv"], mask=mask))


def frequency_energy(y, *, axis: int = 1, num_low: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Energy of the low and high DFT components of a signal along its sequence axis.

    Low = the frequencies |f| < num_low (num_low = 1: the DC term, the mean over tokens); high = the
    rest. By Parseval, low + high = T * sum over the axis of y^2.

    Args:
        y: real array with the sequence on `axis`.
        axis: the sequence axis.
        num_low: how many of the lowest frequencies count as low (>= 1).

    Returns:
        (low, high), each the input shape with `axis` reduced and summed over no other axis.
    """
    if num_low < 1:
        raise ValueError(f"num_low must be >= 1, got {num_low}")
    y = np.asarray(y, np.float64)
    t = y.shape[axis]
    power = np.abs(np.fft.fft(y, axis=axis)) ** 2
    freq = np.minimum(np.arange(t), t - np.arange(t))        # |f| of each DFT bin
    shape = [1] * y.ndim
    shape[axis] = t
    is_low = (freq < num_low).reshape(shape)
    return np.sum(power * is_low, axis=axis), np.sum(power * ~is_low, axis=axis)


def high_frequency_fraction(y, *, axis: int = 1, num_low: int = 1) -> np.ndarray:
    """high / (low + high) of `frequency_energy`, summed over every axis but the leading ones.

    Args:
        y: `[B, T, ...]` (sequence on `axis`).
        axis: the sequence axis.
        num_low: see `frequency_energy`.

    Returns:
        `[B]` fractions in [0, 1].
    """
    low, high = frequency_energy(y, axis=axis, num_low=num_low)
    red = tuple(range(1, low.ndim))
    low, high = low.sum(axis=red), high.sum(axis=red)
    return high / np.maximum(low + high, np.finfo(np.float64).tiny)


def frequency_comparison(layer, variables, x, *, mask=None, num_low: int = 1) -> dict:
    """High-frequency content of the values and of the AGF vs softmax outputs, per head.

    Both outputs apply a T x T matrix to the same per-head values Val (the layer's value
    projection): AGF's implicit H and the same-projection softmax S. A ratio below the input's
    means the operator smooths (low-pass); softmax always does (Theorem 1 / Fig. 3 of the paper).

    Args:
        layer: an `AGFAttention`.
        variables: its variables.
        x: `[B, T, E]`.
        mask: `[B, T]` or None.
        num_low: see `frequency_energy`.

    Returns:
        dict of `[B, H]` high-frequency fractions: 'input' (Val), 'agf' (H Val), 'softmax' (S Val),
        and 'agf_gain' / 'softmax_gain' = ||HC(output)|| / ||HC(Val)|| (energy ratios).
    """
    f = layer.apply(variables, x, mask=mask, method="factors")
    val = np.asarray(f["value"], np.float64)                          # [B, T, H, D]
    h = implicit_attention(layer, variables, x, mask=mask)            # [B, H, T, T]
    s = softmax_attention_matrix(layer, variables, x, mask=mask)
    outs = {"input": val,
            "agf": np.einsum("bhtj,bjhd->bthd", h, val),
            "softmax": np.einsum("bhtj,bjhd->bthd", s, val)}
    result, high = {}, {}
    for name, y in outs.items():
        low_e, high_e = frequency_energy(y, axis=1, num_low=num_low)   # [B, H, D]
        low_e, high_e = low_e.sum(-1), high_e.sum(-1)
        high[name] = high_e
        result[name] = high_e / np.maximum(low_e + high_e, np.finfo(np.float64).tiny)
    tiny = np.finfo(np.float64).tiny
    result["agf_gain"] = high["agf"] / np.maximum(high["input"], tiny)
    result["softmax_gain"] = high["softmax"] / np.maximum(high["input"], tiny)
    return result


def token_cosine_similarity(h, mask=None) -> np.ndarray:
    """Mean cosine similarity over pairs of distinct (real) tokens: 1 = fully over-smoothed.

    Args:
        h: `[B, T, E]` token representations.
        mask: `[B, T]` (True/1 = real token) or None.

    Returns:
        `[B]` (NaN for a sample with fewer than two real tokens).
    """
    h = np.asarray(h, np.float64)
    if h.ndim != 3:
        raise ValueError(f"h must be [B, T, E], got shape {h.shape}")
    m = np.ones(h.shape[:2], bool) if mask is None else np.asarray(mask).astype(bool)
    if m.shape != h.shape[:2]:
        raise ValueError(f"mask must be [B, T] = {h.shape[:2]}, got {m.shape}")
    unit = h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-12)
    cos = np.einsum("bte,bse->bts", unit, unit)
    pair = m[:, :, None] & m[:, None, :] & ~np.eye(h.shape[1], dtype=bool)[None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sum(cos * pair, axis=(1, 2)) / np.sum(pair, axis=(1, 2))


def _find_sown(tree, name: str) -> list:
    found = []
    if isinstance(tree, Mapping):
        for k in sorted(tree):
            if k == name:
                found.extend(tree[k])
            else:
                found.extend(_find_sown(tree[k], name))
    return found


def oversmoothing_profile(model, variables, batch: Mapping[str, Any], *, mask=None) -> np.ndarray:
    """Mean token cosine similarity after the embedding and after every block of a model.

    Uses the 'hidden_states' the models sow into the 'intermediates' collection.

    Args:
        model: an `agf_jax.model` module (LRAClassifier, UEAClassifier; for LRARetrieval the two
            towers are stacked, first tower first).
        variables: {'params': ...}.
        batch: the model's batch.
        mask: `[B, T]` real-token mask; default: batch['mask'] if present, else the token positions
            of integer 'inputs' as the LRA encoder sees them (`lra_encoder_tokens`), else all tokens.

    Returns:
        `[L+1, B]` (per tower for retrieval: `[2 (L+1), B]`).
    """
    _, state = model.apply(variables, batch, mutable=["intermediates"])
    hidden = _find_sown(state["intermediates"], "hidden_states")
    from agf_jax import model as model_lib

    def token_mask(ids):   # the positions the LRA encoder holds tokens at (CLS pooling shifts them)
        pooling = getattr(model, "pooling", "mean")
        vocab = getattr(model, "vocab_size", 0)
        return np.asarray(model_lib.lra_encoder_tokens(jnp.asarray(ids), pooling=pooling,
                                                       vocab_size=vocab)[1]) > 0

    if mask is None:
        if "mask" in batch:
            mask = batch["mask"]
        elif "inputs" in batch and jnp.issubdtype(jnp.asarray(batch["inputs"]).dtype, jnp.integer):
            mask = token_mask(batch["inputs"])
    if "inputs1" in batch and mask is None:
        masks = [token_mask(batch["inputs1"]), token_mask(batch["inputs2"])]
        per = len(hidden) // 2
        return np.stack([token_cosine_similarity(h, masks[i // per]) for i, h in enumerate(hidden)])
    return np.stack([token_cosine_similarity(h, mask) for h in hidden])



# ---------------------------------------------------------------------------------------------
# Per-layer probes of a whole model and the over-smoothing of an attention operator (used by
# notebooks/agf_filters.ipynb).
# ---------------------------------------------------------------------------------------------


def attention_probes(model, variables, batch: Mapping[str, Any]) -> list[dict]:
    """Every AGF attention layer of a model, rebuilt standalone, with the input it sees on `batch`.

    The result plugs into the layer-level functions above (`implicit_attention`,
    `softmax_attention_matrix`, `frequency_comparison`) for each block of a trained model.

    Args:
        model: an `agf_jax.model.LRAClassifier` or `UEAClassifier` with attention='agf'.
        variables: {'params': ...} of that model.
        batch: the model's batch.

    Returns:
        One dict per block, in order: 'name' (params path), 'layer' (an `AGFAttention` with the
        block's fields), 'variables' ({'params': the block's attention params}), 'x' `[B, T, E]`
        (the attention input: LN(h) for the pre-LN LRA blocks, h for the post-LN UEA blocks) and
        'mask' (`[B, T]` float for LRA, None for UEA, whose attention is not masked).

    Raises:
        ValueError: another model class, or attention='softmax'.
    """
    import flax.linen as nn

    from agf_jax import layers as layers_lib
    from agf_jax import model as model_lib

    if not isinstance(model, (model_lib.LRAClassifier, model_lib.UEAClassifier)):
        raise ValueError(f"attention_probes supports LRAClassifier and UEAClassifier, got "
                         f"{type(model).__name__}")
    if model.attention != "agf":
        raise ValueError(f"model.attention must be 'agf', got {model.attention!r}")
    params = variables["params"] if "params" in variables else variables
    _, state = model.apply({"params": params}, batch, mutable=["intermediates"])
    hidden = _find_sown(state["intermediates"], "hidden_states")      # L+1 arrays [B, T, E]
    is_lra = isinstance(model, model_lib.LRAClassifier)
    blocks = params["encoder"] if is_lra else params
    mask = model_lib.lra_encoder_tokens(jnp.asarray(batch["inputs"]), pooling=model.pooling,
                                        vocab_size=model.vocab_size)[1] if is_lra else None
    head_dim = model.head_dim or model.d_model // model.num_heads
    probes = []
    for i in range(model.num_layers):
        name = f"block_{i:02d}"
        block = blocks[name]
        layer = layers_lib.AGFAttention(
            num_heads=model.num_heads, head_dim=head_dim, basis=model.basis, order=model.order,
            alpha=model.alpha, beta=model.beta, learn_c0=False if is_lra else model.learn_c0,
            ortho_count_padding=True, graph_filter=model.graph_filter)
        x = jnp.asarray(hidden[i])
        if is_lra:   # pre-LN: the attention sees LN(h)
            norm = nn.LayerNorm(epsilon=model_lib.LN_EPS)
            x = norm.apply({"params": block["attention_norm"]}, x)
        probes.append(dict(name=("encoder/" if is_lra else "") + f"{name}/attention", layer=layer,
                           variables={"params": block["attention"]}, x=x, mask=mask))
    return probes


def operator_oversmoothing(matrix, values, *, num_steps: int = 8, mask=None) -> np.ndarray:
    """Token similarity after applying a T x T attention operator repeatedly to the values.

    y_0 = Val, y_{k+1} = M y_k per head. A row-stochastic positive M (softmax) drives all tokens to
    the same vector (similarity -> 1, over-smoothing); AGF's signed token-specific spectrum need not.

    Args:
        matrix: `[B, H, T, T]` (e.g. `implicit_attention` or `softmax_attention_matrix`).
        values: `[B, T, H, D]`.
        num_steps: applications of M.
        mask: `[B, T]` real tokens for the similarity, or None.

    Returns:
        `[num_steps + 1, B]` mean pairwise cosine similarity of the tokens (heads concatenated).
    """
    m = np.asarray(matrix, np.float64)
    y = np.asarray(values, np.float64)
    if m.ndim != 4 or y.ndim != 4 or m.shape[-1] != y.shape[1] or m.shape[:2] != (y.shape[0], y.shape[2]):
        raise ValueError(f"matrix must be [B, H, T, T] and values [B, T, H, D] with matching B, H, T; "
                         f"got {m.shape} and {y.shape}")
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    out = []
    for _ in range(num_steps + 1):
        out.append(token_cosine_similarity(y.reshape(y.shape[0], y.shape[1], -1), mask))
        y = np.einsum("bhtj,bjhd->bthd", m, y)
        # A global rescale per sample keeps y in range (cosines are scale-free).
        y = y / np.maximum(np.max(np.abs(y), axis=(1, 2, 3), keepdims=True), 1e-300)
    return np.stack(out)


# The names of 0.1.0 that were renamed warn and give the new function (zoo_core.moved.RENAMED).
__getattr__ = moved.renamed_getattr(__name__)
