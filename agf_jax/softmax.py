"""Softmax attention kernels of the vanilla-Transformer baseline: parallel, chunked, KV-cache step.

    O = softmax(Q K^T / sqrt(D) + masks) V      per head, O(T^2)

Key padding puts -1e9 on the padded logits (the reference harnesses' offset); the causal mask puts
-inf on the future ones, so a padded row with only padded keys before it averages the padded
(zeroed) values instead of reading the future.

Forms of the causal attention (same numbers up to float32 rounding, tests/agf_jax/layers_test.py):

* `softmax_parallel(causal=True)`: the masked T x T form.
* `softmax_chunked`: the same rows, C queries at a time against all T keys (`lax.map`, rematerialised
  body), so the live logits are `[B, H, C, T]` instead of `[B, H, T, T]`.
* `softmax_scan` / `softmax_step`: the token recurrence on a `KVCache` of `max_length` slots; with a
  mask, padded tokens are not written (attention reads no positions, so the cache holds the valid
  tokens only, `length` counts them per sample).

Masking is NaN-safe (the zoo's layer contract): padded and future logits are replaced with
`jnp.where`, padded values are replaced by 0 before the contraction, and since `w[t, s] * v_s` is
still NaN for a zero future weight and a NaN value, a non-finite value at a valid position is
replaced by 0 and every output at or after it is set to NaN (what the token recurrence gives).
A token written past `max_length` makes its output and all later ones NaN instead of being dropped.
Logits, weights, outputs and the cache are float32 (float64 stays float64).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from agf_jax import validation
from agf_jax.ops import MASK_OFFSET, _float

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


def _prepare(q, k, v, mask, causal):
    """Float casts, padded values -> 0, and (causal) the non-finite-value guard `[B, T, H]`."""
    q, k, v = _float(q), _float(k), _float(v)
    validation.check_kernel_inputs(q, k, v, mask)
    valid = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask).astype(bool)
    keep = jnp.broadcast_to(valid[:, :, None], q.shape[:3])
    poisoned = None
    if causal:
        bad = keep & ~jnp.all(jnp.isfinite(v), axis=-1)
        poisoned = jnp.cumsum(bad.astype(jnp.int32), axis=1) > 0
        keep = keep & ~bad
    return q, k, jnp.where(keep[..., None], v, 0.0), valid, poisoned


def _weights(q, k, valid, mask_given, causal, offset=0):
    """Row-stochastic weights `[B, H, Tq, T]`; query i sits at position offset + i."""
    logits = jnp.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(q.shape[-1])
    if mask_given:
        logits = jnp.where(valid[:, None, None, :], logits, -MASK_OFFSET)
    if causal:
        rows = offset + jnp.arange(q.shape[1])[:, None]
        logits = jnp.where(jnp.arange(k.shape[1])[None] <= rows, logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)


def _guard(o, poisoned):
    return o if poisoned is None else jnp.where(poisoned[..., None], jnp.nan, o)


def softmax_attention_weights(q: Array, k: Array, *, mask: Optional[Array] = None,
                              causal: bool = False) -> Array:
    """Scaled dot-product softmax weights `[B, H, T, T]` (float32); q, k `[B, T, H, D]`."""
    validation.check_kernel_inputs(q, k, None, mask)
    q, k = _float(q), _float(k)
    valid = None if mask is None else jnp.asarray(mask).astype(bool)
    return _weights(q, k, valid, mask is not None, causal)


def softmax_parallel(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
                     causal: bool = False, dropout: Dropout = None) -> Array:
    """softmax(Q K^T / sqrt(D)) V per head, O(T^2).

    Args:
        q, k: `[B, T, H, D]`.
        v: `[B, T, H, M]`.
        mask: `[B, T]` key padding mask (True = valid), or None.
        causal: token t attends to s <= t only.
        dropout: optional `(weights, index) -> weights` applied to the weights (index 0).

    Returns:
        `[B, T, H, M]` float32.
    """
    q, k, v, valid, poisoned = _prepare(q, k, v, mask, causal)
    w = _weights(q, k, valid, mask is not None, causal)
    if dropout is not None:
        w = dropout(w, 0)
    return _guard(jnp.einsum("bhtj,bjhm->bthm", w, v.astype(w.dtype)), poisoned)


def softmax_chunked(q: Array, k: Array, v: Array, *, chunk_size: int,
                    mask: Optional[Array] = None, dropout: Dropout = None) -> Array:
    """Causal softmax attention, C queries at a time (any C >= 1; the last chunk may be short).

    Args:
        q, k, v, mask: as in `softmax_parallel`.
        chunk_size: C.
        dropout: optional `(weights, chunk index) -> weights`.

    Returns:
        `[B, T, H, M]` float32, the rows of `softmax_parallel(causal=True)`.
    """
    q, k, v, valid, poisoned = _prepare(q, k, v, mask, True)
    b, t, h, d = q.shape
    c = max(1, min(int(chunk_size), t))
    n = -(-t // c)
    qc = jnp.moveaxis(jnp.pad(q, ((0, 0), (0, n * c - t), (0, 0), (0, 0))).reshape(b, n, c, h, d),
                      1, 0)

    @jax.checkpoint
    def body(xs):
        i, q_i = xs
        w = _weights(q_i, k, valid, mask is not None, True, offset=i * c)
        if dropout is not None:
            w = dropout(w, i)
        return jnp.einsum("bhtj,bjhm->bthm", w, v)

    o = jax.lax.map(body, (jnp.arange(n), qc))
    o = jnp.moveaxis(o, 0, 1).reshape((b, n * c) + o.shape[3:])[:, :t]
    return _guard(o, poisoned)


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
        (new cache, y_t `[B, H, M]` float32; NaN where the cache was already full).
    """
    validation.check_cache(cache, q_t, k_t, v_t)
    dt = jnp.promote_types(cache.key.dtype, _float(q_t).dtype)
    q_t, k_t, v_t = (x.astype(dt) for x in (q_t, k_t, v_t))
    append = jnp.ones(q_t.shape[:1], bool) if append is None else jnp.asarray(append, bool)
    slots = jnp.arange(cache.key.shape[1])[None]                                     # [1, L]
    write = ((slots == cache.length[:, None]) & append[:, None])[..., None, None]    # [B, L, 1, 1]
    key = jnp.where(write, k_t[:, None], cache.key.astype(dt))
    value = jnp.where(write, v_t[:, None], cache.value.astype(dt))
    length = cache.length + append.astype(jnp.int32)
    valid = slots < length[:, None]                                                  # [B, L]
    logits = jnp.einsum("bhd,blhd->bhl", q_t, key) / math.sqrt(q_t.shape[-1])
    w = jax.nn.softmax(jnp.where(valid[:, None], logits, -MASK_OFFSET), axis=-1)
    if dropout is not None:
        w = dropout(w, index)
    y = jnp.einsum("bhl,blhm->bhm", w, jnp.where(valid[..., None, None], value, 0.0))
    full = cache.length >= cache.key.shape[1]
    return KVCache(key, value, length), jnp.where(full[:, None, None], jnp.nan, y)


def softmax_scan(q: Array, k: Array, v: Array, *, cache: KVCache, mask: Optional[Array] = None,
                 dropout: Dropout = None) -> tuple[Array, KVCache]:
    """Causal softmax attention as a `jax.lax.scan` of `softmax_step` (padded tokens not written).

    Args:
        q, k, v, mask: as in `softmax_parallel`.
        cache: `KVCache` of the preceding tokens.
        dropout: optional `(weights, token index) -> weights`.

    Returns:
        (y `[B, T, H, M]` float32, final cache).
    """
    validation.check_kernel_inputs(q, k, v, None)
    append = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask).astype(bool)

    def body(c, xs):
        i, q_t, k_t, v_t, a_t = xs
        return softmax_step(c, q_t, k_t, v_t, append=a_t, dropout=dropout, index=i)

    xs = (jnp.arange(q.shape[1]),) + tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, append))
    cache, ys = jax.lax.scan(body, cache, xs)
    return jnp.swapaxes(ys, 0, 1), cache
