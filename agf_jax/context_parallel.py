"""Context-parallel AGF: one sequence split over a `sequence` mesh axis (issue 42).

The pattern of LASP-2 (arXiv 2502.07563) and docs/specs/context_parallel.md §1-2, with AGF's state:

* **Causal.** The state is an online softmax (m, z, N) per head and feature (`agf_jax.forms.AGFState`),
  and two states combine by the max-aware log-sum-exp merge (associative). Each shard computes the
  summary of its tokens from a zero state (its last document's (m, z, N), `forms._last_document`),
  one `all_gather` of the summaries over the axis and a local gated fold (`factors.gated`: a shard in
  which a document starts cuts the chain; the first shard and a shard whose first token starts a
  document read nothing) give the state entering the shard, from which the shard runs the all-chunks
  form (`forms._all_chunks`, no loop). O(P B H D M) bytes, independent of T.
* **Global (non-causal).** V's softmax over T becomes a `pmax` of the shards' maxima (no gradient: the
  shift cancels) and a `psum` of their sums; V^T Val and the regulariser's Gram matrices U^T U, V^T V
  are `psum`s of the shards' partial sums. O(B H D M) bytes.

NaN-safety as on one device: a non-finite valid input makes its shard's summary NaN (where it reaches
the shard's end), and the gated fold passes it to the later shards of the same document only.

Each `shard_*` function is the body under `jax.shard_map` with every `[B, T, ...]` input split along T
on `axis_name`; `causal` and `noncausal` wrap them for a caller under `jax.set_mesh(mesh)` (or with
`mesh=`) and give the numbers of `forms.agf_chunked` / `fused.agf_with_orthogonality`.
"""
from __future__ import annotations

__all__ = ["causal", "noncausal", "orthogonality"]

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from agf_jax import factors, forms
from agf_jax.factors import MASK_OFFSET, _left_factor, as_float, gated
from agf_jax.forms import AGFState
from zoo_core.ops import context_parallel, guard, masking, packing

Array = jax.Array


def _entering(summary, cut: Array, axis_name: str, merge=None, empty=None, reverse: bool = False):
    """Inside `shard_map`: the state entering this shard, the exclusive gated fold in shard order
    (`reverse`: from the last shard down) of every shard's summary (default: (m, z, N) with the
    max-aware merge; leaves `[B, ...]`) after `empty` (the incoming state; default the empty one);
    cut `[B]`: this shard does not continue the one before it with its whole length (a document
    starts in it, or it is the first and nothing comes in). One all-gather."""
    index = jax.lax.axis_index(axis_name)
    position = jax.lax.psum(1, axis_name) - 1 - index if reverse else index
    order = (lambda x: jnp.flip(x, axis=1)) if reverse else (lambda x: x)         # noqa: E731
    gathered = [order(jnp.moveaxis(jax.lax.all_gather(x, axis_name), 0, 1)) for x in (cut,) + tuple(summary)]
    if empty is None:
        m, z, num = summary
        empty = (jnp.full_like(m, -jnp.inf), jnp.zeros_like(z), jnp.zeros_like(num))
    cuts = jnp.concatenate([jnp.ones_like(cut[:, None]), gathered[0]], axis=1)       # [B, P + 1]
    elements = tuple(jnp.concatenate([e[:, None], x], axis=1) for e, x in zip(empty, gathered[1:]))
    states = jax.lax.associative_scan(gated(merge or forms._merge_from_empty), (cuts, elements), axis=1)[1]
    return tuple(jnp.take(x, position, axis=1) for x in states)                     # shards before


def _continues(segment_ids: Optional[Array], axis_name: str, reverse: bool = False,
               incoming: bool = False) -> Array:
    """bool `[B]`: this shard's first token continues the previous shard's last document
    (`reverse`: its last token is continued by the next shard's first); `incoming`: the first
    shard continues a given initial state."""
    index = jax.lax.axis_index(axis_name)
    size = jax.lax.psum(1, axis_name)
    if incoming:
        return _continues(segment_ids, axis_name) | (index == 0)
    if segment_ids is None:
        return jnp.broadcast_to(index < size - 1 if reverse else index > 0, ())
    if reverse:
        ids = jax.lax.all_gather(segment_ids[:, 0], axis_name)                       # [P, B]
        return (index < size - 1) & (segment_ids[:, -1] == jnp.take(ids, jnp.minimum(index + 1, size - 1), axis=0))
    ids = jax.lax.all_gather(segment_ids[:, -1], axis_name)                          # [P, B]
    return (index > 0) & (segment_ids[:, 0] == jnp.take(ids, jnp.maximum(index - 1, 0), axis=0))


def _merge_totals(left, right):
    """(m, z, bad) of two parts of a document, either of which may be empty (m = -inf, z = 0)."""
    (m1, z1, b1), (m2, z2, b2) = left, right
    m = jnp.maximum(m1, m2)
    ref = jnp.where(m == -jnp.inf, 0.0, m)
    return m, jnp.exp(m1 - ref) * z1 + jnp.exp(m2 - ref) * z2, b1 | b2


def _document_totals(zv: Array, bad: Array, segment_ids: Array, axis_name: str):
    """Inside `shard_map`: per token, (m, z, bad) of its whole document, over every shard it spans:
    the local totals, the shards before through the first local document and the shards after
    through the last (a gated fold each way)."""
    start = packing.starts(segment_ids)
    totals = factors._document_totals(zv, start, bad)
    whole = ~jnp.any(start, axis=1)
    out = totals
    for reverse, at in ((False, -1), (True, 0)):
        continues = _continues(segment_ids, axis_name, reverse)
        summary = tuple(x[:, at] for x in totals)           # the local part of the document passed on
        empty = (jnp.full_like(summary[0], -jnp.inf), jnp.zeros_like(summary[1]), jnp.zeros_like(summary[2]))
        outside = _entering(summary, ~(continues & whole), axis_name, _merge_totals, empty, reverse)
        part = packing.last_segment(start) if reverse else packing.first_segment(start)
        reads = part & continues[:, None]
        merged = _merge_totals(out, tuple(x[:, None] for x in outside))
        out = tuple(jnp.where(masking.expand(reads, x.ndim), y, x) for x, y in zip(out, merged))
    return out


# The chunk length of a shard's causal pass when the caller gives none (the layer's parallel form).
CHUNK = 64


def shard_causal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                 axis_name: str, chunk_size: Optional[int], basis: str = "jacobi",
                 alpha: Optional[float] = None, beta: Optional[float] = None,
                 mask: Optional[Array] = None, spectrum: Optional[Array] = None,
                 segment_ids: Optional[Array] = None, initial_state: Optional[AGFState] = None,
                 return_state: bool = False):
    """Causal AGF of this shard (the body under `shard_map`): zu, zv, zs `[B, T_p, H, D]`, val
    `[B, T_p, H, M]`, mask and segment_ids `[B, T_p]` (a document may span shards), the rest as
    in `forms.agf_chunked` (chunk_size None: min(T_p, `CHUNK`)) -> y `[B, T_p, H, M]`.

    `initial_state` (an `AGFState` of the tokens before, the same on every shard; None = empty)
    is the fold's first element, read by the first shard (packed: by each row's first document);
    with `return_state`, (y, the state after the sequence's last token: the last shard's, on every
    shard)."""
    inputs = forms._causal_inputs(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta,
                                  mask=mask, segment_ids=segment_ids, spectrum=spectrum)
    start = None if segment_ids is None else forms.packing.starts(segment_ids)
    summary, keep = forms._last_document(inputs.zv, inputs.val, start, axis=1)
    reached = guard.last(inputs.poisoned)                                           # [B, H]
    summary = tuple(guard.poison(x, reached) for x in summary)
    incoming = initial_state is not None
    continues = jnp.broadcast_to(_continues(segment_ids, axis_name, incoming=incoming), zu.shape[:1])
    cut = ~continues if keep is None else ~(continues & keep)
    empty = None
    if incoming:
        initial = forms._as_state(initial_state, inputs.a, inputs.val)
        empty = (initial.max, initial.den, initial.num)
    m, z, num = _entering(summary, cut, axis_name, empty=empty)
    chunk_size = chunk_size or min(zu.shape[1], CHUNK)
    expand = lambda x: masking.expand(continues, x.ndim)                           # noqa: E731
    state = AGFState(num=jnp.where(expand(num), num, 0.0), den=jnp.where(expand(z), z, 0.0),
                     max=jnp.where(expand(m), m, -jnp.inf))
    y, final = forms._all_chunks(*forms._to_chunks(inputs, chunk_size, state, segment_ids))
    return (y, context_parallel.last_shard(final, axis_name)) if return_state else y


def shard_noncausal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                    axis_name: str, basis: str = "jacobi", alpha: Optional[float] = None,
                    beta: Optional[float] = None, mask: Optional[Array] = None,
                    count_padding: bool = True,
                    spectrum: Optional[Array] = None) -> tuple[Array, Array]:
    """Global AGF of this shard's tokens over the whole sequence and the regulariser (the body under
    `shard_map`): arguments as in `shard_causal` -> (o `[B, T_p, H, M]`, regulariser `[B]`), the
    numbers of `fused.agf_with_orthogonality`."""
    psum = functools.partial(jax.lax.psum, axis_name=axis_name)
    a = _left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    v = _global_v(zv, mask, psum, axis_name).astype(a.dtype)
    val = as_float(masking.zero_padding(val, mask)).astype(a.dtype)
    o = jnp.einsum("bthd,bhdm->bthm", a, psum(jnp.einsum("bthd,bthm->bhdm", v, val)))
    return o, _regulariser(zu, v, psum, mask, count_padding)


def shard_packed_noncausal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                           axis_name: str, segment_ids: Array, basis: str = "jacobi",
                           alpha: Optional[float] = None, beta: Optional[float] = None,
                           mask: Optional[Array] = None, count_padding: bool = True,
                           spectrum: Optional[Array] = None) -> tuple[Array, Array]:
    """`shard_noncausal` of packed documents (a document may span shards): the numbers of
    `fused.agf_with_orthogonality(segment_ids=...)`. V's per-document (max, sum) come from a gated
    fold each way over the shards (`_document_totals`); the output is packed global linear
    attention over the shards (`zoo_core.ops.context_parallel.shard_noncausal`); the regulariser
    folds each shard's last-document Grams forward, and each shard sums the documents that end in
    it (`_packed_regulariser`)."""
    a = masking.zero_padding(_left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta,
                                          spectrum=spectrum), segment_ids > 0)
    valid = packing.valid(segment_ids, mask)
    zv = masking.zero_padding(as_float(zv), valid, fill=-MASK_OFFSET).astype(a.dtype)
    val = as_float(masking.zero_padding(val, valid)).astype(a.dtype)
    u = jax.nn.softmax(as_float(zu), axis=-1).astype(a.dtype)
    u = masking.zero_padding(u, segment_ids > 0 if count_padding else valid)
    bad = [guard.nonfinite(x) for x in (zv, val, u)]
    zv, val, u = (guard.clean(x, b, f) for x, b, f in zip((zv, val, u), bad, (-MASK_OFFSET, 0.0, 0.0)))
    # Two bad flags per token (a document holding one is NaN, whatever its V): the output's
    # (Z_V, Val) and the regulariser's (Z_V, U).
    flags = jnp.stack([bad[0] | bad[1], bad[0] | bad[2]], axis=-1)
    m, z, doc_bad = _document_totals(zv, flags, segment_ids, axis_name)
    v = masking.zero_padding(jnp.exp(zv - m) / z, segment_ids > 0)
    o, _ = context_parallel.shard_noncausal(a, v, val, axis_name=axis_name, segment_ids=segment_ids)
    o = guard.poison(o, doc_bad[..., 0] & masking.expand(segment_ids > 0, 3))
    return o, _packed_regulariser(u, v, doc_bad[..., 1], segment_ids, axis_name)


def _packed_regulariser(u: Array, v: Array, doc_bad: Array, segment_ids: Array, axis_name: str) -> Array:
    """The packed regulariser `[B]` from this shard's U and V `[B, T_p, H, D]` (V per whole
    document): each shard's last-document Grams folded forward give the first document's entering
    Grams; each shard sums the documents that end in it (`factors._document_penalty`); a psum."""
    psum = functools.partial(jax.lax.psum, axis_name=axis_name)
    start = packing.starts(segment_ids)
    last = masking.expand(packing.last_segment(start), 4)
    grams = tuple(jnp.einsum("bthd,bthe->bhde", jnp.where(last, x, 0.0), x) for x in (u, v))
    continues, ends_later = _continues(segment_ids, axis_name), _continues(segment_ids, axis_name, True)
    keep = continues & ~jnp.any(start, axis=1)
    gathered = [jnp.moveaxis(jax.lax.all_gather(x, axis_name), 0, 1) for x in (keep,) + grams]
    entering, _ = packing.gated_prefix(gathered[0], list(gathered[1:]), [jnp.zeros_like(g) for g in grams])
    index = jax.lax.axis_index(axis_name)
    initial = tuple(jnp.where(masking.expand(continues, 4), jnp.take(x, index, axis=1), 0.0) for x in entering)
    total, docs = factors._document_penalty(u, v, segment_ids, jnp.any(doc_bad, axis=-1), initial, ends_later)
    h, d = u.shape[2:]
    return psum(total) / (h * d * d) / jnp.maximum(psum(docs), 1)


def shard_packed_orthogonality(zu: Array, zv: Array, *, axis_name: str, segment_ids: Array,
                               mask: Optional[Array] = None, count_padding: bool = True) -> Array:
    """`factors.orthogonality_loss(segment_ids=...)` `[B]` from this shard's zu, zv `[B, T_p, H, D]`
    (the body under `shard_map`; the causal layer's packed regulariser)."""
    zv, u, bad = factors._packed_factors(zu, zv, segment_ids, mask, count_padding)
    m, z, doc_bad = _document_totals(zv, bad, segment_ids, axis_name)
    v = masking.zero_padding(jnp.exp(zv - m) / z, segment_ids > 0)
    return _packed_regulariser(u, v, doc_bad, segment_ids, axis_name)


def _regulariser(zu: Array, v: Array, psum, mask: Optional[Array], count_padding: bool) -> Array:
    """`orthogonality_loss` `[B]` from this shard's Z_U and V (V over the whole sequence): the Gram
    matrices are `psum`s of the shards' partial sums."""
    u = jax.nn.softmax(as_float(zu), axis=-1).astype(v.dtype)
    if not count_padding:
        u = masking.zero_padding(u, mask)
    eye = jnp.eye(u.shape[-1], dtype=u.dtype)
    reg = sum(jnp.sum(jnp.abs(psum(jnp.einsum("bthd,bthe->bhde", x, x)) - eye), axis=(1, 2, 3))
              for x in (u, v))
    return reg / (u.shape[2] * u.shape[3] ** 2)


def _global_v(zv: Array, mask: Optional[Array], psum, axis_name: str) -> Array:
    """V `[B, T_p, H, D]` of this shard: the softmax over the whole sequence of the masked Z_V."""
    zv = masking.zero_padding(as_float(zv), mask, fill=-MASK_OFFSET)
    # The softmax's shift: any constant per (head, feature) gives the same V, so no gradient.
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(zv, axis=1)), axis_name)          # [B, H, D]
    e = jnp.exp(zv - m[:, None])
    return e / psum(jnp.sum(e, axis=1))[:, None]


def shard_orthogonality(zu: Array, zv: Array, *, axis_name: str, mask: Optional[Array] = None,
                        count_padding: bool = True) -> Array:
    """`orthogonality_loss` `[B]` of the whole sequence from this shard's zu, zv `[B, T_p, H, D]`
    (the body under `shard_map`)."""
    psum = functools.partial(jax.lax.psum, axis_name=axis_name)
    return _regulariser(zu, _global_v(zv, mask, psum, axis_name), psum, mask, count_padding)


def causal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
           chunk_size: Optional[int], mesh=None, axis_name: str = "sequence", batch_axis: Optional[str] = None,
           mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
           spectrum: Optional[Array] = None, initial_state: Optional[AGFState] = None,
           return_state: bool = False, **basis):
    """`forms.agf_chunked` with the sequence split over `axis_name` of `mesh` (None: the mesh of
    `jax.set_mesh`); T must divide by the axis size. Returns y `[B, T, H, M]`, sharded like the
    inputs, and with `return_state` the final `AGFState` (the last shard's, replicated over the
    axis): prefill over P devices, then decode with `forms.agf_step` / the layer's `step`.
    `initial_state`: the `AGFState` of the tokens before (None: empty), as `agf_chunked`'s `state`.
    `basis`: basis, alpha, beta; chunk_size None: min(T / P, `CHUNK`)."""
    forms.check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, chunk_size=chunk_size or CHUNK,
                          coeffs=coeffs, spectrum=spectrum, state=initial_state, **basis)
    context_parallel.check_length(jnp.shape(zu)[1], mesh, axis_name)
    body = functools.partial(shard_causal, axis_name=axis_name, chunk_size=chunk_size, return_state=return_state,
                             **basis)
    spec = P(batch_axis, axis_name)
    # coeffs and spectrum are arguments of shard_map (replicated), never closed over.
    return context_parallel.sharded(body, mesh, axis_name, batch_axis,
                                    dict(zu=zu, zv=zv, zs=zs, val=val, mask=mask, segment_ids=segment_ids),
                                    (spec, P(batch_axis)) if return_state else spec,
                                    dict(coeffs=(coeffs, P()), spectrum=(spectrum, P()),
                                         initial_state=(initial_state, P(batch_axis))))


def noncausal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
              mesh=None, axis_name: str = "sequence", batch_axis: Optional[str] = None,
              mask: Optional[Array] = None, count_padding: bool = True,
              segment_ids: Optional[Array] = None, spectrum: Optional[Array] = None,
              **basis) -> tuple[Array, Array]:
    """`fused.agf_with_orthogonality` with the sequence split over `axis_name`: (o `[B, T, H, M]`
    sharded like the inputs, regulariser `[B]`); arguments as in `causal`."""
    forms.check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids, coeffs=coeffs, spectrum=spectrum,
                          **basis)
    context_parallel.check_length(jnp.shape(zu)[1], mesh, axis_name)
    body = functools.partial(shard_noncausal if segment_ids is None else shard_packed_noncausal,
                             axis_name=axis_name, count_padding=count_padding, **basis)
    return context_parallel.sharded(body, mesh, axis_name, batch_axis,
                                    dict(zu=zu, zv=zv, zs=zs, val=val, mask=mask,
                                         **({} if segment_ids is None else dict(segment_ids=segment_ids))),
                                    (P(batch_axis, axis_name), P(batch_axis)),
                                    dict(coeffs=(coeffs, P()), spectrum=(spectrum, P())))


def orthogonality(zu: Array, zv: Array, *, mesh=None, axis_name: str = "sequence",
                  batch_axis: Optional[str] = None, mask: Optional[Array] = None,
                  count_padding: bool = True, segment_ids: Optional[Array] = None) -> Array:
    """`factors.orthogonality_loss` `[B]` with the sequence split over `axis_name` (the causal
    layer's regulariser); arguments as in `causal`."""
    forms.check_arguments(zu, zv, None, None, mask=mask, segment_ids=segment_ids)
    context_parallel.check_length(jnp.shape(zu)[1], mesh, axis_name)
    packed = {} if segment_ids is None else dict(segment_ids=segment_ids)
    body = functools.partial(shard_orthogonality if segment_ids is None else shard_packed_orthogonality,
                             axis_name=axis_name, count_padding=count_padding)
    return context_parallel.sharded(body, mesh, axis_name, batch_axis, dict(zu=zu, zv=zv, mask=mask, **packed),
                                    P(batch_axis))
