"""Position tables shared by the packages and the examples: the table `[length, width]` (NumPy, a trace-time
constant) and the same rows at given positions `[B, T]` (packed documents restart their positions,
`zoo_core.ops.packing.positions_from_segments`)."""
from __future__ import annotations

__all__ = ["sinusoidal_table", "sinusoidal_at"]

import math

import jax.numpy as jnp
import numpy as np


def sinusoidal_table(length: int, width: int) -> np.ndarray:
    """The sine/cosine position table `[length, width]` float32 of Vaswani et al. 2017, §3.5: sin in
    the even columns, cos in the odd ones (an odd width drops the last cos column, as AGF's reference
    FixedPositionalEncoding does)."""
    pos = np.arange(length, dtype=np.float32)[:, None]
    div = np.exp(np.arange(0, width, 2, dtype=np.float32) * (-math.log(10000.0) / width))
    table = np.zeros((length, width), np.float32)
    table[:, 0::2] = np.sin(pos * div)
    table[:, 1::2] = np.cos(pos * div)[:, : width // 2]
    return table


def sinusoidal_at(positions, width: int):
    """The rows of `sinusoidal_table` at integer `positions` (any shape, e.g. `[B, T]`): float32
    `[..., width]`, computed in jnp, equal to the table's rows up to float32 rounding of sin and cos.
    With `positions = packing.positions_from_segments(segment_ids)` every packed document gets the
    table of a document alone."""
    pos = jnp.asarray(positions).astype(jnp.float32)[..., None]
    div = jnp.asarray(np.exp(np.arange(0, width, 2, dtype=np.float32) * (-math.log(10000.0) / width)))
    angles = pos * div                                                        # [..., ceil(width / 2)]
    table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(angles.shape[:-1] + (-1,))
    return table[..., :width]
