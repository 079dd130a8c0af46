"""The NaN guard, once for the zoo: what a non-finite input does to a form that never loops over tokens.

A recurrence `S_t = S_{t-1} + k_t v_t^T` that meets a NaN or inf key or value at a valid position t
carries it into every later output (and into the final state). A parallel or chunked form replaces
such inputs before its sums (a future weight of exactly 0 times NaN would still give NaN) and so must
put the NaN back where the recurrence has it: at and after the bad position, within its document
when the batch is packed (`zoo_core.ops.packing`). Padding never counts: it is removed first.

    bad = guard.nonfinite(k, v, valid=mask)          # [B, T, H]
    k, v = guard.clean(k, bad), guard.clean(v, bad)
    ...                                              # the form's sums
    out = guard.poison(out, guard.reach(bad, segment_ids))
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from zoo_core.ops import masking, packing

Array = jax.Array


def nonfinite(*xs: Array, valid: Optional[Any] = None) -> Array:
    """bool `[B, T, H]`: some x `[B, T, H, ...]` holds a NaN or inf at that position and head (its
    trailing axes reduced), at a valid position only (`valid` `[B, T]`, None = all)."""
    bad = None
    for x in xs:
        finite = jnp.isfinite(x)
        x_bad = ~jnp.all(finite.reshape(finite.shape[:3] + (-1,)), axis=-1)
        bad = x_bad if bad is None else bad | x_bad
    return bad if valid is None else bad & masking.expand(valid, bad.ndim)


def reach(bad: Array, segment_ids: Optional[Array] = None) -> Array:
    """bool like `bad` `[B, T, ...]`: at or after a bad position along T, the recurrence's NaN reach;
    with `segment_ids` `[B, T]` only within the bad position's document."""
    if segment_ids is not None:
        return packing.poisoned(bad, packing.starts(segment_ids))
    return jnp.cumsum(bad.astype(jnp.int32), axis=1) > 0


def last(poisoned: Array) -> Array:
    """bool `[B, ...]`: the final state is reached by a bad input (the last position is poisoned)."""
    if poisoned.shape[1]:
        return poisoned[:, -1]
    return jnp.zeros(poisoned.shape[:1] + poisoned.shape[2:], bool)


def clean(x: Array, drop: Array, fill: Any = 0.0) -> Array:
    """x `[B, T, H, ...]` with the positions where `drop` `[B, T, H]` is True replaced by `fill`."""
    return jnp.where(masking.expand(drop, x.ndim), jnp.asarray(fill, x.dtype), x)


def poison(x: Optional[Array], poisoned: Array) -> Optional[Array]:
    """x (`poisoned`'s shape plus trailing axes) set to NaN where `poisoned` is True; None stays None."""
    if x is None:
        return None
    where = poisoned.reshape(poisoned.shape + (1,) * (x.ndim - poisoned.ndim))
    return jnp.where(where, jnp.asarray(jnp.nan, x.dtype), x)
