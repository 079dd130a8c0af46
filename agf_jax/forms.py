"""The forms of AGF attention: parallel (causal or not), chunked, scan, step, the explicit matrix.

Every form computes the same numbers (module docstring of `agf_jax.ops`); the causal state is an
online softmax per (head, feature) with a running maximum, `AGFState`.

Packed sequences (`segment_ids` int `[B, T]`, 0 = padding; `zoo_core.ops.packing`,
docs/specs/context_parallel.md §2): a token attends only within its document. The causal forms cut
the state (num, den and the running maximum) at each document start: a block of tokens (a chunk)
acts on the incoming state as `keep ? merge(S_in, b) : b`, with b the state of its last document
and `merge` the max-aware log-sum-exp merge, and only the block's first document reads S_in. The
first token of the array continues the incoming `state`. Tokens of id 0 are padding (as `mask`).

Checks run once, in the public kernels (`agf_parallel`, `agf_chunked`, `agf_chunked_scan`,
`agf_chunked_parallel`, `agf_scan`, `agf_step`, `agf_attention_matrix`); the private forms they
call trust their arguments. A non-finite Z_V or Val at a valid position is replaced before any sum
and every output it reaches (at and after it, within its document) is set back to NaN, as the
recurrence gives (`zoo_core.ops.guard`).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from agf_jax.basis import check_filter
from agf_jax.factors import MASK_OFFSET, _left_factor, as_float, check_projections, gated
from agf_jax.fused import _with_orthogonality
from zoo_core import checks
from zoo_core.ops import guard, masking, packing

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


def _check_state(state: Optional[AGFState], shape, value_dim: int) -> None:
    """`state` None or an `AGFState` for `shape` = (B, H, D) and M = value_dim."""
    if state is None:
        return
    want = tuple(shape) + (value_dim,)
    if tuple(jnp.shape(state.num)) != want or tuple(jnp.shape(state.den)) != want[:3] or \
            tuple(jnp.shape(state.max)) != want[:3]:
        raise ValueError(f"state shapes {jnp.shape(state.num)}/{jnp.shape(state.den)}/"
                         f"{jnp.shape(state.max)} do not match [B, H, D, M] = {want}")


def check_arguments(zu, zv, zs, val, *, mask=None, segment_ids=None, state=None,
                    chunk_size=None, coeffs=None, basis="jacobi", alpha=None, beta=None,
                    spectrum=None) -> None:
    """The boundary check of a public sequence kernel, once: projections `[B, T, H, D]` (val
    `[B, T, H, M]`), mask and segment_ids `[B, T]`, an `AGFState` for (B, H, D, M), chunk_size >= 1,
    and (given coeffs, without spectrum) coeffs `[K+1]` and the basis."""
    check_projections(zu, zv, zs, val)
    if coeffs is not None and spectrum is None:
        check_filter(coeffs, basis, alpha, beta)
    masking.check_mask(mask, jnp.shape(zu)[:2])
    packing.check_segment_ids(segment_ids, jnp.shape(zu)[:2])
    if val is not None:
        b, _, h, d = jnp.shape(zu)
        _check_state(state, (b, h, d), jnp.shape(val)[-1])
    if chunk_size is not None:
        checks.check_int("chunk_size", chunk_size, 1)


class _Causal(NamedTuple):
    """The inputs of a causal form: a = U * g, zv (padding -1e9, bad positions -1e9) `[B, T, H, D]`,
    val `[B, T, H, M]` (padding and bad positions 0), float32, and poisoned `[B, T, H]`."""
    a: Array
    zv: Array
    val: Array
    poisoned: Array


def _causal_inputs(zu, zv, zs, val, coeffs, *, basis, alpha, beta, mask, segment_ids,
                   spectrum) -> _Causal:
    a = _left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    valid = mask if segment_ids is None else packing.valid(segment_ids, mask)
    if segment_ids is not None:      # tokens of no document read nothing (their output is 0)
        a = masking.zero_padding(a, segment_ids > 0)
    zv = masking.zero_padding(as_float(zv), valid, fill=-MASK_OFFSET).astype(a.dtype)
    val = as_float(masking.zero_padding(val, valid)).astype(a.dtype)
    # A future weight of exactly 0 times a NaN value is NaN: non-finite inputs are replaced here
    # and the outputs they reach set back to NaN at the end (`_finish`).
    bad = guard.nonfinite(zv, val)
    return _Causal(a, guard.clean(zv, bad, -MASK_OFFSET), guard.clean(val, bad),
                   guard.reach(bad, segment_ids))


def _finish(y: Array, state: Optional[AGFState], poisoned: Array):
    """y trimmed to T tokens; NaN where a bad input reaches it, and in such a final state."""
    y = guard.poison(y[:, :poisoned.shape[1]], poisoned)
    if state is None:
        return y
    last = guard.last(poisoned)                                                       # [B, H]
    return y, AGFState(*(guard.poison(s, last) for s in state))


def _as_state(state: Optional[AGFState], a: Array, val: Array) -> AGFState:
    if state is None:
        return init_state(a.shape[0], a.shape[-2], a.shape[-1], val.shape[-1], a.dtype)
    return AGFState(*(jnp.asarray(s).astype(a.dtype) for s in state))


def agf_parallel(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                 basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                 mask: Optional[Array] = None, causal: bool = False,
                 spectrum: Optional[Array] = None, segment_ids: Optional[Array] = None) -> Array:
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
        segment_ids: None, or int `[B, T]` packed documents (0 = padding): V is normalised over
            the token's own document (its prefix there when causal).

    Returns:
        `[B, T, H, M]` float32 (float64 for float64 inputs).
    """
    check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, coeffs=coeffs, basis=basis,
                    alpha=alpha, beta=beta, spectrum=spectrum)
    if not causal:
        return _with_orthogonality(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta, mask=mask,
                                   count_padding=True, spectrum=spectrum, segment_ids=segment_ids)[0]
    a, zv, val, poisoned = _causal_inputs(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha,
                                          beta=beta, mask=mask, segment_ids=segment_ids,
                                          spectrum=spectrum)
    # Per-token elements (m, z, N) = (Z_V, 1, 1 (x) Val): combining prefixes is an associative
    # log-sum-exp merge, so every prefix state is available in parallel.
    m = zv
    z = jnp.ones_like(zv)
    num = jnp.broadcast_to(val[:, :, :, None, :], zv.shape + val.shape[-1:])
    if segment_ids is None:
        m, z, num = jax.lax.associative_scan(_merge, (m, z, num), axis=1)
    else:
        start = packing.starts(segment_ids)
        _, (m, z, num) = jax.lax.associative_scan(gated(_merge), (start, (m, z, num)), axis=1)
    return _finish(jnp.einsum("bthd,bthdm->bthm", a / z, num), None, poisoned)


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


def _chunked(zu, zv, zs, val, coeffs, *, chunk_size, basis, alpha, beta, mask, state, spectrum,
             segment_ids):
    """The padded chunk inputs of both chunked forms (`_to_chunks`)."""
    inputs = _causal_inputs(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta, mask=mask,
                            segment_ids=segment_ids, spectrum=spectrum)
    return _to_chunks(inputs, chunk_size, state, segment_ids)


def _to_chunks(inputs: _Causal, chunk_size: int, state: Optional[AGFState],
               segment_ids: Optional[Array]):
    """(a, zv, val `[B, n, C, H, *]`, start `[B, n, C]` or None, state, poisoned `[B, T, H]`);
    tail padding has Z_V = -inf (weight 0, max unchanged), A = 0, Val = 0, and continues the last
    document."""
    a, zv, val, poisoned = inputs
    state = _as_state(state, a, val)
    b, t = a.shape[:2]
    n = -(-t // chunk_size)
    pad = n * chunk_size - t
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    a, val = jnp.pad(a, widths), jnp.pad(val, widths)
    zv = jnp.pad(zv, widths, constant_values=-jnp.inf)
    a, zv, val = (x.reshape((b, n, chunk_size) + x.shape[2:]) for x in (a, zv, val))
    start = None
    if segment_ids is not None:
        start = jnp.pad(packing.starts(segment_ids), ((0, 0), (0, pad))).reshape(b, n, chunk_size)
    return a, zv, val, start, state, poisoned


def _segment_cummax(zv: Array, start: Array) -> Array:
    """max of Z_V `[..., C, H, D]` over the earlier tokens of the same document in the block
    (start `[..., C]`): the running maximum, restarted at each document start."""
    def combine(left, right):
        (s1, x1), (s2, x2) = left, right
        return s1 | s2, jnp.where(s2, x2, jnp.maximum(x1, x2))
    axis = zv.ndim - 3
    return jax.lax.associative_scan(combine, (start[..., None, None], zv), axis=axis)[1]


def _chunk_rows(a, zv, val, prev: AGFState, start: Optional[Array]) -> tuple[Array, Array]:
    """Outputs `[..., C, H, M]` of chunks a, zv `[..., C, H, D]`, val `[..., C, H, M]` entered with
    `prev` (leaves `[..., H, D(, M)]`), and each row's running maximum `[..., C, H, D]`. Row t uses
    its own maximum M_t = max(m_prev, max_{j<=t} Z_V[j]), so every exponential is <= 1 and every
    denominator >= 1; with `start` `[..., C]` only the same document counts, and only the chunk's
    first document reads `prev`."""
    c = zv.shape[-3]
    allowed = jnp.tril(jnp.ones((c, c), bool))[:, :, None, None]                   # [t, j, 1, 1]
    prev_max = prev.max[..., None, :, :]                                             # [..., 1, H, D]
    if start is None:
        row_max = jnp.maximum(prev_max, jax.lax.cummax(zv, axis=zv.ndim - 3))       # [..., C, H, D]
        carry_scale = jnp.exp(prev_max - row_max)
        carry_den = prev.den[..., None, :, :] * carry_scale
    else:
        run = jnp.cumsum(start.astype(jnp.int32), axis=-1)                           # [..., C]
        head = (run == 0)[..., None, None]                  # the chunk's first document reads prev
        allowed = allowed & (run[..., :, None] == run[..., None, :])[..., None, None]
        seg_max = _segment_cummax(zv, start)
        row_max = jnp.where(head, jnp.maximum(prev_max, seg_max), seg_max)
        # where inside the exp too: a cut-off carry may exceed M_t (overflow, NaN gradients).
        carry_scale = jnp.exp(jnp.where(head, prev_max - row_max, -jnp.inf))
        carry_den = jnp.where(head, prev.den[..., None, :, :] * carry_scale, 0.0)
    logits = zv[..., None, :, :, :] - row_max[..., :, None, :, :]                     # [..., t, j, H, D]
    p = jnp.exp(jnp.where(allowed, logits, -jnp.inf))
    den = carry_den + jnp.sum(p, axis=-3)                                              # >= 1
    w = a / den
    carry_y = jnp.einsum("...thd,...hdm->...thm", w * carry_scale, prev.num)
    if start is not None:
        carry_y = jnp.where(head, carry_y, 0.0)
    return carry_y + jnp.einsum("...thd,...tjhd,...jhm->...thm", w, p, val), row_max


def _last_document(zv: Array, val: Array, start: Optional[Array], axis: int, ref=None):
    """Summary (m, z, N) of the last document of each block along `axis` (the chunk axis of zv
    `[..., C, H, D]`), relative to `ref` `[..., H, D]` (>= its maximum; None: its own maximum m),
    and whether no document starts in the block (`keep` `[...]`, None without `start`)."""
    last, keep = None, None
    if start is not None:
        run = jnp.cumsum(start.astype(jnp.int32), axis=-1)
        last = (run == run[..., -1:])[..., None, None]
        keep = run[..., -1] == 0
    m = ref if ref is not None else jnp.max(masking.zero_padding(zv, last, -jnp.inf), axis=axis)
    logits = zv - jnp.expand_dims(m, axis)
    e = jnp.exp(logits if last is None else jnp.where(last, logits, -jnp.inf))
    return (m, jnp.sum(e, axis=axis), jnp.einsum("...chd,...chm->...hdm", e, val)), keep


def agf_chunked(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *, chunk_size: int,
                basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                mask: Optional[Array] = None, state: Optional[AGFState] = None,
                spectrum: Optional[Array] = None,
                segment_ids: Optional[Array] = None) -> tuple[Array, AGFState]:
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
        segment_ids: None or int `[B, T]` packed documents (0 = padding): the state is cut at each
            document start; the first token continues `state`.

    Returns:
        (y `[B, T, H, M]`, final `AGFState`).
    """
    check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, state=state,
                    chunk_size=chunk_size, coeffs=coeffs, basis=basis, alpha=alpha, beta=beta,
                    spectrum=spectrum)
    kw = dict(chunk_size=chunk_size, basis=basis, alpha=alpha, beta=beta)
    return jax.lax.platform_dependent(
        zu, zv, zs, val, coeffs, mask, state, spectrum, segment_ids,
        cpu=lambda *x: _chunked_scan(*x[:5], mask=x[5], state=x[6], spectrum=x[7],
                                     segment_ids=x[8], **kw),
        default=lambda *x: _chunked_parallel(*x[:5], mask=x[5], state=x[6], spectrum=x[7],
                                             segment_ids=x[8], **kw))


def agf_chunked_scan(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                     chunk_size: int, basis: str = "jacobi", alpha: Optional[float] = None,
                     beta: Optional[float] = None, mask: Optional[Array] = None,
                     state: Optional[AGFState] = None, spectrum: Optional[Array] = None,
                     segment_ids: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF as a `lax.scan` over chunks of C tokens: O(T C D + T D M) time, a carried O(D M)
    state per head, and one chunk's `[B, C, C, H, D]` weights alive at a time (the CPU form).

    Within a chunk every row t uses its own running maximum M_t = max(m_prev, max_{j<=t} Z_V[j]),
    so all exponentials are <= 1 and every denominator is >= 1 (exactly stable, no underflow of the
    early rows); the previous chunks enter through the carried state rescaled by exp(m_prev - M_t).
    T need not be a multiple of C: the tail is padded with tokens of weight exactly 0.

    Arguments and result as in `agf_chunked`.
    """
    check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, state=state,
                    chunk_size=chunk_size, coeffs=coeffs, basis=basis, alpha=alpha, beta=beta,
                    spectrum=spectrum)
    return _chunked_scan(zu, zv, zs, val, coeffs, chunk_size=chunk_size, basis=basis, alpha=alpha,
                         beta=beta, mask=mask, state=state, spectrum=spectrum, segment_ids=segment_ids)


def _chunked_scan(zu, zv, zs, val, coeffs, **kw) -> tuple[Array, AGFState]:
    a, zv, val, start, state, poisoned = _chunked(zu, zv, zs, val, coeffs, **kw)
    b, n, c = a.shape[:3]
    to_scan = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)   # [B, n, ...] -> [n, B, ...]

    def body(carry: AGFState, xs):
        a_c, zv_c, val_c, start_c = xs                          # [B, C, H, D], ..., [B, C, H, M]
        y, row_max = _chunk_rows(a_c, zv_c, val_c, carry, start_c)
        # The state after the chunk: its last document's sums, merged with the carry when no
        # document starts in the chunk, relative to the last row's maximum (as the step form).
        new_max = row_max[:, -1]
        (_, z, num), keep = _last_document(zv_c, val_c, start_c, axis=1, ref=new_max)
        old_scale = jnp.exp(carry.max - new_max)
        if keep is None:
            return AGFState(carry.num * old_scale[..., None] + num, carry.den * old_scale + z, new_max), y
        k = keep[:, None, None]
        old_scale = jnp.exp(jnp.where(k, carry.max - new_max, -jnp.inf))
        return AGFState(jnp.where(k[..., None], carry.num * old_scale[..., None], 0.0) + num,
                        jnp.where(k, carry.den * old_scale, 0.0) + z, new_max), y

    state, ys = jax.lax.scan(body, state, tuple(map(to_scan, (a, zv, val, start))))
    y = jnp.moveaxis(ys, 0, 1).reshape((b, n * c) + ys.shape[3:])
    return _finish(y, state, poisoned)


def agf_chunked_parallel(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                         chunk_size: int, basis: str = "jacobi", alpha: Optional[float] = None,
                         beta: Optional[float] = None, mask: Optional[Array] = None,
                         state: Optional[AGFState] = None, spectrum: Optional[Array] = None,
                         segment_ids: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF with every chunk of C tokens at once: no loop over chunks or tokens (the GPU/TPU form).

    The same numbers as `agf_chunked_scan`, in the state-passing form of chunked linear attention
    (Mamba2's SSD minimal form, fla's chunk kernels), with the running maximum of the online softmax
    in place of a decay. With n = T / C chunks, per chunk i and head:

        m_i = max_C Z_V,  z_i = sum_C exp(Z_V - m_i),  N_i = sum_C exp(Z_V - m_i) (x) Val  (one einsum);
        the state before chunk i, (m, z, N)_{<i}, is the exclusive prefix of the associative
        log-sum-exp merge (m, z, N) + (m', z', N') = (M, e^{m-M} z + e^{m'-M} z', e^{m-M} N + e^{m'-M} N'),
        M = max(m, m'), over the chunk axis (`lax.associative_scan`), after the carried `state`;

    then each row uses its own running maximum exactly as `agf_chunked_scan` does, so every
    exponential is <= 1. All products are batched over batch, chunks and heads. Packed
    (`segment_ids`): a chunk's summary is its last document's, and the merge is gated (`factors.gated`).

    Memory: every chunk's intermediates are alive at once. The intra-chunk weights are
    `[B, T/C, C, C, H, D]` float32, 4 B T C H D bytes (B = 1, T = 16K, C = 64, 8 heads of 64:
    2 GiB), and the per-chunk states `[B, T/C, H, D, M]` float32, 4 B H T D M / C bytes (32 MiB
    there), plus the associative scan's temporaries of about the states' size; the scan form holds
    one chunk of each. The weights grow with C, the states with T / C.

    Arguments and result as in `agf_chunked`.
    """
    check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, state=state,
                    chunk_size=chunk_size, coeffs=coeffs, basis=basis, alpha=alpha, beta=beta,
                    spectrum=spectrum)
    return _chunked_parallel(zu, zv, zs, val, coeffs, chunk_size=chunk_size, basis=basis,
                             alpha=alpha, beta=beta, mask=mask, state=state, spectrum=spectrum,
                             segment_ids=segment_ids)


def _chunked_parallel(zu, zv, zs, val, coeffs, **kw) -> tuple[Array, AGFState]:
    return _all_chunks(*_chunked(zu, zv, zs, val, coeffs, **kw))


def _all_chunks(a, zv, val, start, state, poisoned) -> tuple[Array, AGFState]:
    """`agf_chunked_parallel` on the chunks of `_to_chunks`."""
    b, n = a.shape[:2]
    # Each chunk's own partial sums, relative to its maximum (finite: every chunk holds a token
    # that is not tail padding, in its last document too).
    chunk, keep = _last_document(zv, val, start, axis=2)
    carried = (state.max, state.den, state.num)
    if start is None:
        prefix = jax.lax.associative_scan(_merge, chunk, axis=1)               # through chunk i
        empty = (jnp.full_like(chunk[0][:, :1], -jnp.inf), jnp.zeros_like(chunk[1][:, :1]),
                 jnp.zeros_like(chunk[2][:, :1]))
        before = tuple(jnp.concatenate([x0, x], axis=1) for x0, x in zip(empty, prefix))  # [B, n+1]
        states = _merge_from_empty(tuple(x[:, None] for x in carried), before)  # before chunk i
    else:
        cut = jnp.concatenate([jnp.ones_like(keep[:, :1]), ~keep], axis=1)       # [B, n+1]
        elements = tuple(jnp.concatenate([x0[:, None], x], axis=1) for x0, x in zip(carried, chunk))
        states = jax.lax.associative_scan(gated(_merge_from_empty), (cut, elements), axis=1)[1]
    m_prev, den_prev, num_prev = states
    final = AGFState(num=num_prev[:, -1], den=den_prev[:, -1], max=m_prev[:, -1])
    prev = AGFState(num=num_prev[:, :n], den=den_prev[:, :n], max=m_prev[:, :n])
    y, _ = _chunk_rows(a, zv, val, prev, start)
    return _finish(y.reshape((b, -1) + y.shape[3:]), final, poisoned)


def _step_core(state: AGFState, a_t: Array, zv_t: Array, val_t: Array) -> tuple[AGFState, Array]:
    new_max = jnp.maximum(state.max, zv_t)
    old_scale = jnp.exp(state.max - new_max)
    e = jnp.exp(zv_t - new_max)
    num = state.num * old_scale[..., None] + e[..., None] * val_t[:, :, None, :]
    den = state.den * old_scale + e
    y = jnp.einsum("bhd,bhdm->bhm", a_t / den, num)
    return AGFState(num, den, new_max), y


def agf_scan(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
             basis: str = "jacobi", alpha: Optional[float] = None,
             beta: Optional[float] = None, mask: Optional[Array] = None,
             state: Optional[AGFState] = None, spectrum: Optional[Array] = None,
             segment_ids: Optional[Array] = None) -> tuple[Array, AGFState]:
    """Causal AGF as a `jax.lax.scan` of `agf_step` over time (O(D M) state per head); packed
    (`segment_ids`), the state is emptied at each document start.

    Arguments as in `agf_chunked` (without chunk_size); returns (y `[B, T, H, M]`, final state).
    """
    check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, state=state,
                    coeffs=coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    # The token-local factor is computed for the whole sequence first; only the parameter-free
    # online softmax is scanned.
    a, zv, val, poisoned = _causal_inputs(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha,
                                          beta=beta, mask=mask, segment_ids=segment_ids,
                                          spectrum=spectrum)
    state = _as_state(state, a, val)
    empty = _as_state(None, a, val)
    start = None if segment_ids is None else packing.starts(segment_ids)

    def body(carry, x):
        a_t, zv_t, val_t, start_t = x
        if start_t is not None:
            carry = AGFState(*(jnp.where(masking.expand(start_t, s.ndim), e, s)
                               for s, e in zip(carry, empty)))
        return _step_core(carry, a_t, zv_t, val_t)

    xs = tuple(None if x is None else jnp.moveaxis(x, 1, 0) for x in (a, zv, val, start))
    state, ys = jax.lax.scan(body, state, xs)
    return _finish(jnp.moveaxis(ys, 0, 1), state, poisoned)


def agf_step(state: AGFState, zu_t: Array, zv_t: Array, zs_t: Optional[Array], val_t: Array, coeffs: Array,
             *, basis: str = "jacobi", alpha: Optional[float] = None,
             beta: Optional[float] = None,
             spectrum: Optional[Array] = None) -> tuple[AGFState, Array]:
    """One causal AGF token, O(D M) per head: state of the prefix, zu_t, zv_t, zs_t `[B, H, D]`,
    val_t `[B, H, M]` -> (new `AGFState`, y_t `[B, H, M]`); coeffs, basis and spectrum as in
    `agf_parallel`. A decode carries one document: start a new one from `init_state`.
    """
    check_projections(zu_t, zv_t, zs_t, val_t, rank=3)
    _check_state(state, jnp.shape(zu_t), jnp.shape(val_t)[-1])
    if spectrum is None:
        check_filter(coeffs, basis, alpha, beta)
    a_t = _left_factor(zu_t, zs_t, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    val_t = as_float(val_t).astype(a_t.dtype)
    state = AGFState(*(jnp.asarray(s).astype(a_t.dtype) for s in state))
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
    check_arguments(zu, zv, zs, None, mask=mask, coeffs=coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    a = _left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    zv = masking.zero_padding(as_float(zv), mask, fill=-MASK_OFFSET)
    if not causal:
        v = jax.nn.softmax(zv, axis=1)
        return jnp.einsum("bthd,bjhd->bhtj", a, v)
    t = zv.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None, :, :, None, None]            # [1, t, j, 1, 1]
    logits = jnp.broadcast_to(zv[:, None], (zv.shape[0], t) + zv.shape[1:])      # [B, t, j, H, D]
    v_t = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=2)
    return jnp.einsum("bthd,btjhd->bhtj", a, v_t)
