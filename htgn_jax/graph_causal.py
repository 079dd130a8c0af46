"""Causal window graph attention (the decoder's WinGAT, htgn.md §3.4 "Causal version", §5.10) in its
scan, chunked and step forms, as pure `jnp` functions: `causal_window_step` (one token, rolling
`WindowState` of the last w tokens), `causal_window_scan` (its `lax.scan`) and
`causal_window_chunked` (chunks of C tokens continuing from a state), which runs
`causal_window_chunked_scan` (a `lax.scan` over chunks) on the CPU and
`causal_window_chunked_parallel` (every chunk at once, no loop) on an accelerator. All equal the
parallel form `graph_ops.window_graph_attention(..., causal=True)`; masking is NaN-safe as there.
These kernels assert their structure only: the layer (`WindowGraphAttention`) checks what a user
passes (fields in `setup`, inputs and states in its methods, `validation`).

Packed documents (`segment_ids` int `[B, T]`, 0 = padding; docs/htgn_packing.md): a token's window
holds only tokens of its own document. The state holds only the current document's tokens: a
document start empties it (`causal_window_step`'s `start_t`); the first token of a call continues the
incoming state, as in `zoo_core.ops.packing`.

Skip edges (`offsets` = `graph_ops.window_offsets(w, True, skip_offsets=...)`, e.g. -w..0 then -8,
-16): the state then holds the last `span` = max(w, max skip) tokens and each token attends to the
slots `span + o` of state ++ token, so every form still costs O(T (w + 1 + |skips|)) attention
work and O(span) state. `offsets=None` means the plain window -span..0.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from htgn_jax.graph_kl import attention_kl, distance_prior_logits, neighbour_kl
from htgn_jax.graph_ops import neighbour_attention, unfold, window_distances
from zoo_core.ops import masking, packing

Array = jax.Array


class WindowState(NamedTuple):
    """Rolling cache of the causal window graph attention: the last w tokens, oldest first.

    Attributes:
      value: `[B, w, H, D]` float32, W_s x of the last w tokens (w: the span, max(window, max
        skip offset)); for GATv2 and dot also the score key; slot j holds offset j - w.
      key: `[B, w, H, 1]` float32 score keys a_s . W x (GAT v1), or None (the key is `value`).
      valid: `[B, w]` bool, True where the slot holds a real token (False before the first token
        and for padding).
    """

    value: Array
    key: Optional[Array]
    valid: Array


def init_window_state(batch_size: int, window: int, num_heads: int, head_dim: int, *,
                      key_dim: int | None = None) -> WindowState:
    """Empty `WindowState` (float32 zeros, no valid slot); `key_dim` C only for GAT v1."""
    zeros = lambda d: jnp.zeros((batch_size, window, num_heads, d), jnp.float32)
    return WindowState(zeros(head_dim), None if key_dim is None else zeros(key_dim),
                       jnp.zeros((batch_size, window), bool))


def causal_window_step(query_t: Array, key_t: Array, value_t: Array, state: WindowState,
                       attn: Array | None, *, valid_t: Array | None = None,
                       rel_bias: Array | None = None, negative_slope: float | None = None,
                       offsets: tuple[int, ...] | None = None,
                       start_t: Array | None = None) -> tuple[Array, WindowState]:
    """One token of the causal window GAT with a rolling cache: O(w H C) per token.

    Args:
      query_t: `[B, H, C]` score features of the new token.
      key_t: `[B, H, C]` (ignored for GATv2 / dot, whose score key is `value_t`: state.key None).
      value_t: `[B, H, D]`.
      state: `WindowState` of the previous w tokens.
      attn: `[H, C]`, or None for dot-product scoring.
      valid_t: optional `[B]` bool, False for a padded token (output 0, enters as an invalid
        slot); None means real.
      rel_bias: `[H, w+1]` or None.
      negative_slope: LeakyReLU slope (None: 0.2; must be None with dot-product scoring).
      offsets: the slots (offsets <= 0 from the token) it attends to; None = -w..0.
      start_t: optional `[B]` bool, True where the token begins a new document (packing): the
        state's tokens, of the document before, are dropped first.

    Returns:
      out_t `[B, H, D]` and the updated state (same shapes and dtypes).
    """
    b, heads, ch = query_t.shape
    w = state.value.shape[1]
    offsets = _causal_offsets(offsets, w)
    shared = state.key is None
    assert state.value.shape == (b, w) + value_t.shape[1:] and state.valid.shape == (b, w)
    assert shared or (key_t.shape == query_t.shape and state.key.shape == (b, w, heads, ch))
    assert attn is None or isinstance(attn, str) or attn.shape == (heads, ch)
    assert rel_bias is None or rel_bias.shape == (heads, len(offsets))
    valid_t = _bool_mask(valid_t, (b,))
    query_t, value_t = masking.zero_padding(query_t, valid_t), masking.zero_padding(value_t, valid_t)
    vals = jnp.concatenate([state.value.astype(value_t.dtype), value_t[:, None]], axis=1)
    keys = vals if shared else jnp.concatenate(
        [state.key.astype(key_t.dtype), masking.zero_padding(key_t, valid_t)[:, None]], axis=1)
    kept = state.valid if start_t is None else state.valid & ~jnp.asarray(start_t)[:, None]
    slots = jnp.concatenate([kept, valid_t[:, None]], axis=1)                 # [B, w+1]
    bias = None if rel_bias is None else rel_bias[None, None]
    pick = (lambda a: a) if offsets == tuple(range(-w, 1)) else (
        lambda a: a[:, [w + o for o in offsets]])                            # the stencil's slots
    out, _ = neighbour_attention(query_t[:, None], pick(keys)[:, None], pick(vals)[:, None],
                                 (pick(slots) & valid_t[:, None])[:, None], attn, bias=bias,
                                 negative_slope=negative_slope)
    new = WindowState(vals[:, 1:].astype(state.value.dtype),
                      None if shared else keys[:, 1:].astype(state.key.dtype), slots[:, 1:])
    return out[:, 0], new


def _causal_offsets(offsets, span: int) -> tuple[int, ...]:
    offsets = tuple(range(-span, 1)) if offsets is None else tuple(offsets)
    assert all(-span <= o <= 0 for o in offsets), (offsets, span)
    return offsets


def causal_window_kl(probs: Array, log_probs: Array, valid: Array, *, window: int,
                     kl_tau: float | None = None, kl_mode: str = "prior",
                     skip_offsets: tuple[int, ...] = ()) -> tuple[Array, Array]:
    """(kl_sum, kl_count) of the causal window graph from its token rows' statistics, as
    `window_graph_attention(..., causal=True)` forms them (options checked by the layer)."""
    if kl_mode == "neighbour":
        return neighbour_kl(probs, log_probs, valid)
    prior = distance_prior_logits(window_distances(window, True, skip_offsets=skip_offsets), 0,
                                  kl_tau)
    return attention_kl(probs, log_probs, valid, prior)


def causal_window_chunked(query: Array, key: Array, value: Array, attn: Array | None,
                          state: WindowState, *, chunk_size: int, mask: Array | None = None,
                          rel_bias: Array | None = None, negative_slope: float | None = None,
                          dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                          offsets: tuple[int, ...] | None = None,
                          segment_ids: Array | None = None
                          ) -> tuple[Array, dict[str, Array], WindowState]:
    """The causal window GAT in chunks of C tokens, in the form that suits the platform:
    `causal_window_chunked_scan` on the CPU, `causal_window_chunked_parallel` elsewhere (an
    accelerator runs a loop's control from the host, one chunk at a time). Both give the same
    numbers, dropout included.

    Args:
      query, key, value, attn, rel_bias, negative_slope, mask: as in `causal_window_scan`.
      state: `WindowState` of the tokens before these.
      chunk_size: C >= 1 (clipped to T; need not divide T).
      dropout_rate, dropout_rng: attention dropout (one key per chunk, `fold_in(rng, chunk)`).
      offsets: the stencil's slots (module docstring); None = -w..0.
      segment_ids: optional int `[B, T]` packed documents (module docstring).

    Returns:
      (out `[B, T, H, D]`, {'probs', 'log_probs' `[B, T, H, w+1]`, 'valid' `[B, T, w+1]`}, final
      state); the statistics let the caller form the KL term exactly as the parallel form does.
    """
    kw = dict(chunk_size=chunk_size, mask=mask, rel_bias=rel_bias, negative_slope=negative_slope,
              dropout_rate=dropout_rate, dropout_rng=dropout_rng, offsets=offsets,
              segment_ids=segment_ids)
    return jax.lax.platform_dependent(
        cpu=lambda: causal_window_chunked_scan(query, key, value, attn, state, **kw),
        default=lambda: causal_window_chunked_parallel(query, key, value, attn, state, **kw))


def _bool_mask(mask: Array | None, shape: tuple[int, ...]) -> Array:
    """`mask` as bool (all True when None); its shape was checked by the caller (the layer)."""
    if mask is None:
        return jnp.ones(shape, bool)
    assert jnp.shape(mask) == shape, (jnp.shape(mask), shape)
    return jnp.asarray(mask) != 0


def _chunked_inputs(query, key, value, state, chunk_size, mask, segment_ids):
    """Shared prologue of the chunked forms: clean inputs, document runs `[B, T]` (0 for the run
    that continues the incoming state), chunk count n and size c."""
    assert chunk_size >= 1 and query.ndim == 4
    b, t = query.shape[:2]
    mask = _bool_mask(mask, (b, t))
    run = jnp.zeros((b, t), jnp.int32)
    if segment_ids is not None:
        mask = mask & (jnp.asarray(segment_ids) > 0)
        run = jnp.cumsum(packing.starts(jnp.asarray(segment_ids)).astype(jnp.int32), axis=1)
    query, value = masking.zero_padding(query, mask), masking.zero_padding(value, mask)
    key = value if state.key is None else masking.zero_padding(key, mask)
    c = min(chunk_size, t)
    return query, key, value, mask, run, c, -(-t // c)


def _final_state(state: WindowState, key: Array, value: Array, mask: Array,
                 run: Array) -> WindowState:
    """The `WindowState` after these tokens: the last w of state ++ tokens, of the last document
    only (`run` `[B, T]`: 0 continues the state)."""
    w = state.value.shape[1]
    tail = lambda old, new: jnp.concatenate([old, new.astype(old.dtype)], 1)[:, -w:] if w else old
    last = run[:, -1:]
    return WindowState(tail(state.value, value),
                       None if state.key is None else tail(state.key, key),
                       tail(state.valid & (last == 0), mask & (run == last)))


def _same_run(run: Array, offsets, w: int) -> Array:
    """bool `[B, T, K]`: slot o of token t holds a token of t's document (the w state slots count
    as run 0, the document the tokens continue)."""
    ext = jnp.concatenate([jnp.zeros((run.shape[0], w), run.dtype), run], axis=1)
    return unfold(ext, offsets, -1)[:, w:] == run[:, :, None]


def causal_window_chunked_scan(query: Array, key: Array, value: Array, attn: Array | None,
                               state: WindowState, *, chunk_size: int,
                               mask: Array | None = None, rel_bias: Array | None = None,
                               negative_slope: float | None = None, dropout_rate: float = 0.0,
                               dropout_rng: Array | None = None,
                               offsets: tuple[int, ...] | None = None,
                               segment_ids: Array | None = None
                               ) -> tuple[Array, dict[str, Array], WindowState]:
    """`causal_window_chunked` as a `lax.scan` over chunks carrying the `WindowState` of the last
    w tokens; inside a chunk the parallel (unfold) form. The CPU form: it keeps one chunk's
    neighbour stack `[B, C, w+1, H, D]` live at a time."""
    query, key, value, mask, run, c, n = _chunked_inputs(query, key, value, state, chunk_size,
                                                         mask, segment_ids)
    b, t = query.shape[:2]
    w = state.value.shape[1]
    shared = state.key is None
    offsets = _causal_offsets(offsets, w)

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, n, c) + x.shape[2:]), 1, 0)

    def body(st, xs):
        q, k, v, m, r, before, i = xs
        r = r - before[:, None]              # 0: the document the carried state holds
        vals = jnp.concatenate([st.value.astype(v.dtype), v], axis=1)           # [B, w+C, H, D]
        keys = vals if shared else jnp.concatenate([st.key.astype(k.dtype), k], axis=1)
        slots = jnp.concatenate([st.valid, m], axis=1)                          # [B, w+C]
        kk = unfold(keys, offsets)[:, w:]
        vv = kk if shared else unfold(vals, offsets)[:, w:]
        valid = unfold(slots, offsets, False)[:, w:] & m[:, :, None] & _same_run(r, offsets, w)
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
        out, st_ = neighbour_attention(q, kk, vv, valid, attn, bias=rel_bias,
                                       negative_slope=negative_slope,
                                       dropout_rate=dropout_rate, dropout_rng=rng)
        new = _final_state(st, k, v, m, r)
        return new, (out, st_["probs"], st_["log_probs"], valid)

    # The run of the token before each chunk (0 before the first).
    before = jnp.concatenate([jnp.zeros((b, 1), run.dtype), run], axis=1)[:, 0:n * c:c]
    xs = (chunks(query), chunks(key), chunks(value), chunks(mask), chunks(run),
          jnp.moveaxis(before, 1, 0), jnp.arange(n))
    _, ys = jax.lax.scan(body, state, xs)
    out, probs, log_probs, valid = (
        jnp.moveaxis(y, 0, 1).reshape((b, n * c) + y.shape[3:])[:, :t] for y in ys)
    return (out, {"probs": probs, "log_probs": log_probs, "valid": valid},
            _final_state(state, key, value, mask, run))


def causal_window_chunked_parallel(query: Array, key: Array, value: Array, attn: Array | None,
                                   state: WindowState, *, chunk_size: int,
                                   mask: Array | None = None, rel_bias: Array | None = None,
                                   negative_slope: float | None = None, dropout_rate: float = 0.0,
                                   dropout_rng: Array | None = None,
                                   offsets: tuple[int, ...] | None = None,
                                   segment_ids: Array | None = None
                                   ) -> tuple[Array, dict[str, Array], WindowState]:
    """`causal_window_chunked` with every chunk at once, no loop: a window GAT's causal state is
    only the last w tokens, so the neighbour stack of all T tokens is one unfold of
    state ++ tokens `[B, w+T, ...]` -> `[B, T, w+1, ...]`, batched over heads. The chunks matter
    only to dropout, whose bits are drawn per chunk (vmapped `fold_in(rng, chunk)`) so that this
    form equals `causal_window_chunked_scan` exactly."""
    query, key, value, mask, run, c, n = _chunked_inputs(query, key, value, state, chunk_size,
                                                         mask, segment_ids)
    b, t = query.shape[:2]
    w = state.value.shape[1]
    shared = state.key is None
    offsets = _causal_offsets(offsets, w)
    vals = jnp.concatenate([state.value.astype(value.dtype), value], axis=1)     # [B, w+T, H, D]
    keys = vals if shared else jnp.concatenate([state.key.astype(key.dtype), key], axis=1)
    slots = jnp.concatenate([state.valid, mask], axis=1)                        # [B, w+T]
    kk = unfold(keys, offsets)[:, w:]                                           # [B, T, K, H, C]
    vv = kk if shared else unfold(vals, offsets)[:, w:]                         # [B, T, K, H, D]
    valid = unfold(slots, offsets, False)[:, w:] & mask[:, :, None] & _same_run(run, offsets, w)

    def attend(q, k_, v_, ok, rng):
        out, st = neighbour_attention(q, k_, v_, ok, attn, bias=rel_bias,
                                      negative_slope=negative_slope, dropout_rate=dropout_rate,
                                      dropout_rng=rng)
        return out, st["probs"], st["log_probs"]

    if dropout_rng is None or dropout_rate == 0.0:
        out, probs, log_probs = attend(query, kk, vv, valid, None)
    else:
        def chunks(x):   # [B, T, ...] -> [B, n, c, ...] (the last chunk zero-padded)
            x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
            return x.reshape((b, n, c) + x.shape[2:])

        rngs = jax.vmap(jax.random.fold_in, (None, 0))(dropout_rng, jnp.arange(n))
        ys = jax.vmap(attend, (1, 1, 1, 1, 0), 1)(
            chunks(query), chunks(kk), chunks(vv), chunks(valid), rngs)
        out, probs, log_probs = (y.reshape((b, n * c) + y.shape[3:])[:, :t] for y in ys)
    return (out, {"probs": probs, "log_probs": log_probs, "valid": valid},
            _final_state(state, key, value, mask, run))


def causal_window_scan(query: Array, key: Array, value: Array, attn: Array | None,
                       state: WindowState, *, mask: Array | None = None,
                       rel_bias: Array | None = None, negative_slope: float | None = None,
                       offsets: tuple[int, ...] | None = None,
                       segment_ids: Array | None = None) -> tuple[Array, WindowState]:
    """The causal window GAT as a `lax.scan` of `causal_window_step` over the tokens.

    Args:
      query, key, value: `[B, T, H, C]`, `[B, T, H, C]`, `[B, T, H, D]` (key unused when
        state.key is None).
      attn, rel_bias, negative_slope, offsets: as in `causal_window_step`.
      state: `WindowState` of the tokens before these (`init_window_state` for none).
      mask: optional `[B, T]` bool, True = real token.
      segment_ids: optional int `[B, T]` packed documents: the state empties at each document
        start (the first token continues `state`).

    Returns:
      out `[B, T, H, D]` (equal to `window_graph_attention(..., causal=True)` from an empty
      state) and the final state.
    """
    assert query.ndim == 4
    mask = _bool_mask(mask, query.shape[:2])
    start = jnp.zeros_like(mask)
    if segment_ids is not None:
        mask = mask & (jnp.asarray(segment_ids) > 0)
        start = packing.starts(jnp.asarray(segment_ids))

    def body(st, xs):
        q_t, k_t, v_t, m_t, s_t = xs
        out, st = causal_window_step(q_t, k_t, v_t, st, attn, valid_t=m_t, rel_bias=rel_bias,
                                     negative_slope=negative_slope, offsets=offsets, start_t=s_t)
        return st, out

    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (query, key, value, mask, start))
    final, out = jax.lax.scan(body, state, xs)
    return jnp.swapaxes(out, 0, 1), final
