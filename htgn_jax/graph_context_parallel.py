"""Context parallelism for the window graph: one sequence split over a `sequence` mesh axis.

A window graph is local: token i reads tokens i + o for the stencil offsets o, at most `span` nodes
away (the window plus the largest skip offset; on a grid, the largest raster offset). So each shard
needs only a halo: the `span` boundary nodes of each neighbour (one more on the left, whose id
tells whether the shard's first node starts a document), received by `jax.lax.ppermute` (the
left neighbour's only, when causal), /work/shared/specs/context_parallel.md §3. The global nodes,
which read their whole document, and a document's globals that live on another shard travel as a
few per-shard summaries (`all_gather` of `[P, 2, B, g, H, ...]`); the kernel run on every shard is
`graph_packed.packed_window_attention` (its docstring lists the collectives). So the bytes between
devices depend on the span, g and P, never on the length; packed documents may span shards.

`window_graph_attention` here takes the arguments of `graph_ops.window_graph_attention` plus the
mesh axis, and gives its numbers, values and gradients (an unpacked row is one document). Called
with inputs sharded `P(batch_axis, axis_name)` under `jax.set_mesh(mesh)` (or with `mesh=`); each
shard must hold more than `span` nodes.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from htgn_jax import graph_ops, graph_packed
from zoo_core.checks import fail
from zoo_core.ops import masking

Array = jax.Array


def check_layout(length: int, offsets: Sequence[int], axis_name: Any, mesh=None) -> int:
    """The sequence axis exists, splits `length` evenly, and leaves each shard at least the
    stencil's reach; returns the number of shards P."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        fail(f"the mesh has no axis {axis_name!r} (its axes: {tuple(mesh.axis_names)}); call under "
             f"jax.set_mesh(mesh) with a mesh that has it, or name one of its axes (the layer's or "
             f"attention.make's sequence_axis=)")
    shards = mesh.shape[axis_name]
    if length % shards:
        fail(f"the sequence length {length} must divide by the {axis_name!r} axis size {shards}")
    reach = max(abs(o) for o in offsets)
    if length // shards <= reach:
        fail(f"each of the {shards} shards holds {length // shards} nodes, not more than the "
             f"stencil's reach {reach} (window, skip offsets, grid rows): use fewer shards or a "
             f"longer sequence")
    return shards


def window_graph_attention(query: Array, key: Array, value: Array, attn: Any, *, axis_name: str,
                           window: int, num_global: int = 0, causal: bool = False,
                           mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                           rel_bias: Optional[Array] = None, global_bias: Optional[Array] = None,
                           negative_slope: Optional[float] = None, dropout_rate: float = 0.0,
                           dropout_rng: Optional[Array] = None, kl_tau: Optional[float] = None,
                           kl_mode: str = "prior", grid_width: Optional[int] = None,
                           skip_offsets: Sequence[int] = (), mesh=None,
                           batch_axis: Optional[str] = None) -> tuple[Array, dict[str, Array]]:
    """`graph_ops.window_graph_attention` with the node axis split over `axis_name`.

    Args:
      query, key, value, attn, window, ..., skip_offsets: as in `graph_ops.window_graph_attention`
        (L divisible by the axis size; `segment_ids` `[B, L]` may have documents across shards).
      axis_name: the mesh axis the node axis is split over.
      mesh: the mesh (None: the one of `jax.set_mesh`).
      batch_axis: the mesh axis B is split over, or None.

    Returns:
      out `[B, L, H, D]` sharded like the inputs, and {'kl_sum', 'kl_count'} (replicated).
      Dropout draws its own bits per shard (the key folded with the shard index).
    """
    offsets = graph_ops.check_graph_call(
        query, key, value, attn, window=window, num_global=num_global, rel_bias=rel_bias,
        global_bias=global_bias, kl_tau=kl_tau, kl_mode=kl_mode, causal=causal,
        grid_width=grid_width, skip_offsets=skip_offsets, negative_slope=negative_slope,
        segment_ids=segment_ids)
    b, length, heads = query.shape[:3]
    shards = check_layout(length, offsets, axis_name, mesh)
    mask = masking.as_bool(mask, (b, length), "mask", "[B, L]")
    ids = jnp.ones((b, length), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    static = graph_ops.packed_arguments(window, num_global, causal, grid_width, skip_offsets,
                                        rel_bias, global_bias, heads, kl_tau)
    shared = value is key
    body = functools.partial(graph_packed.packed_window_attention, attn=None, kl_mode=kl_mode,
                             negative_slope=negative_slope, dropout_rate=dropout_rate,
                             axis_name=axis_name, num_shards=shards,
                             **{k: v for k, v in static.items() if k not in ("bias", "prior_logits")})

    # Replicated extras by name (None ones left out: shard_map takes arrays only).
    extras = {"attn": None if isinstance(attn, str) else attn, "bias": static["bias"],
              "prior_logits": static["prior_logits"], "dropout_rng": dropout_rng}
    extras = {name: x for name, x in extras.items() if x is not None}
    if isinstance(attn, str):     # the kernel-score marker is static
        body = functools.partial(body, attn=attn)

    def run(q, k, v, ids_, mask_, extra):
        out, aux = body(q, k, k if shared else v, segment_ids=ids_, mask=mask_,
                        **{"bias": None, "prior_logits": None, "dropout_rng": None, **extra})
        return out, aux["kl_sum"], aux["kl_count"]

    split = P(batch_axis, axis_name)
    arrays = [query, key, key if shared else value, ids, mask]
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == jax.sharding.AxisType.Explicit:
        arrays = [jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, split)) for x in arrays]
    out, kl_sum, kl_count = jax.shard_map(
        run, mesh=mesh, in_specs=(split,) * 5 + ({name: P() for name in extras},),
        out_specs=(split, P(), P()))(*arrays, extras)
    return out, {"kl_sum": kl_sum, "kl_count": kl_count}
