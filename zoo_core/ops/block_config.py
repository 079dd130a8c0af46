"""How a model passes its fields down to its blocks, one way in every package (flax's wmt example's
`TransformerConfig` pattern): a frozen dataclass of the shared fields, built once by the model from its
own same-named fields (`config_from`) and passed to every block and encoder as its `config` field.

Each package declares its own dataclass (`agf_jax.model.BlockConfig`, `htgn_jax.blocks.BlockConfig`);
the models keep their flat fields, which `Model(**config.model)` sets, and the layers inside a block
take explicit fields that the block reads from its config.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def config_from(cls: type[T], module: Any, **overrides) -> T:
    """`cls(...)` with each field that `module` also has taken from it, then `overrides`.

    Args:
      cls: a dataclass (frozen, so that a Linen module can hold it as a field).
      module: the model (any object) whose same-named attributes give the fields.
      **overrides: fields set explicitly (derived values, e.g. a resolved head width).

    Returns:
      The config; a field neither on `module` nor in `overrides` keeps its default.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{**{n: getattr(module, n) for n in names if hasattr(module, n)}, **overrides})
