"""Context parallelism for linear attention: one sequence split over a `sequence` mesh axis.

The pattern of LASP-2 (Sun et al. 2025, arXiv 2502.07563) and of fla's context parallelism
(docs/specs/context_parallel.md §1). A causal linear form carries a state S = sum_s k_s v_s^T; a
shard p of the sequence, computed from a zero state, gives its outputs y_p^0 and its summary S_p
(the state its tokens add). The state entering shard p is the exclusive fold of the summaries of
the shards before it, here a sum (plain linear attention has the identity transition):

    S_in(p) = sum_{i < p} S_i,        y_p = y_p^0 + q S_in(p)   (and den likewise)

One `all_gather` of the summaries over the sequence axis and a local fold give every shard its
S_in: O(P B H D M) bytes per call, independent of the length (autodiff turns the all-gather into
a reduce-scatter of the same size). The non-causal global form needs one `psum` of the summaries.

A state crosses calls: `initial_state` S_0 (the tokens before the sequence) is the fold's first
element, S_in(p) = S_0 + sum_{i < p} S_i, and `return_state` gives the last shard's final state to
every device (`last_shard`, one psum of `[B, H, D, M]`), so a prompt prefilled over P devices
continues on one device with `linear_attention.causal_step` (packed: each row's first document reads
S_0, and the final state is its last document's).

Each `shard_*` function is the body to run under `jax.shard_map` with q, k, v split along T on
`axis_name`; `causal` and `noncausal` wrap them for a jit-level caller whose inputs are (or will
be) sharded `P(batch_axis, axis_name)`. Both give the numbers of the unsharded
`linear_attention.causal_chunked` / `noncausal`, NaN-safety included: a non-finite key or value
makes its shard's summary NaN, which the fold passes on to every later shard, as the recurrence
would.
"""
from __future__ import annotations

__all__ = ["causal", "noncausal", "sequence_map", "shard_causal", "shard_noncausal"]

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo_core.ops import linear_attention, masking, packing
from zoo_core.ops.linear_attention import LinearState

Array = jax.Array


def exclusive_fold(state: LinearState, axis_name: str) -> LinearState:
    """Inside `shard_map`: the sum of the states of the shards before this one on `axis_name`
    (zeros on the first). One all-gather of each leaf `[B, H, ...]` -> `[P, B, H, ...]`; the later
    shards' entries are removed with `jnp.where` (a NaN there must not reach this shard)."""
    index = jax.lax.axis_index(axis_name)

    def fold(x):
        gathered = jax.lax.all_gather(x, axis_name)                         # [P, B, H, ...]
        before = jnp.arange(gathered.shape[0]) < index
        return jnp.sum(jnp.where(before.reshape((-1,) + (1,) * x.ndim), gathered, 0), axis=0)

    return jax.tree_util.tree_map(fold, state)


def _segment_fold(local: LinearState, segment_ids: Array, axis_name: str, reverse: bool,
                  initial: Optional[LinearState] = None):
    """Inside `shard_map`, packed: the state entering this shard and whether the shard's first
    document continues the previous shard's last one (`[B]`; on the first shard: whether an
    `initial` state is given, which the first document then reads). Each shard acts on the incoming
    state as `keep ? S_in + b : b` (b: its last document's state `local`; keep: no document starts
    in it, its first token included); one all-gather of (keep, b, last id) and a local gated fold in
    shard order (`reverse`: from the last shard down) from `initial` (zeros if None)."""
    size = jax.lax.psum(1, axis_name)
    index = jax.lax.axis_index(axis_name)
    position = size - 1 - index if reverse else index
    order = (lambda x: jnp.flip(x, axis=0)) if reverse else (lambda x: x)
    last_ids = order(jax.lax.all_gather(segment_ids[:, -1], axis_name))             # [P, B]
    previous = jnp.take(last_ids, jnp.maximum(position - 1, 0), axis=0)
    continues = (position > 0) & (segment_ids[:, 0] == previous)                     # [B]
    if initial is not None:
        continues = continues | (position == 0)
    keep = continues & ~jnp.any(packing.starts(segment_ids), axis=1)
    gathered = [order(jax.lax.all_gather(x, axis_name)) for x in (keep,) + tuple(local)
                if x is not None]                                                    # [P, B, ...]
    to_b = lambda x: jnp.moveaxis(x, 0, 1)
    adds = [to_b(x) for x in gathered[1:]]
    first = ([jnp.zeros_like(x[:, 0]) for x in adds] if initial is None
             else [x.astype(a.dtype) for x, a in zip(initial, adds) if x is not None])
    entering, _ = packing.gated_prefix(to_b(gathered[0]), adds, first)
    entering = [jnp.take(x, position, axis=1) for x in entering]
    return LinearState(entering[0], entering[1] if local.den is not None else None), continues


def _shard_causal(q, k, v, *, axis_name, chunk_size, mask, denominator, segment_ids, reverse=False,
                  initial_state=None):
    """`shard_causal`, also over the shards in reverse order (for the packed global form's
    backward pass, on inputs flipped along T)."""
    num, den, local = linear_attention.causal_chunked_batched(q, k, v, chunk_size=chunk_size, mask=mask,
                                                              denominator=denominator, segment_ids=segment_ids)
    if initial_state is not None:
        linear_attention.check_state(initial_state, q.shape, v.shape[-1], denominator)
        initial_state = jax.tree_util.tree_map(lambda x, y: x.astype(y.dtype), initial_state, local)
    if segment_ids is None:
        entering = exclusive_fold(local, axis_name)
        if initial_state is not None:
            entering = jax.tree_util.tree_map(jnp.add, initial_state, entering)
        num_in, den_in = linear_attention.read(q, entering, query_mask=mask)
        final = jax.tree_util.tree_map(jnp.add, entering, local)
        return num + num_in, None if den is None else den + den_in, final
    entering, continues = _segment_fold(local, segment_ids, axis_name, reverse, initial_state)
    start = packing.starts(segment_ids)
    # Only the first document reads the entering state, and only if it began in an earlier shard;
    # `where` on the product, so that a NaN state never reaches another document.
    head = packing.first_segment(start) & continues[:, None]                         # [B, T_p]
    num_in, den_in = linear_attention.read(q, entering, query_mask=packing.valid(segment_ids, mask))
    num = num + jnp.where(head[..., None, None], num_in, 0.0)
    den = None if den is None else den + jnp.where(head[..., None], den_in, 0.0)
    keep = continues & ~jnp.any(start, axis=1)
    final = jax.tree_util.tree_map(
        lambda s_in, b: jnp.where(masking.expand(keep, b.ndim), s_in, 0.0) + b, entering, local)
    return num, den, final


def shard_causal(q: Array, k: Array, v: Array, *, axis_name: str, chunk_size: int,
                 mask: Optional[Array] = None, denominator: bool = False,
                 segment_ids: Optional[Array] = None,
                 initial_state: Optional[LinearState] = None) -> tuple[Array, Optional[Array], LinearState]:
    """Causal linear attention of this shard (the body under `shard_map`).

    Args:
      q, k: `[B, T_p, H, D]`, this shard's queries and keys (or their features).
      v: `[B, T_p, H, M]`.
      axis_name: the mesh axis the sequence is split over; shard i holds tokens i T_p ... .
      chunk_size, mask, denominator: as in `linear_attention.causal_chunked` (mask `[B, T_p]`).
      segment_ids: optional int `[B, T_p]` packed documents (`zoo_core.ops.packing`); a document may
        span shards.
      initial_state: optional `LinearState` of the tokens before the sequence (the same on every
        shard): the first shard's fold starts from it, and packed, each row's first document reads it
        (as `linear_attention.causal_scan`'s `state`); None = zeros.

    Returns:
      (num `[B, T_p, H, M]`, den `[B, T_p, H]` or None, the state after this shard's last token;
      `last_shard` gives every shard the last one's).
    """
    # The batched form on every platform: no loop over chunks, whose carried state shard_map would
    # have to type as varying over the axis.
    return _shard_causal(q, k, v, axis_name=axis_name, chunk_size=chunk_size, mask=mask,
                         denominator=denominator, segment_ids=segment_ids, initial_state=initial_state)


def last_shard(tree, axis_name: str):
    """Inside `shard_map`: every leaf of the last shard along `axis_name`, on every shard (a value
    replicated over the axis, as `out_specs` without `axis_name` requires). One `psum` of the leaves,
    the other shards' replaced by zeros with `jnp.where` (exact, and a NaN there stays there)."""
    last = jax.lax.axis_index(axis_name) == jax.lax.psum(1, axis_name) - 1
    return jax.tree_util.tree_map(lambda x: jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), axis_name), tree)


def shard_noncausal(q: Array, k: Array, v: Array, *, axis_name: str, mask: Optional[Array] = None,
                    query_mask: Optional[Array] = None, denominator: bool = False,
                    segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array]]:
    """Global linear attention of this shard's queries over every shard's keys (the body under
    `shard_map`): the `psum` of the shards' summaries, read by the local queries. Arguments as in
    `linear_attention.noncausal`, each along this shard's part of the sequence. Packed
    (`segment_ids`): per document, as the causal fold forward plus the same over the shards in
    reverse, less the diagonal (`linear_attention.noncausal`'s packed form)."""
    if segment_ids is None:
        local = linear_attention.summary(k, v, mask=mask, denominator=denominator)
        total = jax.tree_util.tree_map(functools.partial(jax.lax.psum, axis_name=axis_name), local)
        return linear_attention.read(q, total, query_mask=query_mask)
    flip = lambda x: None if x is None else jnp.flip(x, axis=1)
    kwargs = dict(axis_name=axis_name, chunk_size=linear_attention.SEGMENT_CHUNK, denominator=denominator)
    fwd_num, fwd_den, _ = _shard_causal(q, k, v, mask=mask, segment_ids=segment_ids, **kwargs)
    bwd_num, bwd_den, _ = _shard_causal(flip(q), flip(k), flip(v), mask=flip(mask),
                                        segment_ids=flip(segment_ids), reverse=True, **kwargs)
    valid = packing.valid(segment_ids, mask)
    acc = linear_attention.acc_dtype(q, k, v)
    qz, kz, vz = (masking.zero_padding(x.astype(acc), valid) for x in (q, k, v))
    diag = jnp.einsum("bthd,bthd->bth", qz, kz)
    num = masking.zero_padding(fwd_num + flip(bwd_num) - diag[..., None] * vz, query_mask)
    den = None if not denominator else masking.zero_padding(fwd_den + flip(bwd_den) - diag, query_mask)
    return num, den


def sharded(body, mesh, axis_name: str, batch_axis: Optional[str], arrays: dict, out_specs,
            shared: Optional[dict] = None):
    """`body(**arrays, **shared)` under `jax.shard_map`, each array `[B, T, ...]` split along T on
    `axis_name` and along B on `batch_axis` (None: not split); `shared` maps a name to (pytree, spec):
    a value every shard gets whole along T (parameters `P()`, states `P(batch_axis)`). None entries
    are passed as None. Every input is an argument of `shard_map`, never closed over (which an
    Explicit mesh refuses), and on an Explicit mesh is first resharded as its spec says (an Auto mesh
    reshards by itself). Shared by the mechanisms' context-parallel wrappers."""
    spec = P(batch_axis, axis_name)
    entries = {name: (x, spec) for name, x in arrays.items()}
    entries.update(shared or {})
    given = {name: entry for name, entry in entries.items() if entry[0] is not None}

    def run(*xs):
        return body(**{**dict.fromkeys(entries), **dict(zip(given, xs))})

    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    xs = [x for x, _ in given.values()]
    specs = tuple(s for _, s in given.values())
    if is_explicit(mesh, axis_name):   # a spec (P) covers the subtree of the input at its place
        split = lambda spec, x: jax.tree_util.tree_map(                             # noqa: E731
            lambda a: jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec)), x)
        xs = [jax.tree_util.tree_map(split, s, x, is_leaf=lambda v: isinstance(v, P)) for x, s in zip(xs, specs)]
    return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=out_specs)(*xs)


def is_explicit(mesh, axis_name: str) -> bool:
    """Whether `axis_name` of `mesh` is an Explicit axis (`jax.make_mesh`'s default)."""
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == jax.sharding.AxisType.Explicit


def causal(q: Array, k: Array, v: Array, *, chunk_size: int, mesh=None, axis_name: str = "sequence",
           batch_axis: Optional[str] = None, mask: Optional[Array] = None, denominator: bool = False,
           segment_ids: Optional[Array] = None, initial_state: Optional[LinearState] = None,
           return_state: bool = False):
    """`linear_attention.causal_chunked` with the sequence split over `axis_name` of `mesh` (None: the
    mesh of `jax.set_mesh`). T must divide by the axis size.

    `initial_state` (a `LinearState` `[B, H, D, M]` / `[B, H, D]`, None = zeros) is the state of the
    tokens before the sequence: the first shard's fold starts from it (packed: each row's first
    document reads it). With `return_state`, the state after the last token (the last shard's;
    packed: each row's last document's) is returned too, replicated over `axis_name`: prefill a
    prompt over P devices, then decode from it with `linear_attention.causal_step` on one device.

    Returns (num `[B, T, H, M]`, den `[B, T, H]` or None), sharded like the inputs, and with
    `return_state` the final `LinearState`: the numbers of `causal_chunked(..., state=initial_state)`.
    """
    check_length(q.shape[1], mesh, axis_name)
    body = functools.partial(shard_causal, axis_name=axis_name, chunk_size=chunk_size,
                             denominator=denominator)
    spec = P(batch_axis, axis_name)
    outs = (spec, spec if denominator else None)

    def run(**a):
        num, den, final = body(**a)
        return (num, den, last_shard(final, axis_name)) if return_state else (num, den)

    shared = {"initial_state": (initial_state, P(batch_axis))}
    return sharded(run, mesh, axis_name, batch_axis, dict(q=q, k=k, v=v, mask=mask, segment_ids=segment_ids),
                   outs + ((P(batch_axis),) if return_state else ()), shared)


def noncausal(q: Array, k: Array, v: Array, *, mesh=None, axis_name: str = "sequence",
              batch_axis: Optional[str] = None, mask: Optional[Array] = None,
              query_mask: Optional[Array] = None, denominator: bool = False,
              segment_ids: Optional[Array] = None) -> tuple[Array, Optional[Array]]:
    """`linear_attention.noncausal` (self-attention lengths, T = S) with the sequence split over
    `axis_name`; arguments and results as in `causal`."""
    check_length(q.shape[1], mesh, axis_name)
    body = functools.partial(shard_noncausal, axis_name=axis_name, denominator=denominator)
    spec = P(batch_axis, axis_name)
    return sharded(body, mesh, axis_name, batch_axis,
                   dict(q=q, k=k, v=v, mask=mask, query_mask=query_mask, segment_ids=segment_ids),
                   (spec, spec if denominator else None))


def sequence_map(body, arrays: dict, *, mesh=None, axis_name: str = "sequence",
                 batch_axis: Optional[str] = None):
    """`body(**arrays)` under `jax.shard_map` over `axis_name` of `mesh` (None: the mesh of
    `jax.set_mesh`), for a mechanism's own context-parallel body (e.g. `agf_jax.softmax.shard_softmax`):
    each array `[B, T, ...]` split along T (and along B on `batch_axis`), None entries passed as
    None, one result `[B, T, ...]` split the same way. T must divide by the axis size (one line)."""
    check_length(next(x for x in arrays.values() if x is not None).shape[1], mesh, axis_name)
    return sharded(body, mesh, axis_name, batch_axis, arrays, P(batch_axis, axis_name))


def check_length(t: int, mesh, axis_name: str) -> None:
    """The mesh (None: `jax.set_mesh`'s) has `axis_name`, and the length t divides by its size."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if axis_name not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis_name!r} (its axes: {mesh.axis_names}): call under "
                         f"jax.set_mesh(mesh) with a mesh that has it, or name one of its axes (a layer's or "
                         f"attention.make's sequence_axis=, this function's axis_name=)")
    size = mesh.shape[axis_name]
    if t % size:
        raise ValueError(f"the sequence length {t} must divide by the {axis_name!r} axis size {size}")
