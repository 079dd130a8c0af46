"""Longformer's sliding-window attention with global tokens (Beltagy, Peters, Cohan, "Longformer: The
Long-Document Transformer", 2020, arXiv 2004.05150, §3.1; /work/shared/specs/baselines.md
"Longformer").

Per head, softmax attention (logits q_i . k_j / sqrt(D)) over the keys query i may see:

* the sliding window of `window` = w tokens: non-causal, |i - j| <= w // 2 (w/2 on each side, the
  paper's "w/2 tokens on each side"; an odd w rounds down); causal, i - w < j <= i (the w previous
  tokens, itself included);
* the `num_global` = g global tokens, the first g positions (the paper's task-chosen tokens, e.g. the
  [CLS] token; here always a prefix): every token attends to them (causal: those at j <= i) and they
  attend to every token (causal: every earlier one, which the window and global columns already
  give). One set of query/key/value projections serves both kinds of attention; the paper has
  separate global projections (Q_g, K_g, V_g), which this layer does not (an option to add).

Dilation (§3.1's dilated windows) is not implemented.

Banded, never a T x T mask: the sequence is cut into blocks of C = max(w // 2, 1) tokens (causal:
C = w); each block's queries see the keys of the previous, own and next blocks (causal: previous
and own) plus the g global keys: `[B, H, n, C, 3C + g]` logits, O(T (w + g)). The g global rows are
one `[B, H, g, T]` product. A global key inside a query's window is counted once (its band slot is
masked).

Padding and NaN safety: padded keys get the logit -1e9 and padded values are zeroed (`jnp.where`);
a non-finite value at a valid position is replaced by 0 and exactly the rows that attend it are set
to NaN, so NaN or 1e30 in padding, or (causal) in the future, changes no valid or past output. Every
row's keys sit at fixed slots, so the future does not change their rounding either. Logits, weights
and outputs are float32.

Packed rows (`segment_ids` int `[B, T]`, 0 = padding; issue 42): each document is a sequence of its
own, its window stops at its edges and its global tokens are its own first g tokens (positions
restart per document; docs/baselines.md "Packed sequences"). `_packed` gathers each query's
document's global keys (`[B, T, g]`) and computes the non-causal global rows per (document, slot) by
segment reductions, so packing adds no T x T product; without `segment_ids` the program is unchanged.

`LongformerAttention` (below) follows the zoo's layer contract (README "Layer contract"):
non-causal and causal self-attention, no `scan` / `step` / decode form and no cross form.
"""
from __future__ import annotations

__all__ = ["LongformerAttention", "longformer_attention"]

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from zoo_core import checks
from zoo_core.baselines import ProjectedAttention
from zoo_core.ops import guard, masking, packing

Array = jax.Array
DropoutFn = Optional[Callable[[Array, int], Array]]   # (weights, index) -> weights

MASKED = -1e9   # logit of a key a query may not see (finite: an all-masked padded row stays finite)


def _pad_value(x: Array) -> Array:
    """What fills slots outside the sequence: -1 for positions / buckets (no real one), else 0."""
    return jnp.asarray(-1 if jnp.issubdtype(x.dtype, jnp.integer) else 0, x.dtype)


def _blocks(x: Array, n: int, c: int) -> Array:
    """`[B, H, T, *f]` padded at the end to n * C along T and split: `[B, H, n, C, *f]`."""
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, n * c - x.shape[2])
    x = jnp.pad(x, pad, constant_values=_pad_value(x))
    return x.reshape(x.shape[:2] + (n, c) + x.shape[3:])


def _neighbours(x: Array, causal: bool) -> Array:
    """`[B, H, n, C, *f]` -> each block with its neighbours along C: [previous, own, next] `3C`
    (causal: [previous, own] `2C`); outside the sequence 0 / -1 / False."""
    fill = jnp.full_like(x[:, :, :1], _pad_value(x))
    parts = [jnp.concatenate([fill, x[:, :, :-1]], axis=2), x]
    if not causal:
        parts.append(jnp.concatenate([x[:, :, 1:], fill], axis=2))
    return jnp.concatenate(parts, axis=3)


def _softmax_rows(logits, allowed, bad, v, dropout, index):
    """Masked softmax of `[..., K]` logits against values `[..., K, M]`; rows that attend a
    non-finite value (`bad`) are NaN. Returns `[..., M]` float32."""
    w = jax.nn.softmax(jnp.where(allowed, logits, MASKED), axis=-1)
    if dropout is not None:
        w = dropout(w, index)
    o = jnp.einsum("...qk,...km->...qm", w, v)
    return jnp.where(jnp.any(allowed & bad, axis=-1)[..., None], jnp.nan, o)


def longformer_attention(q: Array, k: Array, v: Array, *, window: int, num_global: int = 0,
                         mask: Optional[Array] = None, causal: bool = False,
                         dropout: DropoutFn = None, segment_ids: Optional[Array] = None) -> Array:
    """Sliding-window plus global softmax attention (the module docstring), banded.

    Args:
        q, k: `[B, T, H, D]`.
        v: `[B, T, H, M]`.
        window: w >= 1 (non-causal: w // 2 on each side; causal: the w tokens up to and including i).
        num_global: g >= 0, the first g positions are global (g > T counts as T).
        mask: `[B, T]` bool key-padding mask (True = valid), or None.
        causal: token i attends to j <= i only.
        dropout: optional `(weights, index) -> weights`: index 0 on the band weights
            `[B, H, n, C, K + g]`, index 1 on the global rows `[B, H, g, T]` (packed: `[B, T, H, g]`,
            each key's weight in the rows of its document's global tokens).
        segment_ids: optional int `[B, T]` packed documents (0 = padding; `_packed` below): the window
            and the global tokens per document; a padding row is 0.

    Returns:
        `[B, T, H, M]` float32.
    """
    b, t, h, d = q.shape
    assert k.shape == q.shape and v.shape[:3] == (b, t, h), (q.shape, k.shape, v.shape)
    assert window >= 1 and num_global >= 0, (window, num_global)
    if segment_ids is not None:
        return _packed(q, k, v, segment_ids, window=window, num_global=num_global, mask=mask, causal=causal,
                       dropout=dropout)
    g = min(num_global, t)
    dt = jnp.promote_types(jnp.result_type(q, k, v), jnp.float32)
    valid = masking.as_bool(mask, (b, t))
    keep = valid[:, :, None, None]
    q, k, v = (jnp.where(keep, x.astype(dt), 0.0) for x in (q, k, v))
    bad = valid[:, :, None] & ~jnp.all(jnp.isfinite(v), axis=-1)                         # [B, T, H]
    v = jnp.where(bad[..., None], 0.0, v)
    q, k, v, bad = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, bad))                     # [B, H, T, ...]
    valid_h = jnp.broadcast_to(valid[:, None], (b, h, t))
    scale = 1.0 / math.sqrt(d)

    c = max(window if causal else window // 2, 1)
    c = min(c, t)
    n = -(-t // c)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, h, t))
    qb, pq = _blocks(q, n, c), _blocks(pos, n, c)
    kb, vb = _neighbours(_blocks(k, n, c), causal), _neighbours(_blocks(v, n, c), causal)
    pk = _neighbours(pq, causal)
    valid_k = _neighbours(_blocks(valid_h, n, c), causal)
    bad_k = _neighbours(_blocks(bad, n, c), causal)
    logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb) * scale                        # [B, H, n, C, K]
    gap = pq[..., :, None] - pk[..., None, :]
    near = (gap >= 0) & (gap < window) if causal else jnp.abs(gap) <= window // 2
    allowed = valid_k[..., None, :] & near & (pk[..., None, :] >= g)
    bad_k = jnp.broadcast_to(bad_k[..., None, :], allowed.shape)
    if g:
        # The global keys as g extra columns of every block.
        glogits = jnp.einsum("bhnqd,bhkd->bhnqk", qb, k[:, :, :g]) * scale           # [B, H, n, C, g]
        gallowed = jnp.broadcast_to(valid_h[:, :, None, None, :g], glogits.shape)
        if causal:
            gallowed = gallowed & (jnp.arange(g)[None, :] <= pq[..., :, None])
        logits = jnp.concatenate([logits, glogits], axis=-1)
        allowed = jnp.concatenate([allowed, gallowed], axis=-1)
        bad_k = jnp.concatenate([bad_k, jnp.broadcast_to(bad[:, :, None, None, :g], glogits.shape)],
                                axis=-1)
        vb = jnp.concatenate([vb, jnp.broadcast_to(v[:, :, None, :g], vb.shape[:3] + (g,) + vb.shape[4:])],
                             axis=3)
    o = _softmax_rows(logits, allowed, bad_k, vb, dropout, 0)
    o = o.reshape((b, h, n * c) + o.shape[4:])[:, :, :t]                              # [B, H, T, M]
    if g and not causal:
        # The global rows attend to every valid token (causal: the band already gives them that).
        rows = jnp.einsum("bhqd,bhkd->bhqk", q[:, :, :g], k) * scale                    # [B, H, g, T]
        allowed_g = jnp.broadcast_to(valid_h[:, :, None, :], rows.shape)
        bad_g = jnp.broadcast_to(bad[:, :, None, :], rows.shape)
        o = o.at[:, :, :g].set(_softmax_rows(rows, allowed_g, bad_g, v, dropout, 1))
    return jnp.swapaxes(o, 1, 2)


def _packed(q, k, v, segment_ids, *, window, num_global, mask, causal, dropout):
    """`longformer_attention` over packed documents (docs/baselines.md, "Longformer, packed").

    Each document is a sequence of its own: its global tokens are its own first g tokens (positions
    restart at each document), its window stops at its edges. So every valid query sees (a) the keys of
    its document within the window, minus the document's global tokens, and (b) its document's global
    tokens (causal: those before it), gathered per query (`[B, T, g]` keys, O(T g D)); non-causal, a
    document's global tokens attend to every token of their document: a softmax per (document, global
    slot) by segment sums over the row's documents (O(T g M), no T x T product).
    """
    b, t, h, d = q.shape
    g = min(num_global, t)
    dt = jnp.promote_types(jnp.result_type(q, k, v), jnp.float32)
    valid = packing.valid(segment_ids, mask)                                          # [B, T]
    q, k, v = (masking.zero_padding(x.astype(dt), valid) for x in (q, k, v))
    bad = guard.nonfinite(v, valid=valid)                                             # [B, T, H]
    v = guard.clean(v, bad)
    pos = jnp.arange(t, dtype=jnp.int32)
    start = packing.starts(segment_ids).at[:, 0].set(True)
    doc_start = jax.lax.cummax(jnp.where(start, pos, 0), axis=1)                     # [B, T]
    doc_pos = pos - doc_start                                                         # restarts per document
    scale = 1.0 / math.sqrt(d)
    heads = lambda x: jnp.broadcast_to(x[:, None], (b, h) + x.shape[1:])             # [B, T] -> [B, H, T]

    # (a) the band, as the unpacked form, within the query's document and without its global tokens.
    c = min(max(window if causal else window // 2, 1), t)
    n = -(-t // c)
    qh, kh, vh, bad_h = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, bad))              # [B, H, T, ...]
    pq, iq = _blocks(heads(jnp.broadcast_to(pos, (b, t))), n, c), _blocks(heads(segment_ids), n, c)
    pk, ik = _neighbours(pq, causal), _neighbours(iq, causal)
    global_k = _neighbours(_blocks(heads(doc_pos), n, c), causal)
    valid_k = _neighbours(_blocks(heads(valid), n, c), causal)
    kb, vb = _neighbours(_blocks(kh, n, c), causal), _neighbours(_blocks(vh, n, c), causal)
    logits = jnp.einsum("bhnqd,bhnkd->bhnqk", _blocks(qh, n, c), kb) * scale         # [B, H, n, C, K]
    gap = pq[..., :, None] - pk[..., None, :]
    near = (gap >= 0) & (gap < window) if causal else jnp.abs(gap) <= window // 2
    allowed = (valid_k[..., None, :] & near & (iq[..., :, None] == ik[..., None, :])
               & (global_k[..., None, :] >= g))
    bad_k = jnp.broadcast_to(_neighbours(_blocks(bad_h, n, c), causal)[..., None, :], allowed.shape)

    # (b) the query's document's global tokens: key index doc_start + j, j < g, gathered per query.
    gi = doc_start[:, :, None] + jnp.arange(g)[None, None]                            # [B, T, g]
    gi_c = jnp.minimum(gi, t - 1)
    take = lambda x: jnp.take_along_axis(x, gi_c.reshape(b, t * g)[..., None, None], axis=1).reshape(
        (b, t, g) + x.shape[2:])
    kg, vg = take(k), take(v)                                                         # [B, T, g, H, .]
    gallowed = ((gi < t) & (jnp.take_along_axis(segment_ids, gi_c.reshape(b, -1), 1).reshape(b, t, g)
                            == segment_ids[..., None])
                & jnp.take_along_axis(valid, gi_c.reshape(b, -1), 1).reshape(b, t, g))
    if causal:
        gallowed = gallowed & (gi <= pos[None, :, None])
    gbad = take(bad[..., None])[..., 0]                                               # [B, T, g, H]
    glogits = jnp.einsum("bthd,btjhd->bhtj", q, kg) * scale                          # [B, H, T, g]
    gallowed = jnp.broadcast_to(gallowed[:, None], glogits.shape)
    to_blocks = lambda x: _blocks(x, n, c)                                            # [B, H, n, C, g]
    gbad = to_blocks(jnp.moveaxis(gbad, 3, 1))
    w = jax.nn.softmax(jnp.where(jnp.concatenate([allowed, to_blocks(gallowed)], -1),
                                 jnp.concatenate([logits, to_blocks(glogits)], -1), MASKED), axis=-1)
    if dropout is not None:
        w = dropout(w, 0)
    vg_b = to_blocks(jnp.moveaxis(vg, 3, 1))                                          # [B, H, n, C, g, M]
    o = (jnp.einsum("bhnqk,bhnkm->bhnqm", w[..., :-g or None], vb)
         + jnp.einsum("bhnqj,bhnqjm->bhnqm", w[..., w.shape[-1] - g:], vg_b))
    hit = jnp.any(allowed & bad_k, axis=-1) | jnp.any(to_blocks(gallowed) & gbad, axis=-1)
    o = jnp.where(hit[..., None], jnp.nan, o)
    o = jnp.swapaxes(o.reshape((b, h, n * c) + o.shape[4:])[:, :, :t], 1, 2)         # [B, T, H, M]
    o = masking.zero_padding(o, valid)
    if g and not causal:
        o = jnp.where(((doc_pos < g) & valid)[..., None, None],
                      _global_rows(q, k, v, bad, valid, doc_start, doc_pos, start, g, scale, dropout), o)
    return o


def _global_rows(q, k, v, bad, valid, doc_start, doc_pos, start, g, scale, dropout):
    """Non-causal packed: the rows of each document's global tokens, each over its whole document:
    `[B, T, H, M]` (meaningful where doc_pos < g). Key s and global slot j meet in the row of token
    doc_start(s) + j; the softmax over s is per (row, document, j), by segment reductions."""
    b, t, h, _ = q.shape
    gi = doc_start[:, :, None] + jnp.arange(g)[None, None]                            # [B, T, g]
    gi_c = jnp.minimum(gi, t - 1)
    same = (gi < t) & (jnp.take_along_axis(doc_start, gi_c.reshape(b, -1), 1).reshape(b, t, g)
                       == doc_start[..., None])
    qg = jnp.take_along_axis(q, gi_c.reshape(b, t * g)[..., None, None], axis=1).reshape((b, t, g) + q.shape[2:])
    logits = jnp.einsum("btjhd,bthd->bthj", qg, k) * scale                           # [B, T, H, g]
    allowed = (same & valid[..., None])[:, :, None, :]                                # [B, T, 1, g]
    logits = jnp.where(allowed, logits, MASKED)
    doc = (jnp.cumsum(start.astype(jnp.int32), axis=1) - 1 + t * jnp.arange(b)[:, None]).reshape(-1)
    seg = lambda f, x: f(x.reshape((b * t,) + x.shape[2:]), doc, num_segments=b * t)
    top = seg(jax.ops.segment_max, logits)                                           # [B T, H, g]
    w = jnp.where(allowed, jnp.exp(logits - top[doc].reshape(logits.shape)), 0.0)
    total = seg(jax.ops.segment_sum, w)
    w = w / jnp.where(total > 0, total, 1.0)[doc].reshape(w.shape)
    if dropout is not None:
        w = dropout(w, 1)
    num = seg(jax.ops.segment_sum, jnp.einsum("bthj,bthm->bthjm", w, v))             # [B T, H, g, M]
    hit = seg(jax.ops.segment_max, (allowed & bad[..., None]).astype(jnp.int32)) > 0  # [B T, H, g]
    num = jnp.where(hit[..., None], jnp.nan, num)
    slot = jnp.minimum(doc_pos, g - 1).reshape(-1)
    rows = num[doc, :, slot]                                                          # [B T, H, M]
    return rows.reshape((b, t) + rows.shape[1:])


class LongformerAttention(ProjectedAttention):
    """Longformer self-attention: sliding window plus global tokens (module docstring), the zoo's
    layer contract.

    Parameters have `SoftmaxAttention`'s names and shapes, so a softmax parameter tree applies as it
    is: `query`, `key`, `value` kernel `[E, H, D]`, bias `[H, D]`; `out` kernel `[H, D, E']`, bias
    `[E']`. One set of projections serves the window and the global attention (the paper has a
    second set for the global one).

    Shapes: x `[B, T, E]` -> y `[B, T, E']`. `__call__` only: no `scan` / `step` / decode form.

    Attributes:
        num_heads: H.
        head_dim: D.
        out_features: E' (default: the input width E).
        causal: token i attends to the `window` tokens up to and including i (and the global ones
            before it).
        window: w >= 1: non-causal, w // 2 tokens on each side; causal, the w tokens ending at i.
        num_global: g >= 0: the first g tokens attend to all and all attend to them (e.g. 1 for a
            [CLS] token).
        dropout_rate, dtype, param_dtype, kernel_init, bias_init, out_bias_init: as
            `ProjectedAttention` (`zoo_core.baselines`); the attention maths is float32.
    """
    causal: bool = False
    window: int = 64
    num_global: int = 1

    def setup(self):
        self._check_common()
        checks.check_int("window", self.window, 1)
        checks.check_int("num_global", self.num_global, 0)
        self.query, self.key = self._projection("query"), self._projection("key")
        self.value = self._projection("value")

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x `[B, T, E]`, mask `[B, T]` bool key-padding mask (True = valid), segment_ids int `[B, T]`
        packed documents (0 = padding; the window and the global tokens per document) -> (y `[B, T, E']`, {}).

        `deterministic=False` with `dropout_rate` > 0 drops attention weights (the 'dropout' rng).
        """
        self._check_inputs(x, mask)
        packing.check_segment_ids(segment_ids, x.shape[:2])
        o = longformer_attention(self.query(x), self.key(x), self.value(x), window=self.window,
                                 num_global=self.num_global, mask=mask, causal=self.causal,
                                 dropout=self._indexed_dropout(deterministic), segment_ids=segment_ids)
        return self._finish(o, x), {}
