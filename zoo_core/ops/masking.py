"""Key-padding masks, once for the zoo: the shape check and the NaN-safe removal of padding.

A mask is `[B, T]` (bool, True = a real token; any nonzero number also counts as real) or None (no
padding). Padding is removed with `jnp.where`, never by multiplying with 0: 0 * NaN = NaN, so a
padded position holding NaN or 1e30 would otherwise still reach the output.
"""
from __future__ import annotations

__all__ = ["check_mask", "as_bool", "expand", "zero_padding"]

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from zoo_core.checks import check_shape

Array = jax.Array


def check_mask(mask: Any, shape: Sequence[int], name: str = "mask", shape_doc: str = "[B, T]") -> None:
    """`mask` is None or has exactly `shape` (`shape_doc` names its axes, e.g. '[B, T]').

    Raises the zoo's boundary error: "`mask` must have shape [B, T] = (2, 7), got (2, 5)".
    """
    if mask is not None:
        check_shape(name, mask, shape, shape_doc)


def as_bool(mask: Any, shape: Sequence[int], name: str = "mask", shape_doc: str = "[B, T]") -> Array:
    """`mask` checked against `shape` and returned as bool `shape` (all True when `mask` is None)."""
    if mask is None:
        return jnp.ones(tuple(shape), bool)
    check_mask(mask, shape, name, shape_doc)
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def expand(mask: Any, ndim: int) -> Array:
    """bool `[B, T]` (or `[B]`) mask with trailing unit axes up to `ndim` dimensions, for `where`."""
    mask = jnp.asarray(mask).astype(bool)
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def zero_padding(x: Array, mask: Optional[Any], fill: Any = 0) -> Array:
    """x `[B, T, ...]` (or `[B, ...]` with a `[B]` mask) with the positions where `mask` is False
    replaced by `fill` (0 by default) in x's dtype; x unchanged when `mask` is None."""
    if mask is None:
        return x
    return jnp.where(expand(mask, jnp.ndim(x)), x, jnp.asarray(fill, jnp.result_type(x)))
