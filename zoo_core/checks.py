"""Argument checks shared by the whole zoo: one wording for every boundary error.

Validation happens once, at the boundary (configs, the `Model(...)` factories, the public layer
entry points for structure); every check raises `ValueError` with one line that names the argument
and what is expected, in the form "`name` must be ..., got ...".
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Any, Iterable, Sequence

import numpy as np


def fail(msg: str) -> None:
    """Raises the zoo's boundary error (`ValueError`) with `msg`."""
    raise ValueError(msg)


# Compute / parameter dtypes a config may name (`--config.model.dtype=bfloat16`).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def constructor_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`config.model` as constructor kwargs, for the `Model(**config.model)` factories.

    A None value marks a field the config leaves unset (an ml_collections placeholder): it is dropped,
    so the class default or the value the model derives applies exactly as if it were not passed.
    `dtype` and `param_dtype` may be given by name ('bfloat16'); they become numpy dtypes.
    """
    out = {k: v for k, v in kwargs.items() if v is not None}
    for key in ("dtype", "param_dtype"):
        if isinstance(out.get(key), str):
            check_choice(key, out[key], DTYPE_NAMES)
            import jax.numpy as jnp  # only here: the rest of this module is numpy-only
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


def check_chunk_size(chunk_size: Any, causal: bool = True) -> None:
    """`chunk_size` (the chunk length C of a chunked causal form) is None or an integer >= 1, and
    None unless `causal` (it chooses the causal form)."""
    check_optional_int("chunk_size", chunk_size, 1)
    if chunk_size is not None and not causal:
        fail("`chunk_size` applies only to causal=True (it chooses the causal form)")


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


def output_path_problem(path: str, *, directory: bool) -> str | None:
    """Why `path` cannot be written as a directory (`directory`) or a file, or None when it can.

    It can when it already is one of that kind, or when the nearest existing folder above it is a
    writable directory (then it is created later, by whoever writes it). A folder that permissions call
    writable is also asked to take a new entry, an empty folder made and removed at once: some file
    systems refuse every new entry whatever the permissions say (/proc, /sys). Nothing is left
    behind, so a refused run leaves nothing. The answer is a phrase to put after the path in a
    one-line error.
    """
    if not path:
        return "is empty"
    full = os.path.abspath(path)
    kind = "a directory" if directory else "a file"
    if os.path.islink(full) and not os.path.exists(full):   # nothing can be made through it
        return f"is a symbolic link to {os.readlink(full)!r}, which does not exist; create that or give another path"
    if os.path.exists(full):
        if os.path.isdir(full) != directory:
            other = "directory" if os.path.isdir(full) else "file"
            return f"is an existing {other}; expected {kind} (or a path to create)"
        if not os.access(full, os.W_OK | (os.X_OK if directory else 0)):
            return "is not writable"
        return _refuses_new_entries(full) if directory else None
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be made: {parent!r} is a file, so no directory can be made under it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: {parent!r} is not writable"
    problem = _refuses_new_entries(parent)
    return f"cannot be made: {parent!r} {problem}" if problem else None


def _refuses_new_entries(directory: str) -> str | None:
    """A phrase when `directory` refuses a new entry (tried with an empty folder, removed at once)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_check_", dir=directory))
    except OSError as e:
        return f"takes no new entries ({e.strerror})"
    return None


def check_rank(name: str, x: Any, rank: int, shape_doc: str) -> None:
    """`x` has `rank` dimensions (`shape_doc` says which, e.g. '[B, T, E]')."""
    if np.ndim(x) != rank:
        fail(f"`{name}` must have rank {rank} {shape_doc}, got shape {tuple(np.shape(x))}")


def check_tokens(name: str, x: Any, shape_doc: str) -> None:
    """`x` is a sequence batch `shape_doc` (e.g. '[B, T, E]'): rank 3 with at least one token, the
    attention layers' input in every form (an empty sequence has no output, no state change and no
    regulariser worth returning)."""
    check_rank(name, x, 3, shape_doc)
    if np.shape(x)[1] < 1:
        fail(f"`{name}` {shape_doc} must hold at least one token, got shape {tuple(np.shape(x))}")


def check_shape(name: str, x: Any, shape: Sequence[int], shape_doc: str) -> None:
    """`x` has exactly `shape`."""
    if tuple(np.shape(x)) != tuple(shape):
        fail(f"`{name}` must have shape {shape_doc} = {tuple(shape)}, got {tuple(np.shape(x))}")


# ----------------------------------------------------------------------------------------------------
# argparse helpers of the scripts (benchmarks/): a bad value is a usage error (exit 2, one line naming
# the flag) when the command is parsed, not a traceback minutes into a run. No jax here: some scripts
# parse their flags before jax may be imported (the CPU device count).


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage error is one line, `error: <message>` on stderr with exit status 2,
    as the training commands answer (argparse prints its usage block first); `--help` still shows the
    usage and every argument."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(str(message).split())}\n")

def _number(text: str, kind: type, minimum: float, strict: bool) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum or (strict and value == minimum):
        what = "an integer" if kind is int else "a finite number"
        raise argparse.ArgumentTypeError(f"must be {what} {'>' if strict else '>='} {minimum:g}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number(text, int, 1, False)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, 0, False)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, 0, True)


def existing_file(text: str) -> str:
    """argparse type: the path of an existing file (not a folder); a leading '~' is the home folder."""
    path = os.path.expanduser(text)
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; expected a file")
    return path


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers >= 1 ('1024,2048')."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1, got {text!r}")
    try:
        return [positive_int(t.strip()) for t in items]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of integers >= 1, got {text!r}") from None


def choice_list(parser: argparse.ArgumentParser, flag: str, text: str, choices: Iterable[str]) -> list[str]:
    """The comma-separated subset of `choices` given to `flag` ('--cases'), in the order given. An
    unknown entry, an entry named twice, or none at all is a usage error (exit 2)."""
    choices = list(choices)
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(items) - set(choices))
    if unknown:
        parser.error(f"unknown {flag} {unknown}; choose from {choices}")
    twice = sorted({t for t in items if items.count(t) > 1})
    if twice:
        parser.error(f"{flag} names {', '.join(twice)} more than once")
    if not items:
        parser.error(f"{flag} names none of {choices}")
    return items


def check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                       dirs: Sequence[str] = (), files: Sequence[str] = ()) -> None:
    """A usage error (exit 2) when a given output flag cannot be written: a file where a folder is
    expected or the reverse, or under a file, or not writable (`output_path_problem`). Checked
    before anything is measured, so a run never ends in a traceback when it comes to write its result.
    A leading '~' in a given path is expanded in `args`."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for names, directory in ((dirs, True), (files, False)):
        for name in names:
            path = getattr(args, name)
            if path is None:
                continue
            if isinstance(path, str):   # '--out=~/x.json': the shell leaves that '~' to us
                path = os.path.expanduser(path)
                setattr(args, name, path)
            problem = output_path_problem(str(path), directory=directory)
            if problem:
                parser.error(f"{flags.get(name, '--' + name)} {path!r} {problem}")
