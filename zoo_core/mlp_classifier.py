"""A reference model for the trainer's own tests and self-test entry (`python -m zoo_core.train`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from zoo_core import checks


class MLPClassifier(nn.Module):
    """Two-layer MLP: batch['inputs'] [B, F] -> ({'logits': [B, K]}, aux).

    `aux['loss/l2']` is a small penalty on the output kernel, so every trainer test also exercises the
    path that adds model-provided losses to the task loss.

    Attributes:
      hidden: width of the hidden layer.
      num_classes: K.
      l2: weight of the output-kernel penalty.
      dtype, param_dtype: compute and parameter dtypes.
    """
    hidden: int
    num_classes: int
    l2: float = 1e-4
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        for name in ("hidden", "num_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.dense_in = nn.Dense(self.hidden, dtype=self.dtype, param_dtype=self.param_dtype, name="dense_in")
        self.dense_out = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                                  name="dense_out")

    def __call__(self, batch, *, train: bool = False):
        x = batch["inputs"]
        if x.ndim != 2:
            raise ValueError(f"batch['inputs'] must be [B, F], got shape {x.shape}")
        logits = self.dense_out(nn.gelu(self.dense_in(x)))
        penalty = self.l2 * jnp.sum(self.dense_out.variables["params"]["kernel"] ** 2)
        return {"logits": logits}, {"loss/l2": penalty}


def Model(**kwargs) -> nn.Module:  # noqa: N802
    """`MLPClassifier(**config.model)`; None leaves a field unset and dtypes may be named
    (`checks.constructor_kwargs`). Raises ValueError naming an unknown field."""
    fields = {f.name for f in dataclasses.fields(MLPClassifier)} - {"parent", "name"}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        checks.fail(f"unknown Model kwargs: {unknown}; allowed: {sorted(fields)}")
    return MLPClassifier(**checks.constructor_kwargs(kwargs))
