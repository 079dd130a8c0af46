"""How a model passes its fields down to its blocks, one way in every package (flax's wmt example's
`TransformerConfig` pattern): a frozen dataclass of the shared fields, built once by the model from its
own same-named fields (`config_from`) and passed to every block and encoder as its `config` field.

Each package has its own dataclass (`agf_jax.model.BlockConfig`, `htgn_jax.blocks.BlockConfig`,
`samovar_jax.model.BlockConfig`); the models keep their flat fields, which `Model(**config.model)` sets,
and the layers inside a block take explicit fields that the block reads from its config. Where the
config holds exactly the models' shared fields, `config_class` makes it from them, so that the field
list is written once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence, TypeVar

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


def config_class(fields_of: type, name: str, doc: str, *,
                 extra: Sequence[tuple[str, Any, Any]] = ()) -> type:
    """A frozen dataclass with the fields of the Linen module class `fields_of`, plus `extra`.

    Args:
      fields_of: the models' shared-fields class (a Linen module, whose `parent` and `name` are left out).
      name, doc: the new class's name and docstring.
      extra: (field name, type, default) of block-only fields the models do not all have.

    Returns:
      The class (keyword-only fields with the same defaults, hashable), with `from_module(m,
      **overrides)` = `config_from(cls, m, **overrides)`.
    """
    specs = [(f.name, f.type, dataclasses.field(default=f.default)) if f.default is not dataclasses.MISSING
             else (f.name, f.type) for f in dataclasses.fields(fields_of) if f.name not in ("parent", "name")]
    specs += [(n, t, dataclasses.field(default=d)) for n, t, d in extra]
    namespace = {"__doc__": doc, "__module__": fields_of.__module__,
                 "from_module": classmethod(lambda cls, m, **overrides: config_from(cls, m, **overrides))}
    return dataclasses.make_dataclass(name, specs, frozen=True, kw_only=True, namespace=namespace)
