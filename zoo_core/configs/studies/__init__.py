"""Study files: the seeds' tables and figures as grids of runs (`python -m zoo_core.study`, docs/studies.md).

Each file defines `get_study(arg)` returning a `zoo_core.study.Study`; `args` parses its `:key=value,...`
the way the training configs do (`configs.common.parse_arg`), and every study takes `smoke` (the same grid
shape on 2-step runs of the configs' `:smoke` variants, fewer cells and seeds) and `seeds=N`.
"""
from __future__ import annotations

from typing import Any, Sequence

from zoo_core import study
from zoo_core.configs import common


def args(arg: str | None, **defaults: Any):
    """The study's `:args` with `smoke` and `seeds` (0: the study's default count) added."""
    parsed = common.parse_arg(arg, smoke=False, seeds=0, **defaults)
    if parsed.seeds < 0:
        raise ValueError(f"study argument seeds={parsed.seeds} must be >= 0")
    return parsed


def seeds(parsed, pool: Sequence[int], default: int, smoke: int = 1) -> list[int]:
    """The first `seeds` of `pool` (the study's own order, e.g. the UEA protocol's 666 first)."""
    n = parsed.seeds or (smoke if parsed.smoke else default)
    if n > len(pool):
        raise ValueError(f"study argument seeds={n}: at most {len(pool)} seeds")
    return list(pool[:n])


def smoke_arg(parsed, config_args: str = "") -> str:
    """':args' of a cell's config: `config_args` plus 'smoke' for a smoke study."""
    parts = [p for p in (config_args, "smoke" if parsed.smoke else "") if p]
    return ":" + ",".join(parts) if parts else ""


def ints(text: str) -> list[int]:
    """'1-2-4' -> [1, 2, 4] (a list inside `:args`, whose items are split on commas)."""
    try:
        return [int(t) for t in text.split("-") if t]
    except ValueError:
        raise ValueError(f"study argument {text!r}: give integers joined by '-', e.g. 1-2-4") from None


def floats(text: str) -> list[float]:
    """'0-1e-4-1e-2' is ambiguous, so floats are joined by '_': '0_1e-4_1e-2' -> [0.0, 1e-4, 1e-2]."""
    try:
        return [float(t) for t in text.split("_") if t]
    except ValueError:
        raise ValueError(f"study argument {text!r}: give numbers joined by '_', e.g. 0_1e-4_1e-2") from None


# The HTGN studies' tasks: config, headline metrics, the command after each run, the data's name.
HTGN_TASKS = ("number_words", "digits")


def htgn_task(parsed):
    """(config file, metrics, evaluate flags, label) of the HTGN study argument `task`: number-words
    En -> De (validation BLEU and exact match, the best validation checkpoint's test BLEU) or digits
    (test accuracy: its only held-out split, the best over the evaluations and the last, the config's
    reported number)."""
    if parsed.task not in HTGN_TASKS:
        raise ValueError(f"study argument task={parsed.task!r}; choose one of {', '.join(HTGN_TASKS)}")
    if parsed.task == "digits":
        return ("configs/htgn/digits.py",
                [study.Best("eval/accuracy", "max", label="best test accuracy"),
                 study.Last("eval/accuracy", label="last test accuracy")], (), "digits")
    return ("configs/htgn/number_words.py",
            [study.Best("eval/bleu", "max", label="best validation BLEU"),
             study.Best("eval/exact_match", "max", label="best validation exact match"),
             study.EvalFile("eval_best_test.json", "eval/bleu", label="test BLEU (best val ckpt)")],
            ("--eval_only", "--eval_split=test"), "number words")
