"""The forms of AGF attention: parallel (causal or not), chunked, recurrent, step, the explicit matrix.

Every form computes the same numbers (module docstring of `agf_jax.ops`); the causal state is an
online softmax per (head, feature) with a running maximum, `AGFState`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from agf_jax.factors import MASK_OFFSET, as_float, check_projections, left_factor, masked_logits
from agf_jax.fused import agf_with_orthogonality
from zoo_core import checks
from zoo_core.ops import masking

Array = jax.Array




class AGFState(NamedTuple):
    """Recurrent state of causal AGF per head: an online softmax over the prefix (float32).

    Attributes:
        num: `[B, H, D, M]` sum_j exp(Z_V[j] - m) (x) Val_j.
        den: `[B, H, D]` sum_j exp(Z_V[j] - m).
        max: `[B, H, D]` running maximum m of Z_V (-inf before the first token).
    """
    num: Array
    den: Array
    max: Array


def init_state(batch_size: int, num_heads: int, head_dim: int, value_dim: Optional[int] = None,
               dtype=jnp.float32) -> AGFState:
    """Empty causal state: num `[B, H, D, M]` (M = value_dim, default D), den and max `[B, H, D]`,
    in float32 (float64 stays float64; never a low-precision type)."""
    value_dim = head_dim if value_dim is None else value_dim
    dtype = jnp.promote_types(dtype, jnp.float32)
    return AGFState(num=jnp.zeros((batch_size, num_heads, head_dim, value_dim), dtype),
                    den=jnp.zeros((batch_size, num_heads, head_dim), dtype),
                    max=jnp.full((batch_size, num_heads, head_dim), -jnp.inf, dtype))


def _check_state(state: AGFState, a: Array, val: Array, time_axis: bool = True):
    b, h, d = (a.shape[0], a.shape[2], a.shape[3]) if time_axis else a.shape
    want = (b, h, d, val.shape[-1])
    if tuple(state.num.shape) != want or tuple(state.den.shape) != want[:3] or \
        tuple(state.max.shape) != want[:3]:
        raise ValueError(f"state shapes {state.num.shape}/{state.den.shape}/{state.max.shape} do "
                         f"not match [B, H, D, M] = {want}")


def agf_parallel(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                 basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                 mask: Optional[Array] = None, causal: bool = False,
                 spectrum: Optional[Array] = None) -> Array:
    """AGF attention over a whole sequence, O(T D M) per head (agf.md §2.2-2.3).

    Non-causal: O = (U * g) (V^T Val), exactly the reference. Causal (extension, see module
    docstring): V is normalised over each prefix; computed with an associative scan of the
    online-softmax monoid, O(T D M) memory, no T x T matrix.

    Args:
        zu: `[B, T, H, D]` left-factor logits (reference: query projection).
        zv: `[B, T, H, D]` right-factor logits (reference: key projection).
        zs: `[B, T, H, D]` singular-value logits (reference: Sigma projection).
        val: `[B, T, H, M]` values.
        coeffs: `[K+1]` filter coefficients.
        basis, alpha, beta: see `resolve_basis`.
        mask: `[B, T]` padding mask (1/True = real), applied to V and Val only, or None.
        causal: prefix-normalised V.
        spectrum: None (AGF's filter), or `[H, D]` singular values used as g for every token (the
            Table 6 variants; zs and coeffs are then unused and zs may be None): see `left_factor`.

    Returns:
        `[B, T, H, M]` float32 (float64 for float64 inputs).
    """
    check_projections(zu, zv, zs, val)
    if not causal:
        return agf_with_orthogonality(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta,
                                      mask=mask, spectrum=spectrum)[0]
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    zv = masked_logits(zv, mask)
    val = as_float(masking.zero_padding(val, mask)).astype(a.dtype)
    # Per-token elements (m, z, N) = (Z_V, 1, 1 (x) Val): combining prefixes is an associative
    # log-sum-exp merge, so every prefix state is available in parallel.
    m = zv
    z = jnp.ones_like(zv)
    num = jnp.broadcast_to(val[:, :, :, None, :], zv.shape + val.shape[-1:])
    m, z, num = jax.lax.associative_scan(_merge, (m, z, num), axis=1)
    return jnp.einsum("bthd,bthdm->bthm", a / z, num)


def _merge(left, right):
    """Associative merge of two online-softmax partial sums (m, z, N); element shapes broadcast."""
    m1, z1, n1 = left
    m2, z2, n2 = right
    m = jnp.maximum(m1, m2)
    w1 = jnp.exp(m1 - m)
    w2 = jnp.exp(m2 - m)
    return m, w1 * z1 + w2 * z2, w1[..., None] * n1 + w2[..., None] * n2


def _merge_from_empty(left, right):
    """`_merge` where either side may be the empty prefix (m = -inf, z = 0, N = 0)."""
    m1, z1, n1 = left
    m2, z2, n2 = right
    m = jnp.maximum(m1, m2)
    ref = jnp.where(m == -jnp.inf, 0.0, m)      # two empty sides: exp(-inf) = 0, not exp(NaN)
    w1 = jnp.exp(m1 - ref)
    w2 = jnp.exp(m2 - ref)
    return m, w1 * z1 + w2 * z2, w1[..., None] * n1 + w2[..., None] * n2


def _check_chunk_size(chunk_size) -> None:
    assert isinstance(chunk_size, int) and chunk_size >= 1, f"chunk_size {chunk_size!r}"


class _Chunks(NamedTuple):
    """Inputs of a chunked form, padded to n * C tokens: a, zv `[B, nC, H, D]`, val `[B, nC, H, M]`,
    state `AGFState` (float32), poisoned `[B, T, H]` (outputs at or after a non-finite valid input)."""
    a: Array
    zv: Array
    val: Array
    state: AGFState
    poisoned: Array


def _chunk_inputs(zu, zv, zs, val, coeffs, *, chunk_size, basis, alpha, beta, mask,
                  state, spectrum) -> _Chunks:
    check_projections(zu, zv, zs, val)
    _check_chunk_size(chunk_size)
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    zv = masked_logits(zv, mask)
    val = as_float(masking.zero_padding(val, mask)).astype(a.dtype)
    # The intra-chunk sum multiplies the future weights (exactly 0) with the future values, and
    # 0 * NaN = NaN: a non-finite Z_V or Val at a valid position is replaced here and every output
    # at or after it is set to NaN below, which is what the recurrence gives.
    bad = ~(jnp.all(jnp.isfinite(zv), axis=-1) & jnp.all(jnp.isfinite(val), axis=-1))   # [B, T, H]
    poisoned = jnp.cumsum(bad.astype(jnp.int32), axis=1) > 0
    zv = jnp.where(bad[..., None], -MASK_OFFSET, zv)
    val = jnp.where(bad[..., None], 0.0, val)
    b, t, h, d = a.shape
    if state is None:
        state = init_state(b, h, d, val.shape[-1], a.dtype)
    _check_state(state, a, val)
    state = AGFState(*(s.astype(a.dtype) for s in state))
    pad = -(-t // chunk_size) * chunk_size - t
    if pad:
        # Padded tokens: Z_V = -inf (weight exactly 0, max unchanged), A = 0, Val = 0.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        a = jnp.pad(a, widths)
        val = jnp.pad(val, widths)
        zv = jnp.pad(zv, widths, constant_values=-jnp.inf)
    return _Chunks(a, zv, val, state, poisoned)


def _poison(y: Array, state: AGFState, poisoned: Array) -> tuple[Array, AGFState]:
    """Trims y to T tokens; NaN at and after a non-finite valid input, and in such a final state."""
    y = y[:, :poisoned.shape[1]]
    last = poisoned[:, -1]                                                            # [B, H]
    state = AGFState(jnp.where(last[..., None, None], jnp.nan, state.num),
                     jnp.where(last[..., None], jnp.nan, state.den),
                     jnp.where(last[..., None], jnp.nan, state.max))
    return jnp.where(poisoned[..., None], jnp.nan, y), state


def agf_chunked(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *, chunk_size: int,
                basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                mask: Optional[Array] = None, state: Optional[AGFState] = None,
                spectrum: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF in chunks of C tokens, in the form that suits the platform it runs on.

    The CPU runs `agf_chunked_scan` (a `lax.scan` over the chunks, one chunk's temporaries at a
    time); GPUs and TPUs run `agf_chunked_parallel` (every chunk at once, no loop: an accelerator
    runs a while loop's control from the host, microseconds per chunk). Both give the same numbers.

    Args:
        zu, zv, zs: `[B, T, H, D]`.
        val: `[B, T, H, M]`.
        coeffs: `[K+1]`.
        chunk_size: C >= 1 (any value; need not divide T).
        basis, alpha, beta: see `resolve_basis`.
        mask: `[B, T]` or None.
        state: `AGFState` of the tokens before this sequence, or None for an empty prefix.
        spectrum: None or `[H, D]`, as in `agf_parallel`.

    Returns:
        (y `[B, T, H, M]`, final `AGFState`).
    """
    check_projections(zu, zv, zs, val)
    checks.check_int("chunk_size", chunk_size, 1)   # a user-chosen argument of a public kernel
    kw = dict(chunk_size=chunk_size, basis=basis, alpha=alpha, beta=beta)
    return jax.lax.platform_dependent(
        zu, zv, zs, val, coeffs, mask, state, spectrum,
        cpu=lambda *x: agf_chunked_scan(*x[:5], mask=x[5], state=x[6], spectrum=x[7], **kw),
        default=lambda *x: agf_chunked_parallel(*x[:5], mask=x[5], state=x[6], spectrum=x[7],
                                                **kw))


def agf_chunked_scan(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                     chunk_size: int, basis: str = "jacobi", alpha: Optional[float] = None,
                     beta: Optional[float] = None, mask: Optional[Array] = None,
                     state: Optional[AGFState] = None,
                     spectrum: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF as a `lax.scan` over chunks of C tokens: O(T C D + T D M) time, a carried O(D M)
    state per head, and one chunk's `[B, C, C, H, D]` weights alive at a time (the CPU form).

    Within a chunk every row t uses its own running maximum M_t = max(m_prev, max_{j<=t} Z_V[j]),
    so all exponentials are <= 1 and every denominator is >= 1 (exactly stable, no underflow of the
    early rows); the previous chunks enter through the carried state rescaled by exp(m_prev - M_t).
    T need not be a multiple of C: the tail is padded with tokens of weight exactly 0.

    Arguments and result as in `agf_chunked`.
    """
    a, zv, val, state, poisoned = _chunk_inputs(zu, zv, zs, val, coeffs, chunk_size=chunk_size,
                                                basis=basis, alpha=alpha, beta=beta, mask=mask,
                                                state=state, spectrum=spectrum)
    b, c = a.shape[0], chunk_size
    n_chunks = a.shape[1] // c

    def to_chunks(x):  # [B, n*C, ...] -> [n, B, C, ...]
        return jnp.moveaxis(x.reshape((b, n_chunks, c) + x.shape[2:]), 1, 0)

    tril = jnp.tril(jnp.ones((c, c), bool))[None, :, :, None, None]   # [1, t, j, 1, 1]

    def body(carry: AGFState, xs):
        a_c, zv_c, val_c = xs                                   # [B, C, H, D], ..., [B, C, H, M]
        row_max = jnp.maximum(carry.max[:, None], jax.lax.cummax(zv_c, axis=1))      # [B, C, H, D]
        logits = zv_c[:, None, :] - row_max[:, :, None]                     # [B, t, j, H, D]
        p = jnp.exp(jnp.where(tril, logits, -jnp.inf))
        carry_scale = jnp.exp(carry.max[:, None] - row_max)                          # [B, C, H, D]
        den = carry.den[:, None] * carry_scale + jnp.sum(p, axis=2)                  # >= 1
        w = a_c / den
        y = (jnp.einsum("bthd,bhdm->bthm", w * carry_scale, carry.num)
             + jnp.einsum("bthd,btjhd,bjhm->bthm", w, p, val_c))
        new_max = row_max[:, -1]
        e = jnp.exp(zv_c - new_max[:, None])
        old_scale = jnp.exp(carry.max - new_max)
        new = AGFState(num=(carry.num * old_scale[..., None]
                            + jnp.einsum("bjhd,bjhm->bhdm", e, val_c)),
                       den=carry.den * old_scale + jnp.sum(e, axis=1),
                       max=new_max)
        return new, y

    state, ys = jax.lax.scan(body, state, (to_chunks(a), to_chunks(zv), to_chunks(val)))
    y = jnp.moveaxis(ys, 0, 1).reshape((b, n_chunks * c) + ys.shape[3:])
    return _poison(y, state, poisoned)


def agf_chunked_parallel(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                         chunk_size: int, basis: str = "jacobi", alpha: Optional[float] = None,
                         beta: Optional[float] = None, mask: Optional[Array] = None,
                         state: Optional[AGFState] = None,
                         spectrum: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF with every chunk of C tokens at once: no loop over chunks or tokens (the GPU/TPU form).

    The same numbers as `agf_chunked_scan`, in the state-passing form of chunked linear attention
    (Mamba2's SSD minimal form, fla's chunk kernels), with the running maximum of the online softmax
    in place of a decay. With n = T / C chunks, per chunk i and head:

        m_i = max_C Z_V,  z_i = sum_C exp(Z_V - m_i),  N_i = sum_C exp(Z_V - m_i) (x) Val  (one einsum);
        the state before chunk i, (m, z, N)_{<i}, is the exclusive prefix of the associative
        log-sum-exp merge (m, z, N) + (m', z', N') = (M, e^{m-M} z + e^{m'-M} z', e^{m-M} N + e^{m'-M} N'),
        M = max(m, m'), over the chunk axis (`lax.associative_scan`), after the carried `state`;

    then each row uses its own running maximum exactly as `agf_chunked_scan` does, so every
    exponential is <= 1. All products are batched over batch, chunks and heads.

    Memory: every chunk's intermediates are alive at once. The intra-chunk weights are
    `[B, T/C, C, C, H, D]` float32, 4 B T C H D bytes (B = 1, T = 16K, C = 64, 8 heads of 64:
    2 GiB), and the per-chunk states `[B, T/C, H, D, M]` float32, 4 B H T D M / C bytes (32 MiB
    there), plus the associative scan's temporaries of about the states' size; the scan form holds
    one chunk of each. The weights grow with C, the states with T / C.

    Arguments and result as in `agf_chunked`.
    """
    a, zv, val, state, poisoned = _chunk_inputs(zu, zv, zs, val, coeffs, chunk_size=chunk_size,
                                                basis=basis, alpha=alpha, beta=beta, mask=mask,
                                                state=state, spectrum=spectrum)
    b, tc, h, d = a.shape
    c = chunk_size
    n = tc // c
    a, zv, val = (x.reshape((b, n, c) + x.shape[2:]) for x in (a, zv, val))   # [B, n, C, H, *]
    # Each chunk's own partial sums, relative to its maximum (finite: every chunk holds a token
    # that is not tail padding).
    cm = jnp.max(zv, axis=2)                                                   # [B, n, H, D]
    e = jnp.exp(zv - cm[:, :, None])
    chunk = (cm, jnp.sum(e, axis=2), jnp.einsum("bnchd,bnchm->bnhdm", e, val))
    prefix = jax.lax.associative_scan(_merge, chunk, axis=1)                   # through chunk i
    empty = (jnp.full_like(cm[:, :1], -jnp.inf), jnp.zeros_like(cm[:, :1]),
             jnp.zeros_like(chunk[2][:, :1]))
    before = tuple(jnp.concatenate([x0, x], axis=1) for x0, x in zip(empty, prefix))  # [B, n+1]
    carried = tuple(x[:, None] for x in (state.max, state.den, state.num))
    m_prev, den_prev, num_prev = _merge_from_empty(carried, before)           # before chunk i
    final = AGFState(num=num_prev[:, -1], den=den_prev[:, -1], max=m_prev[:, -1])
    m_prev, den_prev, num_prev = m_prev[:, :n], den_prev[:, :n], num_prev[:, :n]
    # Within a chunk, as in agf_chunked_scan: row t's maximum M_t, its weights exp(Z_V[j] - M_t).
    row_max = jnp.maximum(m_prev[:, :, None], jax.lax.cummax(zv, axis=2))     # [B, n, C, H, D]
    logits = zv[:, :, None] - row_max[:, :, :, None]                          # [B, n, t, j, H, D]
    tril = jnp.tril(jnp.ones((c, c), bool))[:, :, None, None]
    p = jnp.exp(jnp.where(tril, logits, -jnp.inf))
    carry_scale = jnp.exp(m_prev[:, :, None] - row_max)                       # 0 for an empty one
    den = den_prev[:, :, None] * carry_scale + jnp.sum(p, axis=3)             # >= 1
    w = a / den
    y = (jnp.einsum("bnthd,bnhdm->bnthm", w * carry_scale, num_prev)
         + jnp.einsum("bnthd,bntjhd,bnjhm->bnthm", w, p, val))
    return _poison(y.reshape((b, tc) + y.shape[3:]), final, poisoned)


def _step_core(state: AGFState, a_t: Array, zv_t: Array, val_t: Array) -> tuple[AGFState, Array]:
    new_max = jnp.maximum(state.max, zv_t)
    old_scale = jnp.exp(state.max - new_max)
    e = jnp.exp(zv_t - new_max)
    num = state.num * old_scale[..., None] + e[..., None] * val_t[:, :, None, :]
    den = state.den * old_scale + e
    y = jnp.einsum("bhd,bhdm->bhm", a_t / den, num)
    return AGFState(num, den, new_max), y


def agf_recurrent(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                  basis: str = "jacobi", alpha: Optional[float] = None,
                  beta: Optional[float] = None, mask: Optional[Array] = None,
                  state: Optional[AGFState] = None,
                  spectrum: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF as a `jax.lax.scan` of `agf_step` over time (O(D M) state per head).

    Arguments as in `agf_chunked` (without chunk_size); returns (y `[B, T, H, M]`, final state).
    """
    check_projections(zu, zv, zs, val)
    # The token-local factor is computed for the whole sequence first; only the parameter-free
    # online softmax is scanned.
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    zv = masked_logits(zv, mask)
    val = as_float(masking.zero_padding(val, mask)).astype(a.dtype)
    b, _, h, d = a.shape
    if state is None:
        state = init_state(b, h, d, val.shape[-1], a.dtype)
    _check_state(state, a, val)
    state = AGFState(*(s.astype(a.dtype) for s in state))
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (a, zv, val))
    state, ys = jax.lax.scan(lambda c, x: _step_core(c, *x), state, xs)
    return jnp.moveaxis(ys, 0, 1), state


def agf_step(state: AGFState, zu_t: Array, zv_t: Array, zs_t: Optional[Array], val_t: Array, coeffs: Array,
             *, basis: str = "jacobi", alpha: Optional[float] = None,
             beta: Optional[float] = None,
             spectrum: Optional[Array] = None) -> tuple[AGFState, Array]:
    """One causal AGF token, O(D M) per head: state of the prefix, zu_t, zv_t, zs_t `[B, H, D]`,
    val_t `[B, H, M]` -> (new `AGFState`, y_t `[B, H, M]`); coeffs, basis and spectrum as in
    `agf_parallel`.
    """
    check_projections(zu_t, zv_t, zs_t, val_t, rank=3)
    a_t = left_factor(zu_t, zs_t, coeffs, basis=basis, alpha=alpha, beta=beta,
                      spectrum=spectrum)
    val_t = as_float(val_t).astype(a_t.dtype)
    _check_state(state, a_t, val_t, time_axis=False)
    state = AGFState(*(s.astype(a_t.dtype) for s in state))
    return _step_core(state, a_t, as_float(zv_t).astype(a_t.dtype), val_t)


def agf_attention_matrix(zu: Array, zv: Array, zs: Optional[Array], coeffs: Array, *, basis: str = "jacobi",
                         alpha: Optional[float] = None, beta: Optional[float] = None,
                         mask: Optional[Array] = None, causal: bool = False,
                 spectrum: Optional[Array] = None) -> Array:
    """The implicit T x T attention matrix H_tj = sum_k U_tk g_tk V^(t)_jk; O(T^2 D), small T only.

    Used as the explicit reference in tests and by `agf_jax.analysis`. Non-causal: V^(t) = V.
    Causal: V^(t) is the softmax over the prefix j <= t (zero for j > t). Arguments as in
    `agf_parallel` (no values); returns `[B, H, T, T]` (query t, key j), `O = H @ Val` per head.
    """
    check_projections(zu, zv, zs)
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    zv = masked_logits(zv, mask)
    if not causal:
        v = jax.nn.softmax(zv, axis=1)
        return jnp.einsum("bthd,bjhd->bhtj", a, v)
    t = zv.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None, :, :, None, None]            # [1, t, j, 1, 1]
    logits = jnp.broadcast_to(zv[:, None], (zv.shape[0], t) + zv.shape[1:])      # [B, t, j, H, D]
    v_t = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=2)
    return jnp.einsum("bthd,btjhd->bhtj", a, v_t)
