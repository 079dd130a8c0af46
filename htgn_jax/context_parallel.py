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
from zoo_core.ops import context_parallel, masking, packing
from zoo_core.ops.linear_attention import LinearState

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
                mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                initial_state: Optional[LinearState] = None, return_state: bool = False):
    """FAVOR+ self-attention of this shard (the body under `shard_map`): q, k `[B, T_p, H, D]`, v
    `[B, T_p, H, Dv]`, mask and segment_ids `[B, T_p]` (a document may span shards), projection
    Omega `[M, D]` (replicated) or None for 'relu'/'elu'. Causal: `initial_state` (a `LinearState`
    `[B, H, M, Dv]` / `[B, H, M]` of the tokens before, None = zeros) starts the fold, and with
    `return_state` the state after the sequence's last token (the last shard's, on every shard) is
    returned too. Returns the normalised `[B, T_p, H, Dv]` (and the state), the numbers of
    `FavorAttention.__call__` (`scan` from the state) on one device."""
    valid = None if mask is None else mask.astype(bool)
    valid = packing.valid(segment_ids, valid) if segment_ids is not None else valid
    key_max = None if causal else functools.partial(shard_key_max, axis_name=axis_name)
    # the caller (the layer) checked the arguments: the features' unchecked form
    phi_q, phi_k, guard = ops._features(q, k, feature_map, projection, valid, eps,
                                        "constant" if causal else "max", segment_ids, key_max)
    v = masking.zero_padding(v, valid)
    final = None
    if causal:
        num, den, final = context_parallel.shard_causal(phi_q, phi_k, v, axis_name=axis_name, chunk_size=chunk_size,
                                                        mask=valid, denominator=True, segment_ids=segment_ids,
                                                        initial_state=initial_state)
    else:   # the key features are zero at padding already, as on one device
        num, den = context_parallel.shard_noncausal(phi_q, phi_k, v, axis_name=axis_name, denominator=True,
                                                    segment_ids=segment_ids)
    y = ops.normalize(num, den, guard, floor=feature_map == "trig")
    return (y, context_parallel.last_shard(final, axis_name)) if return_state else y


def favor(q: Array, k: Array, v: Array, projection: Optional[Array], *, axis_name: str, feature_map: str,
          causal: bool, chunk_size: Optional[int], eps: float, mask: Optional[Array] = None,
          segment_ids: Optional[Array] = None, mesh=None, initial_state: Optional[LinearState] = None,
          return_state: bool = False):
    """`shard_favor` under `jax.shard_map` over `axis_name` of `mesh` (None: the mesh of
    `jax.set_mesh`), the arrays `[B, T, ...]` split along T, Omega and the states replicated. T must
    divide by the axis size; `chunk_size` None = one chunk per shard. The arguments are the layer's,
    checked there (`initial_state` and `return_state`: causal only). Returns `[B, T, H, Dv]`, sharded
    like q, and with `return_state` the final `LinearState` (replicated)."""
    if not causal and (initial_state is not None or return_state):
        raise ValueError("initial_state and return_state are for causal FAVOR+ (a state crosses from one call "
                         "to the next only there)")
    size = _axis_size(q.shape[1], axis_name, mesh)
    body = functools.partial(shard_favor, axis_name=axis_name, feature_map=feature_map, causal=causal,
                             chunk_size=chunk_size or q.shape[1] // size, eps=eps, return_state=return_state)
    spec = P(None, axis_name)
    return context_parallel.sharded(body, mesh, axis_name, None, dict(q=q, k=k, v=v, mask=mask, segment_ids=segment_ids),
                                    (spec, P()) if return_state else spec,
                                    dict(projection=(projection, P()), initial_state=(initial_state, P())))


def positions(segment_ids: Array, *, axis_name: str, mesh=None) -> Array:
    """`packing.positions_from_segments` `[B, T]` with T split over `axis_name` (`shard_positions`):
    no collective grows with T."""
    _axis_size(segment_ids.shape[1], axis_name, mesh)
    return context_parallel.sequence_map(functools.partial(shard_positions, axis_name=axis_name),
                                         dict(segment_ids=segment_ids), mesh=mesh, axis_name=axis_name)


def _axis_size(t: int, axis_name: str, mesh) -> int:
    context_parallel.check_length(t, mesh, axis_name)
    return (mesh if mesh is not None else jax.sharding.get_abstract_mesh()).shape[axis_name]
