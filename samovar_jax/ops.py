"""Pure kernels of SAMoVAR (Lu & Yang, "Linear Transformers as VAR Models", ICML 2025, arXiv:2502.07244).

Everything here is a plain `jnp` function with no parameters; the Flax layers in `layers.py` own the
weights and call these. Section numbers refer to the project spec `samovar.md`, which follows the
released code (LJC-FVNR/Structural-Aligned-Mixture-of-VAR @ 4e2581f).

Shape letters (see `zoo_core`): B batch (for the model: batch x target channels, folded), T tokens,
H heads, D head width, E = H*D model width, L number of VAR layers (stacked leading axis), C chunk
length or series channels (said where used), N patches, P patch length.

Contents:

* Causal linear attention without normaliser, `o_t = sum_{s<=t} (q_t . k_s) v_s` (spec §2.6; the
  LinTrans baseline §7 and one layer of the VAR chain), in four forms:
  `linear_attention_parallel` (masked), `linear_attention_chunked`, `linear_attention_recurrent`
  (`jax.lax.scan`) and `linear_attention_step`, with `linear_attention_init_state`.
* The VAR attention chain of SAMoVAR (spec §2.6, §4): queries and values from the first-layer input
  x0, key of layer m = output of layer m-1 (key of layer 1 = x0), optionally through a key matrix
  W_k (the "w/ W_k" ablation). Four forms: `var_chain_parallel`, `var_chain_chunked`,
  `var_chain_recurrent` (ONE scan over time carrying all layers' D x D states) and
  `var_chain_step`, with `var_chain_init_state`.
* The LU-parameterised structural matrix D = L U (spec §2.7): `structural_matrix`,
  `structural_matrix_inverse` (two triangular solves).
* RMS normalisation (spec §1), instance normalisation and patching (spec §2.1-2.2).

Precision: the attention sums have no normaliser and grow with T, so every kernel accumulates in
at least float32 (`_acc_dtype`) and returns outputs in the input dtype; recurrent states are float32
(float64 under x64 inputs).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def _acc_dtype(*xs) -> jnp.dtype:
    """At least float32: the unnormalised causal sums must not be accumulated in bf16/fp16."""
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


# ---------------------------------------------------------------------------------------------
# Normalisation, instance normalisation and patching (spec §1, §2.1, §2.2)
# ---------------------------------------------------------------------------------------------

def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis(es) of `scale`'s rank-1 layout: `x / sqrt(mean(x^2) + eps) * scale`.

    As in the reference, the normalisation itself is computed in float32 and cast back to x's dtype
    before the gain is applied (spec §1).

    Args:
      x: [..., F] activations.
      scale: [F] gain, or any shape broadcastable against x (e.g. [H, D] for a per-head norm on
        x [..., H, D]); the mean is always taken over the last axis of x.
      eps: stabiliser added to the mean square (1e-5 for the model-wide norm, 1e-8 for the per-head
        q/v norm of SAMoVAR).

    Returns:
      [..., F] normalised x in the promoted dtype of (x, scale).
    """
    xf = x.astype(_acc_dtype(x))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * scale


def instance_norm_stats(x: Array, patch_len: int, mean_mode: str = "last_patch") -> tuple[Array, Array]:
    """Per-window, per-channel statistics of the reference's "RevIN" (no affine part; spec §2.1).

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
    """Left-pads with zeros to a multiple of P and cuts into patches (spec §2.2).

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
# Causal linear attention without normaliser (spec §2.6 for one layer, §7 for LinTrans)
# ---------------------------------------------------------------------------------------------

def linear_attention_init_state(batch: int, heads: int, key_dim: int, value_dim: int,
                                dtype=jnp.float32) -> Array:
    """Zero state S = sum_s k_s v_s^T of the causal linear attention: [B, H, D, M]."""
    return jnp.zeros((batch, heads, key_dim, value_dim), dtype)


def linear_attention_parallel(q: Array, k: Array, v: Array) -> Array:
    """Masked (quadratic) form: `o_t = sum_{s<=t} (q_t . k_s) v_s` per head, inclusive of s = t.

    No 1/sqrt(D) scale, no feature map, no denominator (spec §2.6: "inclusive causal linear attention
    with no normaliser"). O(T^2) time and memory; cheapest for the short token sequences of the
    benchmarks (T <= 22).

    Args:
      q: [B, T, H, D] queries.
      k: [B, T, H, D] keys.
      v: [B, T, H, M] values.

    Returns:
      [B, T, H, M] outputs in q's dtype.
    """
    acc = _acc_dtype(q, k, v)
    t = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(acc), k.astype(acc))
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, 0.0)
    return jnp.einsum("bhts,bshm->bthm", scores, v.astype(acc)).astype(q.dtype)


def linear_attention_chunked(q: Array, k: Array, v: Array, chunk_size: int,
                             state: Optional[Array] = None) -> tuple[Array, Array]:
    """Chunkwise form: masked attention inside chunks plus an inter-chunk state (spec §4, "chunked").

    The sequence is zero-padded at the END to a multiple of `chunk_size` (any chunk size works, also
    one that does not divide T); padded positions have v = 0, so they add nothing to the state, and
    their outputs are dropped. Chunk states are combined with an exclusive cumulative sum (no
    sequential loop), so time is O(T C D + T D M) and memory O(T C H + (T/C) H D M), against O(T^2 H)
    for the masked form.

    Args:
      q: [B, T, H, D]; k: [B, T, H, D]; v: [B, T, H, M].
      chunk_size: C >= 1.
      state: optional [B, H, D, M] state carried in from earlier tokens (zeros if None).

    Returns:
      (o [B, T, H, M] in q's dtype, final state [B, H, D, M] in the accumulation dtype).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    acc = _acc_dtype(q, k, v)
    b, t, h, d = q.shape
    m = v.shape[-1]
    c = min(chunk_size, max(t, 1))
    pad = (-t) % c
    n = (t + pad) // c

    def chunks(x):
        x = jnp.pad(x.astype(acc), ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(b, n, c, h, x.shape[-1])

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    s0 = jnp.zeros((b, h, d, m), acc) if state is None else state.astype(acc)
    scores = jnp.einsum("bnthd,bnshd->bnhts", qc, kc)
    scores = jnp.where(jnp.tril(jnp.ones((c, c), bool)), scores, 0.0)
    o = jnp.einsum("bnhts,bnshm->bnthm", scores, vc)
    delta = jnp.einsum("bnshd,bnshm->bnhdm", kc, vc)              # one state increment per chunk
    # Exclusive prefix sum (state entering each chunk), built by shifting rather than by subtracting
    # delta from the inclusive sum, which would leak rounding of later chunks into earlier ones.
    inclusive = jnp.cumsum(delta, axis=1)
    before = s0[:, None] + jnp.concatenate([jnp.zeros_like(inclusive[:, :1]), inclusive[:, :-1]], axis=1)
    o = o + jnp.einsum("bnthd,bnhdm->bnthm", qc, before)
    o = o.reshape(b, n * c, h, m)[:, :t]
    return o.astype(q.dtype), s0 + inclusive[:, -1]


def linear_attention_step(state: Array, q_t: Array, k_t: Array, v_t: Array) -> tuple[Array, Array]:
    """One token of the recurrent form: `S += k_t v_t^T; o_t = q_t S` (inclusive of the new token).

    Args:
      state: [B, H, D, M] running sum of k v^T.
      q_t, k_t: [B, H, D]; v_t: [B, H, M].

    Returns:
      (new state [B, H, D, M], o_t [B, H, M] in q_t's dtype).
    """
    acc = _acc_dtype(state, q_t, k_t, v_t)
    state = state.astype(acc) + jnp.einsum("bhd,bhm->bhdm", k_t.astype(acc), v_t.astype(acc))
    o = jnp.einsum("bhd,bhdm->bhm", q_t.astype(acc), state)
    return state, o.astype(q_t.dtype)


def linear_attention_recurrent(q: Array, k: Array, v: Array,
                               state: Optional[Array] = None) -> tuple[Array, Array]:
    """Recurrent form: `jax.lax.scan` of `linear_attention_step` over time.

    Args:
      q: [B, T, H, D]; k: [B, T, H, D]; v: [B, T, H, M].
      state: optional [B, H, D, M] initial state (zeros if None).

    Returns:
      (o [B, T, H, M], final state [B, H, D, M]).
    """
    acc = _acc_dtype(q, k, v)
    b, _, h, d = q.shape
    if state is None:
        state = linear_attention_init_state(b, h, d, v.shape[-1], acc)

    def body(s, xs):
        return linear_attention_step(s, *xs)

    state, o = jax.lax.scan(body, state.astype(acc), tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
    return jnp.swapaxes(o, 0, 1), state


# ---------------------------------------------------------------------------------------------
# The VAR attention chain (spec §2.6, §3, §4)
# ---------------------------------------------------------------------------------------------

def _key_map(o: Array, key_kernel: Optional[Array]) -> Array:
    """Next layer's key from a layer output: identity (SAMoVAR, W_k = I) or `o_flat @ W_k`.

    o: [..., H, D]; key_kernel: None or [E, E] (Flax kernel layout [in, out], E = H*D). A full W_k
    mixes heads; with W_k = I heads never mix inside the key chain (spec §2.6).
    """
    if key_kernel is None:
        return o
    flat = o.reshape(o.shape[:-2] + (-1,))
    return (flat @ key_kernel.astype(flat.dtype)).reshape(o.shape)


def _check_chain(x0, q, v, key_kernels, dropout_mask):
    if q.ndim != x0.ndim + 1 or v.shape != q.shape or q.shape[1:] != x0.shape:
        raise ValueError(f"VAR chain expects x0 [B, T, H, D] and q, v [L, B, T, H, D]; got x0 "
                         f"{x0.shape}, q {q.shape}, v {v.shape}")
    if key_kernels is not None:
        e = x0.shape[-1] * x0.shape[-2]
        if key_kernels.shape != (q.shape[0], e, e):
            raise ValueError(f"key_kernels must be [L, E, E] = {(q.shape[0], e, e)}, got {key_kernels.shape}")
    if dropout_mask is not None and dropout_mask.shape != q.shape:
        raise ValueError(f"dropout_mask must have q's shape {q.shape}, got {dropout_mask.shape}")


def var_chain_init_state(layers: int, batch: int, heads: int, head_dim: int, dtype=jnp.float32) -> Array:
    """Zero state of the VAR chain: one S^(m) = sum k^(m-1) v^(m)T per layer, [L, B, H, D, D]."""
    return jnp.zeros((layers, batch, heads, head_dim, head_dim), dtype)


def var_chain_parallel(x0: Array, q: Array, v: Array, *, key_kernels: Optional[Array] = None,
                       dropout_mask: Optional[Array] = None) -> Array:
    """Masked form of the VAR chain, one quadratic causal linear attention per layer.

    For m = 1..L (spec §2.6): `k^(0) = x0`,
    `o^(m)_t = sum_{s<=t} <q^(m)_t, k^(m-1)_s> v^(m)_s` per head, `o^(m) <- dropout(o^(m))`,
    `k^(m) = o^(m)` (or `o^(m) W_k^(m+1)` in the "w/ W_k" ablation, where also `k^(0) = x0 W_k^(1)`).

    Args:
      x0: [B, T, H, D] the VAR observation (output of `VAR_input_norm`, split into heads).
      q: [L, B, T, H, D] per-layer queries (from x0, already per-head normalised).
      v: [L, B, T, H, D] per-layer values.
      key_kernels: optional [L, E, E] key matrices (row-vector layout, `k = o_flat @ W`); None = I.
      dropout_mask: optional [L, B, T, H, D] multiplier applied to each layer output (already scaled
        by 1/(1-rate)); the same mask makes every form agree in training mode.

    Returns:
      [L, B, T, H, D] every layer's output (the model sums them over L).
    """
    _check_chain(x0, q, v, key_kernels, dropout_mask)
    k = x0
    outs = []
    for m in range(q.shape[0]):
        key = _key_map(k, None if key_kernels is None else key_kernels[m])
        o = linear_attention_parallel(q[m], key, v[m])
        if dropout_mask is not None:
            o = o * dropout_mask[m].astype(o.dtype)
        outs.append(o)
        k = o
    return jnp.stack(outs)


def var_chain_chunked(x0: Array, q: Array, v: Array, chunk_size: int, *, state: Optional[Array] = None,
                      key_kernels: Optional[Array] = None,
                      dropout_mask: Optional[Array] = None) -> tuple[Array, Array]:
    """Chunked form of the VAR chain: `linear_attention_chunked` once per layer (spec §4).

    Args:
      x0, q, v, key_kernels, dropout_mask: as in `var_chain_parallel`.
      chunk_size: C >= 1 (need not divide T).
      state: optional [L, B, H, D, D] state carried in from earlier tokens.

    Returns:
      (o [L, B, T, H, D], final state [L, B, H, D, D]).
    """
    _check_chain(x0, q, v, key_kernels, dropout_mask)
    k = x0
    outs, states = [], []
    for m in range(q.shape[0]):
        key = _key_map(k, None if key_kernels is None else key_kernels[m])
        o, s = linear_attention_chunked(q[m], key, v[m], chunk_size, None if state is None else state[m])
        if dropout_mask is not None:
            o = o * dropout_mask[m].astype(o.dtype)
        outs.append(o)
        states.append(s)
        k = o
    return jnp.stack(outs), jnp.stack(states)


def var_chain_step(state: Array, x0_t: Array, q_t: Array, v_t: Array, *,
                   key_kernels: Optional[Array] = None,
                   dropout_mask_t: Optional[Array] = None) -> tuple[Array, Array]:
    """One token through all L layers (spec §4, "recurrent"): one call per time step.

    With `k = x0_t`, for m = 1..L: `S^(m) += k v^(m)_t^T`, `o^(m)_t = q^(m)_t S^(m)`, `k = o^(m)_t`.
    This works token by token because layer m at time t needs only layer m-1's outputs at times <= t.

    Args:
      state: [L, B, H, D, D] per-layer states.
      x0_t: [B, H, D] observation at this token.
      q_t, v_t: [L, B, H, D] this token's per-layer queries and values.
      key_kernels: optional [L, E, E] (see `var_chain_parallel`).
      dropout_mask_t: optional [L, B, H, D] this token's output dropout multipliers.

    Returns:
      (new state [L, B, H, D, D], o_t [L, B, H, D]).
    """
    k = x0_t
    new_states, outs = [], []
    for m in range(q_t.shape[0]):
        key = _key_map(k, None if key_kernels is None else key_kernels[m])
        s, o = linear_attention_step(state[m], q_t[m], key, v_t[m])
        if dropout_mask_t is not None:
            o = o * dropout_mask_t[m].astype(o.dtype)
        new_states.append(s)
        outs.append(o)
        k = o
    return jnp.stack(new_states), jnp.stack(outs)


def var_chain_recurrent(x0: Array, q: Array, v: Array, *, state: Optional[Array] = None,
                        key_kernels: Optional[Array] = None,
                        dropout_mask: Optional[Array] = None) -> tuple[Array, Array]:
    """Recurrent form: ONE `jax.lax.scan` over time carrying all layers' D x D states (spec §4).

    Args:
      x0, q, v, key_kernels, dropout_mask: as in `var_chain_parallel`.
      state: optional [L, B, H, D, D] initial state (zeros if None).

    Returns:
      (o [L, B, T, H, D], final state [L, B, H, D, D]).
    """
    _check_chain(x0, q, v, key_kernels, dropout_mask)
    layers, b, _, h, d = q.shape
    acc = _acc_dtype(x0, q, v)
    if state is None:
        state = var_chain_init_state(layers, b, h, d, acc)

    def body(s, xs):
        x_t, q_t, v_t, m_t = xs
        return var_chain_step(s, x_t, q_t, v_t, key_kernels=key_kernels, dropout_mask_t=m_t)

    xs = (jnp.swapaxes(x0, 0, 1), jnp.moveaxis(q, 2, 0), jnp.moveaxis(v, 2, 0),
          None if dropout_mask is None else jnp.moveaxis(dropout_mask, 2, 0))
    state, o = jax.lax.scan(body, state.astype(acc), xs)
    return jnp.moveaxis(o, 0, 2), state


# ---------------------------------------------------------------------------------------------
# Structural matrix D = L U (spec §2.7)
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


def structural_matrix_inverse(theta: Array) -> Array:
    """D^-1 = U^-1 L^-1 per head via two triangular solves, [H, D, D] (the paper's reading)."""
    lower, upper = lu_factors(theta)
    eye = jnp.broadcast_to(jnp.eye(theta.shape[-1], dtype=theta.dtype), theta.shape)
    l_inv = jax.scipy.linalg.solve_triangular(lower, eye, lower=True, unit_diagonal=True)
    return jax.scipy.linalg.solve_triangular(upper, l_inv, lower=False)
