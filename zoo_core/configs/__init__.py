"""The zoo's ml_collections configs, shipped inside the package as `zoo_core.configs`.

`<arch>/<task>.py` (each `get_config(arg)`, with a `:smoke` variant), `common.py` (every trainer field),
`tasks/` (the task pieces) and `studies/` (the papers' tables as grids of runs). A checkout also has them
at `configs/`, a link to this folder; the commands name them that way (`--config configs/agf/uea.py`),
and `resolve` finds the shipped file for such a name wherever the command runs.
"""
from __future__ import annotations

__all__ = ["ROOT", "resolve"]

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent
PREFIX = "configs"


def resolve(spec: str) -> str:
    """`spec` ('path[:args]') with its path replaced by the shipped config's when the path names one as
    `configs/<...>` and no such file exists relative to the working directory; else `spec` unchanged
    (a file of the user's own, or a missing file that the caller reports).

    E.g. 'configs/agf/uea.py:smoke' -> '<site-packages>/zoo_core/configs/agf/uea.py:smoke' outside a
    checkout, and unchanged in one.
    """
    path, colon, args = spec.partition(":")
    if not path or os.path.exists(path):
        return spec
    parts = pathlib.PurePath(os.path.normpath(path)).parts
    if len(parts) < 2 or parts[0] != PREFIX:
        return spec
    shipped = ROOT.joinpath(*parts[1:])
    return f"{shipped}{colon}{args}" if shipped.is_file() else spec
