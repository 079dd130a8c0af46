"""FAVOR+ with one sequence split over a `sequence` mesh axis (context parallelism; issue 42).

FAVOR+ is linear attention on random features (htgn.md §2.5-2.6), so it reuses the zoo's LASP-2
folds (`zoo_core.ops.context_parallel`, docs/specs/context_parallel.md §1): each shard maps its own
queries and keys to features, then

* causal: `shard_causal` on (phi(Q), phi(K), V) with a denominator: the shards' summaries
  (state, normaliser) are all-gathered and folded, O(P B H M Dv) bytes whatever the length. The
  causal key stabiliser is the data-independent constant c(Omega), the same on every shard;
* non-causal: `shard_noncausal`, one `psum` of the summaries (per document when packed). The
  'max' key stabiliser (the original's, htgn.md §5.4) is a max over every key of the row, or of the
  key's document when packed, so it is reduced over the shards too: one `pmax` of `[B, 1, H]`, or,
  packed, an all-gather of each shard's first and last document maxima `[P, B, H]` and a gated max
  fold (a document may span several shards), so that every shard gets the one-device numbers.

Omega is drawn once by the layer (a pure function of its seed and step) and passed replicated
(`P()`), the same matrix on every shard. Padding, documents and NaN-safety are the one-device
forms' (`htgn_jax.ops`, `zoo_core.ops.packing`). The step form (decoding) is not split.
"""
from __future__ import annotations

__all__ = ["favor", "positions"]

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from htgn_jax import ops
from zoo_core.checks import fail
from zoo_core.ops import context_parallel, masking, packing

Array = Any


def shard_key_max(values: Array, segment_ids: Optional[Array], *, axis_name: str) -> Array:
    """Inside `shard_map`: the 'max' key stabiliser's reduction (`ops.row_max`) over the whole
    sequence. values `[B, T_p, H]` (-inf at padding), segment_ids `[B, T_p]` or None; returns
    `[B, 1, H]` (the row's max) or, packed, `[B, T_p, H]` (each key's document max)."""
    local = ops.row_max(values, segment_ids)
    if segment_ids is None:
        return jax.lax.pmax(local, axis_name)
    start, whole, continues = _neighbours(segment_ids, axis_name)
    first_max, last_max = (jax.lax.all_gather(x, axis_name) for x in (local[:, 0], local[:, -1]))  # [P, B, H]
    continued = jnp.concatenate([continues[1:], jnp.zeros_like(whole[:1])], axis=0)
    flip = lambda x: jnp.flip(x, axis=0)
    # The max of the document open at the end (left) or the start (right) of each shard.
    left = _gated_max(whole & continues, last_max)
    right = flip(_gated_max(flip(whole & continued), flip(first_max)))
    p, size = jax.lax.axis_index(axis_name), first_max.shape[0]
    from_left = jnp.where(continues[p][:, None], left[jnp.maximum(p - 1, 0)], -jnp.inf)      # [B, H]
    from_right = jnp.where(continued[p][:, None], right[jnp.minimum(p + 1, size - 1)], -jnp.inf)
    out = jnp.where(packing.first_segment(start)[..., None], jnp.maximum(local, from_left[:, None]), local)
    return jnp.where(packing.last_segment(start)[..., None], jnp.maximum(out, from_right[:, None]), out)


def shard_positions(segment_ids: Array, *, axis_name: str) -> Array:
    """Inside `shard_map`: `packing.positions_from_segments` of the whole sequence at this shard's
    tokens `[B, T_p]`: a document that began in earlier shards continues its positions, offset by
    its tokens there (a gated sum of the shards' last-document lengths, `packing.gated_prefix`)."""
    local = packing.positions_from_segments(segment_ids)
    start, whole, continues = _neighbours(segment_ids, axis_name)
    last_length = jax.lax.all_gather(local[:, -1] + 1, axis_name)                    # [P, B]
    to_b = lambda x: jnp.moveaxis(x, 0, 1)
    entering, _ = packing.gated_prefix(to_b(whole & continues), [to_b(last_length)],
                                       [jnp.zeros_like(last_length[0])])
    p = jax.lax.axis_index(axis_name)
    offset = jnp.where(continues[p], jnp.take(entering[0], p, axis=1), 0)             # [B]
    return jnp.where(packing.first_segment(start) & (segment_ids > 0), local + offset[:, None], local)


def _neighbours(segment_ids: Array, axis_name: str):
    """(starts `[B, T_p]`, whole `[P, B]`: the shard holds one run, continues `[P, B]`: shard j's
    first document is shard j-1's last one), from one all-gather of each shard's end ids."""
    start = packing.starts(segment_ids)
    gather = lambda x: jax.lax.all_gather(x, axis_name)
    whole = gather(~jnp.any(start, axis=1))
    first_ids, last_ids = gather(segment_ids[:, 0]), gather(segment_ids[:, -1])
    continues = jnp.concatenate([jnp.zeros_like(whole[:1]), first_ids[1:] == last_ids[:-1]], axis=0)
    return start, whole, continues


def _gated_max(keep: Array, values: Array) -> Array:
    """`S_j = keep_j ? max(S_{j-1}, values_j) : values_j` along axis 0 (keep `[P, B]`, values
    `[P, B, H]`), one associative scan."""
    def combine(a, b):
        return a[0] & b[0], jnp.where(b[0], jnp.maximum(a[1], b[1]), b[1])

    return jax.lax.associative_scan(combine, (jnp.broadcast_to(keep[..., None], values.shape), values),
                                    axis=0)[1]


def shard_favor(q: Array, k: Array, v: Array, projection: Optional[Array], *, axis_name: str,
                feature_map: str, causal: bool, chunk_size: int, eps: float,
                mask: Optional[Array] = None, segment_ids: Optional[Array] = None) -> Array:
    """FAVOR+ self-attention of this shard (the body under `shard_map`): q, k `[B, T_p, H, D]`, v
    `[B, T_p, H, Dv]`, mask and segment_ids `[B, T_p]` (a document may span shards), projection
    Omega `[M, D]` (replicated) or None for 'relu'/'elu'. Returns the normalised `[B, T_p, H, Dv]`,
    the numbers of `FavorAttention.__call__` on one device."""
    valid = None if mask is None else mask.astype(bool)
    valid = packing.valid(segment_ids, valid) if segment_ids is not None else valid
    key_max = None if causal else functools.partial(shard_key_max, axis_name=axis_name)
    # the caller (the layer) checked the arguments: the features' unchecked form
    phi_q, phi_k, guard = ops._features(q, k, feature_map, projection, valid, eps,
                                        "constant" if causal else "max", segment_ids, key_max)
    v = masking.zero_padding(v, valid)
    if causal:
        num, den, _ = context_parallel.shard_causal(phi_q, phi_k, v, axis_name=axis_name, chunk_size=chunk_size,
                                                    mask=valid, denominator=True, segment_ids=segment_ids)
    else:   # the key features are zero at padding already, as on one device
        num, den = context_parallel.shard_noncausal(phi_q, phi_k, v, axis_name=axis_name, denominator=True,
                                                    segment_ids=segment_ids)
    return ops.normalize(num, den, guard, floor=feature_map == "trig")


def favor(q: Array, k: Array, v: Array, projection: Optional[Array], *, axis_name: str, feature_map: str,
          causal: bool, chunk_size: Optional[int], eps: float, mask: Optional[Array] = None,
          segment_ids: Optional[Array] = None, mesh=None) -> Array:
    """`shard_favor` under `jax.shard_map` over `axis_name` of `mesh` (None: the mesh of
    `jax.set_mesh`), the arrays `[B, T, ...]` split along T, Omega replicated. T must divide by the
    axis size; `chunk_size` None = one chunk per shard. The arguments are the layer's, checked there.
    Returns `[B, T, H, Dv]`, sharded like q."""
    size = _axis_size(q.shape[1], axis_name, mesh)
    body = functools.partial(shard_favor, axis_name=axis_name, feature_map=feature_map, causal=causal,
                             chunk_size=chunk_size or q.shape[1] // size, eps=eps)
    return _sharded(lambda omega, **a: body(projection=omega, **a), projection, axis_name, mesh,
                    q=q, k=k, v=v, mask=mask, segment_ids=segment_ids)


def positions(segment_ids: Array, *, axis_name: str, mesh=None) -> Array:
    """`packing.positions_from_segments` `[B, T]` with T split over `axis_name` (`shard_positions`):
    no collective grows with T."""
    _axis_size(segment_ids.shape[1], axis_name, mesh)
    return _sharded(lambda _, **a: shard_positions(axis_name=axis_name, **a), None, axis_name, mesh,
                    segment_ids=segment_ids)


def _axis_size(t: int, axis_name: str, mesh) -> int:
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if axis_name not in mesh.axis_names:
        fail(f"the mesh has no axis {axis_name!r} (its axes: {mesh.axis_names}); call under "
             f"jax.set_mesh(mesh) with a sequence axis, or set sequence_axis=None")
    size = mesh.shape[axis_name]
    if t % size:
        fail(f"the sequence length {t} must divide by the {axis_name!r} axis size {size}")
    return size


def _sharded(body, replicated, axis_name: str, mesh, **arrays):
    """`body(replicated, **arrays)` under `jax.shard_map`: each array `[B, T, ...]` split along T on
    `axis_name` (None entries passed as None), `replicated` (a pytree, or None) the same on every shard."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    spec = P(None, axis_name)
    given = {name: x for name, x in arrays.items() if x is not None}
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == jax.sharding.AxisType.Explicit:
        # an explicit mesh refuses inputs not yet split along T; an Auto one reshards them itself
        given = {n: jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec)) for n, x in given.items()}

    def run(shared, *xs):
        return body(shared, **{**dict.fromkeys(arrays), **dict(zip(given, xs))})

    return jax.shard_map(run, mesh=mesh, in_specs=(P(),) + (spec,) * len(given), out_specs=spec)(
        replicated, *given.values())
