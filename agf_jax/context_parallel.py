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

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from agf_jax import forms
from agf_jax.factors import MASK_OFFSET, as_float, gated, left_factor
from agf_jax.forms import AGFState
from zoo_core.ops import context_parallel, guard, masking

Array = jax.Array


def _entering(summary, cut: Array, axis_name: str):
    """Inside `shard_map`: the state entering this shard, the exclusive gated fold in shard order
    of every shard's summary (m, z, N) (leaves `[B, H, D(, M)]`); cut `[B]`: this shard does not
    continue the one before it with its whole length (a document starts in it, or it is the
    first). One all-gather of (cut, m, z, N)."""
    index = jax.lax.axis_index(axis_name)
    gathered = [jnp.moveaxis(jax.lax.all_gather(x, axis_name), 0, 1) for x in (cut,) + tuple(summary)]
    m, z, num = summary
    empty = (jnp.full_like(m, -jnp.inf), jnp.zeros_like(z), jnp.zeros_like(num))
    cuts = jnp.concatenate([jnp.ones_like(cut[:, None]), gathered[0]], axis=1)       # [B, P + 1]
    elements = tuple(jnp.concatenate([e[:, None], x], axis=1) for e, x in zip(empty, gathered[1:]))
    states = jax.lax.associative_scan(gated(forms._merge_from_empty), (cuts, elements), axis=1)[1]
    return tuple(jnp.take(x, index, axis=1) for x in states)                        # shards < index


def _continues(segment_ids: Optional[Array], axis_name: str) -> Array:
    """bool `[B]`: this shard's first token continues the previous shard's last document."""
    index = jax.lax.axis_index(axis_name)
    if segment_ids is None:
        return jnp.broadcast_to(index > 0, ())
    last_ids = jax.lax.all_gather(segment_ids[:, -1], axis_name)                     # [P, B]
    previous = jnp.take(last_ids, jnp.maximum(index - 1, 0), axis=0)
    return (index > 0) & (segment_ids[:, 0] == previous)


# The chunk length of a shard's causal pass when the caller gives none (the layer's parallel form).
CHUNK = 64


def shard_causal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                 axis_name: str, chunk_size: Optional[int], basis: str = "jacobi",
                 alpha: Optional[float] = None, beta: Optional[float] = None,
                 mask: Optional[Array] = None, spectrum: Optional[Array] = None,
                 segment_ids: Optional[Array] = None) -> Array:
    """Causal AGF of this shard (the body under `shard_map`): zu, zv, zs `[B, T_p, H, D]`, val
    `[B, T_p, H, M]`, mask and segment_ids `[B, T_p]` (a document may span shards), the rest as
    in `forms.agf_chunked` (chunk_size None: min(T_p, `CHUNK`)) -> y `[B, T_p, H, M]`."""
    inputs = forms._causal_inputs(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta,
                                  mask=mask, segment_ids=segment_ids, spectrum=spectrum)
    start = None if segment_ids is None else forms.packing.starts(segment_ids)
    summary, keep = forms._last_document(inputs.zv, inputs.val, start, axis=1)
    reached = guard.last(inputs.poisoned)                                           # [B, H]
    summary = tuple(guard.poison(x, reached) for x in summary)
    continues = jnp.broadcast_to(_continues(segment_ids, axis_name), zu.shape[:1])
    cut = ~continues if keep is None else ~(continues & keep)
    m, z, num = _entering(summary, cut, axis_name)
    chunk_size = chunk_size or min(zu.shape[1], CHUNK)
    expand = lambda x: masking.expand(continues, x.ndim)                           # noqa: E731
    state = AGFState(num=jnp.where(expand(num), num, 0.0), den=jnp.where(expand(z), z, 0.0),
                     max=jnp.where(expand(m), m, -jnp.inf))
    y, _ = forms._all_chunks(*forms._to_chunks(inputs, chunk_size, state, segment_ids))
    return y


def shard_noncausal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                    axis_name: str, basis: str = "jacobi", alpha: Optional[float] = None,
                    beta: Optional[float] = None, mask: Optional[Array] = None,
                    count_padding: bool = True,
                    spectrum: Optional[Array] = None) -> tuple[Array, Array]:
    """Global AGF of this shard's tokens over the whole sequence and the regulariser (the body under
    `shard_map`): arguments as in `shard_causal` -> (o `[B, T_p, H, M]`, regulariser `[B]`), the
    numbers of `fused.agf_with_orthogonality`."""
    psum = functools.partial(jax.lax.psum, axis_name=axis_name)
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)
    v = _global_v(zv, mask, psum, axis_name).astype(a.dtype)
    val = as_float(masking.zero_padding(val, mask)).astype(a.dtype)
    o = jnp.einsum("bthd,bhdm->bthm", a, psum(jnp.einsum("bthd,bthm->bhdm", v, val)))
    return o, _regulariser(zu, v, psum, mask, count_padding)


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
           spectrum: Optional[Array] = None, **basis) -> Array:
    """`forms.agf_chunked`'s output with the sequence split over `axis_name` of `mesh` (None: the
    mesh of `jax.set_mesh`); T must divide by the axis size. Returns y `[B, T, H, M]`, sharded like
    the inputs. `basis`: basis, alpha, beta; chunk_size None: min(T / P, `CHUNK`)."""
    forms.check_arguments(zu, zv, zs, val, mask=mask, segment_ids=segment_ids,
                          chunk_size=chunk_size or CHUNK)
    context_parallel.check_length(jnp.shape(zu)[1], mesh, axis_name)
    body = functools.partial(shard_causal, axis_name=axis_name, chunk_size=chunk_size, **basis)
    run = lambda **x: body(coeffs=coeffs, spectrum=spectrum, **x)                   # noqa: E731
    return context_parallel.sharded(run, mesh, axis_name, batch_axis,
                                    dict(zu=zu, zv=zv, zs=zs, val=val, mask=mask, segment_ids=segment_ids),
                                    P(batch_axis, axis_name))


def noncausal(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
              mesh=None, axis_name: str = "sequence", batch_axis: Optional[str] = None,
              mask: Optional[Array] = None, count_padding: bool = True,
              spectrum: Optional[Array] = None, **basis) -> tuple[Array, Array]:
    """`fused.agf_with_orthogonality` with the sequence split over `axis_name`: (o `[B, T, H, M]`
    sharded like the inputs, regulariser `[B]`); arguments as in `causal`."""
    forms.check_arguments(zu, zv, zs, val, mask=mask)
    context_parallel.check_length(jnp.shape(zu)[1], mesh, axis_name)
    body = functools.partial(shard_noncausal, axis_name=axis_name, count_padding=count_padding, **basis)
    run = lambda **x: body(coeffs=coeffs, spectrum=spectrum, **x)                   # noqa: E731
    return context_parallel.sharded(run, mesh, axis_name, batch_axis,
                                    dict(zu=zu, zv=zv, zs=zs, val=val, mask=mask),
                                    (P(batch_axis, axis_name), P(batch_axis)))


def orthogonality(zu: Array, zv: Array, *, mesh=None, axis_name: str = "sequence",
                  batch_axis: Optional[str] = None, mask: Optional[Array] = None,
                  count_padding: bool = True) -> Array:
    """`factors.orthogonality_loss` `[B]` with the sequence split over `axis_name` (the causal
    layer's regulariser); arguments as in `causal`."""
    forms.check_arguments(zu, zv, None, None, mask=mask)
    context_parallel.check_length(jnp.shape(zu)[1], mesh, axis_name)
    body = functools.partial(shard_orthogonality, axis_name=axis_name, count_padding=count_padding)
    return context_parallel.sharded(body, mesh, axis_name, batch_axis, dict(zu=zu, zv=zv, mask=mask),
                                    P(batch_axis))
