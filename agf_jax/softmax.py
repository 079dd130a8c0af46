"""Softmax attention kernels of the vanilla-Transformer baseline: parallel, chunked, KV-cache step.

    O = softmax(Q K^T / sqrt(D) + masks) V      per head, O(T^2)

Key padding puts -1e9 on the padded logits (the reference harnesses' offset); the causal mask puts
-inf on the future ones, so a padded row with only padded keys before it averages the padded
(zeroed) values instead of reading the future.

Forms of the causal attention (same numbers up to float32 rounding, tests/agf_jax/softmax_test.py
and layers_test.py):

* `softmax_parallel(causal=True)`: the masked T x T form.
* `softmax_chunked`: the same rows, C queries at a time against all T keys. Chosen per platform
  (`jax.lax.platform_dependent`): on the CPU a `lax.map` over the chunks with a rematerialised body,
  so the live logits are `[B, H, C, T]` instead of `[B, H, T, T]`; on accelerators, whose loops run
  one iteration at a time, `softmax_chunked_batched` (every chunk at once) or, on a GPU without
  dropout, `softmax_fused`.
* `softmax_fused`: `jax.nn.dot_product_attention` (cuDNN's fused flash attention for bf16/fp16
  inputs where this host has cuDNN, JAX's XLA form otherwise); `softmax_parallel` and
  `softmax_chunked` use it on a GPU when no dropout is asked for (it has no weight dropout).
* `softmax_scan` / `softmax_step`: the token recurrence on a `KVCache` of `max_length` slots; with a
  mask, padded tokens are not written (attention reads no positions, so the cache holds the valid
  tokens only, `length` counts them per sample).

Masking is NaN-safe (the zoo's layer contract): padded and future logits are replaced with
`jnp.where`, padded values are replaced by 0 before the contraction, and since `w[t, s] * v_s` is
still NaN for a zero future weight and a NaN value, a non-finite value at a valid position is
replaced by 0 and every output at or after it is set to NaN (what the token recurrence gives).

Packed rows (`segment_ids` int `[B, T]`, 0 = padding; `zoo_core.ops.packing`, issue 42): a token
attends only to the valid tokens of its own document, in every form but the fused one (which takes no
segment ids: the packed calls take the XLA forms on every platform); `softmax_cross` takes the
queries' `segment_ids` and the keys' `kv_segment_ids`. A row with no key to attend (a padding query)
is 0, never NaN. `softmax_scan` empties the cache at each document start (the first document reads
the cache given). The NaN guard is `zoo_core.ops.guard`, per document when packed: a non-finite key
or value poisons the rows that attend it (causal: its document from it on; non-causal: its document).

Context parallelism (`softmax_context_parallel`, the body `shard_softmax`): the sequence split over a
mesh axis, each shard's queries against every shard's keys and values, gathered with one
`all_gather` (of K, V, the key mask and the segment ids): O(T D) bytes per call, the baseline of
docs/specs/context_parallel.md §3; causal and not, packed or not, the single-device numbers.

Decoding past the cache: a token written past `max_length` is an error. With a concrete cache (an
eager decoding loop, `DropInAttention(decode=True)` applied without `jit`) `check_room` raises
`ValueError` naming `max_length` before anything is computed; under `jit` (the length is traced) the
step runs a host callback (`jax.pure_callback`, inside a `lax.cond` taken only when the cache is
full, so a step with room costs one compare and jit keeps its fast dispatch) that raises the same
`ValueError` line, which jax re-raises as a `jax.errors.JaxRuntimeError` whose message ends with it. The output of such a
token is NaN should the error be swallowed.

Logits, weights, outputs and the cache are float32 (float64 stays float64); the fused form takes
bf16/fp16 inputs as they are (cuDNN keeps its softmax statistics in float32) and returns float32.
"""
from __future__ import annotations

__all__ = ["KVCache", "init_cache", "check_room", "softmax_attention_weights", "softmax_parallel", "softmax_cross",
           "softmax_fused", "softmax_chunked", "softmax_chunked_batched", "softmax_step", "softmax_scan",
           "softmax_context_parallel"]

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from agf_jax import validation
from agf_jax.factors import MASK_OFFSET, as_float
from zoo_core.ops import context_parallel, guard, masking, packing

Array = jax.Array
Dropout = Optional[Callable[[Array, Array], Array]]   # (weights, chunk or token index) -> weights


class KVCache(NamedTuple):
    """Key/value cache of causal softmax attention (float32).

    Attributes:
        key: `[B, L, H, D]` keys of the tokens seen so far (slots >= length are 0).
        value: `[B, L, H, M]` values.
        length: `[B]` int32, the number of tokens written per sample.
    """
    key: Array
    value: Array
    length: Array


def init_cache(batch_size: int, max_length: int, num_heads: int, head_dim: int,
               value_dim: Optional[int] = None, dtype=jnp.float32) -> KVCache:
    """Empty cache with `max_length` slots: key `[B, L, H, D]`, value `[B, L, H, M]`, length 0."""
    value_dim = head_dim if value_dim is None else value_dim
    dtype = jnp.promote_types(dtype, jnp.float32)
    return KVCache(jnp.zeros((batch_size, max_length, num_heads, head_dim), dtype),
                   jnp.zeros((batch_size, max_length, num_heads, value_dim), dtype),
                   jnp.zeros((batch_size,), jnp.int32))


def check_room(cache: KVCache, tokens=1) -> None:
    """Raises `ValueError` if writing `tokens` more tokens (int, or int `[B]` per sample) would overflow
    the `max_length` slots of a concrete `cache`; does nothing for a traced one (inside `jit`, where
    `softmax_step`'s host callback raises the same error: module docstring)."""
    if isinstance(cache.length, jax.core.Tracer) or isinstance(tokens, jax.core.Tracer):
        return
    _raise_if_over(np.asarray(cache.length) + np.asarray(tokens), slots=cache.key.shape[1])


def _raise_if_over(need, *, slots: int) -> None:
    """`need` `[B]`: the cache length each sample reaches; one `ValueError` line if one exceeds `slots`
    (called eagerly by `check_room`, and on the host by the traced step's callback)."""
    need = np.broadcast_to(np.asarray(need), np.shape(need) or (1,))
    over = np.flatnonzero(need > slots)
    if over.size:
        raise ValueError(
            f"softmax decoding: the key/value cache has {slots} slots (the max_length given at init: the "
            f"length of the sequence DropInAttention(decode=True) was initialised with) and sample(s) "
            f"{over.tolist()} would write token {int(need[over].max())}; "
            f"init the cache with max_length >= the tokens you decode")


def _room_callback(length: Array, slots: int) -> Array:
    """Under `jit`: the error of `check_room`, raised on the host by a callback that runs only when
    a sample's length (after the write) exceeds the slots (`lax.cond`: no host call while there is
    room). A `pure_callback` (no effect, so jit keeps its fast dispatch) whose True result the step's
    output depends on, so that it is never removed. Returns bool `[]`: True."""
    def host(need):
        _raise_if_over(need, slots=slots)
        return np.array(True)

    return jax.lax.cond(
        jnp.any(length > slots),
        lambda: jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.bool_), length, vmap_method="sequential"),
        lambda: jnp.array(True))


def _prepare(q, k, v, mask, causal):
    """Float casts, padded values -> 0, and (causal) the non-finite-value guard: (q, k, v, valid
    `[B, S]`, poisoned `[B, S, H]` or None), through `zoo_core.ops.guard`."""
    q, k, v = as_float(q), as_float(k), as_float(v)
    valid = jnp.ones(k.shape[:2], bool) if mask is None else jnp.asarray(mask).astype(bool)
    bad = guard.nonfinite(v, valid=valid) if causal else jnp.zeros(v.shape[:3], bool)
    v = guard.clean(v, bad | ~masking.expand(valid, 3))
    return q, k, v, valid, guard.reach(bad) if causal else None


def _prepare_packed(q, k, v, query_ids, key_ids, query_mask, key_mask, causal):
    """`_prepare` of packed documents: q `[B, T, H, D]` of documents `query_ids` `[B, T]`, k, v `[B, S, ...]`
    of `key_ids` `[B, S]` (0 = padding). Padded and non-finite keys and values -> 0, padded queries
    -> 0. Returns (q, k, v, key_valid `[B, S]`, bad `[B, S, H]`, poisoned `[B, S, H]` (causal, per
    document, along the keys) or None)."""
    q, k, v = as_float(q), as_float(k), as_float(v)
    key_valid = packing.valid(key_ids, key_mask)
    bad = guard.nonfinite(k, v, valid=key_valid)
    drop = bad | ~masking.expand(key_valid, 3)
    q = masking.zero_padding(q, packing.valid(query_ids, query_mask))
    poisoned = guard.reach(bad, key_ids) if causal else None
    return q, guard.clean(k, drop), guard.clean(v, drop), key_valid, bad, poisoned


def _pairs(query_ids, key_ids, key_valid):
    """bool `[B, T, S]`: query t may attend key s (same document, a valid key)."""
    return packing.same_segment(query_ids, key_ids) & key_valid[:, None, :]


def _weights(q, k, valid, mask_given, causal, offset=0, pairs=None):
    """Row-stochastic weights `[B, H, Tq, S]`; query i sits at position offset + i. With `pairs`
    `[B, Tq, S]` (packed) only those keys, and a row without any is 0."""
    logits = jnp.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(q.shape[-1])
    rows = offset + jnp.arange(q.shape[1])[:, None]
    future_ok = jnp.arange(k.shape[1])[None] <= rows                                  # [Tq, S]
    if pairs is not None:
        allowed = (pairs & future_ok if causal else pairs)[:, None]                    # [B, 1, Tq, S]
        some = jnp.any(allowed, axis=-1, keepdims=True)
        w = jax.nn.softmax(jnp.where(some, jnp.where(allowed, logits, -jnp.inf), 0.0), axis=-1)
        return jnp.where(allowed, w, 0.0)
    if mask_given:
        logits = jnp.where(valid[:, None, None, :], logits, -MASK_OFFSET)
    if causal:
        logits = jnp.where(future_ok, logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)


def _rows(poisoned, offset, length):
    """The query rows `[offset, offset + length)` of a per-key `poisoned` `[B, S, H]` (offset traced
    under `shard_map`)."""
    if isinstance(offset, int) and offset == 0 and length == poisoned.shape[1]:
        return poisoned
    return jax.lax.dynamic_slice_in_dim(poisoned, offset, length, axis=1)


def _attend(q, k, v, mask, *, causal, dropout=None, offset=0, segment_ids=None, kv_segment_ids=None,
            query_mask=None):
    """The XLA parallel form: queries q `[B, Tq, H, D]` at positions offset.. against keys and values
    `[B, S, ...]` (mask `[B, S]`); packed with `segment_ids` `[B, Tq]` and `kv_segment_ids` `[B, S]`
    (`query_mask` `[B, Tq]`: the queries' padding). Returns `[B, Tq, H, M]`."""
    tq = q.shape[1]
    if kv_segment_ids is None:
        q, k, v, valid, poisoned = _prepare(q, k, v, mask, causal)
        w = _weights(q, k, valid, mask is not None, causal, offset)
    else:
        q, k, v, valid, bad, poisoned = _prepare_packed(q, k, v, segment_ids, kv_segment_ids, query_mask,
                                                        mask, causal)
        pairs = _pairs(segment_ids, kv_segment_ids, valid)
        w = _weights(q, k, valid, True, causal, offset, pairs)
        if not causal:   # a non-finite key or value poisons every row of its document
            hit = jnp.einsum("bts,bsh->bth", pairs.astype(jnp.int32), bad.astype(jnp.int32))
            poisoned, offset = hit > 0, 0
    if dropout is not None:
        w = dropout(w, 0)
    o = jnp.einsum("bhtj,bjhm->bthm", w, v.astype(w.dtype))
    return o if poisoned is None else guard.poison(o, _rows(poisoned, offset, tq))


def softmax_attention_weights(q: Array, k: Array, *, mask: Optional[Array] = None,
                              causal: bool = False) -> Array:
    """Scaled dot-product softmax weights `[B, H, T, T]` (float32); q, k `[B, T, H, D]`."""
    validation.check_kernel_inputs(q, k, None, mask)
    q, k = as_float(q), as_float(k)
    valid = None if mask is None else jnp.asarray(mask).astype(bool)
    return _weights(q, k, valid, mask is not None, causal)


def softmax_parallel(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
                     causal: bool = False, dropout: Dropout = None,
                     segment_ids: Optional[Array] = None) -> Array:
    """softmax(Q K^T / sqrt(D)) V per head, O(T^2).

    On a GPU without `dropout` and without `segment_ids` this is `softmax_fused` (chosen by
    `jax.lax.platform_dependent`); elsewhere the XLA form below.

    Args:
        q, k: `[B, T, H, D]`.
        v: `[B, T, H, M]`.
        mask: `[B, T]` key padding mask (True = valid), or None.
        causal: token t attends to s <= t only.
        dropout: optional `(weights, index) -> weights` applied to the weights (index 0).
        segment_ids: optional int `[B, T]` packed documents (0 = padding): a token attends only
            within its document; a padding row is 0.

    Returns:
        `[B, T, H, M]` float32.
    """
    validation.check_kernel_inputs(q, k, v, mask)
    packing.check_segment_ids(segment_ids, jnp.shape(q)[:2])
    xla = functools.partial(_parallel_xla, causal=causal, dropout=dropout, segment_ids=segment_ids)
    if dropout is not None or segment_ids is not None:
        return xla(q, k, v, mask)
    return jax.lax.platform_dependent(q, k, v, mask, cuda=functools.partial(_fused, causal=causal),
                                      default=xla)


def _parallel_xla(q, k, v, mask, *, causal, dropout, segment_ids=None):
    return _attend(q, k, v, mask, causal=causal, dropout=dropout, segment_ids=segment_ids,
                   kv_segment_ids=segment_ids, query_mask=mask)


def softmax_cross(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
                  segment_ids: Optional[Array] = None, kv_segment_ids: Optional[Array] = None,
                  dropout: Dropout = None) -> Array:
    """Cross-attention softmax(Q K^T / sqrt(D)) V: T queries over S keys, packed or not.

    Args:
        q: `[B, T, H, D]`.
        k: `[B, S, H, D]`.
        v: `[B, S, H, M]`.
        mask: `[B, S]` key padding mask (True = valid), or None.
        segment_ids, kv_segment_ids: int `[B, T]` and `[B, S]` (given together, 0 = padding): query t
            attends only the keys of its own document (the rows of packed sources and targets,
            flax's wmt `inputs_segmentation` / `targets_segmentation`); a padding query's row is 0.
        dropout: optional `(weights, 0) -> weights`.

    Returns:
        `[B, T, H, M]` float32.
    """
    _check_cross(q, k, v, mask, segment_ids, kv_segment_ids)
    return _attend(q, k, v, mask, causal=False, dropout=dropout, segment_ids=segment_ids,
                   kv_segment_ids=kv_segment_ids)


def _check_cross(q, k, v, mask, segment_ids, kv_segment_ids) -> None:
    qs, ks, vs = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or ks[0] != qs[0] or ks[2:] != qs[2:] \
            or vs[:3] != ks[:3]:
        raise ValueError(f"softmax cross-attention expects q [B, T, H, D], k [B, S, H, D], v [B, S, H, M]; "
                         f"got q {qs}, k {ks}, v {vs}")
    masking.check_mask(mask, ks[:2], "mask", "[B, S]")
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("softmax cross-attention takes segment_ids (queries) and kv_segment_ids (keys) "
                         "together, or neither")
    packing.check_segment_ids(segment_ids, qs[:2])
    packing.check_segment_ids(kv_segment_ids, ks[:2], "kv_segment_ids")


def shard_softmax(q: Array, k: Array, v: Array, *, axis_name: str, causal: bool = False,
                  mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                  dropout: Dropout = None) -> Array:
    """Softmax attention of this shard's queries (the body under `jax.shard_map`, inputs split along
    T on `axis_name`; shard i holds tokens i T_p ...): one `all_gather` of the keys, values, mask and
    segment ids over the axis, then `softmax_parallel`'s rows for the local queries (the causal
    offset is the shard's first position). q, k `[B, T_p, H, D]`, v `[B, T_p, H, M]`, mask and
    segment_ids `[B, T_p]`; `dropout(w, shard index)`. Returns `[B, T_p, H, M]` float32."""
    gather = lambda x: None if x is None else jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    index = jax.lax.axis_index(axis_name)
    drop = None if dropout is None else (lambda w, _: dropout(w, index))
    return _attend(q, gather(k), gather(v), gather(mask), causal=causal, dropout=drop,
                   offset=index * q.shape[1], segment_ids=segment_ids, kv_segment_ids=gather(segment_ids),
                   query_mask=mask)


def softmax_context_parallel(q: Array, k: Array, v: Array, *, axis_name: str = "sequence",
                             causal: bool = False, mesh=None, batch_axis: Optional[str] = None,
                             mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                             dropout: Dropout = None) -> Array:
    """`softmax_parallel` with the sequence split over `axis_name` of `mesh` (None: the mesh of
    `jax.set_mesh`) by `shard_softmax` under `jax.shard_map`; T must divide by the axis size.
    Arguments as in `softmax_parallel` (`batch_axis`: the mesh axis B is split over, or None);
    `dropout` draws per shard, so only its distribution matches the single-device call. Returns
    `[B, T, H, M]` float32, sharded like the inputs."""
    validation.check_kernel_inputs(q, k, v, mask)
    packing.check_segment_ids(segment_ids, jnp.shape(q)[:2])
    body = functools.partial(shard_softmax, axis_name=axis_name, causal=causal, dropout=dropout)
    return context_parallel.sequence_map(body, dict(q=q, k=k, v=v, mask=mask, segment_ids=segment_ids),
                                         mesh=mesh, axis_name=axis_name, batch_axis=batch_axis)


def softmax_fused(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
                  causal: bool = False) -> Array:
    """`softmax_parallel` (no dropout) through `jax.nn.dot_product_attention`, on any platform.

    bf16/fp16 inputs take cuDNN's fused flash attention (`implementation='cudnn'`, `is_causal`, key
    padding as key lengths when the mask is a valid prefix per row) where this host has cuDNN and the
    shapes suit it (head width a multiple of 8 up to 128, value width = key width); other float16/32
    inputs JAX's XLA form of the same function (softmax in float32); float64 inputs, or values of
    another width than keys, `softmax_parallel`'s XLA form. There key padding is a `-1e9` bias on
    the padded keys (the offset of `softmax_parallel`, so a row with only padded keys averages the
    zeroed padded values as there). Padded keys and values are zeroed with `jnp.where` first, and
    causal rows at and after a non-finite key or value are NaN, so padding or the future holding
    NaN changes no output.

    Args:
        q, k: `[B, T, H, D]`; v: `[B, T, H, M]`; mask: `[B, T]` (True = valid) or None;
        causal: as in `softmax_parallel`.

    Returns:
        `[B, T, H, M]` float32 (float64 for float64 inputs).
    """
    validation.check_kernel_inputs(q, k, v, mask)
    return _fused(q, k, v, mask, causal=causal)


_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _fused(q, k, v, mask, *, causal):
    dt = jnp.result_type(q, k, v)
    if not jnp.issubdtype(dt, jnp.floating):
        dt = jnp.float32
    # jax.nn's attention needs values as wide as keys, and its softmax is float32 even for float64
    if jnp.shape(v)[-1] != jnp.shape(q)[-1] or dt == jnp.float64:
        return _parallel_xla(q, k, v, mask, causal=causal, dropout=None)
    q, k, v = (jnp.asarray(x).astype(dt) for x in (q, k, v))
    valid = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask).astype(bool)
    bad = jnp.zeros(q.shape[:3], bool)
    if causal:
        bad = guard.nonfinite(k, v, valid=valid)
    drop = (bad | ~valid[:, :, None])[..., None]
    k, v = jnp.where(drop, 0.0, k).astype(dt), jnp.where(drop, 0.0, v).astype(dt)
    bias = None
    if mask is not None:
        bias = jnp.where(valid, 0.0, -MASK_OFFSET).astype(jnp.promote_types(dt, jnp.float32))[:, None, None, :]
    o = _dot_product_attention(q, k, v, valid, bias, causal)
    o = o.astype(jnp.promote_types(dt, jnp.float32))
    return guard.poison(o, guard.reach(bad)) if causal else o


def _dot_product_attention(q, k, v, valid, bias, causal):
    """`jax.nn.dot_product_attention`: cuDNN where it takes the operands, else JAX's XLA form.

    cuDNN's padding is by key lengths, so a mask goes there only when every row is a non-empty
    valid prefix (checked on the device, `lax.cond`); other masks take the XLA form's bias.
    """
    def xla():
        return jax.nn.dot_product_attention(q, k, v, bias, is_causal=causal)

    d = q.shape[-1]
    if not (jax.default_backend() == "gpu" and q.dtype in _CUDNN_DTYPES and d % 8 == 0 and d <= 128):
        return xla()
    try:
        if bias is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
        prefix = (jnp.all(valid == (jnp.arange(q.shape[1])[None] < lengths[:, None]))
                  & jnp.all(lengths > 0))
        return jax.lax.cond(prefix, lambda: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, key_value_seq_lengths=lengths, implementation="cudnn"), xla)
    except (RuntimeError, NotImplementedError, ValueError):   # no cuDNN here, or a shape it lacks
        return xla()


def softmax_chunked(q: Array, k: Array, v: Array, *, chunk_size: int,
                    mask: Optional[Array] = None, dropout: Dropout = None,
                    segment_ids: Optional[Array] = None) -> Array:
    """Causal softmax attention, C queries at a time (any C >= 1; the last chunk may be short).

    Per platform (`jax.lax.platform_dependent`): on the CPU a `lax.map` over the chunks (live logits
    `[B, H, C, T]`); on accelerators no loop over chunks: `softmax_fused` on a GPU without dropout
    or segment ids, else `softmax_chunked_batched`. All give the same rows and the same dropout masks.

    Args:
        q, k, v, mask, segment_ids: as in `softmax_parallel`.
        chunk_size: C.
        dropout: optional `(weights, chunk index) -> weights`.

    Returns:
        `[B, T, H, M]` float32, the rows of `softmax_parallel(causal=True)`.
    """
    validation.check_kernel_inputs(q, k, v, mask)
    packing.check_segment_ids(segment_ids, jnp.shape(q)[:2])
    kw = dict(chunk_size=chunk_size, dropout=dropout, segment_ids=segment_ids)
    by_map = functools.partial(_chunked_xla, batched=False, **kw)
    batched = functools.partial(_chunked_xla, batched=True, **kw)
    fused = dropout is None and segment_ids is None
    gpu = functools.partial(_fused, causal=True) if fused else batched
    return jax.lax.platform_dependent(q, k, v, mask, cpu=by_map, cuda=gpu, default=batched)


def softmax_chunked_batched(q: Array, k: Array, v: Array, *, chunk_size: int,
                            mask: Optional[Array] = None, dropout: Dropout = None,
                            segment_ids: Optional[Array] = None) -> Array:
    """`softmax_chunked`'s accelerator form, on any platform: every chunk at once (`jax.vmap` of the
    chunk body over the chunk axis, live logits `[n, B, H, C, T]`), the same rows and dropout masks.

    Args and Returns: as in `softmax_chunked`.
    """
    validation.check_kernel_inputs(q, k, v, mask)
    packing.check_segment_ids(segment_ids, jnp.shape(q)[:2])
    return _chunked_xla(q, k, v, mask, chunk_size=chunk_size, dropout=dropout, batched=True,
                        segment_ids=segment_ids)


def _chunked_xla(q, k, v, mask, *, chunk_size, dropout, batched, segment_ids=None):
    b, t = q.shape[:2]
    c = max(1, min(int(chunk_size), t))
    n = -(-t // c)
    if segment_ids is None:
        q, k, v, valid, poisoned = _prepare(q, k, v, mask, True)
        ids = None
    else:
        q, k, v, valid, _, poisoned = _prepare_packed(q, k, v, segment_ids, segment_ids, mask, mask, True)
        ids = jnp.moveaxis(jnp.pad(segment_ids, ((0, 0), (0, n * c - t))).reshape(b, n, c), 1, 0)
    h, d = q.shape[2:]
    qc = jnp.moveaxis(jnp.pad(q, ((0, 0), (0, n * c - t), (0, 0), (0, 0))).reshape(b, n, c, h, d),
                      1, 0)

    @jax.checkpoint
    def body(xs):
        i, q_i, ids_i = xs
        pairs = None if segment_ids is None else _pairs(ids_i, segment_ids, valid)
        w = _weights(q_i, k, valid, mask is not None, True, offset=i * c, pairs=pairs)
        if dropout is not None:
            w = dropout(w, i)
        return jnp.einsum("bhtj,bjhm->bthm", w, v)

    xs = (jnp.arange(n), qc, ids)
    o = jax.vmap(body)(xs) if batched else jax.lax.map(body, xs)
    o = jnp.moveaxis(o, 0, 1).reshape((b, n * c) + o.shape[3:])[:, :t]
    return guard.poison(o, poisoned)


def softmax_step(cache: KVCache, q_t: Array, k_t: Array, v_t: Array, *,
                 append: Optional[Array] = None, dropout: Dropout = None,
                 index=0) -> tuple[KVCache, Array]:
    """One token: write (k_t, v_t) at slot `length` (where `append`), attend over the cache.

    Args:
        cache: `KVCache` of the prefix.
        q_t, k_t: `[B, H, D]`.
        v_t: `[B, H, M]`.
        append: `[B]` bool, False for a padded token (not written; it still reads the cache), or
            None (all True).
        dropout: optional `(weights, index) -> weights`.
        index: the token index passed to `dropout`.

    Returns:
        (new cache, y_t `[B, H, M]` float32). Writing past the cache's `max_length` slots raises
        `ValueError` (eagerly: `check_room`; under `jit`: from the host, module docstring).
    """
    validation.check_cache(cache, q_t, k_t, v_t)
    check_room(cache, 1 if append is None or isinstance(append, jax.core.Tracer)
               else np.asarray(append, bool).astype(np.int32))
    dt = jnp.promote_types(cache.key.dtype, as_float(q_t).dtype)
    q_t, k_t, v_t = (x.astype(dt) for x in (q_t, k_t, v_t))
    append = jnp.ones(q_t.shape[:1], bool) if append is None else jnp.asarray(append, bool)
    slots = jnp.arange(cache.key.shape[1])[None]                                     # [1, L]
    write = ((slots == cache.length[:, None]) & append[:, None])[..., None, None]    # [B, L, 1, 1]
    key = jnp.where(write, k_t[:, None], cache.key.astype(dt))
    value = jnp.where(write, v_t[:, None], cache.value.astype(dt))
    length = cache.length + append.astype(jnp.int32)
    # Under jit the host check; its result feeds the output, so that it is never removed.
    room = _room_callback(length, cache.key.shape[1]) if isinstance(length, jax.core.Tracer) else jnp.array(True)
    valid = slots < length[:, None]                                                  # [B, L]
    logits = jnp.einsum("bhd,blhd->bhl", q_t, key) / math.sqrt(q_t.shape[-1])
    w = jax.nn.softmax(jnp.where(valid[:, None], logits, -MASK_OFFSET), axis=-1)
    if dropout is not None:
        w = dropout(w, index)
    y = jnp.einsum("bhl,blhm->bhm", w, jnp.where(valid[..., None, None], value, 0.0))
    full = (length > cache.key.shape[1]) | ~room   # overflowed (a padded token that writes nothing is not)
    return KVCache(key, value, length), jnp.where(full[:, None, None], jnp.nan, y)


def softmax_scan(q: Array, k: Array, v: Array, *, cache: KVCache, mask: Optional[Array] = None,
                 dropout: Dropout = None, segment_ids: Optional[Array] = None) -> tuple[Array, KVCache]:
    """Causal softmax attention as a `jax.lax.scan` of `softmax_step` (padded tokens not written).

    Args:
        q, k, v, mask: as in `softmax_parallel`.
        cache: `KVCache` of the preceding tokens.
        dropout: optional `(weights, token index) -> weights`.
        segment_ids: optional int `[B, T]` packed documents (0 = padding, not written, its row 0):
            the cache is emptied at each document start; the first document reads `cache`.

    Returns:
        (y `[B, T, H, M]` float32, final cache: the last document's).
    """
    validation.check_kernel_inputs(q, k, v, None)
    packing.check_segment_ids(segment_ids, jnp.shape(q)[:2])
    append = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask).astype(bool)
    if segment_ids is None:
        start = jnp.zeros(q.shape[:2], bool)
        check_room(cache, q.shape[1] if mask is None else append.sum(axis=1, dtype=jnp.int32))
    else:
        append = packing.valid(segment_ids, append)
        start = packing.starts(segment_ids)
        _check_packed_room(cache, append, start)

    def body(c, xs):
        i, q_t, k_t, v_t, a_t, s_t = xs
        if segment_ids is not None:   # a document start empties the cache (slots past `length` are never read)
            c = c._replace(length=jnp.where(s_t, 0, c.length))
        c, y = softmax_step(c, q_t, k_t, v_t, append=a_t, dropout=dropout, index=i)
        return c, y if segment_ids is None else jnp.where(a_t[:, None, None], y, 0.0)

    xs = (jnp.arange(q.shape[1]),) + tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, append, start))
    cache, ys = jax.lax.scan(body, cache, xs)
    return jnp.swapaxes(ys, 0, 1), cache


def _check_packed_room(cache: KVCache, append: Array, start: Array) -> None:
    """`check_room` of a packed scan: the longest document (the first one after the cache's tokens)."""
    if any(isinstance(x, jax.core.Tracer) for x in (cache.length, append, start)):
        return
    if append.shape[1] == 0:
        return
    a, s = np.asarray(append, np.int64), np.asarray(start, bool)
    written = np.cumsum(a, axis=1)
    before = np.maximum.accumulate(np.where(s, written - a, 0), axis=1)   # written before the document
    first = np.cumsum(s, axis=1) == 0
    need = written - before + np.where(first, np.asarray(cache.length)[:, None], 0)
    _raise_if_over(need.max(axis=1), slots=cache.key.shape[1])
