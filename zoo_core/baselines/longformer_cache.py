"""Causal Longformer one token at a time: a cache of the last w keys and values plus the g global ones.

The causal query at position i reads the keys i - w < j <= i and the global tokens j < g, j <= i
(`zoo_core.baselines.longformer`). So decoding needs only a ring buffer of the last w tokens (slot
i mod w) and the first g tokens: O(w + g) memory, whatever the length decoded. `LongformerCache`
holds them in float32 with each ring slot's position in its document (-1: empty or padding);
`longformer_step` is one token, `longformer_scan` the same step under `jax.lax.scan`. A
decoded sequence equals the causal `longformer_attention` within float32 rounding.

Padding (`valid` False) takes a position but is never read: its slot is marked -1 (and so is its
global slot). A document start (`start`, packed rows) empties the cache first: positions restart
and the document's own first g tokens become its globals. The NaN guard is the parallel form's: a
non-finite value at a slot that a row reads makes that row NaN, and a slot a row does not read is
replaced with `jnp.where` before the weighted sum.
"""
from __future__ import annotations

__all__ = ["LongformerCache", "init_cache", "longformer_step", "longformer_scan"]

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

MASKED = -1e9   # logit of a key a query may not see (finite: an all-masked padded row stays finite)


class LongformerCache(NamedTuple):
    """Decoding state of causal Longformer (float32 keys and values).

    Attributes:
        key: `[B, w, H, D]` the last w keys, token i at slot i mod w.
        value: `[B, w, H, M]`.
        position: `[B, w]` int32, each slot's position in its document (-1: empty or padding).
        global_key: `[B, g, H, D]` the document's first g keys.
        global_value: `[B, g, H, M]`.
        global_valid: `[B, g]` bool, the global slot holds a valid token.
        length: `[B]` int32, the position of the next token in its document.
    """
    key: Array
    value: Array
    position: Array
    global_key: Array
    global_value: Array
    global_valid: Array
    length: Array


def init_cache(batch_size: int, window: int, num_global: int, num_heads: int, head_dim: int,
               value_dim: Optional[int] = None) -> LongformerCache:
    """An empty cache: w ring slots and g global slots, nothing in them."""
    m = head_dim if value_dim is None else value_dim
    zeros = lambda n, f: jnp.zeros((batch_size, n, num_heads, f), jnp.float32)
    return LongformerCache(zeros(window, head_dim), zeros(window, m), jnp.full((batch_size, window), -1, jnp.int32),
                           zeros(num_global, head_dim), zeros(num_global, m),
                           jnp.zeros((batch_size, num_global), bool), jnp.zeros((batch_size,), jnp.int32))


def longformer_step(cache: LongformerCache, q: Array, k: Array, v: Array, *, valid: Optional[Array] = None,
                    start: Optional[Array] = None,
                    dropout: Optional[Callable[[Array], Array]] = None) -> tuple[Array, LongformerCache]:
    """One token: q, k `[B, H, D]`, v `[B, H, M]`; `valid` bool `[B]` (False: padding), `start` bool `[B]`
    (a document begins here: the cache is emptied first); `dropout(weights)` on its `[B, H, w + g]`
    weights. Returns (o `[B, H, M]` float32, the cache after it)."""
    b = q.shape[0]
    window, g = cache.key.shape[1], cache.global_key.shape[1]
    valid = jnp.ones((b,), bool) if valid is None else valid
    if start is not None:
        cache = cache._replace(position=jnp.where(start[:, None], -1, cache.position),
                               global_valid=cache.global_valid & ~start[:, None],
                               length=jnp.where(start, 0, cache.length))
    i = cache.length                                                                    # [B]
    keep = valid[:, None, None]
    q, k, v = (jnp.where(keep, x.astype(jnp.float32), 0.0) for x in (q, k, v))
    slot = (jnp.arange(window) == (i % window)[:, None])                               # [B, w]
    write = lambda old, new, at: jnp.where(at[..., None, None], new[:, None], old)
    cache = cache._replace(key=write(cache.key, k, slot), value=write(cache.value, v, slot),
                           position=jnp.where(slot, jnp.where(valid, i, -1)[:, None], cache.position),
                           length=i + 1)
    if g:
        at = jnp.arange(g) == i[:, None]                                               # [B, g]
        cache = cache._replace(global_key=write(cache.global_key, k, at), global_value=write(cache.global_value, v, at),
                               global_valid=jnp.where(at, valid[:, None], cache.global_valid))
    # The window's keys that are not global tokens, then the global ones (all at j <= i).
    position = cache.position
    allowed = jnp.concatenate([(position >= g) & (position > i[:, None] - window), cache.global_valid], axis=1)
    keys = jnp.concatenate([cache.key, cache.global_key], axis=1)                       # [B, w + g, H, D]
    values = jnp.concatenate([cache.value, cache.global_value], axis=1)
    logits = jnp.einsum("bhd,bkhd->bhk", q, keys) / math.sqrt(q.shape[-1])
    w = jax.nn.softmax(jnp.where(allowed[:, None], logits, MASKED), axis=-1)            # [B, H, w + g]
    if dropout is not None:
        w = dropout(w)
    bad = allowed[..., None] & ~jnp.all(jnp.isfinite(values), axis=-1)                 # [B, w + g, H]
    values = jnp.where((allowed[..., None] & ~bad)[..., None], values, 0.0)
    o = jnp.einsum("bhk,bkhm->bhm", w, values)
    o = jnp.where(jnp.any(allowed, axis=1)[:, None, None], o, 0.0)
    return jnp.where(jnp.any(bad, axis=1)[..., None], jnp.nan, o), cache


def longformer_scan(cache: LongformerCache, q: Array, k: Array, v: Array, *, valid: Optional[Array] = None,
                    start: Optional[Array] = None,
                    dropout: Optional[Callable[[Array, Array], Array]] = None) -> tuple[Array, LongformerCache]:
    """`longformer_step` over T tokens (`jax.lax.scan`): q, k `[B, T, H, D]`, v `[B, T, H, M]`, valid and
    start bool `[B, T]` or None; `dropout(weights, t)`. Returns (o `[B, T, H, M]` float32, final cache)."""
    b, t = q.shape[:2]
    valid = jnp.ones((b, t), bool) if valid is None else valid
    start = jnp.zeros((b, t), bool) if start is None else start
    xs = [jnp.swapaxes(x, 0, 1) for x in (q, k, v, valid, start)] + [jnp.arange(t)]

    def body(carry, x):
        q_t, k_t, v_t, valid_t, start_t, index = x
        drop = None if dropout is None else (lambda w: dropout(w, index))
        return longformer_step(carry, q_t, k_t, v_t, valid=valid_t, start=start_t, dropout=drop)[::-1]

    cache, o = jax.lax.scan(body, cache, xs)
    return jnp.swapaxes(o, 0, 1), cache
