"""Interpretability of SAMoVAR as a VAR model (Lu & Yang, ICML 2025; spec `samovar.md` §3, §10).

Column-vector convention throughout (the spec's §3): every token's VAR observation x0_j and output z_t
are column vectors in R^E (E = H*D, heads concatenated), and

    z_t = sum_{j<=t} Gamma_{t,j} x0_j,      Gamma_{t,j} = D^T C_{t,j} + I 1[j=t],
    C_{t,j} = sum_{m=1}^{l} B^(m)_{t,j},    B^(m)_{t,j} = sum_{s=j}^{t} A^(m)_{t,s} W_k^(m)T B^(m-1)_{s,j},
    B^(0)_{s,j} = I 1[s=j],                 A^(m)_{t,s} = blockdiag_h( v^(m)_{s,h} q^(m)T_{t,h} ),

where q, v are the per-layer queries and values computed from x0 (held fixed: this is the VAR reading,
linear in x0 given its data-dependent coefficients), W_k = I in SAMoVAR (`key_kernels` is the row-layout
matrix W of the "w/ W_k" ablation, k = o W, i.e. W^T on columns) and D^T is the column-side form of
the released code's row-side `z = x0 + M D` (block-diagonal over heads). With `shortcut_inside`
(`z = (x0 + M) D`) Gamma = D^T (C + I 1[j=t]); with D^-1 or no D the corresponding matrix is used.

Functions:
  `lag_matrices`: Gamma (or D^T C without the shortcut) for every (t, j), [..., T, T, E, E].
  `channel_contributions`: W_out D C_{t,j} W_out^T, the lag matrices seen through the output head,
    [..., T, T, P, P] (for P = 1, a T x T heatmap).
  `path_factors`, `temporal_path_weights`, `model_temporal_paths`, `num_temporal_paths`,
    `total_num_paths`: the poster's temporal-influence paths A^(l)_{t,i1} A^(l-1)_{i1,i2} ... A^(1)_{i_{l-1},j}
    (Fig. 5), with each rank-1 A replaced by its scalar q . v as the reference notebook does.
  `model_lag_matrices`: the above for a `Model` and a batch.
  `jacobian_var_coefficients`, `var_coefficient_distance`: recovery of VAR coefficients on synthetic
    VAR data (estimator and distance documented there).
  `var_attention_maps`, `lintrans_attention_maps`, `attention_maps`: per-layer causal attention scores
    q_t . k_s of the VAR chain (keys = previous layer outputs) and of LinTrans, [L, B, C_t, H, T, T].
"""
from __future__ import annotations

__all__ = ["lag_matrices", "channel_contributions", "model_lag_matrices", "path_factors", "temporal_path_weights",
           "model_temporal_paths", "num_temporal_paths", "total_num_paths", "jacobian_var_coefficients",
           "var_coefficient_distance", "var_attention_maps", "lintrans_attention_maps", "attention_maps"]

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Effective lag matrices (samovar.md §3)
# ---------------------------------------------------------------------------------------------

def _layer_lags(q: Array, v: Array, key_kernels: Optional[Array]) -> Array:
    """Per-layer B^(m)_{t,j} for one sequence: q, v [L, T, H, D] -> [L, T, T, E, E]."""
    layers, t, h, d = q.shape
    e = h * d
    causal = jnp.tril(jnp.ones((t, t), q.dtype))
    prev = jnp.einsum("sj,ef->sjef", jnp.eye(t, dtype=q.dtype), jnp.eye(e, dtype=q.dtype))   # B^(0)
    out = []
    for m in range(layers):
        g = prev if key_kernels is None else jnp.einsum("ie,sjif->sjef", key_kernels[m], prev)
        g = g.reshape(t, t, h, d, e)

        def row(args, g=g, m=m):
            q_t, mask_t = args                                                   # [H, D], [T]
            y = jnp.einsum("hd,sjhdf->sjhf", q_t, g)                             # q_t^T G_{s,j}
            return jnp.einsum("s,shd,sjhf->jhdf", mask_t, v[m], y).reshape(t, e, e)

        prev = jax.lax.map(row, (q[m], causal))                                  # [T(t), T(j), E, E]
        out.append(prev)
    return jnp.stack(out)


@functools.partial(jax.jit, static_argnames=("shortcut_inside", "include_shortcut", "per_layer"))
def lag_matrices(q: Array, v: Array, *, key_kernels: Optional[Array] = None,
                 structural: Optional[Array] = None, shortcut_inside: bool = False,
                 include_shortcut: bool = True, per_layer: bool = False) -> Array:
    """Effective VAR lag matrices Gamma_{t,j} of the VAR chain (samovar.md §3).

    Args:
      q: [L, ..., T, H, D] per-layer queries (from `Model.var_terms` or `VARChain.project`).
      v: [L, ..., T, H, D] per-layer values.
      key_kernels: optional [L, E, E] row-layout key matrices ("w/ W_k"); None = identity.
      structural: optional [H, D, D] row-side matrix of the mixture (D, or D^-1); None = identity.
      shortcut_inside: the mixture is z = (x0 + M) D instead of z = x0 + M D.
      include_shortcut: add the identity key shortcut (False gives D^T C_{t,j}, the VAR part only).
      per_layer: return the per-layer terms D^T B^(m)_{t,j} stacked on a leading L axis instead
        (no shortcut).

    Returns:
      [..., T, T, E, E] (or [L, ..., T, T, E, E] with per_layer): entry [t, j] maps x0_j to z_t;
      zero for j > t.
    """
    lead = q.shape[1:-3]
    layers, t, h, d = q.shape[0], q.shape[-3], q.shape[-2], q.shape[-1]
    e = h * d
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qf = q.astype(acc).reshape((layers, -1, t, h, d))
    vf = v.astype(acc).reshape((layers, -1, t, h, d))
    kk = None if key_kernels is None else key_kernels.astype(acc)
    per = jax.vmap(lambda a, b: _layer_lags(a, b, kk), in_axes=(1, 1), out_axes=1)(qf, vf)  # [L, B*, T, T, E, E]
    eye = jnp.einsum("tj,ef->tjef", jnp.eye(t, dtype=acc), jnp.eye(e, dtype=acc))

    def left(mat):  # blockdiag(S_h^T) @ mat over the output (row) index
        if structural is None:
            return mat
        s = structural.astype(acc)
        mat = mat.reshape(mat.shape[:-2] + (h, d, e))
        return jnp.einsum("hde,...hdf->...hef", s, mat).reshape(mat.shape[:-3] + (e, e))

    if per_layer:
        return left(per).reshape((layers,) + lead + (t, t, e, e))
    c = jnp.sum(per, axis=0)
    if include_shortcut and shortcut_inside:
        gamma = left(c + eye)
    elif include_shortcut:
        gamma = left(c) + eye
    else:
        gamma = left(c)
    return gamma.reshape(lead + (t, t, e, e))


def channel_contributions(lags: Array, head_kernel: Array) -> Array:
    """Lag matrices seen through the output head: `W_out Gamma_{t,j} W_out^T` per (t, j).

    With `lags = lag_matrices(..., include_shortcut=False)` this is the heatmap W_out D C_{t,j} W_out^T:
    how the part of x0_j that lies in the head's row space drives the prediction at token t. The final
    RMSNorm (a positive per-token scale times a gain) is left out, as in the formula.

    Args:
      lags: [..., T, T, E, E] from `lag_matrices`.
      head_kernel: [E, P] Flax kernel of the output head (W_out^T).

    Returns:
      [..., T, T, P, P] (for P = 1 squeeze the last two axes to get a T x T heatmap).
    """
    w = head_kernel.astype(lags.dtype)
    return jnp.einsum("ep,...tjef,fq->...tjpq", w, lags, w)


def model_lag_matrices(model, params, batch: dict, *, include_shortcut: bool = True) -> dict:
    """Gamma and the output-head heatmap of a SAMoVAR / FixedVAR `Model` on `batch` (eval mode).

    Args:
      model: `samovar_jax.model.Model` with kind 'samovar' or 'fixedvar'.
      params: its params.
      batch: {'inputs': [B, L_I, C]}.
      include_shortcut: as in `lag_matrices` (the heatmap always excludes it).

    Returns:
      {'lags': [B, C_t, T, T, E, E], 'heatmap': [B, C_t, T, T, P, P], 'x0': [B, C_t, T, E], and the
      `var_terms` operands}. `z_t = sum_j lags[..., t, j, :, :] @ x0[..., j, :]` equals the model's
      mixture output at endogenous tokens t = 2i+1. Memory is B C_t T^2 E^2 floats (67 MB per window
      and channel for the synthetic T = 128, E = 32), so pass a few windows at a time.
    """
    terms = model.apply({"params": params}, batch, method=type(model).var_terms)
    kw = dict(key_kernels=terms["key_kernels"], structural=terms["structural"],
              shortcut_inside=terms["shortcut_inside"])
    lags = lag_matrices(terms["q"], terms["v"], include_shortcut=include_shortcut, **kw)
    if not include_shortcut:
        var_part = lags
    elif terms["shortcut_inside"]:
        var_part = lag_matrices(terms["q"], terms["v"], include_shortcut=False, **kw)
    else:                                   # the shortcut is the identity on the diagonal (t = j)
        t, e = lags.shape[-3], lags.shape[-1]
        var_part = lags - jnp.einsum("tj,ef->tjef", jnp.eye(t, dtype=lags.dtype), jnp.eye(e, dtype=lags.dtype))
    x0 = terms["x0"]
    return dict(terms, lags=lags, heatmap=channel_contributions(var_part, terms["head_kernel"]),
                x0=x0.reshape(x0.shape[:-2] + (-1,)))


# ---------------------------------------------------------------------------------------------
# Temporal influence paths (poster; samovar.md §3)
# ---------------------------------------------------------------------------------------------

def path_factors(q: Array, v: Array) -> Array:
    """The scalar edge weights of the temporal-influence paths: a^(m)_{t,s} = 1[s<=t] q^(m)_t . v^(m)_s
    per head (the reference notebook's `q v^T` simplification of the rank-1 A^(m)_{t,s}; poster Fig. 5).

    A depth-m path t >= i_1 >= ... >= i_{m-1} >= j multiplies one factor of each layer, layer m's at
    its last hop: a^(m)_{t,i_1} a^(m-1)_{i_1,i_2} ... a^(1)_{i_{m-1},j} (`temporal_path_weights`).

    Args:
      q: [L, ..., T, H, D]; v: [L, ..., T, H, D].

    Returns:
      [L, ..., H, T, T], zero above the diagonal (s > t).
    """
    t = q.shape[-3]
    mask = jnp.tril(jnp.ones((t, t), bool))
    return jnp.where(mask, jnp.einsum("l...thd,l...shd->l...hts", q, v), 0.0)


def temporal_path_weights(q: Array, v: Array) -> Array:
    """Summed temporal-influence path weights per depth, with the scalar simplification of the
    reference notebook (`compute_samovar_var_weights`: each rank-1 A^(m)_{t,s} replaced by
    (q^(m)_t . v^(m)_s) I per head).

    With a^(m)_{t,s} = 1[s<=t] q^(m)_t . v^(m)_s, the depth-m weight from j to t is the sum over all
    paths t >= i1 >= ... >= i_{m-1} >= j of a^(m)_{t,i_{m-1}} ... a^(1)_{i_1,j}, i.e. the matrix product
    P^(m) = a^(m) a^(m-1) ... a^(1). With all a = 1 on the causal triangle, P^(m)_{t,j} equals the
    number of paths `num_temporal_paths(t - j, m)`.

    Args:
      q: [L, ..., T, H, D]; v: [L, ..., T, H, D].

    Returns:
      [L, ..., H, T, T]: entry m-1 is P^(m) (depth m: the first m layers).
    """
    a = path_factors(q, v)
    out, prod = [], None
    for m in range(q.shape[0]):
        prod = a[m] if prod is None else a[m] @ prod
        out.append(prod)
    return jnp.stack(out)


def model_temporal_paths(model, params, batch: dict) -> dict:
    """The temporal-influence paths of a SAMoVAR / FixedVAR `Model` on `batch` (eval mode; poster Fig. 5).

    Args:
      model: `samovar_jax.model.Model` with kind 'samovar' or 'fixedvar'.
      params: its params.
      batch: {'inputs': [B, L_I, C]}.

    Returns:
      {'factors': [L, B, C_t, H, T, T] per-layer edge weights (`path_factors`), 'paths': [L, B, C_t, H, T, T]
      summed path weights per depth (`temporal_path_weights`)}; tokens alternate exogenous (even t) and
      endogenous (odd t), and the last row t = T-1 is the forecasting token.
    """
    terms = model.apply({"params": params}, batch, method=type(model).var_terms)
    return {"factors": path_factors(terms["q"], terms["v"]),
            "paths": temporal_path_weights(terms["q"], terms["v"])}


def num_temporal_paths(lag: int, depth: int) -> int:
    """Number of depth-`depth` paths from j to t = j + lag: C(lag + depth - 1, depth - 1)."""
    if lag < 0 or depth < 1:
        raise ValueError(f"need lag >= 0 and depth >= 1, got lag={lag}, depth={depth}")
    return math.comb(lag + depth - 1, depth - 1)


def total_num_paths(lag: int, layers: int) -> int:
    """Paths summed over depths 1..l plus the shortcut (samovar.md §3): 1 + sum_m C(lag + m - 1, m - 1)."""
    return 1 + sum(num_temporal_paths(lag, m) for m in range(1, layers + 1))


# ---------------------------------------------------------------------------------------------
# VAR coefficient recovery on synthetic VAR data (samovar.md §10)
# ---------------------------------------------------------------------------------------------

def jacobian_var_coefficients(forecast_fn: Callable[[Array], Array], inputs: Array, num_lags: int, *,
                              step: int = 0) -> Array:
    """Estimator of the VAR coefficients a forecaster implies: its input Jacobian.

    For a window x_1..x_L (column vectors, VAR convention x_t = sum_{j=1}^p A_j x_{t-j} + e_t with
    A_j[c_out, c_in]), the estimate is the local linearisation

        A_hat_j[c_out, c_in] = d forecast_{L+1+step}[c_out] / d x_{L+1-j}[c_in],   j = 1..num_lags,

    taken in raw units through everything (instance normalisation, tokeniser, trunk, head). A forecaster
    that is exactly the linear VAR predictor returns A_j exactly, for any window; for SAMoVAR the
    estimate depends on the window, so average it over windows (or compare per window).

    Args:
      forecast_fn: inputs [B, L, C] -> forecast [B, horizon, C_t] (e.g.
        `lambda x: model.apply(variables, {'inputs': x})[0]['forecast']`).
      inputs: [B, L, C] windows.
      num_lags: number of lags to return (<= L).
      step: forecast step to differentiate (0 = one step ahead).

    Returns:
      [B, num_lags, C_t, C] per-window estimates.
    """
    length = inputs.shape[1]
    if not 1 <= num_lags <= length:
        raise ValueError(f"num_lags must be in [1, {length}], got {num_lags}")

    def one(x):                                                                   # x [L, C]
        return forecast_fn(x[None])[0, step]                                      # [C_t]

    jac = jax.jit(jax.vmap(jax.jacrev(one)))(inputs)                              # [B, C_t, L, C]
    lags = jac[:, :, length - 1 - jnp.arange(num_lags)]                           # lag j = 1.. at L - j
    return jnp.transpose(lags, (0, 2, 1, 3))


def var_coefficient_distance(true_coefs, estimated) -> dict[str, np.ndarray]:
    """Distance between true VAR coefficients and a model's estimate.

    Lags are aligned from lag 1; the shorter stack is zero-padded (a true VAR(p) has A_j = 0 for j > p,
    so coefficients the model puts on longer lags count as error). Leading batch axes broadcast.

    Args:
      true_coefs: [..., p, C, C] true A_1..A_p.
      estimated: [..., q, C, C] estimated A_hat_1..A_hat_q (e.g. from `jacobian_var_coefficients`).

    Returns:
      dict of numpy arrays with the broadcast leading shape:
        'rel_frobenius': ||A_hat - A||_F / ||A||_F over all lags (the headline number);
        'frobenius': ||A_hat - A||_F;
        'max_abs': max |A_hat - A|;
        'per_lag': [..., max(p, q)] Frobenius error of every lag.
    """
    a = np.asarray(true_coefs, np.float64)
    b = np.asarray(estimated, np.float64)
    if a.ndim < 3 or b.ndim < 3 or a.shape[-2:] != b.shape[-2:] or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"coefficients must be [..., lags, C, C] with the same C; got {a.shape} and {b.shape}")
    p = max(a.shape[-3], b.shape[-3])

    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[-3] = (0, p - x.shape[-3])
        return np.pad(x, widths)

    diff = pad(b) - pad(a)
    per_lag = np.sqrt(np.sum(diff ** 2, axis=(-1, -2)))
    fro = np.sqrt(np.sum(per_lag ** 2, axis=-1))
    norm = np.sqrt(np.sum(a ** 2, axis=(-1, -2, -3)))
    return {"rel_frobenius": fro / np.maximum(norm, 1e-300), "frobenius": fro,
            "max_abs": np.max(np.abs(diff), axis=(-1, -2, -3)), "per_lag": per_lag}


# ---------------------------------------------------------------------------------------------
# Attention maps (for plots: SAMoVAR / FixedVAR VAR chain against LinTrans)
# ---------------------------------------------------------------------------------------------

def _causal_scores(q: Array, k: Array) -> Array:
    """q, k [..., T, H, D] -> [..., H, T, T] unnormalised causal scores 1[s<=t] q_t . k_s."""
    t = q.shape[-3]
    scores = jnp.einsum("...thd,...shd->...hts", q.astype(jnp.float32), k.astype(jnp.float32))
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, 0.0)


def var_attention_maps(model, params, batch: dict) -> Array:
    """Per-layer attention scores of the VAR chain of a SAMoVAR / FixedVAR `Model` (eval mode).

    Layer m attends with its query q^(m) to the key k^(m-1): x0 for m = 1, else the previous layer's
    output o^(m-1) (times W_k^(m) in the "w/ W_k" ablation), samovar.md §2.6:
    a^(m)_{t,s} = 1[s<=t] q^(m)_t . k^(m-1)_s, per head, over all tokens (exogenous at even t).

    Args:
      model: `samovar_jax.model.Model` with kind 'samovar' or 'fixedvar'.
      params: its params.
      batch: {'inputs': [B, L_I, C]}.

    Returns:
      [L, B, C_t, H, T, T] float32.
    """
    from samovar_jax import ops  # pylint: disable=import-outside-toplevel

    terms = model.apply({"params": params}, batch, method=type(model).var_terms)
    x0, q, v, kernels = terms["x0"], terms["q"], terms["v"], terms["key_kernels"]
    lead = x0.shape[:2]
    fold = lambda a: a.reshape((-1,) + a.shape[-3:])  # noqa: E731  [B, C_t, T, H, D] -> [B', T, H, D]
    x0f = fold(x0)
    qf = jnp.stack([fold(a) for a in q])
    vf = jnp.stack([fold(a) for a in v])
    outs = ops.var_chain_parallel(x0f, qf, vf, key_kernels=kernels)
    keys = [x0f] + [outs[m] for m in range(q.shape[0] - 1)]
    maps = []
    for m, k in enumerate(keys):
        if kernels is not None:
            flat = k.reshape(k.shape[:-2] + (-1,)) @ kernels[m].astype(k.dtype)
            k = flat.reshape(k.shape)
        maps.append(_causal_scores(qf[m], k))
    maps = jnp.stack(maps)                                                        # [L, B', H, T, T]
    return maps.reshape((maps.shape[0],) + lead + maps.shape[2:])


def lintrans_attention_maps(model, params, batch: dict) -> Array:
    """Per-block attention scores 1[s<=t] q_t . k_s of a LinTrans `Model` (eval mode, no normaliser).

    The queries and keys are captured from the blocks' `attention/query` and `attention/key` Dense
    outputs (Flax `capture_intermediates`), so this reads exactly what the forward pass used.

    Args:
      model: `samovar_jax.model.Model` with kind 'lintrans'.
      params: its params.
      batch: {'inputs': [B, L_I, C]} (cropped to the model's input_len if `crop_inputs`).

    Returns:
      [L, B, C_t, H, T, T] float32 (T tokens of the cropped window).
    """
    import flax.linen as nn  # pylint: disable=import-outside-toplevel

    if model.kind != "lintrans":
        raise ValueError(f"lintrans_attention_maps needs kind='lintrans', got {model.kind!r}")
    r = model.resolved
    keep = lambda mdl, _: isinstance(mdl, nn.Dense) and mdl.name in ("query", "key")  # noqa: E731
    _, state = model.apply({"params": params}, batch, capture_intermediates=keep, mutable=["intermediates"])
    inter = state["intermediates"]
    b = jnp.asarray(batch["inputs"]).shape[0]
    maps = []
    for i in range(r.num_layers):
        att = inter[f"block_{i:02d}"]["attention"]
        q, k = (att[n]["__call__"][0] for n in ("query", "key"))                  # [B', T, E]
        split = lambda a: a.reshape(a.shape[:-1] + (r.num_heads, r.head_dim))   # noqa: E731
        maps.append(_causal_scores(split(q), split(k)))
    maps = jnp.stack(maps)                                                        # [L, B', H, T, T]
    return maps.reshape((maps.shape[0], b, r.num_targets) + maps.shape[2:])


def attention_maps(model, params, batch: dict) -> Array:
    """`var_attention_maps` or `lintrans_attention_maps` by `model.kind`: [L, B, C_t, H, T, T]."""
    if model.kind == "lintrans":
        return lintrans_attention_maps(model, params, batch)
    return var_attention_maps(model, params, batch)
