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


def _run(block: nn.Module, deterministic: bool, args: tuple, kwargs: dict) -> Any:
    return block(*args, deterministic=deterministic, **kwargs)


_remat_run = nn.remat(_run, static_argnums=(1,))


def call_block(block: nn.Module, *args: Any, deterministic: bool, remat: bool,
               **kwargs: Any) -> Any:
    """`block(*args, deterministic=deterministic, **kwargs)`, rematerialised when `remat` is True.

    Args:
      block: a bound Linen submodule whose `__call__` takes `deterministic=`.
      *args, **kwargs: its other arguments (arrays, None or static Python values in kwargs are
        passed through as pytrees).
      deterministic: dropout off (static).
      remat: recompute the block's forward pass in the backward pass.
    """
    if not remat:
        return block(*args, deterministic=deterministic, **kwargs)
    return _remat_run(block, deterministic, args, kwargs)
