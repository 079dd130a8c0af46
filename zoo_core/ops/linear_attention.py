"""Causal linear attention, once for the whole zoo: parallel, chunked, `lax.scan` and step forms.

    num_t = sum_{s <= t} (q_t . k_s) v_s          [B, T, H, M]
    den_t = sum_{s <= t}  q_t . k_s               [B, T, H]     (only with `denominator=True`)

inclusive of s = t, per head, with no scale and no feature map: callers pass queries and keys
already mapped (SAMoVAR's VAR chain and LinTrans use the raw projections, samovar.md §2.6 and §7;
FAVOR+ passes its random features phi(q), phi(k) and divides num by den, htgn.md §2.6). The state
carried between calls is `LinearState(num = sum_s k_s v_s^T [B, H, D, M], den = sum_s k_s [B, H, D])`.

Forms (all return the same numbers up to float32 rounding; `tests/zoo_core/linear_attention_test.py`):

* `causal_parallel`: the masked quadratic form `tril(Q K^T) V`, O(T^2) time and memory; the fastest
  for short sequences.
* `causal_chunked`: the quadratic form inside chunks of C tokens (any C >= 1, also one that does not
  divide T) and the state across chunks, O(T C D + T D M) time. Chosen per platform: on accelerators
  `causal_chunked_batched` (every chunk's state at once from a prefix sum, all heads in one einsum,
  no loop); on the CPU a per-head prefix sum where the chunk states are no larger than the inputs,
  else a rematerialised `lax.scan` over the chunks (O(T (D + M) + D M) memory).
* `causal_chunked_batched`: the accelerator form of `causal_chunked`, callable on any platform.
* `causal_scan`: a `lax.scan` of `causal_step` over tokens (the recurrent form).
* `causal_step`: one token, `S += k_t v_t^T; num_t = q_t S`.

Precision: sums and states accumulate in at least float32 (`acc_dtype`; float64 under x64 inputs)
whatever the input dtype, and outputs are returned in that accumulation dtype: the unnormalised sums
grow with T and must not be rounded to bf16 before the caller normalises or casts.

Masking is NaN-safe (the zoo's layer contract). Padding (`mask` False) and future positions are
removed with `jnp.where`, never by multiplying with 0, since 0 * NaN = NaN:

* a padded position's q, k and v are replaced by 0 before any product, so whatever it holds (NaN,
  1e30) it changes no output and no state, and its own output is 0;
* the quadratic forms mix every position s into every row t through `scores[t, s] * v_s`, where
  the future entries of `scores` are zeroed with `jnp.where`; a non-finite future k_s or v_s would
  still give 0 * NaN. Non-finite keys and values at valid positions are therefore replaced by 0 as
  well, and every output and state at or after such a position is set to NaN (`_guard`), which is
  what the token recurrence gives: a NaN input still reaches the loss (the trainer's non-finite
  check sees it) but never an earlier output. Finite inputs are untouched (bit for bit).
"""
from __future__ import annotations

__all__ = ["LinearState", "init_state", "causal_parallel", "causal_chunked", "causal_chunked_batched", "causal_step",
           "causal_scan", "summary", "read", "noncausal"]

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from zoo_core import checks
from zoo_core.ops import guard, masking, packing, xla_forms

Array = jax.Array


class LinearState(NamedTuple):
    """Carried state of causal linear attention (float32 unless the inputs are float64).

    Attributes:
      num: `[B, H, D, M]`, sum_s k_s v_s^T over the tokens seen so far.
      den: `[B, H, D]`, sum_s k_s; None for attention without a denominator.
    """

    num: Array
    den: Optional[Array]


def acc_dtype(*xs) -> jnp.dtype:
    """At least float32 (float64 stays float64): the accumulation dtype of every sum and state."""
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def init_state(batch_size: int, num_heads: int, key_dim: int, value_dim: int, *,
               denominator: bool = False, dtype=jnp.float32) -> LinearState:
    """Zero state: num `[B, H, D, M]`, den `[B, H, D]` (or None)."""
    num = jnp.zeros((batch_size, num_heads, key_dim, value_dim), dtype)
    den = jnp.zeros((batch_size, num_heads, key_dim), dtype) if denominator else None
    return LinearState(num, den)


def _check(q: Array, k: Array, v: Array, mask: Optional[Array] = None, segment_ids: Optional[Array] = None, *,
           rank: int = 4, state: Optional[LinearState] = None, denominator: bool = False,
           chunk_size: Optional[int] = None) -> None:
    """The boundary checks of the causal kernels, once per public call, one line each: q, k
    `[B, T, H, D]` (a step: `[B, H, D]`), v like q but its last axis, the mask and segment ids `[B, T]`,
    a given state's shapes, `chunk_size` >= 1. The private forms below trust them."""
    qs, ks, vs = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    if len(qs) != rank or ks != qs or len(vs) != rank or vs[:-1] != qs[:-1]:
        what = "[B, T, H, D]" if rank == 4 else "[B, H, D] (one token)"
        checks.fail(f"causal linear attention expects q {what}, k like q, v like q but its last axis (M); "
                    f"got q {qs}, k {ks}, v {vs}")
    if rank == 4:
        masking.check_mask(mask, qs[:2])
        packing.check_segment_ids(segment_ids, qs[:2])
    if chunk_size is not None:
        checks.check_int("chunk_size", chunk_size, 1)
    if state is not None:
        _check_state(state, qs, vs[-1], denominator)


def check_state(state: LinearState, q_shape, m: int, denominator: bool) -> None:
    """`state` is a `LinearState` for queries of shape `q_shape` (`[B, ..., H, D]`), M = m value
    features and a den exactly when `denominator` (one line each)."""
    if not isinstance(state, LinearState):
        checks.fail(f"the state must be a LinearState(num [B, H, D, M], den [B, H, D] or None), got "
                    f"{type(state).__name__}")
    _check_state(state, q_shape, m, denominator)


def _check_state(state: LinearState, q_shape, m: int, denominator: bool) -> None:
    b, h, d = q_shape[0], q_shape[-2], q_shape[-1]
    if tuple(jnp.shape(state.num)) != (b, h, d, m):
        checks.fail(f"state.num must be [B, H, D, M] = {(b, h, d, m)}, got {tuple(jnp.shape(state.num))}")
    if denominator != (state.den is not None):
        checks.fail(f"state.den must be {'[B, H, D]' if denominator else 'None'} with denominator={denominator}")
    if denominator and tuple(jnp.shape(state.den)) != (b, h, d):
        checks.fail(f"state.den must be [B, H, D] = {(b, h, d)}, got {tuple(jnp.shape(state.den))}")


def _prepare(q: Array, k: Array, v: Array, mask: Optional[Array], segment_ids: Optional[Array] = None):
    """Casts to the accumulation dtype and removes padding and non-finite keys/values with `where`.

    Returns (q, k, v, poisoned) where poisoned `[B, T, H]` is True at and after the first valid
    position whose key or value is not finite (`zoo_core.ops.guard`); with `segment_ids` (0 =
    padding), only within that position's document.
    """
    if segment_ids is not None:
        mask = packing.valid(segment_ids, mask)
    acc = acc_dtype(q, k, v)
    q, k, v = q.astype(acc), k.astype(acc), v.astype(acc)
    bad = guard.nonfinite(k, v, valid=mask)                                         # [B, T, H]
    drop = bad
    if mask is not None:
        q = masking.zero_padding(q, mask)
        drop = bad | ~masking.expand(mask, bad.ndim)
    return q, guard.clean(k, drop), guard.clean(v, drop), guard.reach(bad, segment_ids)


def _guard(poisoned: Array, num: Array, den: Optional[Array], state: Optional[LinearState]):
    """NaN at and after a non-finite key/value (rows of `poisoned`), as the recurrence would give."""
    if state is not None:
        last = guard.last(poisoned)                                                 # [B, H]
        state = LinearState(guard.poison(state.num, last), guard.poison(state.den, last))
    return guard.poison(num, poisoned), guard.poison(den, poisoned), state


def _initial(state: Optional[LinearState], q: Array, v: Array, denominator: bool, dt) -> LinearState:
    if state is None:
        return init_state(q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1], denominator=denominator,
                          dtype=dt)
    return LinearState(state.num.astype(dt), None if state.den is None else state.den.astype(dt))


def causal_parallel(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
                    denominator: bool = False,
                    segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array]]:
    """Masked quadratic form `tril(Q K^T) V` (and `tril(Q K^T) 1`).

    Args:
      q: `[B, T, H, D]` queries (or query features).
      k: `[B, T, H, D]` keys (or key features).
      v: `[B, T, H, M]` values.
      mask: optional `[B, T]` bool key-padding mask, True = valid.
      denominator: also return den.
      segment_ids: optional int `[B, T]` packed documents (`zoo_core.ops.packing`; 0 = padding): a token
        attends only within its document.

    Returns:
      (num `[B, T, H, M]`, den `[B, T, H]` or None), in the accumulation dtype.
    """
    _check(q, k, v, mask, segment_ids)
    q, k, v, poisoned = _prepare(q, k, v, mask, segment_ids)
    t = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k)
    allowed = jnp.tril(jnp.ones((t, t), bool))
    if segment_ids is not None:
        allowed = allowed & packing.same_segment(segment_ids, segment_ids)[:, None]
    scores = jnp.where(allowed, scores, 0.0)
    num = jnp.einsum("bhts,bshm->bthm", scores, v)
    den = jnp.swapaxes(jnp.sum(scores, axis=-1), 1, 2) if denominator else None
    num, den, _ = _guard(poisoned, num, den, None)
    return num, den


def causal_chunked(q: Array, k: Array, v: Array, *, chunk_size: int,
                   state: Optional[LinearState] = None, mask: Optional[Array] = None,
                   denominator: bool = False,
                   segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array], LinearState]:
    """Chunkwise form: quadratic inside chunks of C tokens, the state across them.

    T is zero-padded at the end to a multiple of C; padded tokens have k = v = 0, so they add nothing
    to the state, and their rows are dropped. The state entering each of the n = ceil(T / C) chunks
    is computed per platform (`jax.lax.platform_dependent`), with the same numbers up to float32
    rounding:

    * on accelerators, `causal_chunked_batched`'s form: every chunk's entering state at once, as an
      exclusive prefix sum over the chunks of their sums k^T v, each product one einsum over all
      chunks and heads (no loop over chunks, whose iterations a GPU would run one by one);
    * on the CPU, the same prefix sum one head at a time when the n states and score blocks are no
      larger than the inputs (n D M <= T (D + M) and C <= D + M), since einsums batched over (B, n)
      alone need no relayout copies there (`zoo_core.ops.xla_forms.heads`); otherwise a `lax.scan` over the
      chunks whose body is rematerialised (`jax.checkpoint`), so that the backward pass stores one
      state per chunk instead of the per-chunk score blocks. Memory O(T (D + M) + D M).

    With `segment_ids`, every platform takes the batched form with the state cut at each document
    start (`_chunked_segments`); `state` is read by the first document only, and the final state is
    the last document's.

    Args:
      q, k, v, mask, denominator, segment_ids: as in `causal_parallel`.
      chunk_size: C >= 1 (clipped to T).
      state: optional `LinearState` of earlier tokens (zeros if None).

    Returns:
      (num `[B, T, H, M]`, den `[B, T, H]` or None, final `LinearState`).
    """
    _check(q, k, v, mask, segment_ids, state=state, denominator=denominator, chunk_size=chunk_size)
    if segment_ids is not None:
        return _batched(q, k, v, chunk_size, state, mask, denominator, segment_ids)
    q, k, v, poisoned, state, c = _chunked_inputs(q, k, v, chunk_size, state, mask, denominator)
    num, den, final = jax.lax.platform_dependent(q, k, v, state, cpu=functools.partial(_chunked_cpu, c),
                                                 default=functools.partial(_chunked_batched, c))
    return _guard(poisoned, num, den, final)


def causal_chunked_batched(q: Array, k: Array, v: Array, *, chunk_size: int,
                           state: Optional[LinearState] = None, mask: Optional[Array] = None,
                           denominator: bool = False,
                           segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array], LinearState]:
    """The accelerator form of `causal_chunked`, on any platform: no loop over chunks or heads.

    With chunks `Q_j, K_j, V_j` of C tokens and `S_j = sum_{i < j} K_i^T V_i` (plus the carried
    state), `num_j = tril(Q_j K_j^T) V_j + Q_j S_j`: the chunk sums `K_j^T V_j` are one einsum over
    `[B, n, H]`, the entering states an exclusive `cumsum` over the chunk axis, and the outputs two
    more einsums (the chunkwise parallel form of linear attention, as in fla's chunk kernels).
    The n entering states `[B, n, H, D, M]` are float32 (float64 under x64): memory
    O(T (D + M) + n H D M).

    Args and Returns: as in `causal_chunked`.
    """
    _check(q, k, v, mask, segment_ids, state=state, denominator=denominator, chunk_size=chunk_size)
    return _batched(q, k, v, chunk_size, state, mask, denominator, segment_ids)


def _batched(q, k, v, chunk_size, state, mask, denominator, segment_ids):
    """`causal_chunked_batched` after its checks (also the packed `causal_chunked` and the packed global form)."""
    q, k, v, poisoned, state, c = _chunked_inputs(q, k, v, chunk_size, state, mask, denominator, segment_ids)
    if segment_ids is not None:
        return _guard(poisoned, *_chunked_segments(c, q, k, v, state, segment_ids))
    return _guard(poisoned, *_chunked_batched(c, q, k, v, state))


def _chunked_inputs(q, k, v, chunk_size, state, mask, denominator, segment_ids=None):
    """`_prepare` of the chunked forms: (q, k, v, poisoned, initial state, C)."""
    q, k, v, poisoned = _prepare(q, k, v, mask, segment_ids)
    state = _initial(state, q, v, denominator, q.dtype)
    return q, k, v, poisoned, state, max(1, min(chunk_size, q.shape[1]))


def _to_chunks(x: Array, c: int) -> Array:
    """`[B, T, ...]` -> `[B, n, C, ...]`, zero-padded at the end to n = ceil(T / C) chunks."""
    b, t = x.shape[:2]
    n = -(-t // c)
    x = jnp.pad(x, ((0, 0), (0, n * c - t)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape((b, n, c) + x.shape[2:])


def _from_chunks(num: Array, den: Optional[Array], t: int):
    """`[B, n, C, H, .]` -> `[B, T, H, .]`: the rows of the first T tokens."""
    b, n, c = num.shape[:3]
    num = num.reshape((b, n * c) + num.shape[3:])[:, :t]
    return num, None if den is None else den.reshape((b, n * c) + den.shape[3:])[:, :t]


def _chunked_cpu(c: int, q: Array, k: Array, v: Array, state: LinearState):
    """`causal_chunked` on the CPU: per-head prefix sums where they fit, else a scan over chunks."""
    t, h, d, m = q.shape[1], q.shape[2], q.shape[3], v.shape[-1]
    if _prefix_sum_fits(t, c, d, m):
        # One head at a time: einsums batched over (B, n) alone run without relayout copies
        # (`zoo_core.ops.xla_forms.heads`).
        dens = [None] * h if state.den is None else xla_forms.heads(state.den, axis=1)
        out = [_chunks_by_prefix_sum(_to_chunks(qh, c), _to_chunks(kh, c), _to_chunks(vh, c),
                                     LinearState(num_h, den_h))
               for qh, kh, vh, num_h, den_h in zip(xla_forms.heads(q), xla_forms.heads(k), xla_forms.heads(v),
                                                   xla_forms.heads(state.num, axis=1), dens)]
        num = jnp.stack([o[0] for o in out], axis=3)
        den = None if state.den is None else jnp.stack([o[1] for o in out], axis=3)
        final = LinearState(jnp.stack([o[2].num for o in out], axis=1),
                            None if state.den is None else jnp.stack([o[2].den for o in out], axis=1))
    else:
        num, den, final = _chunks_by_scan(_to_chunks(q, c), _to_chunks(k, c), _to_chunks(v, c), state)
    return _from_chunks(num, den, t) + (final,)


def _chunked_batched(c: int, q: Array, k: Array, v: Array, state: LinearState):
    """`causal_chunked_batched` after `_prepare`: every chunk and head in the same einsums."""
    qc, kc, vc = _to_chunks(q, c), _to_chunks(k, c), _to_chunks(v, c)           # [B, n, C, H, .]
    tril = jnp.tril(jnp.ones((c, c), bool))
    scores = jnp.where(tril, jnp.einsum("bnihd,bnjhd->bnhij", qc, kc), 0.0)    # [B, n, H, C, C]
    kv = jnp.einsum("bnjhd,bnjhm->bnhdm", kc, vc)                                # [B, n, H, D, M]
    entering = _exclusive_cumsum(kv, state.num)
    num = jnp.einsum("bnhij,bnjhm->bnihm", scores, vc) + jnp.einsum("bnihd,bnhdm->bnihm", qc, entering)
    final = LinearState(entering[:, -1] + kv[:, -1], None)
    den = None
    if state.den is not None:
        ksum = jnp.sum(kc, axis=2)                                               # [B, n, H, D]
        entering_den = _exclusive_cumsum(ksum, state.den)
        den = (jnp.swapaxes(jnp.sum(scores, axis=-1), 2, 3)
               + jnp.einsum("bnihd,bnhd->bnih", qc, entering_den))
        final = LinearState(final.num, entering_den[:, -1] + ksum[:, -1])
    return _from_chunks(num, den, q.shape[1]) + (final,)


def _chunked_segments(c: int, q: Array, k: Array, v: Array, state: LinearState, segment_ids: Array):
    """`_chunked_batched` over packed documents (`zoo_core.ops.packing`): inside a chunk, pairs of one
    document only; across chunks the gated chain `S_{j+1} = keep_j ? S_j + b_j : b_j`, b_j the state of
    chunk j's last document, keep_j = no document starts in chunk j; a chunk's first document reads
    the entering state (the others read nothing from before the chunk)."""
    start = _to_chunks(packing.starts(segment_ids), c)                            # [B, n, C], pad: False
    ids = _to_chunks(segment_ids, c)
    # The end padding of the last chunk continues its last document (its k, v are 0 and its rows dropped).
    ids = jnp.where(_to_chunks(jnp.ones_like(segment_ids, bool), c), ids, segment_ids[:, -1:, None])
    qc, kc, vc = _to_chunks(q, c), _to_chunks(k, c), _to_chunks(v, c)             # [B, n, C, H, .]
    allowed = jnp.tril(jnp.ones((c, c), bool)) & (ids[..., :, None] == ids[..., None, :])  # [B, n, C, C]
    scores = jnp.where(allowed[:, :, None], jnp.einsum("bnihd,bnjhd->bnhij", qc, kc), 0.0)
    tail = masking.expand(packing.last_segment(start, axis=2), 5)                 # [B, n, C, 1, 1]
    kc_tail = jnp.where(tail, kc, 0.0)
    adds = [jnp.einsum("bnjhd,bnjhm->bnhdm", kc_tail, vc)]
    initial = [state.num]
    if state.den is not None:
        adds.append(jnp.sum(kc_tail, axis=2))
        initial.append(state.den)
    entering, final = packing.gated_prefix(~jnp.any(start, axis=2), adds, initial)
    # `where` on the product, not on q: a NaN entering state must not reach a later document.
    head = masking.expand(packing.first_segment(start, axis=2), 5)[..., 0]       # [B, n, C, 1]
    num = (jnp.einsum("bnhij,bnjhm->bnihm", scores, vc)
           + jnp.where(head[..., None], jnp.einsum("bnihd,bnhdm->bnihm", qc, entering[0]), 0.0))
    den = None
    if state.den is not None:
        den = (jnp.swapaxes(jnp.sum(scores, axis=-1), 2, 3)
               + jnp.where(head, jnp.einsum("bnihd,bnhd->bnih", qc, entering[1]), 0.0))
    return _from_chunks(num, den, q.shape[1]) + (LinearState(final[0], final[1] if den is not None else None),)


def _prefix_sum_fits(t: int, c: int, d: int, m: int) -> bool:
    """Whether the n = ceil(T / C) chunk states and score blocks are no larger than the inputs."""
    return -(-t // c) * d * m <= t * (d + m) and c <= d + m


def _exclusive_cumsum(x: Array, initial: Array) -> Array:
    """`initial + sum_{i < j} x[:, i]` for every j of axis 1 (x `[B, n, ...]`, initial `[B, ...]`)."""
    before = jnp.cumsum(x, axis=1)[:, :-1]
    return initial[:, None] + jnp.concatenate([jnp.zeros_like(x[:, :1]), before], axis=1)


def _chunks_by_prefix_sum(qc: Array, kc: Array, vc: Array, state: LinearState):
    """`causal_chunked` for one head, on chunks `[B, n, C, .]`, every chunk's entering state at once
    (`state`: num `[B, D, M]`, den `[B, D]` or None)."""
    c = qc.shape[2]
    scores = jnp.where(jnp.tril(jnp.ones((c, c), bool)), jnp.einsum("bnid,bnjd->bnij", qc, kc), 0.0)
    kv = jnp.einsum("bnjd,bnjm->bndm", kc, vc)                                 # [B, n, D, M]
    entering = _exclusive_cumsum(kv, state.num)
    num = jnp.einsum("bnij,bnjm->bnim", scores, vc) + jnp.einsum("bnid,bndm->bnim", qc, entering)
    final_num = entering[:, -1] + kv[:, -1]
    if state.den is None:
        return num, None, LinearState(final_num, None)
    ksum = jnp.sum(kc, axis=2)                                                   # [B, n, D]
    entering_den = _exclusive_cumsum(ksum, state.den)
    den = jnp.sum(scores, axis=-1) + jnp.einsum("bnid,bnd->bni", qc, entering_den)
    return num, den, LinearState(final_num, entering_den[:, -1] + ksum[:, -1])


def _chunks_by_scan(qc: Array, kc: Array, vc: Array, state: LinearState):
    """`causal_chunked` on chunks `[B, n, C, H, .]` with a `lax.scan` carrying the state."""
    c, dt = qc.shape[2], qc.dtype
    tril = jnp.tril(jnp.ones((c, c), bool))

    @jax.checkpoint
    def body(carry, xs):
        qc, kc, vc = xs
        scores = jnp.where(tril, jnp.einsum("bihd,bjhd->bhij", qc, kc), 0.0)
        num = jnp.einsum("bhij,bjhm->bihm", scores, vc) + jnp.einsum("bihd,bhdm->bihm", qc, carry.num)
        new_num = carry.num + jnp.einsum("bjhd,bjhm->bhdm", kc, vc)
        if carry.den is None:
            return LinearState(new_num, None), (num, jnp.zeros((), dt))
        den = jnp.sum(scores, axis=-1).swapaxes(1, 2) + jnp.einsum("bihd,bhd->bih", qc, carry.den)
        return LinearState(new_num, carry.den + jnp.sum(kc, axis=1)), (num, den)

    final, (num, den) = jax.lax.scan(body, state, tuple(jnp.moveaxis(x, 1, 0) for x in (qc, kc, vc)))
    return jnp.moveaxis(num, 0, 1), (None if state.den is None else jnp.moveaxis(den, 0, 1)), final


def causal_step(state: LinearState, q_t: Array, k_t: Array,
                v_t: Array) -> tuple[Array, Optional[Array], LinearState]:
    """One token of the recurrence, inclusive of the new token: `S += k_t v_t^T; num_t = q_t S`.

    Args:
      state: `LinearState` of the prefix (its `den` decides whether a denominator is kept).
      q_t, k_t: `[B, H, D]`.
      v_t: `[B, H, M]`.

    Returns:
      (num_t `[B, H, M]`, den_t `[B, H]` or None, new state).
    """
    _check(q_t, k_t, v_t, rank=3, state=state, denominator=state.den is not None)
    return _step(state, q_t, k_t, v_t)


def _step(state: LinearState, q_t: Array, k_t: Array, v_t: Array):
    """`causal_step` after its checks (the scan's body)."""
    dt = acc_dtype(state.num, q_t, k_t, v_t)
    q_t, k_t, v_t = q_t.astype(dt), k_t.astype(dt), v_t.astype(dt)
    num_state = state.num.astype(dt) + jnp.einsum("bhd,bhm->bhdm", k_t, v_t)
    num = jnp.einsum("bhd,bhdm->bhm", q_t, num_state)
    if state.den is None:
        return num, None, LinearState(num_state, None)
    den_state = state.den.astype(dt) + k_t
    return num, jnp.einsum("bhd,bhd->bh", q_t, den_state), LinearState(num_state, den_state)


def causal_scan(q: Array, k: Array, v: Array, *, state: Optional[LinearState] = None,
                mask: Optional[Array] = None, denominator: bool = False,
                segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array], LinearState]:
    """Recurrent form: `jax.lax.scan` of `causal_step` over the tokens.

    Autodiff through it stores every state (O(T D M)); train with `causal_chunked`.

    Args:
      q, k, v, mask, denominator, segment_ids: as in `causal_parallel` (the state is reset to zero
        at each document start; `state` is read by the first document).
      state: optional `LinearState` of earlier tokens (zeros if None).

    Returns:
      (num `[B, T, H, M]`, den `[B, T, H]` or None, final `LinearState`).
    """
    _check(q, k, v, mask, segment_ids, state=state, denominator=denominator)
    q, k, v, poisoned = _prepare(q, k, v, mask, segment_ids)
    state = _initial(state, q, v, denominator, q.dtype)
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    if segment_ids is not None:
        xs += (jnp.swapaxes(packing.starts(segment_ids), 0, 1),)

    def body(carry, xs):
        if segment_ids is not None:
            xs, start = xs[:3], xs[3]
            carry = jax.tree_util.tree_map(lambda s: jnp.where(masking.expand(start, s.ndim), 0.0, s), carry)
        num, den, carry = _step(carry, *xs)
        return carry, (num, jnp.zeros((), q.dtype) if den is None else den)

    final, (num, den) = jax.lax.scan(body, state, xs)
    num = jnp.swapaxes(num, 0, 1)
    den = jnp.swapaxes(den, 0, 1) if denominator else None
    return _guard(poisoned, num, den, final)


def summary(k: Array, v: Array, *, mask: Optional[Array] = None,
            denominator: bool = False) -> LinearState:
    """The state a block of keys and values adds: `num = sum_s k_s v_s^T` `[B, H, D, M]`, `den =
    sum_s k_s` `[B, H, D]` (or None), over the valid positions (`mask` `[B, S]`, padding removed with
    `jnp.where`), in the accumulation dtype. Summaries of disjoint blocks add: the fold of context
    parallelism (`zoo_core.ops.context_parallel`) and of the global form below."""
    ks, vs = jnp.shape(k), jnp.shape(v)
    if len(ks) != 4 or len(vs) != 4 or vs[:3] != ks[:3]:
        checks.fail(f"summary expects k [B, S, H, D] and v [B, S, H, M]; got k {ks}, v {vs}")
    masking.check_mask(mask, ks[:2], "mask", "[B, S]")
    return _summary(k, v, mask, denominator)


def _summary(k: Array, v: Array, mask: Optional[Array], denominator: bool) -> LinearState:
    acc = acc_dtype(k, v)
    k, v = masking.zero_padding(k.astype(acc), mask), masking.zero_padding(v.astype(acc), mask)
    return LinearState(jnp.einsum("bshd,bshm->bhdm", k, v), jnp.sum(k, axis=1) if denominator else None)


def read(q: Array, state: LinearState, *, query_mask: Optional[Array] = None) -> tuple[Array, Optional[Array]]:
    """What queries q `[B, T, H, D]` read from a state: `num_t = q_t S` `[B, T, H, M]`, `den_t = q_t .
    z` `[B, T, H]` (None without `state.den`); padded queries (`query_mask` False) read 0."""
    qs = jnp.shape(q)
    if len(qs) != 4:
        checks.fail(f"read expects q [B, T, H, D], got shape {qs}")
    _check_state(state, qs, jnp.shape(state.num)[-1], state.den is not None)
    masking.check_mask(query_mask, qs[:2], "query_mask", "[B, T]")
    return _read(q, state, query_mask)


def _read(q: Array, state: LinearState, query_mask: Optional[Array]) -> tuple[Array, Optional[Array]]:
    q = masking.zero_padding(q.astype(acc_dtype(q, state.num)), query_mask)
    num = jnp.einsum("bthd,bhdm->bthm", q, state.num)
    return num, None if state.den is None else jnp.einsum("bthd,bhd->bth", q, state.den)


def noncausal(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
              query_mask: Optional[Array] = None, denominator: bool = False,
              segment_ids: Optional[Array] = None,
              kv_segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array]]:
    """Global (non-causal) linear attention, every query over every valid key.

        num_t = sum_s (q_t . k_s) v_s = q_t S,   S = sum_s k_s v_s^T   [B, H, D, M]
        den_t = q_t . sum_s k_s                                         (with `denominator`)

    the non-causal form of Katharopoulos et al. 2020 ("Transformers are RNNs"), eq. (4)-(5), with
    the feature map left to the caller: `read(q, summary(k, v))`. Queries and keys may have different
    lengths (cross-attention: T queries, S keys). O((T + S) D M) time, O(D M) for the summary S.

    Masking is NaN-safe: padded keys and values (`mask` False) and padded queries (`query_mask`
    False) are replaced by 0 with `jnp.where` before any product, so whatever they hold changes no
    output, and a padded query's own output is 0.

    Args:
      q: `[B, T, H, D]` queries (or query features).
      k: `[B, S, H, D]` keys (or key features).
      v: `[B, S, H, M]` values.
      mask: optional `[B, S]` bool key-padding mask, True = valid.
      query_mask: optional `[B, T]` bool query mask, True = valid.
      denominator: also return den.
      segment_ids: optional int `[B, T]` packed documents of a self-attention (T = S; 0 = padding):
        each query reads the sum over its own document only, computed as the inclusive causal
        form forward plus the same backward, less the diagonal counted twice (O(T) memory, no
        per-document table).
      kv_segment_ids: optional int `[B, S]` packed documents of the keys of a cross-attention, with
        `segment_ids` `[B, T]` those of the queries (documents matched by id, in any order): each
        query reads the sum over its own document's keys only. Keys and queries are merged into one
        row ordered by (id, keys first) and run through the packed causal form: O((S + T)(D + M))
        memory, no per-document table.

    Returns:
      (num `[B, T, H, M]`, den `[B, T, H]` or None), in the accumulation dtype.
    """
    qs, ks, vs = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or ks[:1] + ks[2:] != qs[:1] + qs[2:] or vs[:3] != ks[:3]:
        checks.fail(f"non-causal linear attention expects q [B, T, H, D], k [B, S, H, D], v [B, S, H, M]; "
                    f"got q {qs}, k {ks}, v {vs}")
    masking.check_mask(mask, ks[:2], "mask", "[B, S]")
    masking.check_mask(query_mask, qs[:2], "query_mask", "[B, T]")
    if kv_segment_ids is not None or (segment_ids is not None and ks[1] != qs[1]):
        if segment_ids is None or kv_segment_ids is None:
            checks.fail("packed cross-attention takes both `segment_ids` [B, T] (queries) and `kv_segment_ids` "
                        "[B, S] (keys)")
        packing.check_segment_ids(segment_ids, qs[:2])
        packing.check_segment_ids(kv_segment_ids, ks[:2], "kv_segment_ids")
        return _cross_segments(q, k, v, mask, query_mask, denominator, segment_ids, kv_segment_ids)
    if segment_ids is not None:
        packing.check_segment_ids(segment_ids, qs[:2])
        return _noncausal_segments(q, k, v, mask, query_mask, denominator, segment_ids)
    acc = acc_dtype(q, k, v)
    return _read(q.astype(acc), _summary(k.astype(acc), v, mask, denominator), query_mask)


# Chunk length of the causal passes that make the packed global form.
SEGMENT_CHUNK = 64


def _noncausal_segments(q, k, v, mask, query_mask, denominator, segment_ids):
    """`noncausal` per packed document: forward + backward inclusive causal sums - the diagonal."""
    flip = lambda x: None if x is None else jnp.flip(x, axis=1)
    fwd_num, fwd_den, _ = _batched(q, k, v, SEGMENT_CHUNK, None, mask, denominator, segment_ids)
    bwd_num, bwd_den, _ = _batched(flip(q), flip(k), flip(v), SEGMENT_CHUNK, None, flip(mask), denominator,
                                   flip(segment_ids))
    qp, kp, vp, _ = _prepare(q, k, v, mask, segment_ids)
    diag = jnp.einsum("bthd,bthd->bth", qp, kp)                                   # q_t . k_t  [B, T, H]
    num = masking.zero_padding(fwd_num + flip(bwd_num) - diag[..., None] * vp, query_mask)
    den = None if not denominator else masking.zero_padding(fwd_den + flip(bwd_den) - diag, query_mask)
    return num, den


def _cross_segments(q, k, v, mask, query_mask, denominator, q_ids, kv_ids):
    """`noncausal` of packed cross-attention: keys and queries merged into one row ordered by (document
    id, keys before queries), then the packed causal form on it, so that each query reads exactly the
    sum over its document's keys (query rows add no key, key rows' outputs are dropped); the outputs are
    taken back in the queries' order. Padding (id 0, or `mask` / `query_mask` False) is id 0 there."""
    b, s, t = q.shape[0], k.shape[1], q.shape[1]
    acc = acc_dtype(q, k, v)
    kv_ids = jnp.where(packing.valid(kv_ids, mask), kv_ids, 0)
    q_ids = jnp.where(packing.valid(q_ids, query_mask), q_ids, 0)
    zeros = lambda x, n: jnp.zeros((b, n) + x.shape[2:], acc)                                  # noqa: E731
    rows_q = jnp.concatenate([zeros(q, s), q.astype(acc)], axis=1)
    rows_k = jnp.concatenate([k.astype(acc), zeros(k, t)], axis=1)
    rows_v = jnp.concatenate([v.astype(acc), zeros(v, t)], axis=1)
    ids = jnp.concatenate([kv_ids, q_ids], axis=1).astype(jnp.int32)
    kind = jnp.concatenate([jnp.zeros((b, s), jnp.int32), jnp.ones((b, t), jnp.int32)], axis=1)
    order = jnp.argsort(2 * ids + kind, axis=1, stable=True)                                  # [B, S + T]
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    num, den, _ = _batched(take(rows_q, order), take(rows_k, order), take(rows_v, order), SEGMENT_CHUNK, None,
                           None, denominator, take(ids, order))
    back = jnp.argsort(order, axis=1)[:, s:]                                                 # the queries' rows
    return take(num, back), None if den is None else take(den, back)
