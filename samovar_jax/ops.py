"""Pure kernels of SAMoVAR (Lu & Yang, "Linear Transformers as VAR Models", ICML 2025, arXiv:2502.07244).

Everything here is a plain `jnp` function with no parameters; the Flax layers (`layers.py`, `modules.py`) own the
weights and call these. Section numbers refer to the project spec `samovar.md`, which follows the
released code (LJC-FVNR/Structural-Aligned-Mixture-of-VAR @ 4e2581f).

Shape letters (see `zoo_core`): B batch (for the model: batch x target channels, folded), T tokens,
H heads, D head width, E = H*D model width, L number of VAR layers (stacked leading axis), C chunk
length or series channels (said where used), N patches, P patch length.

Contents:

* The VAR attention chain of SAMoVAR (samovar.md §2.6, §4): queries and values from the first-layer input
  x0, key of layer m = output of layer m-1 (key of layer 1 = x0), optionally through a key matrix
  W_k (the "w/ W_k" ablation). Each layer is the zoo's causal linear attention without normaliser,
  `o_t = sum_{s<=t} (q_t . k_s) v_s` (`zoo_core.ops.linear_attention`, denominator=False), in four forms:
  `var_chain_parallel`, `var_chain_chunked` (per platform: on accelerators
  `var_chain_chunked_batched`, batched over heads with no loop), `var_chain_scan` (a token scan
  per layer) and `var_chain_step`, with `var_chain_init_state`. Padding masks and non-finite values are handled by
  the shared kernels with `jnp.where` (NaN-safe: no future or padded position reaches a past or valid
  output, in any form and through the whole chain). Packed rows (`segment_ids` `[B, T]`, 0 = padding,
  `zoo_core.ops.packing`): every layer's state is cut at each document start, so a packed row gives
  each document's own chain (docs/samovar_packing.md). The chain split over a mesh axis is
  `samovar_jax.context_parallel`.
* The LU-parameterised structural matrix D = L U (samovar.md §2.7): `structural_matrix`,
  `structural_matrix_inverse` (two triangular solves).
* RMS normalisation (samovar.md §1), instance normalisation and patching (samovar.md §2.1-2.2).

Precision: the attention sums have no normaliser and grow with T, so they accumulate in at least
float32 (`zoo_core.ops.linear_attention.acc_dtype`), and the chain passes each layer's output to the next
one in that dtype; the returned outputs are in x0's dtype; states are float32 (float64 under x64).
"""
from __future__ import annotations

__all__ = ["rms_norm", "instance_norm_stats", "patchify", "unpatchify", "var_chain_init_state", "var_chain_parallel",
           "var_chain_chunked", "var_chain_chunked_batched", "var_chain_layers", "var_chain_scan", "var_chain_step",
           "lu_factors", "structural_matrix", "structural_matrix_inverse"]

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core import checks, moved
from zoo_core.ops import linear_attention, masking, packing

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Normalisation, instance normalisation and patching (samovar.md §1, §2.1, §2.2)
# ---------------------------------------------------------------------------------------------

def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis(es) of `scale`'s rank-1 layout: `x / sqrt(mean(x^2) + eps) * scale`.

    As in the reference, the normalisation itself is computed in float32 and cast back to x's dtype
    before the gain is applied (samovar.md §1).

    Args:
      x: [..., F] activations.
      scale: [F] gain, or any shape broadcastable against x (e.g. [H, D] for a per-head norm on
        x [..., H, D]); the mean is always taken over the last axis of x.
      eps: stabiliser added to the mean square (1e-5 for the model-wide norm, 1e-8 for the per-head
        q/v norm of SAMoVAR).

    Returns:
      [..., F] normalised x in the promoted dtype of (x, scale).
    """
    xf = x.astype(linear_attention.acc_dtype(x))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * scale


def instance_norm_stats(x: Array, patch_len: int, mean_mode: str = "last_patch") -> tuple[Array, Array]:
    """Per-window, per-channel statistics of the reference's "RevIN" (no affine part; samovar.md §2.1).

    Args:
      x: [B, L_I, C] raw input window.
      patch_len: P; with `mean_mode='last_patch'` the mean is over the last P raw values.
      mean_mode: 'last_patch' (released code) or 'window' (mean over the whole window, the reading
        the third-party docs attribute to the paper's App. A.4).

    Returns:
      (mean, std), each [B, 1, C]; std is the unbiased (N-1) standard deviation over the whole
      window plus 1e-8.
    """
    if mean_mode == "last_patch":
        mean = jnp.mean(x[:, -patch_len:, :], axis=1, keepdims=True)
    elif mean_mode == "window":
        mean = jnp.mean(x, axis=1, keepdims=True)
    else:
        raise ValueError(f"mean_mode must be 'last_patch' or 'window', got {mean_mode!r}")
    std = jnp.std(x, axis=1, keepdims=True, ddof=1) + 1e-8
    return mean, std


def patchify(x: Array, patch_len: int) -> Array:
    """Left-pads with zeros to a multiple of P and cuts into patches (samovar.md §2.2).

    Args:
      x: [B, L, C] (normalised) series; the padding is added after normalisation, so it is zero in
        normalised units.
      patch_len: P.

    Returns:
      [B, C, N, P] with N = ceil(L / P); patch i covers padded positions [iP, (i+1)P).
    """
    b, length, c = x.shape
    pad = (-length) % patch_len
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0)))
    n = (length + pad) // patch_len
    return jnp.transpose(x.reshape(b, n, patch_len, c), (0, 3, 1, 2))


def unpatchify(patches: Array) -> Array:
    """Inverse layout of `patchify` without the padding: [B, C, N, P] -> [B, N*P, C]."""
    b, c, n, p = patches.shape
    return jnp.transpose(patches, (0, 2, 3, 1)).reshape(b, n * p, c)


# ---------------------------------------------------------------------------------------------
# The VAR attention chain (samovar.md §2.6, §3, §4) on the shared causal linear-attention kernels
# ---------------------------------------------------------------------------------------------

def _key_map(o: Array, key_kernel: Optional[Array]) -> Array:
    """Next layer's key from a layer output: identity (SAMoVAR, W_k = I) or `o_flat @ W_k`.

    o: [..., H, D]; key_kernel: None or [E, E] (Flax kernel layout [in, out], E = H*D). A full W_k
    mixes heads; with W_k = I heads never mix inside the key chain (samovar.md §2.6).
    """
    if key_kernel is None:
        return o
    flat = o.reshape(o.shape[:-2] + (-1,))
    return (flat @ key_kernel.astype(flat.dtype)).reshape(o.shape)


def check_chain(x0, q, v, *, key_kernels=None, dropout_mask=None, mask=None, segment_ids=None,
                state=None, chunk_size=None, token_axis: bool = True) -> None:
    """The public chain kernels' argument checks, once per call, each problem in one line (ValueError).

    x0 `[B, T, H, D]` (`[B, H, D]` for a step, `token_axis=False`), q and v `[L, *x0.shape]` (or
    sequences of L arrays of x0's shape), key_kernels `[L, E, E]`, dropout_mask q's shape, mask and
    segment_ids `[B, T]` (segment_ids integers), state `[L, B, H, D, D]`, chunk_size an int >= 1.
    """
    rank = 4 if token_axis else 3
    doc = "[B, T, H, D]" if token_axis else "[B, H, D]"
    checks.check_rank("x0", x0, rank, doc)
    q_shape, v_shape = (tuple(np.shape(a)) if not isinstance(a, (list, tuple)) else
                        (len(a),) + (tuple(np.shape(a[0])) if len(a) else ()) for a in (q, v))
    for name, seq in (("q", q), ("v", v)):
        if isinstance(seq, (list, tuple)) and any(np.shape(a) != np.shape(x0) for a in seq):
            checks.fail(f"each of `{name}` must have x0's shape {tuple(np.shape(x0))}, got "
                        f"{[tuple(np.shape(a)) for a in seq]}")
    want = q_shape[:1] + tuple(np.shape(x0))
    if len(q_shape) != rank + 1 or q_shape[0] < 1 or q_shape != want or v_shape != want:
        checks.fail(f"the VAR chain expects x0 {doc} and q, v [L] + x0's shape (L >= 1); got x0 "
                    f"{tuple(np.shape(x0))}, q {q_shape}, v {v_shape}")
    layers, b, h, d = q_shape[0], x0.shape[0], x0.shape[-2], x0.shape[-1]
    if key_kernels is not None:
        checks.check_shape("key_kernels", key_kernels, (layers, h * d, h * d), "[L, E, E]")
    if dropout_mask is not None:
        checks.check_shape("dropout_mask", dropout_mask, q_shape, "[L] + x0's shape")
    if state is not None:
        checks.check_shape("state", state, (layers, b, h, d, d), "[L, B, H, D, D]")
    if token_axis:
        masking.check_mask(mask, x0.shape[:2])
        packing.check_segment_ids(segment_ids, x0.shape[:2])
    if chunk_size is not None:
        checks.check_int("chunk_size", chunk_size, 1)


def var_chain_init_state(layers: int, batch: int, heads: int, head_dim: int, dtype=jnp.float32) -> Array:
    """Zero state of the VAR chain: one S^(m) = sum k^(m-1) v^(m)T per layer, [L, B, H, D, D]."""
    return jnp.zeros((layers, batch, heads, head_dim, head_dim), dtype)


def _chain(layer_fn, x0, q, v, key_kernels, dropout_mask, state, stack=True):
    """Runs `layer_fn(q_m, key_m, v_m, state_m) -> (num, state)` for m = 1..L, chaining keys (the one
    loop over layers of every form, also `samovar_jax.context_parallel`'s; callers checked the operands).

    q, v (and dropout_mask) are [L, ...] arrays or sequences of L arrays; with `stack=False` the
    outputs come back as a tuple of L arrays (and no state).

    Every layer output is multiplied by its dropout mask (position-wise, so a non-finite output stays
    at its own position) and becomes the next key in the kernels' accumulation dtype (at least
    float32: a bf16 rounding between layers would compound over the chain); the shared kernel keeps
    any non-finite key from reaching an earlier output of the next layer. The returned outputs are
    cast to x0's dtype.
    """
    k = x0
    outs, states = [], []
    for m in range(len(q)):
        key = _key_map(k, None if key_kernels is None else key_kernels[m])
        o, s = layer_fn(q[m], key, v[m], None if state is None else linear_attention.LinearState(state[m], None))
        if dropout_mask is not None:
            o = o * dropout_mask[m].astype(o.dtype)
        outs.append(o.astype(x0.dtype))
        states.append(None if s is None else s.num)
        k = o
    if not stack:
        return tuple(outs)
    return jnp.stack(outs), (None if states[0] is None else jnp.stack(states))


def var_chain_parallel(x0: Array, q: Array, v: Array, *, key_kernels: Optional[Array] = None,
                       dropout_mask: Optional[Array] = None, mask: Optional[Array] = None,
                       segment_ids: Optional[Array] = None) -> Array:
    """Masked form of the VAR chain: `zoo_core.ops.linear_attention.causal_parallel` once per layer.

    For m = 1..L (samovar.md §2.6): `k^(0) = x0`,
    `o^(m)_t = sum_{s<=t} <q^(m)_t, k^(m-1)_s> v^(m)_s` per head, `o^(m) <- dropout(o^(m))`,
    `k^(m) = o^(m)` (or `o^(m) W_k^(m+1)` in the "w/ W_k" ablation, where also `k^(0) = x0 W_k^(1)`).

    Args:
      x0: [B, T, H, D] the VAR observation (output of `VAR_input_norm`, split into heads).
      q: [L, B, T, H, D] per-layer queries (from x0, already per-head normalised).
      v: [L, B, T, H, D] per-layer values.
      key_kernels: optional [L, E, E] key matrices (row-vector layout, `k = o_flat @ W`); None = I.
      dropout_mask: optional [L, B, T, H, D] multiplier applied to each layer output (already scaled
        by 1/(1-rate)); the same mask makes every form agree in training mode.
      mask: optional [B, T] bool key-padding mask (True = valid); padded outputs are 0.
      segment_ids: optional int [B, T] packed documents (0 = padding): in every layer a token reads
        only the keys of its own document, so each document gets its own chain.

    Returns:
      [L, B, T, H, D] every layer's output in x0's dtype (the model sums them over L).
    """
    check_chain(x0, q, v, key_kernels=key_kernels, dropout_mask=dropout_mask, mask=mask, segment_ids=segment_ids)
    return _chain(_masked_layer(mask, segment_ids), x0, q, v, key_kernels, dropout_mask, None)[0]


def _masked_layer(mask, segment_ids):
    """`_chain`'s layer function of the masked form (no state)."""
    return lambda qm, km, vm, _: (linear_attention.causal_parallel(qm, km, vm, mask=mask,
                                                                   segment_ids=segment_ids)[0], None)


def _chunked_layer(chunk_size, mask, segment_ids, form=linear_attention.causal_chunked):
    """`_chain`'s layer function of a chunked form (carries each layer's state)."""
    def fn(qm, km, vm, s):
        num, _, s = form(qm, km, vm, chunk_size=chunk_size, state=s, mask=mask, segment_ids=segment_ids)
        return num, s
    return fn


def var_chain_chunked(x0: Array, q: Array, v: Array, chunk_size: int, *, state: Optional[Array] = None,
                      key_kernels: Optional[Array] = None, dropout_mask: Optional[Array] = None,
                      mask: Optional[Array] = None, segment_ids: Optional[Array] = None) -> tuple[Array, Array]:
    """Chunked form: `zoo_core.ops.linear_attention.causal_chunked` once per layer (samovar.md §4).

    The form of each layer is chosen per platform by `causal_chunked`: on accelerators it is
    `var_chain_chunked_batched`'s (all heads and chunks in the same einsums, no loop, a program that
    does not grow with H); on the CPU one head at a time (or a scan over chunks). Packed
    (`segment_ids`), every platform takes the batched form with each layer's state cut at every
    document start (`zoo_core.ops.packing`'s gated chain).

    Args:
      x0, q, v, key_kernels, dropout_mask, mask, segment_ids: as in `var_chain_parallel`.
      chunk_size: C >= 1 (need not divide T).
      state: optional [L, B, H, D, D] state carried in from earlier tokens; packed, it is read by
        each row's first document only.

    Returns:
      (o [L, B, T, H, D], final state [L, B, H, D, D] float32; packed: the last document's).
    """
    check_chain(x0, q, v, key_kernels=key_kernels, dropout_mask=dropout_mask, mask=mask, segment_ids=segment_ids,
                state=state, chunk_size=chunk_size)
    return _chain(_chunked_layer(chunk_size, mask, segment_ids), x0, q, v, key_kernels, dropout_mask, state)


def var_chain_chunked_batched(x0: Array, q: Array, v: Array, chunk_size: int, *,
                              state: Optional[Array] = None, key_kernels: Optional[Array] = None,
                              dropout_mask: Optional[Array] = None, mask: Optional[Array] = None,
                              segment_ids: Optional[Array] = None) -> tuple[Array, Array]:
    """The accelerator form of `var_chain_chunked`, on any platform: per layer
    `zoo_core.ops.linear_attention.causal_chunked_batched` (every chunk's entering state at once by an
    exclusive prefix sum over the chunks, each product one einsum over [B, n, H]).

    Args and Returns: as in `var_chain_chunked`.
    """
    check_chain(x0, q, v, key_kernels=key_kernels, dropout_mask=dropout_mask, mask=mask, segment_ids=segment_ids,
                state=state, chunk_size=chunk_size)
    return _chain(_chunked_layer(chunk_size, mask, segment_ids, linear_attention.causal_chunked_batched), x0, q, v,
                 key_kernels, dropout_mask, state)


def var_chain_layers(x0: Array, q: Sequence[Array], v: Sequence[Array], *, chunk_size: Optional[int] = None,
                     key_kernels: Optional[Array] = None, dropout_mask: Optional[Array] = None,
                     mask: Optional[Array] = None, segment_ids: Optional[Array] = None) -> tuple[Array, ...]:
    """The VAR chain on per-layer operands, returning per-layer outputs: no `[L, ...]` stacks.

    The same maths as `var_chain_parallel` (`chunk_size=None`) and `var_chain_chunked`; what a
    caller that only sums the layers' outputs wants (the model's training path): stacking q, v and
    the outputs along L costs a copy of each forwards and a padded cotangent per layer backwards.

    Args:
      x0: [B, T, H, D].
      q, v: sequences of L arrays [B, T, H, D].
      chunk_size: None for the masked form, else the chunked form's C.
      key_kernels: optional [L, E, E]; dropout_mask: optional [L, B, T, H, D]; mask: optional [B, T];
      segment_ids: optional int [B, T] (as in `var_chain_parallel`).

    Returns:
      a tuple of L arrays [B, T, H, D], layer m's output in x0's dtype.
    """
    check_chain(x0, tuple(q), tuple(v), key_kernels=key_kernels, dropout_mask=dropout_mask, mask=mask,
                segment_ids=segment_ids, chunk_size=chunk_size)
    fn = _masked_layer(mask, segment_ids) if chunk_size is None else _chunked_layer(chunk_size, mask, segment_ids)
    return _chain(fn, x0, q, v, key_kernels, dropout_mask, None, stack=False)


def var_chain_scan(x0: Array, q: Array, v: Array, *, state: Optional[Array] = None,
                   key_kernels: Optional[Array] = None, dropout_mask: Optional[Array] = None,
                   mask: Optional[Array] = None, segment_ids: Optional[Array] = None) -> tuple[Array, Array]:
    """Token recurrence: `zoo_core.ops.linear_attention.causal_scan` (a token `lax.scan`) once per layer.

    Args:
      x0, q, v, key_kernels, dropout_mask, mask, segment_ids: as in `var_chain_parallel` (packed,
        each layer's state is reset to zero at every document start).
      state: optional [L, B, H, D, D] initial state (zeros if None); packed, read by each row's first
        document only.

    Returns:
      (o [L, B, T, H, D], final state [L, B, H, D, D] float32; packed: the last document's).
    """
    check_chain(x0, q, v, key_kernels=key_kernels, dropout_mask=dropout_mask, mask=mask, segment_ids=segment_ids,
                state=state)

    def fn(qm, km, vm, s):
        num, _, s = linear_attention.causal_scan(qm, km, vm, state=s, mask=mask, segment_ids=segment_ids)
        return num, s
    return _chain(fn, x0, q, v, key_kernels, dropout_mask, state)


def var_chain_step(state: Array, x0_t: Array, q_t: Array, v_t: Array, *,
                   key_kernels: Optional[Array] = None,
                   dropout_mask_t: Optional[Array] = None) -> tuple[Array, Array]:
    """One token through all L layers (samovar.md §4, "recurrent"), `causal_step` per layer.

    With `k = x0_t`, for m = 1..L: `S^(m) += k v^(m)_t^T`, `o^(m)_t = q^(m)_t S^(m)`, `k = o^(m)_t`.
    This works token by token because layer m at time t needs only layer m-1's outputs at times <= t.
    (A new document is a new state: `var_chain_init_state`.)

    Args:
      state: [L, B, H, D, D] per-layer states.
      x0_t: [B, H, D] observation at this token.
      q_t, v_t: [L, B, H, D] this token's per-layer queries and values.
      key_kernels: optional [L, E, E] (see `var_chain_parallel`).
      dropout_mask_t: optional [L, B, H, D] this token's output dropout multipliers.

    Returns:
      (new state [L, B, H, D, D], o_t [L, B, H, D]) in the scan-carry order.
    """
    check_chain(x0_t, q_t, v_t, key_kernels=key_kernels, dropout_mask=dropout_mask_t, state=state,
                token_axis=False)

    def fn(qm, km, vm, s):
        num, _, s = linear_attention.causal_step(s, qm, km, vm)
        return num, s
    o, state = _chain(fn, x0_t, q_t, v_t, key_kernels, dropout_mask_t, state)
    return state, o


# ---------------------------------------------------------------------------------------------
# Structural matrix D = L U (samovar.md §2.7)
# ---------------------------------------------------------------------------------------------

def lu_factors(theta: Array) -> tuple[Array, Array]:
    """L = I + strict_lower(theta), U = strict_upper(theta) + diag(softplus(diag theta)).

    Args:
      theta: [H, D, D] the single LU parameter (`generate_S.LU` in the reference).

    Returns:
      (L, U), each [H, D, D]; U has a positive diagonal, so D = L U is always invertible.
    """
    d = theta.shape[-1]
    eye = jnp.eye(d, dtype=theta.dtype)
    lower = jnp.tril(theta, -1) + eye
    diag = jax.nn.softplus(jnp.diagonal(theta, axis1=-2, axis2=-1))
    upper = jnp.triu(theta, 1) + diag[..., :, None] * eye
    return lower, upper


def structural_matrix(theta: Array) -> Array:
    """D = L U per head, [H, D, D] (what the released forward multiplies by, row-vector side)."""
    lower, upper = lu_factors(theta)
    return lower @ upper


def per_head_product(x: Array, matrices: Array) -> Array:
    """Row-vector product per head, `einsum('...hd,hde->...he')`, as one 2-D matmul.

    `x [..., H, D]` is read as `[rows, H*D]` (a free reshape) and multiplied by the block-diagonal
    `[H*D, H*D]` matrix of the heads' matrices: no relayout of x into a heads-first batch (what XLA's
    CPU backend did for the einsum, two transposing copies of x per call). The off-diagonal blocks
    are exact zeros, so every output adds the same nonzero products; only a non-finite entry of x
    reaches the other heads of its own row.

    Args:
      x: [..., H, D].
      matrices: [H, D, D].

    Returns:
      [..., H, D] in the promoted dtype of (x, matrices).
    """
    h, d, _ = matrices.shape
    if x.shape[-2:] != (h, d):
        raise ValueError(f"`x` must be [..., {h}, {d}] to match matrices {matrices.shape}, got {x.shape}")
    block = jnp.einsum("hde,hg->hdge", matrices, jnp.eye(h, dtype=matrices.dtype)).reshape(h * d, h * d)
    out = jnp.reshape(x, (-1, h * d)) @ block
    return out.reshape(x.shape[:-2] + (h, d))


def structural_matrix_inverse(theta: Array) -> Array:
    """D^-1 = U^-1 L^-1 per head via two triangular solves, [H, D, D] (the paper's reading)."""
    lower, upper = lu_factors(theta)
    eye = jnp.broadcast_to(jnp.eye(theta.shape[-1], dtype=theta.dtype), theta.shape)
    l_inv = jax.scipy.linalg.solve_triangular(lower, eye, lower=True, unit_diagonal=True)
    return jax.scipy.linalg.solve_triangular(upper, l_inv, lower=False)


# The names of 0.1.0 that were renamed warn and give the new function (zoo_core.moved.RENAMED).
__getattr__ = moved.renamed_getattr(__name__)
