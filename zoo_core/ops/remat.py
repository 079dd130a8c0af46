"""Rematerialised blocks: `call_block(block, ...)` recomputes a block's forward pass in the backward
pass.

Every model of the zoo has a `remat` field (a config field, `--config.model.remat=true`): with it,
each block of the encoder / trunk / decoder is called through `flax.linen.remat`, so that only the
block's inputs are kept for the backward pass and everything inside is recomputed there: less
activation memory (what limits the batch and the sequence length on an accelerator) for about one
more forward pass of compute. Parameters, values and gradients are the same either way (tested).

`deterministic` is a Python bool that decides whether dropout runs; it is passed to the lifted
function as a static argument (a keyword argument would be traced).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn


def _run(block: nn.Module, deterministic: bool, method: str, args: tuple, kwargs: dict) -> Any:
    return getattr(block, method)(*args, deterministic=deterministic, **kwargs)


_remat_run = nn.remat(_run, static_argnums=(1, 2))


def call_block(block: nn.Module, *args: Any, deterministic: bool, remat: bool,
               method: str = "__call__", **kwargs: Any) -> Any:
    """`block.method(*args, deterministic=deterministic, **kwargs)`, rematerialised when `remat`.

    Args:
      block: a bound Linen submodule whose `method` takes `deterministic=`.
      *args, **kwargs: its other arguments (arrays or None; with remat they are traced, so no
        Python values that steer control flow).
      deterministic: dropout off (static).
      remat: recompute the block's forward pass in the backward pass.
      method: the name of the block's method to call (static).
    """
    if not remat:
        return getattr(block, method)(*args, deterministic=deterministic, **kwargs)
    return _remat_run(block, deterministic, method, args, kwargs)
