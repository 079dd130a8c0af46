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
A token written past `max_length` is an error where it can be seen: `softmax_step` / `softmax_scan` called
with a concrete cache (eagerly, as an un-jitted decoding loop or `DropInAttention(decode=True)` applied
without `jit` does) raise `ValueError` naming the cache size (`check_room`). Under `jit` the length is
traced and no Python error can be raised (no checkify, no host callback): the output of that token and
of every later one is NaN instead of the token being dropped; `check_room(cache)` between jitted steps
is the host-side check.
Logits, weights, outputs and the cache are float32 (float64 stays float64); the fused form takes
bf16/fp16 inputs as they are (cuDNN keeps its softmax statistics in float32) and returns float32.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from agf_jax import validation
from agf_jax.factors import MASK_OFFSET, as_float

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
    the `max_length` slots of a concrete `cache`; does nothing for a traced one (inside `jit`, where the
    overflowing outputs are NaN instead: module docstring)."""
    if isinstance(cache.length, jax.core.Tracer) or isinstance(tokens, jax.core.Tracer):
        return
    slots = cache.key.shape[1]
    need = np.asarray(cache.length) + np.asarray(tokens)   # [B]: the cache length after the tokens
    over = np.flatnonzero(need > slots)
    if over.size:
        raise ValueError(
            f"softmax decoding: the key/value cache has {slots} slots (the max_length given at init: the "
            f"length of the sequence DropInAttention(decode=True) was initialised with) and sample(s) "
            f"{over.tolist()} would write token {int(need[over].max())}; "
            f"init the cache with max_length >= the tokens you decode")


def _prepare(q, k, v, mask, causal):
    """Float casts, padded values -> 0, and (causal) the non-finite-value guard `[B, T, H]`."""
    q, k, v = as_float(q), as_float(k), as_float(v)
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
    q, k = as_float(q), as_float(k)
    valid = None if mask is None else jnp.asarray(mask).astype(bool)
    return _weights(q, k, valid, mask is not None, causal)


def softmax_parallel(q: Array, k: Array, v: Array, *, mask: Optional[Array] = None,
                     causal: bool = False, dropout: Dropout = None) -> Array:
    """softmax(Q K^T / sqrt(D)) V per head, O(T^2).

    On a GPU without `dropout` this is `softmax_fused` (chosen by `jax.lax.platform_dependent`);
    elsewhere the XLA form below.

    Args:
        q, k: `[B, T, H, D]`.
        v: `[B, T, H, M]`.
        mask: `[B, T]` key padding mask (True = valid), or None.
        causal: token t attends to s <= t only.
        dropout: optional `(weights, index) -> weights` applied to the weights (index 0).

    Returns:
        `[B, T, H, M]` float32.
    """
    validation.check_kernel_inputs(q, k, v, mask)
    xla = functools.partial(_parallel_xla, causal=causal, dropout=dropout)
    if dropout is not None:
        return xla(q, k, v, mask)
    return jax.lax.platform_dependent(q, k, v, mask, cuda=functools.partial(_fused, causal=causal),
                                      default=xla)


def _parallel_xla(q, k, v, mask, *, causal, dropout):
    q, k, v, valid, poisoned = _prepare(q, k, v, mask, causal)
    w = _weights(q, k, valid, mask is not None, causal)
    if dropout is not None:
        w = dropout(w, 0)
    return _guard(jnp.einsum("bhtj,bjhm->bthm", w, v.astype(w.dtype)), poisoned)


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
        bad = valid[:, :, None] & ~(jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1))
    drop = (bad | ~valid[:, :, None])[..., None]
    k, v = jnp.where(drop, 0.0, k).astype(dt), jnp.where(drop, 0.0, v).astype(dt)
    bias = None
    if mask is not None:
        bias = jnp.where(valid, 0.0, -MASK_OFFSET).astype(jnp.promote_types(dt, jnp.float32))[:, None, None, :]
    o = _dot_product_attention(q, k, v, valid, bias, causal)
    o = o.astype(jnp.promote_types(dt, jnp.float32))
    return _guard(o, jnp.cumsum(bad.astype(jnp.int32), axis=1) > 0 if causal else None)


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
                    mask: Optional[Array] = None, dropout: Dropout = None) -> Array:
    """Causal softmax attention, C queries at a time (any C >= 1; the last chunk may be short).

    Per platform (`jax.lax.platform_dependent`): on the CPU a `lax.map` over the chunks (live logits
    `[B, H, C, T]`); on accelerators no loop over chunks: `softmax_fused` on a GPU without dropout,
    else `softmax_chunked_batched`. All give the same rows and the same dropout masks.

    Args:
        q, k, v, mask: as in `softmax_parallel`.
        chunk_size: C.
        dropout: optional `(weights, chunk index) -> weights`.

    Returns:
        `[B, T, H, M]` float32, the rows of `softmax_parallel(causal=True)`.
    """
    validation.check_kernel_inputs(q, k, v, mask)
    by_map = functools.partial(_chunked_xla, chunk_size=chunk_size, dropout=dropout, batched=False)
    batched = functools.partial(_chunked_xla, chunk_size=chunk_size, dropout=dropout, batched=True)
    gpu = batched if dropout is not None else functools.partial(_fused, causal=True)
    return jax.lax.platform_dependent(q, k, v, mask, cpu=by_map, cuda=gpu, default=batched)


def softmax_chunked_batched(q: Array, k: Array, v: Array, *, chunk_size: int,
                            mask: Optional[Array] = None, dropout: Dropout = None) -> Array:
    """`softmax_chunked`'s accelerator form, on any platform: every chunk at once (`jax.vmap` of the
    chunk body over the chunk axis, live logits `[n, B, H, C, T]`), the same rows and dropout masks.

    Args and Returns: as in `softmax_chunked`.
    """
    validation.check_kernel_inputs(q, k, v, mask)
    return _chunked_xla(q, k, v, mask, chunk_size=chunk_size, dropout=dropout, batched=True)


def _chunked_xla(q, k, v, mask, *, chunk_size, dropout, batched):
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

    o = jax.vmap(body)((jnp.arange(n), qc)) if batched else jax.lax.map(body, (jnp.arange(n), qc))
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
        (new cache, y_t `[B, H, M]` float32; NaN where this or an earlier token was written past the
        cache, which a concrete cache raises instead: `check_room`).
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
    valid = slots < length[:, None]                                                  # [B, L]
    logits = jnp.einsum("bhd,blhd->bhl", q_t, key) / math.sqrt(q_t.shape[-1])
    w = jax.nn.softmax(jnp.where(valid[:, None], logits, -MASK_OFFSET), axis=-1)
    if dropout is not None:
        w = dropout(w, index)
    y = jnp.einsum("bhl,blhm->bhm", w, jnp.where(valid[..., None, None], value, 0.0))
    full = length > cache.key.shape[1]   # overflowed by now (a padded token that writes nothing is not)
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
    check_room(cache, q.shape[1] if mask is None else append.sum(axis=1, dtype=jnp.int32))

    def body(c, xs):
        i, q_t, k_t, v_t, a_t = xs
        return softmax_step(c, q_t, k_t, v_t, append=a_t, dropout=dropout, index=i)

    xs = (jnp.arange(q.shape[1]),) + tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, append))
    cache, ys = jax.lax.scan(body, cache, xs)
    return jnp.swapaxes(ys, 0, 1), cache
