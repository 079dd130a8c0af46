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
and own) plus the g global keys: `[B, H, n, C, 3C + g]` logits, O(T (w + g)). The non-causal rows of
the g global tokens are a softmax over every key from float32 statistics (max, sum, weighted sum),
O(T g). A global key inside a query's window is counted once (its band slot is masked).

Padding and NaN safety: padded keys get the logit -1e9 and padded values are zeroed (`jnp.where`);
a non-finite value at a valid position is replaced by 0 and exactly the rows that attend it are set
to NaN, so NaN or 1e30 in padding, or (causal) in the future, changes no valid or past output. Every
row's keys sit at fixed slots, so the future does not change their rounding either. A row with no
key to attend (a padded query) is 0. Logits, weights and outputs are float32.

Packed rows (`segment_ids` int `[B, T]`, 0 = padding; issue 42): each document is a sequence of its
own, its window stops at its edges and its global tokens are its own first g tokens (positions
restart per document; docs/baselines.md "Packed sequences"). Each query's document's global keys are
gathered (`[B, T, g]`) and the global rows' statistics are per (document, slot) by segment
reductions, so packing adds no T x T product; a padding row is 0.

Context parallelism (`longformer_context_parallel`, the layer's `sequence_axis`;
/work/shared/specs/context_parallel.md §3): `longformer_shard` is the body of one shard holding tokens
[p n, (p+1) n) and, with no axis, the single-device kernel itself. Its band reads C tokens of each
neighbouring shard (causal: of the left one), a halo by `ppermute` (`zoo_core.ops.halo`). A
document's global tokens may live on another shard: each shard publishes its first min(g, n) tokens
and the g tokens from its last document start (one `all_gather`). The non-causal global rows combine
every shard's statistics like log-sum-exp: unpacked a `pmax` and `psum`s; packed, each shard's first
and last document's statistics (one `all_gather`), since only those can span shards. So the bytes
between devices depend on C, g, P and the widths, never on T.

`LongformerAttention` (below) follows the zoo's layer contract (README "Layer contract"):
non-causal and causal self-attention, and causal `init_state` / `scan` / `step` on the decoding
cache of `zoo_core.baselines.longformer_cache` (the last w and the first g keys and values); no
cross form.
"""
from __future__ import annotations

__all__ = ["LongformerAttention", "longformer_attention", "longformer_context_parallel"]

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo_core import checks
from zoo_core.baselines import ProjectedAttention
from zoo_core.baselines.longformer_cache import MASKED, LongformerCache, init_cache, longformer_scan, longformer_step
from zoo_core.ops import guard, halo, masking, packing
from zoo_core.ops.dropout import keep_mask

Array = jax.Array
DropoutFn = Optional[Callable[[Array, int], Array]]   # (weights, index) -> weights



def _pad_value(x: Array) -> Array:
    """What fills slots outside the sequence: -1 for integers (no real position / id), else 0."""
    return jnp.asarray(-1 if jnp.issubdtype(x.dtype, jnp.integer) else 0, x.dtype)


def _blocks(x: Array, n: int, c: int) -> Array:
    """`[B, H, T, *f]` padded at the end to n * C along T and split: `[B, H, n, C, *f]`."""
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, n * c - x.shape[2])
    x = jnp.pad(x, pad, constant_values=_pad_value(x))
    return x.reshape(x.shape[:2] + (n, c) + x.shape[3:])


def _key_blocks(ext: Array, n: int, c: int, causal: bool) -> Array:
    """Halo-extended keys `[B, H, C + T + (C), *f]` (padded to whole blocks) -> each query block's keys
    `[B, H, n, K, *f]`: the previous, own and next block (causal: previous and own), K = 3C (2C)."""
    e = _blocks(ext, n + (1 if causal else 2), c)
    return jnp.concatenate([e[:, :, i:i + n] for i in range(2 if causal else 3)], axis=3)


def _rows(x: Array, index: Array) -> Array:
    """x `[B, N, *f]` at `index` int `[B, *i]` -> `[B, *i, *f]`."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, index)


def longformer_attention(q: Array, k: Array, v: Array, *, window: int, num_global: int = 0,
                         mask: Optional[Array] = None, causal: bool = False,
                         dropout: DropoutFn = None, segment_ids: Optional[Array] = None) -> Array:
    """Sliding-window plus global softmax attention (the module docstring), banded, on one device.

    Args:
        q, k: `[B, T, H, D]`.
        v: `[B, T, H, M]`.
        window: w >= 1 (non-causal: w // 2 on each side; causal: the w tokens up to and including i).
        num_global: g >= 0, the first g positions are global (g > T counts as T).
        mask: `[B, T]` bool key-padding mask (True = valid), or None.
        causal: token i attends to j <= i only.
        dropout: optional `(weights, index) -> weights`: index 0 on the band weights
            `[B, H, n, C, K + g]`, index 1 on the global rows' unnormalised weights `[B, T, H, g]`
            (each key's weight in the rows of its document's g global tokens).
        segment_ids: optional int `[B, T]` packed documents (0 = padding): the window and the global
            tokens per document; a padding row is 0.

    Returns:
        `[B, T, H, M]` float32.
    """
    b, t, h, d = q.shape
    assert k.shape == q.shape and v.shape[:3] == (b, t, h), (q.shape, k.shape, v.shape)
    assert window >= 1 and num_global >= 0, (window, num_global)
    mask = masking.as_bool(mask, (b, t))
    ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    return longformer_shard(q, k, v, mask, ids, window=window, num_global=num_global, causal=causal,
                            packed=segment_ids is not None, dropout=dropout)


def longformer_shard(q: Array, k: Array, v: Array, mask: Array, segment_ids: Array, *, window: int,
                     num_global: int, causal: bool, packed: bool, dropout: DropoutFn = None,
                     axis_name: Optional[str] = None, num_shards: int = 1) -> Array:
    """Longformer attention of the n tokens [p n, (p+1) n) of a sequence split over `axis_name` (the body
    under `jax.shard_map`; `axis_name=None`: the whole sequence on one device, no collective).

    q, k `[B, n, H, D]`, v `[B, n, H, M]`, mask bool `[B, n]`, segment_ids int `[B, n]` (ones when not
    `packed`); with `num_shards` > 1 each shard holds at least the band's block C. Collectives (module
    docstring): the halo of C tokens of each neighbour (`zoo_core.ops.halo`), the global tokens' features
    and (non-causal) their rows' softmax statistics. Returns `[B, n, H, M]` float32.
    """
    b, n, h, d = q.shape
    g = min(num_global, n * num_shards)
    dt = jnp.promote_types(jnp.result_type(q, k, v), jnp.float32)
    shard = 0 if axis_name is None else jax.lax.axis_index(axis_name)
    pos = shard * n + jnp.arange(n, dtype=jnp.int32)                                   # [n]
    valid = packing.valid(segment_ids, mask)                                           # [B, n]
    q, k, v = (masking.zero_padding(x.astype(dt), valid) for x in (q, k, v))
    bad = guard.nonfinite(v, valid=valid)                                              # [B, n, H]
    v = guard.clean(v, bad)
    scale = 1.0 / math.sqrt(d)
    c = max(window if causal else window // 2, 1)
    c = min(c, n) if num_shards == 1 else c
    ext = lambda x: halo.extend(x, c, 0 if causal else c, axis_name, num_shards)
    docs = _documents(segment_ids, pos, axis_name, num_shards) if packed else None
    doc_start = docs[0] if packed else jnp.zeros((b, 1), jnp.int32)     # [B, n] packed, else [B, 1]
    doc_pos = pos - doc_start                                                          # [B, n]
    find = functools.partial(_globals, n=n, g=g, packed=packed, axis_name=axis_name, num_shards=num_shards,
                             last_start=docs[1] if packed else None)

    # The band: blocks of C queries against their blocks' halo-extended keys.
    nb = -(-n // c)
    heads = lambda x: jnp.swapaxes(x, 1, 2)                                            # [B, n, H, ..] <-> [B, H, n, ..]
    keys = lambda x: _key_blocks(heads(ext(x)), nb, c, causal)                        # [B, n, *f] -> [B, *f0, nb, K, ..]
    kb, vb = keys(k), keys(v)                                                          # [B, H, nb, K, D / M]
    qb = _blocks(heads(q), nb, c)                                                      # [B, H, nb, C, D]
    logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb) * scale                          # [B, H, nb, C, K]
    blk = jnp.arange(nb)[:, None, None] * c
    pq = shard * n + blk + jnp.arange(c)[None, :, None]                               # [nb, C, 1]
    pk = shard * n + blk - c + jnp.arange(kb.shape[3])[None, None, :]                 # [nb, 1, K]
    gap = pq - pk
    near = (gap >= 0) & (gap < window) if causal else jnp.abs(gap) <= window // 2
    # A valid key within the window, not one of its document's global tokens (and, packed, of the query's document).
    allowed = near & keys((valid & (doc_pos >= g))[..., None])[..., None, :]          # [B, 1, nb, C, K]
    if packed:
        allowed = allowed & (_blocks(segment_ids[:, None], nb, c)[..., None] == keys(segment_ids[..., None])[..., None, :])
    bad_k = jnp.broadcast_to(keys(bad)[..., None, :], logits.shape)
    values = [vb]
    if g:
        # The g global keys of each query's document (unpacked: the first g tokens, one set for all).
        a = doc_start[..., None] + jnp.arange(g)                                       # [B, G, g]
        (kg, vg, idg, okg, badg), inside = find(a, doc_start, [k, v, segment_ids, valid, bad])
        gallowed = inside & okg & (idg == (segment_ids[..., None] if packed else 1))   # [B, G, g]
        if causal:
            gallowed = gallowed & (a <= pos[:, None])
        gallowed = jnp.broadcast_to(gallowed, (b, n, g))
        if packed:
            glogits = jnp.einsum("bthd,btjhd->bhtj", q, kg) * scale                    # [B, H, n, g]
            values.append(_blocks(jnp.moveaxis(vg, 3, 1), nb, c))                      # [B, H, nb, C, g, M]
        else:
            glogits = jnp.einsum("bthd,bjhd->bhtj", q, kg[:, 0]) * scale
            values.append(jnp.moveaxis(vg[:, 0], 2, 1))                                # [B, H, g, M]
        gbad = jnp.moveaxis(badg, 3, 1)                                                # [B, H, G, g]
        logits = jnp.concatenate([logits, _blocks(glogits, nb, c)], axis=-1)
        allowed = jnp.concatenate([jnp.broadcast_to(allowed, bad_k.shape),
                                   jnp.broadcast_to(_blocks(gallowed[:, None], nb, c), bad_k.shape[:4] + (g,))],
                                  axis=-1)
        bad_k = jnp.concatenate([bad_k, jnp.broadcast_to(_blocks(jnp.broadcast_to(gbad, (b, h, n, g)), nb, c),
                                                         bad_k.shape[:4] + (g,))], axis=-1)
    w = jax.nn.softmax(jnp.where(allowed, logits, MASKED), axis=-1)
    if dropout is not None:
        w = dropout(w, 0)
    o = jnp.einsum("bhnqk,bhnkm->bhnqm", w[..., :kb.shape[3]], vb)
    if g:
        rule = "bhnqj,bhnqjm->bhnqm" if packed else "bhnqj,bhjm->bhnqm"
        o = o + jnp.einsum(rule, w[..., kb.shape[3]:], values[1])
    # A row with no key (a padded query out of reach of every valid key) is 0, whatever the blocks hold.
    o = jnp.where(jnp.any(allowed, axis=-1)[..., None], o, 0.0)
    o = jnp.where(jnp.any(allowed & bad_k, axis=-1)[..., None], jnp.nan, o)
    o = heads(o.reshape((b, h, nb * c) + o.shape[4:])[:, :, :n])                      # [B, n, H, M]
    if packed:
        o = masking.zero_padding(o, valid)
    if g and not causal:
        rows = _global_rows(q, k, v, bad, valid, doc_start, doc_pos, find, g=g, scale=scale, packed=packed,
                            dropout=dropout, axis_name=axis_name, num_shards=num_shards)
        o = jnp.where(((doc_pos < g) & (valid if packed else True))[..., None, None], rows, o)
    return o


def longformer_context_parallel(q: Array, k: Array, v: Array, *, window: int, num_global: int = 0,
                                mask: Optional[Array] = None, causal: bool = False,
                                segment_ids: Optional[Array] = None, dropout_rate: float = 0.0,
                                dropout_rng: Optional[Array] = None, axis_name: str = "sequence", mesh=None,
                                batch_axis: Optional[str] = None) -> Array:
    """`longformer_attention` with T split over `axis_name` of `mesh` (None: the mesh of `jax.set_mesh`):
    `longformer_shard` under `jax.shard_map`, every input passed to it explicitly (so that an Explicit
    mesh axis works as an Auto one). T must divide by the axis size, and each shard hold at least the
    band's block (w // 2 tokens, causal w) when there are several. Arguments as in `longformer_attention`;
    dropout at `dropout_rate` from `dropout_rng` (drawn per shard, so only its distribution matches the
    single-device call); `batch_axis`: the mesh axis B is split over, or None. Returns `[B, T, H, M]`
    float32, sharded like the inputs."""
    b, t = q.shape[:2]
    shards = check_layout(t, window, causal, axis_name, mesh)
    arrays = [q, k, v, masking.as_bool(mask, (b, t)),
              jnp.ones((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)]
    extra = {} if dropout_rng is None or dropout_rate == 0.0 else {"rng": dropout_rng}

    def run(q, k, v, mask, ids, extra):
        drop = None
        if extra:
            rng, keep = jax.random.fold_in(extra["rng"], jax.lax.axis_index(axis_name)), 1.0 - dropout_rate
            drop = lambda w, i: jnp.where(keep_mask(jax.random.fold_in(rng, i), keep, w.shape), w / keep, 0.0)
        return longformer_shard(q, k, v, mask, ids, window=window, num_global=num_global, causal=causal,
                                packed=segment_ids is not None, dropout=drop, axis_name=axis_name,
                                num_shards=shards)

    split = P(batch_axis, axis_name)
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == jax.sharding.AxisType.Explicit:
        # An Explicit axis takes only inputs already split along T (an Auto one reshards them itself).
        arrays = [jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, split)) for x in arrays]
    return jax.shard_map(run, mesh=mesh, in_specs=(split,) * 5 + ({name: P() for name in extra},),
                         out_specs=split)(*arrays, extra)


def check_layout(length: int, window: int, causal: bool, axis_name, mesh=None) -> int:
    """The mesh (None: `jax.set_mesh`'s) has `axis_name`, whose size P divides `length` and (P > 1)
    leaves each shard the band's block; returns P. Each problem in one line."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        checks.fail(f"the mesh has no axis {axis_name!r} (its axes: {tuple(mesh.axis_names)}); run under "
                    f"jax.set_mesh(mesh) with a sequence axis, or set sequence_axis to one of them")
    shards = mesh.shape[axis_name]
    if length % shards:
        checks.fail(f"the sequence length {length} must divide by the {axis_name!r} axis size {shards}")
    reach = max(window if causal else window // 2, 1)
    if shards > 1 and length // shards < reach:
        checks.fail(f"each of the {shards} shards holds {length // shards} tokens, fewer than Longformer's "
                    f"halo {reach} ({'the window' if causal else 'half the window'}): use fewer shards or a "
                    f"longer sequence")
    return shards


def _documents(segment_ids: Array, pos: Array, axis_name, num_shards: int):
    """Packed: each token's document start (a global position, `[B, n]`) and the local index of the last
    document start on this shard (`[B]`, -1 if none); the left neighbour's last id by `ppermute` and one
    all-gather of the shards' last starts."""
    ids = jnp.concatenate([halo.shift_in(segment_ids, 1, True, axis_name, num_shards), segment_ids], axis=1)
    start = (ids[:, 1:] != ids[:, :-1]) | (pos == 0)[None]
    last = jnp.max(jnp.where(start, pos, -1), axis=1)                                  # [B]
    doc_start = jnp.maximum(jax.lax.cummax(jnp.where(start, pos, -1), axis=1),
                            halo.earlier(last, axis_name, jnp.max, -1)[:, None])
    return doc_start, jnp.where(last >= 0, last - pos[0], -1)


def _globals(a: Array, doc_start: Array, feats: list, *, n: int, g: int, packed: bool, axis_name, num_shards,
             last_start):
    """The features `[B, G, g, *f]` of the tokens at global positions `a` `[B, G, g]` (the global tokens
    doc_start `[B, G]` + j of some documents), and `[B, G, g]` whether they lie inside the sequence.

    On one device a gather. Split over `axis_name`, a global token lies on this shard, or at the head
    of its shard (its document began on an earlier one: within g of the shard's first token), or in
    the g tokens from the last document start of its document's first shard (a document that goes on
    to later shards): each shard publishes its first min(g, n) tokens and (packed) the g tokens from
    its last document start, one `all_gather` of `[P, B, min(g, n) + g, *f]`.
    """
    inside = a < n * num_shards
    if axis_name is None or num_shards == 1:
        return [_rows(x, jnp.minimum(a, n - 1)) for x in feats], inside
    shard = jax.lax.axis_index(axis_name)
    gh = min(g, n)
    width = gh + (g if packed else 0)
    table = [x[:, :gh] for x in feats]
    if packed:
        tail = jnp.clip(last_start[:, None] + jnp.arange(g), 0, n - 1)                # [B, g]
        table = [jnp.concatenate([h, _rows(x, tail)], axis=1) for h, x in zip(table, feats)]
    gather = lambda x: jnp.moveaxis(jax.lax.all_gather(x, axis_name), 0, 1).reshape((x.shape[0], -1) + x.shape[2:])
    source = [jnp.concatenate([x, gather(t)], axis=1) for x, t in zip(feats, table)]
    home, first = a // n, (doc_start // n)[..., None]
    remote = home * width + a - home * n
    if packed:
        remote = jnp.where(home == first, first * width + gh + a - doc_start[..., None], remote)
    index = jnp.clip(jnp.where(home == shard, a - shard * n, n + remote), 0, source[0].shape[1] - 1)
    return [_rows(x, index) for x in source], inside


def _global_rows(q, k, v, bad, valid, doc_start, doc_pos, find, *, g, scale, packed, dropout, axis_name, num_shards):
    """Non-causal: the rows of each document's g global tokens, each over its whole document: `[B, n, H, M]`
    (meaningful where the token's document position is < g). Key s and global slot j meet in the row of
    token doc_start(s) + j; the softmax over s is per (document, j), from statistics (max, sum, weighted
    sum; float32) per local run of one document, completed across shards (`_across_shards`)."""
    b, n, h, _ = q.shape
    a = doc_start[..., None] + jnp.arange(g)                                           # [B, G, g]
    (qg, start_g), inside = find(a, doc_start, [q, jnp.broadcast_to(doc_start, (b, n))])
    same = inside & (start_g == doc_start[..., None]) if packed else inside
    if packed:
        logits = jnp.einsum("btjhd,bthd->bthj", qg, k) * scale                        # [B, n, H, g]
    else:
        logits = jnp.einsum("bjhd,bthd->bthj", qg[:, 0], k) * scale
    allowed = (same & valid[..., None])[:, :, None, :]                                 # [B, n, 1, g]
    logits = jnp.where(allowed, logits, MASKED)
    if packed:   # runs of one document on this shard: 0, 1, ... (the first may continue an earlier shard)
        run = jnp.cumsum((doc_start != jnp.roll(doc_start, 1, axis=1)).at[:, 0].set(True), axis=1) - 1
        seg = (run + n * jnp.arange(b)[:, None]).reshape(-1)
        reduce = lambda f, x: f(x.reshape((b * n,) + x.shape[2:]), seg, num_segments=b * n).reshape(
            (b, n) + x.shape[2:])
        at_run = lambda x: _rows(x, run)
    else:        # one document
        run = jnp.zeros((b, n), jnp.int32)
        reduce = lambda f, x: (jnp.max if f is jax.ops.segment_max else jnp.sum)(x, axis=1, keepdims=True)
        at_run = lambda x: x
    top = jax.lax.stop_gradient(jnp.maximum(reduce(jax.ops.segment_max, logits), MASKED))   # [B, R, H, g]
    e = jnp.where(allowed, jnp.exp(logits - at_run(top)), 0.0)
    total = reduce(jax.ops.segment_sum, e)
    if dropout is not None:
        e = dropout(e, 1)
    if packed:
        num = reduce(jax.ops.segment_sum, jnp.einsum("bthj,bthm->bthjm", e, v))       # [B, R, H, g, M]
    else:
        num = jnp.einsum("bthj,bthm->bhjm", e, v)[:, None]
    hit = reduce(jax.ops.segment_max, (allowed & bad[..., None]).astype(jnp.int32))   # [B, R, H, g]
    stats = (top, total, num, hit)
    if axis_name is not None and num_shards > 1:
        stats = _across_shards(stats, run, doc_start, packed, axis_name)
    top, total, num, hit = stats
    slot = jnp.clip(doc_pos, 0, g - 1)                                                 # the token's slot j
    if packed:
        pick = lambda x: jax.vmap(lambda xb, rb, sb: xb[rb, :, sb])(x, run, slot)     # [B, n, H, ...]
    else:        # one run: a select and a sum over the g slots, no gather (whose gradient is a scatter)
        sel = slot[..., None] == jnp.arange(g)                                         # [B, n, g]
        pick = lambda x: jnp.sum(jnp.where(masking.expand(sel[:, :, None], x.ndim), x[:, 0][:, None], 0), axis=3)
    rows = pick(num) / jnp.where(pick(total) > 0, pick(total), 1.0)[..., None]
    return jnp.where((pick(hit) > 0)[..., None], jnp.nan, rows)


def _across_shards(stats, run, doc_start, packed: bool, axis_name: str):
    """The softmax statistics (top, total, num, hit) `[B, R, H, g, ...]` of this shard's runs, completed
    with the other shards' parts of the same documents, log-sum-exp style. Unpacked: one document, a
    `pmax` and `psum`s. Packed: only a shard's first and last run can continue elsewhere; each shard
    publishes theirs with their document's start (one `all_gather` of `[P, B, 2, H, g, ...]`) and adds
    the other shards' entries of the same document (an entry of a one-run shard counted once)."""
    top, total, num, hit = stats
    if not packed:
        peak = jax.lax.pmax(top, axis_name)
        scale = jnp.exp(top - peak)
        return (peak, jax.lax.psum(total * scale, axis_name), jax.lax.psum(num * scale[..., None], axis_name),
                jax.lax.psum(hit, axis_name))
    b, n = run.shape
    ends = jnp.stack([jnp.zeros_like(run[:, -1]), run[:, -1]], axis=1)                 # [B, 2] first, last run
    mine = [_rows(x, ends) for x in stats]                                             # [B, 2, H, g, ...]
    key = jnp.stack([doc_start[:, 0], doc_start[:, -1]], axis=1)                       # [B, 2]
    theirs = [jax.lax.all_gather(x, axis_name) for x in mine + [key, run[:, -1]]]     # [P, B, 2, ...]
    t_top, t_total, t_num, t_hit, t_key, t_last = theirs
    other = jnp.arange(t_key.shape[0]) != jax.lax.axis_index(axis_name)
    counted = jnp.stack([jnp.ones_like(t_last, bool), t_last > 0], axis=-1)           # [P, B, 2]
    match = ((t_key[:, :, None, :] == key[None, :, :, None]) & counted[:, :, None, :]
             & other[:, None, None, None])                                             # [P, B, 2 mine, 2 theirs]
    m = match[..., None, None]
    t = lambda x: x[:, :, None]                                                        # [P, B, 1, 2, H, g, ...]
    peak = jnp.maximum(mine[0], jnp.max(jnp.where(m, t(t_top), MASKED), axis=(0, 3)))
    weight = jnp.where(m, jnp.exp(t(t_top) - peak[None, :, :, None]), 0.0)             # [P, B, 2, 2, H, g]
    own = jnp.exp(mine[0] - peak)
    done = [peak, own * mine[1] + jnp.sum(weight * t(t_total), axis=(0, 3)),
            own[..., None] * mine[2] + jnp.sum(weight[..., None] * t(t_num), axis=(0, 3)),
            mine[3] + jnp.sum(jnp.where(m, t(t_hit), 0), axis=(0, 3))]
    # Written back at the first and last run (the same run twice on a one-run shard: equal values).
    put = lambda x, y: jax.vmap(lambda xb, eb, yb: xb.at[eb].set(yb))(x, ends, y.astype(x.dtype))
    return tuple(put(x, y) for x, y in zip(stats, done))


class LongformerAttention(ProjectedAttention):
    """Longformer self-attention: sliding window plus global tokens (module docstring), the zoo's
    layer contract.

    Parameters have `SoftmaxAttention`'s names and shapes, so a softmax parameter tree applies as it
    is: `query`, `key`, `value` kernel `[E, H, D]`, bias `[H, D]`; `out` kernel `[H, D, E']`, bias
    `[E']`. One set of projections serves the window and the global attention (the paper has a
    second set for the global one).

    Shapes: x `[B, T, E]` -> y `[B, T, E']`. Causal, also `init_state` / `scan` / `step` on a
    `LongformerCache` of the last w and the first g keys and values (`longformer_cache`): O(w + g)
    memory, whatever the length decoded.

    Attributes:
        num_heads: H.
        head_dim: D.
        out_features: E' (default: the input width E).
        causal: token i attends to the `window` tokens up to and including i (and the global ones
            before it).
        window: w >= 1: non-causal, w // 2 tokens on each side; causal, the w tokens ending at i.
        num_global: g >= 0: the first g tokens attend to all and all attend to them (e.g. 1 for a
            [CLS] token).
        sequence_axis: the mesh axis one sequence is split over (context parallelism): `__call__` then
            runs `longformer_context_parallel` (a halo exchange of the window, a gather of the global
            tokens) under the mesh of `jax.set_mesh`; None = the single-device program.
        dropout_rate, dtype, param_dtype, kernel_init, bias_init, out_bias_init: as
            `ProjectedAttention` (`zoo_core.baselines`); the attention maths is float32.
    """
    causal: bool = False
    window: int = 64
    num_global: int = 1
    sequence_axis: Optional[str] = None

    def setup(self):
        self._check_common()
        checks.check_int("window", self.window, 1)
        checks.check_int("num_global", self.num_global, 0)
        if self.sequence_axis is not None and not isinstance(self.sequence_axis, str):
            checks.fail(f"`sequence_axis` must be a mesh axis name or None, got {self.sequence_axis!r}")
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
        q, k, v = self.query(x), self.key(x), self.value(x)
        kw = dict(window=self.window, num_global=self.num_global, mask=mask, causal=self.causal,
                  segment_ids=segment_ids)
        if self.sequence_axis is None:
            o = longformer_attention(q, k, v, dropout=self._indexed_dropout(deterministic), **kw)
        else:
            active = not deterministic and self.dropout_rate > 0.0
            o = longformer_context_parallel(q, k, v, axis_name=self.sequence_axis,
                                            dropout_rate=self.dropout_rate if active else 0.0,
                                            dropout_rng=self.make_rng("dropout") if active else None, **kw)
        return self._finish(o, x), {}

    def init_state(self, batch_size: int) -> LongformerCache:
        """An empty `LongformerCache`: w ring slots and g global slots (float32), independent of any length."""
        self._check_causal("init_state")
        checks.check_int("batch_size", batch_size, 1)
        return init_cache(batch_size, self.window, self.num_global, self.num_heads, self.head_dim)

    def scan(self, x: Array, state: Optional[LongformerCache] = None, *, mask: Optional[Array] = None,
             segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, LongformerCache]:
        """The token recurrence on the cache (`longformer_scan`): x `[B, T, E]`, mask `[B, T]` (padding takes
        a position, is never read), segment_ids int `[B, T]` (the cache is emptied at each document start;
        the first document continues `state`) -> (y `[B, T, E']`, the final cache); the causal `__call__`'s
        numbers."""
        self._check_causal("scan")
        self._check_inputs(x, mask)
        packing.check_segment_ids(segment_ids, x.shape[:2])
        state = self.init_state(x.shape[0]) if state is None else state
        valid = masking.as_bool(mask, x.shape[:2]) if segment_ids is None else packing.valid(segment_ids, mask)
        start = None if segment_ids is None else packing.starts(segment_ids)
        o, state = longformer_scan(state, self.query(x), self.key(x), self.value(x), valid=valid, start=start,
                                   dropout=self._indexed_dropout(deterministic))
        if segment_ids is not None:
            o = masking.zero_padding(o, valid)
        return self._finish(o, x), state

    def step(self, state: LongformerCache, x_t: Array) -> tuple[Array, LongformerCache]:
        """One token x_t `[B, E]` -> (y_t `[B, E']`, the cache after it)."""
        self._check_causal("step")
        if jnp.ndim(x_t) != 2 or jnp.shape(x_t)[0] != state.length.shape[0]:
            checks.fail(f"`x_t` must be one token [B, E] with B = {state.length.shape[0]} (the cache's), got "
                        f"shape {tuple(jnp.shape(x_t))}")
        o, state = longformer_step(state, self.query(x_t), self.key(x_t), self.value(x_t))
        return self._finish(o, x_t), state

    def _check_causal(self, method: str) -> None:
        if not self.causal:
            checks.fail(f"LongformerAttention.{method} is the causal form's (the decoding cache): build the "
                        f"layer with causal=True")
