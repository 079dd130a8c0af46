"""Context parallelism for SAMoVAR's VAR chain: one sequence split over a mesh axis (issue 42).

The chain (samovar.md §2.6, `samovar_jax.ops`) is L causal linear attentions in series: layer m's
keys are layer m-1's outputs. Read as one recurrence, its state is the stack (S^(1), ..., S^(L)) of
the layers' `[B, H, D, D]` sums, and a token's update is not the identity on it: S^(m) grows by
`o^(m-1)_t^T v^(m)_t = (q^(m-1)_t S^(m-1))^T v^(m)_t`, so layer m's state reads layer m-1's. Over a
shard p of the sequence the stacked state moves affinely, `S_out = A_p S_in + b_p`, with A_p block
lower-triangular: identity blocks on the diagonal, and below it maps on `[D, D]` matrices
(`S^(1) -> S^(1)T G`, G = sum_t q^(1)T_t v^(2)_t, for L = 2; sums of `C_t^T S q_t^T v_t` sandwiches,
`[D^2, D^2]` per head, from L = 3 on).

Gathering that transition (fla's per-rank "state and transition", LASP-2's fold generalised) would
move L^2 H D^4 values per shard. The triangular structure gives a cheaper exact order: fold layer by
layer. Layer 1 is plain linear attention over x0 (transition I): one all-gather of the shards'
summaries and a local exclusive fold (`zoo_core.ops.context_parallel.shard_causal`) give every shard
its entering S^(1) and so layer 1's exact outputs. Those are layer 2's keys on the same shard, so
layer 2's own transition is again I, and so on: L all-gathers of the `(transition, state)` pair each
layer needs, `[B, H, D, D]` states (plus, packed, the per-row gate A in {0, I} of
`zoo_core.ops.packing`: 0 when a document starts inside the shard, and the last document ids).
Per call each device receives L P B H D^2 numbers (and the backward pass their transposes),
independent of the length T.

`shard_var_chain` is the body under `jax.shard_map`; `var_chain` wraps it for a jit-level caller
whose inputs are (or will be) split along T on `axis_name`. Both give the numbers of the unsharded
`ops.var_chain_chunked`, NaN-safety included (a non-finite key makes its shard's summary NaN, which
reaches every later token of its document, as the recurrence would). A call may start from a
state and return its final one (`initial_state`, `return_state`; layer m's fold starts from its own
S^(m)): prefill a prompt over P devices, then decode on one device (`ops.var_chain_step`).
"""
from __future__ import annotations

__all__ = ["var_chain"]

import functools
from typing import Optional, Sequence, Union

import jax
from jax.sharding import PartitionSpec as P

from samovar_jax import ops
from zoo_core.ops import context_parallel, linear_attention

Array = jax.Array
Operands = Union[Array, Sequence[Array]]


def shard_var_chain(x0: Array, q: Operands, v: Operands, *, axis_name: str, chunk_size: int,
                    key_kernels: Optional[Array] = None, dropout_mask: Optional[Array] = None,
                    mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                    initial_state: Optional[Array] = None, return_state: bool = False):
    """This shard's VAR chain (the body under `shard_map`; operands checked by the caller).

    Args:
      x0: `[B, T_p, H, D]` this shard's observations (the first layer's keys).
      q, v: `[L, B, T_p, H, D]`, or sequences of L arrays `[B, T_p, H, D]`.
      axis_name: the mesh axis the sequence is split over; shard i holds tokens i T_p ... .
      chunk_size: C >= 1 of each shard's chunked form.
      key_kernels: optional `[L, E, E]` (replicated); dropout_mask: optional `[L, B, T_p, H, D]`;
      mask, segment_ids: optional `[B, T_p]` (a packed document may span shards).
      initial_state: optional `[L, B, H, D, D]` per-layer states of the tokens before (replicated
        along T; None = zeros): layer m's fold starts from its own (`ops.var_chain_scan`'s `state`).
      return_state: also return the state after the sequence's last token `[L, B, H, D, D]` (the
        last shard's, on every shard; packed: each row's last document's).

    Returns:
      `[L, B, T_p, H, D]` (stacked q) or a tuple of L arrays `[B, T_p, H, D]`, in x0's dtype; with
      `return_state`, (that, the final state).
    """
    def layer(qm, km, vm, state_m):
        num, _, final = context_parallel.shard_causal(qm, km, vm, axis_name=axis_name, chunk_size=chunk_size,
                                                      mask=mask, segment_ids=segment_ids, initial_state=state_m)
        return num, final

    stacked = not isinstance(q, (list, tuple))
    if not return_state and initial_state is None:
        out = ops._chain(layer, x0, q, v, key_kernels, dropout_mask, None, stack=stacked)  # noqa: SLF001
        return out[0] if stacked else out
    state = initial_state if initial_state is not None else ops.var_chain_init_state(
        len(q), x0.shape[0], x0.shape[2], x0.shape[3], linear_attention.acc_dtype(x0))
    o, final = ops._chain(layer, x0, q, v, key_kernels, dropout_mask, state, stack=True)  # noqa: SLF001
    o = o if stacked else tuple(o)
    return (o, context_parallel.last_shard(final, axis_name)) if return_state else o


def var_chain(x0: Array, q: Operands, v: Operands, *, chunk_size: int, mesh=None, axis_name: str = "sequence",
              batch_axis: Optional[str] = None, key_kernels: Optional[Array] = None,
              dropout_mask: Optional[Array] = None, mask: Optional[Array] = None,
              segment_ids: Optional[Array] = None, initial_state: Optional[Array] = None,
              return_state: bool = False):
    """`ops.var_chain_chunked`'s outputs (or `ops.var_chain_layers`' with per-layer q, v) with the
    sequence split over `axis_name` of `mesh` (None: the mesh of `jax.set_mesh`).

    Args:
      x0: `[B, T, H, D]`; T must divide by the axis size.
      q, v: `[L, B, T, H, D]` or sequences of L arrays `[B, T, H, D]`.
      chunk_size: C >= 1 of each shard's chunked form (clipped to the shard's length).
      mesh, axis_name: the mesh and its sequence axis; batch_axis: the axis B is split over (None: not).
      key_kernels, dropout_mask, mask, segment_ids: as in `ops.var_chain_parallel`.
      initial_state: optional `[L, B, H, D, D]` state of the tokens before (None: zeros), as
        `ops.var_chain_chunked`'s `state`.
      return_state: also return the final state `[L, B, H, D, D]` (replicated over the axis): prefill
        a prompt over P devices, then decode with `ops.var_chain_step` / `VARChain.step`.

    Returns:
      `[L, B, T, H, D]` (or a tuple of L `[B, T, H, D]`), in x0's dtype, sharded like the inputs; with
      `return_state`, (that, the final state).
    """
    stacked = not isinstance(q, (list, tuple))
    ops.check_chain(x0, q if stacked else tuple(q), v if stacked else tuple(v), key_kernels=key_kernels,
                    dropout_mask=dropout_mask, mask=mask, segment_ids=segment_ids, chunk_size=chunk_size,
                    state=initial_state)
    _check_layout(x0.shape[1], mesh, axis_name)
    tokens, layered = P(batch_axis, axis_name), P(None, batch_axis, axis_name)
    per_layer = layered if stacked else tuple(tokens for _ in q)
    operands = dict(x0=(x0, tokens), q=(q if stacked else tuple(q), per_layer),
                    v=(v if stacked else tuple(v), per_layer), key_kernels=(key_kernels, P()),
                    dropout_mask=(dropout_mask, layered), mask=(mask, tokens), segment_ids=(segment_ids, tokens),
                    initial_state=(initial_state, P(None, batch_axis)))
    body = functools.partial(shard_var_chain, axis_name=axis_name, chunk_size=chunk_size, return_state=return_state)
    return context_parallel.sharded(body, mesh, axis_name, batch_axis, {},
                                    (per_layer, P(None, batch_axis)) if return_state else per_layer, operands)


def _check_layout(t: int, mesh, axis_name: str) -> None:
    """The mesh has `axis_name` and T divides by its size (one line each)."""
    context_parallel.check_length(t, mesh, axis_name)
