"""Halo exchange for local attention split over a sequence mesh axis (docs/specs/context_parallel.md §3).

A mechanism whose token i reads only tokens within a reach r of it (a sliding window, a graph stencil)
needs, on the shard holding tokens [p n, (p+1) n), only r boundary tokens of each neighbouring shard:
received with one `jax.lax.ppermute` per side (the left one only, when causal), so the bytes moved depend
on r, never on the length. Each shard must hold at least r tokens. Inside `jax.shard_map`; with
`axis_name=None` (one device) the halo is padding (zeros), so that one body serves both.

Shared by the window graph (`htgn_jax.graph_packed`) and Longformer (`zoo_core.baselines.longformer`).
"""
from __future__ import annotations

__all__ = ["shift_in", "extend", "earlier"]

from typing import Callable, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def shift_in(x: Array, size: int, left: bool, axis_name: Optional[str], num_shards: int) -> Array:
    """The `size` tokens `[B, size, ...]` beside this shard's x `[B, n, ...]` (size <= n): the left
    neighbour's last ones (`left`) or the right neighbour's first ones; zeros past the row's ends and on
    one device."""
    if axis_name is None or num_shards == 1:
        return jnp.zeros((x.shape[0], size) + x.shape[2:], x.dtype)
    if left:
        return jax.lax.ppermute(x[:, x.shape[1] - size:], axis_name, [(i, i + 1) for i in range(num_shards - 1)])
    return jax.lax.ppermute(x[:, :size], axis_name, [(i + 1, i) for i in range(num_shards - 1)])


def extend(x: Array, left: int, right: int, axis_name: Optional[str], num_shards: int) -> Array:
    """`[left halo ; x ; right halo]` along axis 1: `[B, left + n + right, ...]`."""
    parts = [shift_in(x, left, True, axis_name, num_shards)] if left else []
    parts += [x] + ([shift_in(x, right, False, axis_name, num_shards)] if right else [])
    return jnp.concatenate(parts, axis=1) if len(parts) > 1 else x


def earlier(x: Array, axis_name: Optional[str], reduce: Callable, empty) -> Array:
    """`reduce` over the shards before this one of x `[B, ...]` (`empty` on the first shard and on one
    device): one `all_gather`, the later shards' entries replaced with `jnp.where`."""
    if axis_name is None:
        return jnp.full_like(x, empty)
    gathered = jax.lax.all_gather(x, axis_name)                                   # [P, B, ...]
    before = (jnp.arange(gathered.shape[0]) < jax.lax.axis_index(axis_name)).reshape((-1,) + (1,) * x.ndim)
    return reduce(jnp.where(before, gathered, empty), axis=0)
