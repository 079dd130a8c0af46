"""Argument checks shared by the whole zoo: one wording for every boundary error.

Validation happens once, at the boundary (configs, the `Model(...)` factories, the public layer
entry points for structure); every check raises `ValueError` with one line that names the argument
and what is expected, in the form "`name` must be ..., got ...".
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np


def fail(msg: str) -> None:
    """Raises the zoo's boundary error (`ValueError`) with `msg`."""
    raise ValueError(msg)


# Compute / parameter dtypes a config may name (`--config.model.dtype=bfloat16`).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def model_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`config.model` as constructor kwargs, for the `Model(**config.model)` factories.

    A None value marks a field the config leaves unset (an ml_collections placeholder): it is dropped,
    so the class default or the value the model derives applies exactly as if it were not passed.
    `dtype` and `param_dtype` may be given by name ('bfloat16'); they become numpy dtypes.
    """
    out = {k: v for k, v in kwargs.items() if v is not None}
    for key in ("dtype", "param_dtype"):
        if isinstance(out.get(key), str):
            check_choice(key, out[key], DTYPE_NAMES)
            import jax.numpy as jnp   # only here: the rest of this module is numpy-only
            out[key] = jnp.dtype(out[key])
    return out


def check_int(name: str, value: Any, minimum: int = 0) -> None:
    """`value` is an integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        fail(f"`{name}` must be an integer >= {minimum}, got {value!r}")


def check_optional_int(name: str, value: Any, minimum: int = 1) -> None:
    """`value` is None or an integer >= `minimum`."""
    if value is not None:
        check_int(name, value, minimum)


def check_rate(name: str, value: Any) -> None:
    """`value` is a real number in [0, 1) (a dropout or drop-path probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not 0.0 <= float(value) < 1.0:
        fail(f"`{name}` must be in [0, 1), got {value!r}")


def check_positive(name: str, value: Any) -> None:
    """`value` is a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not (np.isfinite(value) and value > 0):
        fail(f"`{name}` must be a finite number > 0, got {value!r}")


def check_nonnegative(name: str, value: Any) -> None:
    """`value` is a finite real number >= 0 (a loss weight, a norm bound, a ratio)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not (np.isfinite(value) and value >= 0):
        fail(f"`{name}` must be a finite number >= 0, got {value!r}")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """`value` is one of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        fail(f"`{name}` must be one of {choices}, got {value!r}")


def check_divisible(name: str, value: int, divisor_name: str, divisor: int) -> None:
    """`value` is a multiple of `divisor`."""
    if divisor < 1 or value % divisor:
        fail(f"`{name}` = {value} must be divisible by `{divisor_name}` = {divisor}")


def check_rank(name: str, x: Any, rank: int, shape_doc: str) -> None:
    """`x` has `rank` dimensions (`shape_doc` says which, e.g. '[B, T, E]')."""
    if np.ndim(x) != rank:
        fail(f"`{name}` must have rank {rank} {shape_doc}, got shape {tuple(np.shape(x))}")


def check_shape(name: str, x: Any, shape: Sequence[int], shape_doc: str) -> None:
    """`x` has exactly `shape`."""
    if tuple(np.shape(x)) != tuple(shape):
        fail(f"`{name}` must have shape {shape_doc} = {tuple(shape)}, got {tuple(np.shape(x))}")


def check_mask(mask: Any, batch_time: Sequence[int], name: str = "mask") -> None:
    """`mask` is None or a `[B, T]` key-padding mask (bool, True = valid; 0/1 also accepted)."""
    if mask is not None:
        check_shape(name, mask, batch_time, "[B, T]")
