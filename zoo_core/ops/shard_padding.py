"""Padding a sequence to a multiple of the shards of a `sequence` mesh axis, inside a model.

A context-parallel layer (docs/specs/context_parallel.md) splits T evenly over the P devices of its
mesh axis. A model whose own sequence has a length P may not divide (HTGN's `[globals ; tokens]`,
SAMoVAR's 2N ARX tokens) pads it at its end before its layers and removes the padding after them:

* causal layers: positions past the end change no earlier output, so no mask is needed;
* non-causal layers: the added positions are masked (`mask` False), which every layer of the zoo
  treats as absent (README "Layer contract": padding never changes an output).

The axis size is read from the mesh of `jax.set_mesh` while tracing; without that axis there is
nothing to pad to, and the layer's own check names the missing axis.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def shard_count(axis_name: Optional[str]) -> int:
    """The size of mesh axis `axis_name` under `jax.set_mesh` (1: None, or no such axis)."""
    if axis_name is None:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    return int(mesh.shape[axis_name]) if axis_name in mesh.axis_names else 1


def padded_length(length: int, axis_name: Optional[str]) -> int:
    """`length` rounded up to a multiple of the shards of `axis_name` (`shard_count`)."""
    p = shard_count(axis_name)
    return -(-length // p) * p


def pad_end(x: Optional[Array], length: int, *, axis: int = 1, value=0) -> Optional[Array]:
    """x with `value` appended along `axis` up to `length` (x itself when it is that long; None stays)."""
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)
