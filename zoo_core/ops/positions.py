"""Position tables shared by the packages and the examples."""
from __future__ import annotations

import math

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
