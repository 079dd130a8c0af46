"""Context parallelism for Cross-Graph attention: the decoder's sequence split over a `sequence` mesh axis.

Decoder node i reads the encoder window around c_i = round(rho i) (clipped to its example's valid
tokens, htgn.md §5.5) and the encoder globals. c_i depends on the example's token count and rho, so
the memory nodes a shard of queries reads are known only at run time; each shard therefore holds the
whole projected memory (keys and values, `[B, g + N, H, D]`: jit all-gathers a memory split along its
length, O(N d) bytes, as softmax's K and V) and its own T / P queries with their global indices
(packed: each query's index within its document, counted over the whole row before the split). The
kernel on every shard is `graph_ops.cross_graph_attention` itself, so the numbers are one device's.

The KL term sums over rows ('prior') or over consecutive row pairs ('neighbour'): with 'neighbour'
each shard also receives the last query row of the shard before it (`ppermute`, a halo of one row,
masked on the first shard), so the pair that straddles two shards is counted once, where its second
row lives. The sums are `psum`med. Dropout draws its own bits per shard (the key folded with the
shard index), as the window graph's context-parallel form does.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from htgn_jax import graph_ops
from zoo_core.checks import fail
from zoo_core.ops import masking

Array = jax.Array


def document_positions(segment_ids: Array) -> Array:
    """int `[B, T]`: each token's index within its run of equal ids (its packed document)."""
    t = segment_ids.shape[1]
    tq = jnp.arange(t)
    start = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                            axis=1)
    return tq - jax.lax.cummax(jnp.where(start, tq, 0), axis=1)


def _halo(x: Array, axis_name: str, shards: int) -> Array:
    """The last row (axis 1) of the previous shard on `axis_name` (the first shard gets its own, to be masked)."""
    last = x[:, -1:]
    return jax.lax.ppermute(last, axis_name, [(i, (i + 1) % shards) for i in range(shards)])


def cross_graph_attention(query: Array, key: Array, value: Array, attn: Any, *, axis_name: str,
                          window: int, num_global: int = 0, rho: float = 1.0,
                          mask: Optional[Array] = None, memory_mask: Optional[Array] = None,
                          rel_bias: Optional[Array] = None, global_bias: Optional[Array] = None,
                          negative_slope: Optional[float] = None, dropout_rate: float = 0.0,
                          dropout_rng: Optional[Array] = None, kl_tau: Optional[float] = None,
                          kl_mode: str = "prior", skip_offsets: Sequence[int] = (),
                          segment_ids: Optional[Array] = None, kv_segment_ids: Optional[Array] = None,
                          mesh=None, batch_axis: Optional[str] = None) -> tuple[Array, dict[str, Array]]:
    """`graph_ops.cross_graph_attention` with the decoder axis T split over `axis_name`.

    Args:
      query: `[B, T, H, C]` decoder score features (T divisible by the axis size).
      key, value, attn, window, ..., kv_segment_ids: as in `graph_ops.cross_graph_attention` (the
        memory `[B, g + N, ...]` may be split along its length; every shard reads all of it).
      axis_name: the mesh axis T is split over.
      mesh: the mesh (None: the one of `jax.set_mesh`).
      batch_axis: the mesh axis B is split over, or None.

    Returns:
      out `[B, T, H, D]` sharded like the queries, and {'kl_sum', 'kl_count'} (replicated).
    """
    b, t = query.shape[:2]
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        fail(f"the mesh has no axis {axis_name!r} (its axes: {tuple(mesh.axis_names)}); run under "
             f"jax.set_mesh(mesh) with a sequence axis, or set sequence_axis to one of them")
    shards = int(mesh.shape[axis_name])
    if t % shards:
        fail(f"the decoder length {t} must divide by the {axis_name!r} axis size {shards}")
    mask = masking.as_bool(mask, (b, t), "mask", "[B, T]")
    memory_mask = masking.as_bool(memory_mask, key.shape[:2], "memory_mask", "[B, L]")
    packed = segment_ids is not None
    positions = (document_positions(jnp.asarray(segment_ids)) if packed
                 else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    shared = value is key
    static = dict(window=window, num_global=num_global, rho=rho, negative_slope=negative_slope,
                  dropout_rate=dropout_rate, kl_tau=kl_tau, kl_mode=kl_mode, skip_offsets=tuple(skip_offsets))
    extras = {"attn": None if isinstance(attn, str) else attn, "rel_bias": rel_bias, "global_bias": global_bias,
              "dropout_rng": dropout_rng}
    extras = {name: x for name, x in extras.items() if x is not None}
    body = functools.partial(graph_ops.cross_graph_attention, **static)
    if isinstance(attn, str):   # the kernel-score marker is static
        body = functools.partial(body, attn=attn)
    halo = kl_mode == "neighbour"

    def run(q, pos, mask_, seg, k, v, mmask, kvseg, extra):
        extra = dict(extra)
        index = jax.lax.axis_index(axis_name)
        if "dropout_rng" in extra:
            extra["dropout_rng"] = jax.random.fold_in(extra["dropout_rng"], index)
        if "attn" not in extra and not isinstance(attn, str):
            extra["attn"] = None
        if halo:   # the previous shard's last row, so that the pair across the boundary is counted here
            first = index > 0
            q, pos = (jnp.concatenate([_halo(x, axis_name, shards), x], axis=1) for x in (q, pos))
            mask_ = jnp.concatenate([_halo(mask_, axis_name, shards) & first, mask_], axis=1)
            seg = None if seg is None else jnp.concatenate([_halo(seg, axis_name, shards), seg], axis=1)
        out, st = body(q, k, k if shared else v, mask=mask_, memory_mask=mmask, positions=pos,
                       segment_ids=seg, kv_segment_ids=kvseg, **extra)
        if halo:
            out = out[:, 1:]
        return out, jax.lax.psum(st["kl_sum"], axis_name), jax.lax.psum(st["kl_count"], axis_name)

    split, whole = P(batch_axis, axis_name), P(batch_axis)
    arrays = [(query, split), (positions, split), (mask, split), (segment_ids, split), (key, whole),
              (None if shared else value, whole), (memory_mask, whole), (kv_segment_ids, whole)]
    given = [(x, spec) for x, spec in arrays if x is not None]
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == jax.sharding.AxisType.Explicit:
        given = [(jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec)), spec) for x, spec in given]
    present = [x is not None for x, _ in arrays]

    def unpack(*xs):
        it = iter(xs[:-1])
        full = [next(it) if here else None for here in present]
        return run(*full, xs[-1])

    out, kl_sum, kl_count = jax.shard_map(
        unpack, mesh=mesh, in_specs=tuple(spec for _, spec in given) + ({name: P() for name in extras},),
        out_specs=(split, P(), P()))(*(x for x, _ in given), extras)
    return out, {"kl_sum": kl_sum, "kl_count": kl_count}
