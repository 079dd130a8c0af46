"""Window graph attention on packed documents, on one device or on one shard of a sequence axis.

Packing (docs/htgn_packing.md, /work/shared/specs/context_parallel.md §2): `segment_ids` int `[B, L]`
marks the documents of a row, contiguous runs of one id (0 = padding). Each document is laid out as
in an unpacked row, `[its g global nodes ; its tokens]`: its first `num_global` nodes are its
globals. An edge exists only inside one document:

  * token i -> tokens i + o (o a stencil offset) of its own document, never its globals' slots, and
    -> its own document's g globals (slot k = node docstart + k);
  * global k of a document -> every node of that document (no bias).

A 2-D grid (`grid_width` W) counts columns from each document's first token. So a packed row gives,
on every document, the numbers that document gives alone (`window_graph_attention` on its slice).

Context parallelism (`axis_name`, htgn.md §3.4 under `jax.shard_map`, context_parallel.md §3): this
function is also the body of one shard holding nodes [p n, (p+1) n) of the row. A token's stencil
reaches at most `span` nodes away, so each shard receives that many boundary nodes of each neighbour
by `ppermute` (left only when causal): the halo. A document may span shards; what its nodes need
from other shards is small and independent of the length:
  * where its document starts and its index among the row's documents: one `all_gather` of two
    ints per row and shard;
  * its global nodes' features when they live on another shard: each shard publishes the global
    slots of its first and last document (`all_gather`, `[P, 2, B, g, H, C]`);
  * a global node's softmax over its document: each shard's partial statistics (max, sum, weighted
    sum) of its first and last document, combined like log-sum-exp (`all_gather`).
The KL sums end in one `psum`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from htgn_jax.graph_kl import neighbour_kl
from htgn_jax.graph_stencil import KERNEL_FLOOR, NEGATIVE_SLOPE, gather_rows, neighbour_attention, unfold
from zoo_core.ops import halo, masking

Array = jax.Array


class _Docs:
    """Where each node of this shard sits in its document (global node coordinates).

    Attributes (all `[B, n]`): real (segment id > 0 and mask), run (run index over the halo-extended
    nodes, equal iff same document), start (node begins a document), docstart (position of its
    document's first node), doc (the document's index in the row), r (position within the document).
    """

    def __init__(self, ids_ext, real_ext, left: int, n: int, pos0, axis_name):
        change = jnp.concatenate([jnp.zeros_like(ids_ext[:, :1], bool),
                                  ids_ext[:, 1:] != ids_ext[:, :-1]], axis=1)
        self.run_ext = jnp.cumsum(change.astype(jnp.int32), axis=1)
        self.real_ext = real_ext
        local = slice(left, left + n)
        self.real, self.run = real_ext[:, local], self.run_ext[:, local]
        pos = pos0 + jnp.arange(n)
        # Node 0 of the row starts a document when real (the left halo there is padding, id 0).
        self.start = change[:, local] | (pos[None] == 0)
        last_start = jnp.max(jnp.where(self.start, pos, -1), axis=1)             # [B]
        self.docstart = jnp.maximum(jax.lax.cummax(jnp.where(self.start, pos, -1), axis=1),
                                    halo.earlier(last_start, axis_name, jnp.max, -1)[:, None])
        count = jnp.sum(self.start, axis=1, dtype=jnp.int32)
        self.doc = (halo.earlier(count, axis_name, jnp.sum, 0)[:, None]
                    + jnp.cumsum(self.start.astype(jnp.int32), axis=1))
        self.r = pos - self.docstart
        self.pos0, self.n = pos0, n


def _slots(docs: _Docs, docstart: Array, run: Array, xs: Sequence[Array], g: int):
    """The g global nodes (positions docstart + k) of one document per row, where on this shard.

    Args: docstart, run `[B]` of the document; xs: node arrays `[B, n, ...]`.
    Returns: ([x `[B, g, ...]`], here `[B, g]`: slot k is a real node of the document on this shard).
    """
    li = docstart[:, None] + jnp.arange(g)[None] - docs.pos0                       # [B, g]
    idx = jnp.clip(li, 0, docs.n - 1)
    take = lambda x: jax.vmap(lambda xb, ib: xb[ib])(x, idx)
    here = (li >= 0) & (li < docs.n) & take(docs.real) & (take(docs.run) == run[:, None])
    return [masking.zero_padding(take(x), here) for x in xs], here


def _global_slots(docs: _Docs, xs: Sequence[Array], g: int, axis_name):
    """Per node `[B, n, g, ...]`: the features of its document's g global nodes, and `[B, n, g]`
    whether each is a real node of the document. Local ones are gathered; on a shard, those of the
    first and last document, which may live elsewhere, come from the other shards' published slots."""
    li = docs.docstart[..., None] + jnp.arange(g) - docs.pos0                      # [B, n, g]
    idx = jnp.clip(li, 0, docs.n - 1)
    run_at = gather_rows(docs.run, idx)
    here = (li >= 0) & (li < docs.n) & gather_rows(docs.real, idx) & (run_at == docs.run[..., None])
    feats = [gather_rows(x, idx) for x in xs]
    if axis_name is None:
        return [masking.zero_padding(f, here) for f in feats], here
    ends = [(docs.docstart[:, i], docs.run[:, i], docs.doc[:, i]) for i in (0, -1)]
    published = [_slots(docs, ds, run, xs, g) for ds, run, _ in ends]
    # The last document is published only when it is not also the first (each slot once).
    single = docs.doc[:, 0] == docs.doc[:, -1]
    keys = jnp.stack([ends[0][2], jnp.where(single, -1, ends[1][2])])             # [2, B]
    here_pub = jnp.stack([published[0][1], published[1][1] & ~single[:, None]])   # [2, B, g]
    gather = lambda x: jax.lax.all_gather(x, axis_name)                          # [P, 2, B, ...]
    tab_keys, tab_here = gather(keys), gather(here_pub)
    first = (docs.doc == ends[0][2][:, None])[..., None]                          # [B, n, 1]
    last = (docs.doc == ends[1][2][:, None])[..., None]
    matches = [(tab_keys == doc[None, None])[..., None] & tab_here for _, _, doc in ends]
    found = [jnp.any(m, axis=(0, 1))[:, None] for m in matches]                   # [B, 1, g]
    out = []
    for j, f in enumerate(feats):
        tab = gather(jnp.stack([published[0][0][j], published[1][0][j]]))         # [P, 2, B, g, ...]
        look = [jnp.sum(jnp.where(masking.expand(m, tab.ndim), tab, 0), axis=(0, 1))[:, None]
                for m in matches]                                                 # [B, 1, g, ...]
        remote = jnp.where(masking.expand(first, f.ndim), look[0], look[1])
        out.append(jnp.where(masking.expand(here, f.ndim), f, remote))
    ok = here | (first & found[0]) | (last & found[1])
    return [masking.zero_padding(f, ok) for f in out], ok & docs.real[..., None]


def _pair_logits(q: Array, k: Array, attn, negative_slope, acc) -> Array:
    """Scores of the pairs q, k `[..., H, C]` (same shape) -> `[..., H]`, as `neighbour_attention`."""
    if isinstance(attn, str):
        return jnp.log(jnp.maximum(jnp.einsum("...c,...c->...", q, k, preferred_element_type=acc),
                                   KERNEL_FLOOR))
    if attn is None:
        return jnp.einsum("...c,...c->...", q, k, preferred_element_type=acc) * (q.shape[-1] ** -0.5)
    slope = NEGATIVE_SLOPE if negative_slope is None else negative_slope
    pre = jax.nn.leaky_relu(q + k, slope)
    return jnp.einsum("...hc,hc->...h", pre, attn.astype(pre.dtype), preferred_element_type=acc)


def _combine_stats(stats, docs: _Docs, axis_name):
    """Complete the partial softmax statistics of this shard's first and last document with those
    of the other shards (log-sum-exp style); stats: (m, s, u, o, cnt) `[B, R, ...]` per local run."""
    m, s, u, o, cnt = stats
    last = docs.run[:, -1] - docs.run[:, 0]
    single = docs.doc[:, 0] == docs.doc[:, -1]
    keys = jnp.stack([docs.doc[:, 0], jnp.where(single, -1, docs.doc[:, -1])])    # [2, B]
    at = lambda x, i: jax.vmap(lambda xb, ib: xb[ib])(x, i)
    ends = [jnp.zeros_like(last), last]
    pub = [jnp.stack([at(x, e) for e in ends]) for x in stats]                   # [2, B, ...]
    pub[0] = jnp.where(pub[1] > 0, pub[0], -jnp.inf)      # a run with no valid node sets no max
    tab = [jax.lax.all_gather(x, axis_name) for x in pub]                        # [P, 2, B, ...]
    tab_keys = jax.lax.all_gather(keys, axis_name)
    out = [x for x in stats]
    for i, e in enumerate(ends):
        doc = docs.doc[:, 0] if i == 0 else docs.doc[:, -1]
        match = tab_keys == doc[None, None]                                      # [P, 2, B]
        tm = tab[0]
        mm = masking.expand(match, tm.ndim)
        big = jnp.max(jnp.where(mm, tm, -jnp.inf), axis=(0, 1))
        big = jax.lax.stop_gradient(jnp.where(jnp.isfinite(big), big, 0.0))
        mm = mm & jnp.isfinite(tm)
        shift = jnp.where(mm, tm - big, 0.0)
        scale = jnp.where(mm, jnp.exp(shift), 0.0)
        total_s = jnp.sum(scale * tab[1], axis=(0, 1))
        total_u = jnp.sum(scale * (tab[2] + tab[1] * shift), axis=(0, 1))
        total_o = jnp.sum(scale[..., None] * tab[3], axis=(0, 1))
        total_c = jnp.sum(jnp.where(masking.expand(match, tm.ndim), tab[4], 0.0), axis=(0, 1))
        for j, v in enumerate((big, total_s, total_u, total_o, total_c)):
            out[j] = jax.vmap(lambda xb, ib, vb: xb.at[ib].set(vb))(out[j], e, v)
    return out


def _global_rows(query, key, value, docs: _Docs, attn, negative_slope, dropout_rate, dropout_rng,
                 g: int, axis_name):
    """Global nodes' attention over their whole document, O(B n g H C): per node j the scores of
    its document's g global queries against key_j, then a softmax per (document, slot) by segment
    sums over the shard's runs (completed across shards by `_combine_stats`).

    Returns out `[B, n, H, D]` (at global nodes), kl_sum, kl_count (uniform prior, htgn.md §5.7)."""
    b, n, heads = query.shape[:3]
    (gq,), ok = _global_slots(docs, [query], g, axis_name)                       # [B, n, g, H, C]
    acc = jnp.promote_types(jnp.result_type(query, key), jnp.float32)
    logits = _pair_logits(gq, jnp.broadcast_to(key[:, :, None], gq.shape[:3] + key.shape[2:]),
                          attn, negative_slope, acc)                             # [B, n, g, H]
    valid = (ok & docs.real[..., None])[..., None]                                # [B, n, g, 1]
    run = docs.run - docs.run[:, :1]                                              # 0 .. n-1
    seg = (jnp.arange(b)[:, None] * n + run).reshape(-1)
    flat = lambda x: x.reshape((b * n,) + x.shape[2:])
    unflat = lambda x: x.reshape((b, n) + x.shape[1:])
    m = unflat(jax.ops.segment_max(flat(jnp.where(valid, logits, -jnp.inf)), seg, b * n))
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))                 # [B, R, g, H]
    z = jnp.where(valid, logits - gather_rows(m, run[..., None])[:, :, 0], 0.0)
    e = jnp.where(valid, jnp.exp(z), 0.0)
    weights = e
    if dropout_rng is not None and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, e.shape)
        weights = jnp.where(keep, e / (1.0 - dropout_rate), 0.0)
    segsum = lambda x: unflat(jax.ops.segment_sum(flat(x), seg, b * n))
    vals = value.astype(acc)[:, :, None]                                          # [B, n, 1, H, D]
    stats = [m, segsum(e), segsum(e * z), segsum(weights[..., None] * vals),
             segsum(jnp.broadcast_to(valid, e.shape).astype(acc))]
    if axis_name is not None:
        stats = _combine_stats(stats, docs, axis_name)
    m, s, u, o, cnt = stats
    # Node j that is global slot k = r_j of its document reads row (its run, k).
    is_glob = docs.real & (docs.r < g)
    slot = jnp.clip(docs.r, 0, g - 1)
    pick = lambda x: jnp.take_along_axis(
        gather_rows(x, run[..., None])[:, :, 0], slot.reshape((b, n, 1) + (1,) * (x.ndim - 3)),
        axis=2)[:, :, 0]
    s_j, u_j, o_j, c_j = pick(s), pick(u), pick(o), pick(cnt)                     # [B, n, H(, D)]
    s_safe = jnp.where(s_j > 0, s_j, 1.0)
    out = jnp.where(masking.expand(is_glob, o_j.ndim), o_j / s_safe[..., None], 0.0)
    kl = u_j / s_safe - jnp.log(s_safe) + jnp.log(jnp.maximum(c_j, 1.0))
    has = is_glob[..., None] & (c_j > 0)
    kl_sum = jnp.sum(jnp.where(has, kl, 0.0))
    return out.astype(value.dtype), kl_sum, jnp.sum(has).astype(jnp.float32)


def packed_window_attention(query: Array, key: Array, value: Array, attn: Any, *,
                            offsets: tuple[int, ...], num_global: int, segment_ids: Array,
                            mask: Optional[Array], bias: Optional[Array],
                            negative_slope: Optional[float], dropout_rate: float,
                            dropout_rng: Optional[Array], prior_logits: Optional[Array],
                            kl_mode: str, grid_dc: Optional[np.ndarray] = None,
                            grid_width: Optional[int] = None, axis_name: Optional[str] = None,
                            num_shards: int = 1) -> tuple[Array, dict[str, Array]]:
    """The window graph of `window_graph_attention` over packed documents (module docstring).

    Args:
      query, key, value: `[B, n, H, C]`, `[B, n, H, C]`, `[B, n, H, D]` (this shard's nodes).
      attn: `[H, C]`, None (dot product) or `KERNEL`.
      offsets: the stencil (`window_offsets`), K of them.
      num_global: g, the global nodes at the front of each document.
      segment_ids: int `[B, n]`, 0 = padding.
      mask: `[B, n]` bool or None.
      bias: `[H, K + g]` logit bias row (`bias_row`) or None.
      negative_slope, dropout_rate, dropout_rng, prior_logits: as in `neighbour_attention`.
      kl_mode: 'prior' or 'neighbour'.
      grid_dc: `[K]` column step of each slot on a grid (with `grid_width`), or None.
      axis_name, num_shards: the sequence axis this runs on (inside `jax.shard_map`), or None.

    Returns:
      out `[B, n, H, D]` (0 at padding), {'probs' `[B, n, H, K + g]` (token rows), 'kl_sum',
      'kl_count'} (summed over the shards).
    """
    b, n, heads = query.shape[:3]
    g = num_global
    shared = value is key
    real = packing_valid(segment_ids, mask)
    query, key = masking.zero_padding(query, real), masking.zero_padding(key, real)
    value = key if shared else masking.zero_padding(value, real)
    left, right = max(0, -min(offsets)) + 1, max(0, max(offsets))
    pos0 = 0 if axis_name is None else jax.lax.axis_index(axis_name) * n
    ext = lambda x: halo.extend(x, left, right, axis_name, num_shards)
    docs = _Docs(ext(segment_ids), ext(real), left, n, pos0, axis_name)
    rng_tok = rng_glb = dropout_rng
    if dropout_rng is not None:
        if axis_name is not None:
            dropout_rng = jax.random.fold_in(dropout_rng, jax.lax.axis_index(axis_name))
        rng_tok, rng_glb = jax.random.split(dropout_rng)

    # Token rows: the stencil over the halo-extended nodes, inside the token's document only.
    cut = lambda x: x[:, left:left + n]
    k_ext = ext(key)
    keys = cut(unfold(k_ext, offsets))                                            # [B, n, K, H, C]
    vals = keys if shared else cut(unfold(ext(value), offsets))
    tok = docs.real & (docs.r >= g)
    o = jnp.asarray(offsets)
    valid = (tok[..., None] & cut(unfold(docs.real_ext, offsets, False))
             & (cut(unfold(docs.run_ext, offsets, -1)) == docs.run[..., None])
             & (docs.r[..., None] + o >= g))                                     # [B, n, K]
    if grid_dc is not None:
        col = ((docs.r - g) % grid_width)[..., None] + jnp.asarray(grid_dc)
        valid = valid & (col >= 0) & (col < grid_width)
    if g:
        (gk, gv), gok = _global_slots(docs, [key, value], g, axis_name)
        keys = jnp.concatenate([keys, gk], axis=2)
        vals = keys if shared else jnp.concatenate([vals, gv], axis=2)
        valid = jnp.concatenate([valid, gok & tok[..., None]], axis=2)
    out, st = neighbour_attention(query, keys, vals, valid, attn, bias=bias,
                                  negative_slope=negative_slope, dropout_rate=dropout_rate,
                                  dropout_rng=rng_tok, prior_logits=prior_logits)
    kl_sum, kl_count = st["kl_sum"], st["kl_count"]
    if kl_mode == "neighbour":
        kl_sum, kl_count = _neighbour_kl(st, valid, tok, docs, left, g, axis_name, num_shards)
    if g:
        out_g, kl_g, count_g = _global_rows(query, key, value, docs, attn, negative_slope,
                                            dropout_rate, rng_glb, g, axis_name)
        out = jnp.where(masking.expand(tok, out.ndim), out, out_g)
        if kl_mode == "prior":
            kl_sum, kl_count = kl_sum + kl_g, kl_count + count_g
    if axis_name is not None:
        kl_sum, kl_count = jax.lax.psum((kl_sum, kl_count), axis_name)
    return out, {"probs": st["probs"], "kl_sum": kl_sum, "kl_count": kl_count}


def _neighbour_kl(st, valid, tok, docs: _Docs, left: int, g: int, axis_name, num_shards):
    """`neighbour_kl` over consecutive token rows of one document, across the shard boundary too
    (the left neighbour's last row arrives by `ppermute`)."""
    prev = lambda x: halo.shift_in(x, 1, True, axis_name, num_shards)
    rows = lambda x: jnp.concatenate([prev(x), x], axis=1)
    # The node before each token row is a token row of the same document.
    before_run = docs.run_ext[:, left - 1:left - 1 + docs.n]
    pair_ok = tok & (before_run == docs.run) & (docs.r - 1 >= g)
    return neighbour_kl(rows(st["probs"]), rows(st["log_probs"]), rows(valid), pair_ok)


def packing_valid(segment_ids: Array, mask: Optional[Array]) -> Array:
    """bool `[B, n]`: a real node (segment id > 0 and mask)."""
    real = jnp.asarray(segment_ids) > 0
    return real if mask is None else real & (jnp.asarray(mask) != 0)


def cross_neighbours(segment_ids: Array, kv_segment_ids: Array, mask: Array, memory_mask: Array,
                     positions: Optional[Array], rho: float, offsets: tuple[int, ...],
                     num_global: int) -> tuple[Array, Array, Array]:
    """Packed Cross-Graph neighbourhoods (htgn.md §5.5 per document, docs/htgn_packing.md).

    A query of document d (id `segment_ids`) at position i within d reads the memory document with
    the same id (`kv_segment_ids`, laid out `[g globals ; tokens]`, first run of that id): the tokens
    c_i + o, c_i = clip(round(rho i), 0, N_d - 1) with N_d that document's real tokens, and its g
    globals. Cost O(B (T + L) log L) for the lookup, no `[T, L]` array.

    Args:
      segment_ids: int `[B, T]`; kv_segment_ids: int `[B, L]` (0 = padding).
      mask: bool `[B, T]`; memory_mask: bool `[B, L]`.
      positions: `[T]` or `[B, T]` indices within each document, or None (counted from each
        document's start).
      rho, offsets, num_global: as in `cross_graph_attention`.

    Returns:
      (memory node index `[B, T, K + g]`, valid `[B, T, K + g]`, centres `[B, T]` within the
      document's tokens).
    """
    b, t = segment_ids.shape
    length = kv_segment_ids.shape[1]
    g = num_global
    q_real = packing_valid(segment_ids, mask)
    m_real = packing_valid(kv_segment_ids, memory_mask)
    if positions is None:
        tq = jnp.arange(t)
        start = jnp.concatenate([jnp.ones((b, 1), bool),
                                 segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        positions = tq - jax.lax.cummax(jnp.where(start, tq, 0), axis=1)
    positions = jnp.broadcast_to(jnp.asarray(positions), (b, t))
    pos = jnp.arange(length)
    change = jnp.concatenate([jnp.ones((b, 1), bool),
                              kv_segment_ids[:, 1:] != kv_segment_ids[:, :-1]], axis=1)
    # Each memory document's first node, found by id: sort the run starts by id, search the queries.
    big = jnp.iinfo(jnp.int32).max
    keys = jnp.where(change & (kv_segment_ids > 0), kv_segment_ids, big).astype(jnp.int32)
    order = jnp.argsort(keys, axis=1)
    ordered = jnp.take_along_axis(keys, order, axis=1)
    hit = jnp.clip(jax.vmap(jnp.searchsorted)(ordered, segment_ids.astype(jnp.int32)), 0, length - 1)
    found = (jnp.take_along_axis(ordered, hit, axis=1) == segment_ids) & q_real
    doc_start = jnp.take_along_axis(order, hit, axis=1)                          # [B, T]
    # The end of that run: the next change after its start.
    nxt = jnp.flip(jax.lax.cummin(jnp.flip(jnp.where(change, pos, length), 1), axis=1), 1)
    nxt = jnp.concatenate([nxt[:, 1:], jnp.full((b, 1), length, nxt.dtype)], axis=1)
    doc_end = jnp.take_along_axis(nxt, doc_start, axis=1)
    real_before = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                                   jnp.cumsum(m_real.astype(jnp.int32), axis=1)], axis=1)
    tok0 = jnp.minimum(doc_start + g, doc_end)
    n_tok = (jnp.take_along_axis(real_before, doc_end, axis=1)
             - jnp.take_along_axis(real_before, tok0, axis=1))                   # [B, T]
    c = jnp.round(jnp.float32(rho) * positions.astype(jnp.float32)).astype(jnp.int32)
    c = jnp.clip(c, 0, jnp.maximum(n_tok - 1, 0))
    rel = c[..., None] + jnp.asarray(offsets, jnp.int32)                          # [B, T, K]
    in_doc = (rel >= 0) & (rel < doc_end[..., None] - tok0[..., None])
    idx = jnp.concatenate([tok0[..., None] + rel,
                           doc_start[..., None] + jnp.arange(g, dtype=jnp.int32)], axis=-1)
    in_doc = jnp.concatenate([in_doc, jnp.arange(g) < (doc_end - doc_start)[..., None]], axis=-1)
    idx = jnp.clip(idx, 0, length - 1)
    valid = in_doc & gather_rows(m_real, idx) & found[..., None]
    return idx, valid, c
