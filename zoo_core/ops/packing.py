"""Packed sequences: several documents in one row, told apart by segment ids (docs/specs/context_parallel.md §2).

`segment_ids` is int `[B, T]`: tokens with the same positive id form one document, 0 is padding (as
in flax's wmt and lm1b input pipelines and MaxText). Documents are contiguous runs of one id; a
token attends only within its own. For a causal form carrying a state, one rule serves chunk
boundaries, shard boundaries and document boundaries: a block of tokens (a chunk or a shard) acts on
the incoming state as `S_out = A S_in + b`, where A = 1 when no document starts inside the block
and 0 when one does, and b is the state of the block's last document alone; the incoming state is
read only by the tokens of the block's first document, and only when that document began before
the block.
"""
from __future__ import annotations

__all__ = ["check_segment_ids", "valid", "starts", "same_segment", "positions_from_segments"]

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from zoo_core.checks import check_shape
from zoo_core.ops import masking

Array = jax.Array


def check_segment_ids(segment_ids: Any, shape: Sequence[int], name: str = "segment_ids") -> None:
    """`segment_ids` is None or an integer array of exactly `shape` (`[B, T]`), in one line."""
    if segment_ids is None:
        return
    check_shape(name, segment_ids, shape, "[B, T]")
    if not jnp.issubdtype(jnp.asarray(segment_ids).dtype, jnp.integer):
        raise ValueError(f"`{name}` must be integers (0 = padding), got dtype {jnp.asarray(segment_ids).dtype}")


def valid(segment_ids: Array, mask: Optional[Array] = None) -> Array:
    """bool `[B, T]`: a real token (segment id > 0, and `mask` True where given)."""
    real = segment_ids > 0
    return real if mask is None else real & masking.as_bool(mask, segment_ids.shape)


def starts(segment_ids: Array) -> Array:
    """bool `[B, T]`: the token's id differs from the previous token's. The first token of the array
    counts as continuing (what comes before it, an incoming state or an earlier shard, decides)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), change], axis=1)


def same_segment(query_ids: Array, key_ids: Array) -> Array:
    """bool `[B, T, S]`: query t and key s are in the same document."""
    return query_ids[:, :, None] == key_ids[:, None, :]


def first_segment(start: Array, axis: int = 1) -> Array:
    """bool, like `start`: the token comes before the first document start along `axis` (its
    block's first document, which may continue the incoming state)."""
    return jnp.cumsum(start.astype(jnp.int32), axis=axis) == 0


def last_segment(start: Array, axis: int = 1) -> Array:
    """bool, like `start`: no document starts after the token along `axis` (its block's last
    document, whose state the block passes on)."""
    counts = jnp.cumsum(start.astype(jnp.int32), axis=axis)
    return counts == jnp.take(counts, jnp.array([-1]), axis=axis)


def poisoned(bad: Array, start: Array) -> Array:
    """bool like `bad` `[B, T, ...]`: at or after a bad (non-finite) position of the same document,
    the recurrence's NaN reach, cut at document starts (`start` `[B, T]`)."""
    t = jnp.arange(bad.shape[1]).reshape((1, -1) + (1,) * (bad.ndim - 2))
    last_bad = jax.lax.cummax(jnp.where(bad, t, -1), axis=1)
    begin = jax.lax.cummax(jnp.where(masking.expand(start, bad.ndim), t, 0), axis=1)
    return last_bad >= begin


def gated_prefix(keep: Array, add: Any, initial: Any) -> tuple[Any, Any]:
    """The states entering each block of a gated chain and the state after the last one.

    With blocks j = 0 .. n-1 along axis 1, `S_0 = initial`, `S_{j+1} = keep_j ? S_j + add_j : add_j`
    (keep `[B, n]` bool: no document starts in block j). Returns (entering `[B, n, ...]` per leaf of
    `add`, final `[B, ...]`). One associative scan (no loop over blocks); a NaN in a cut-off state
    never crosses the cut (`jnp.where`, not a product with 0).
    """
    flat_add, tree = jax.tree_util.tree_flatten(add)
    flat_init = tree.flatten_up_to(initial)

    def combine(a, b):
        (keep_a, add_a), (keep_b, add_b) = a, b
        out = [jnp.where(masking.expand(keep_b, x.ndim), x, 0) + y for x, y in zip(add_a, add_b)]
        return keep_a & keep_b, out

    # Element 0 is the incoming state (never kept beyond a cut), element j + 1 block j's action.
    keeps = jnp.concatenate([jnp.zeros_like(keep[:, :1]), keep], axis=1)
    adds = [jnp.concatenate([i[:, None].astype(x.dtype), x], axis=1) for i, x in zip(flat_init, flat_add)]
    _, states = jax.lax.associative_scan(combine, (keeps, adds), axis=1)
    entering = [s[:, :-1] for s in states]
    final = [s[:, -1] for s in states]
    return tree.unflatten(entering), tree.unflatten(final)


def positions_from_segments(segment_ids: Array) -> Array:
    """int32 `[B, T]`: each token's index inside its document (0 at every document start, so positions
    restart per document for RoPE, HRPE and the sinusoidal tables), 0 at padding (id 0). The first
    token of the array starts at 0: positions of a document that began in an earlier shard or call
    are the caller's (add that document's offset)."""
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None]
    begin = jax.lax.cummax(jnp.where(starts(segment_ids), t, 0), axis=1)
    return jnp.where(segment_ids > 0, t - begin, 0)
