"""Resuming a run: which config changes a resumed run may make (`SAFE_ON_RESUME`, `check_resume`) and
which model an evaluation may use (`check_eval_config`), against the run's stored config.json.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from zoo_core.run.errors import ConfigError

# Config fields that may change between a run and its resumption: they decide what is logged,
# evaluated or kept, not what is trained. `total_steps` may grow when the schedule does not depend on
# it (see `resume_changes`). Every other difference is refused unless the caller allows it.


SAFE_ON_RESUME = ("log_every_steps", "eval_every_steps", "eval_also_at_step", "eval_max_examples",
                  "eval_batch_size", "checkpoint_every_steps", "progress_bar", "checkpoint.keep",
                  "checkpoint.best_metric", "checkpoint.best_mode", "checkpoint.patience", "data.data_dir",
                  "data.eval_split", "test_split", "decode.", "parallel.cpu_devices", "parallel.sequence")
# Fields added after runs were stored: absent in a stored config means this value.
ADDED_DEFAULTS = {"data.packing": False, "data.packing_factor": 1, "parallel.sequence": 1}
# Schedules whose learning rate at a step does not depend on total_steps.


_STEP_FREE_SCHEDULES = ("constant", "warmup_rsqrt")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def resume_changes(stored: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed): the dotted keys in which `new` differs from the `stored` config of a run.

    Both are JSON-like dicts (`config.to_json_best_effort()`). Allowed are the `SAFE_ON_RESUME` fields
    and a larger total_steps under a schedule that does not depend on it. A null field (an unset
    placeholder) equals an absent one: both leave the value to the model or dataset; an absent field of
    `ADDED_DEFAULTS` (a config stored before it existed) equals its default.
    """
    a, b = _flatten(dict(stored)), _flatten(dict(new))
    for key, value in ADDED_DEFAULTS.items():
        a.setdefault(key, value)
        b.setdefault(key, value)
    refused, allowed = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):   # equal, or null on one side and absent on the other
            continue
        safe = any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)
        if key == "total_steps":
            old_steps, new_steps = a.get(key), b.get(key)
            schedule = b.get("schedule.name")
            safe = (isinstance(old_steps, int) and isinstance(new_steps, int) and new_steps >= old_steps
                    and schedule in _STEP_FREE_SCHEDULES and a.get("schedule.name") == schedule)
        (allowed if safe else refused).append(key)
    return refused, allowed


def _describe(key: str, stored: dict, new: dict) -> str:
    missing = "(absent)"
    return f"{key}: {stored.get(key, missing)!r} -> {new.get(key, missing)!r}"


def _has_checkpoints(workdir: str) -> bool:
    checkpoints = os.path.join(workdir, "checkpoints")
    return os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))


def stored_run_config(workdir: str) -> dict | None:
    """The config.json of the run in `workdir` if it has a checkpoint to resume (and the file is
    there), else None."""
    return _read_run_config(os.path.join(workdir, "config.json")) if _has_checkpoints(workdir) else None


def _read_run_config(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({type(e).__name__}); it records the run's config, "
                          "restore it or use a new --workdir") from e
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} holds a JSON {type(stored).__name__}, not a config (a JSON object); it "
                          "records the run's config, restore it or use a new --workdir")
    return stored


def check_resume(config_dict: dict, workdir: str, *, allow_config_change: bool = False) -> list[str]:
    """Compares the config of the run being resumed in `workdir` with `config_dict`.

    Returns:
      The lines describing the differences that the resumed run will use (to be logged).

    Raises:
      ConfigError: a difference in a field that changes what is trained (model, optimiser, schedule,
        data, seed, batch, ...), naming the keys, or checkpoints without their config.json, unless
        `allow_config_change`.
    """
    stored = stored_run_config(workdir)
    if stored is None:
        if not _has_checkpoints(workdir):
            return []
        if not allow_config_change:   # their config cannot be compared with this one
            raise ConfigError(f"{workdir} holds checkpoints but no config.json, so the config they were "
                              "trained with cannot be compared with this one; restore config.json, use a new "
                              "--workdir, or pass --allow_config_change to resume them with this config")
        return ["config.json was missing: resuming the checkpoints with this config (allow_config_change)"]
    refused, allowed = resume_changes(stored, config_dict)
    a, b = _flatten(stored), _flatten(config_dict)
    if refused and not allow_config_change:
        shown = ", ".join(_describe(k, a, b) for k in refused[:6])
        more = f" and {len(refused) - 6} more" if len(refused) > 6 else ""
        problem = f"the run in {workdir} was trained with another config: {shown}{more}; resume it with its own config"
        raise ConfigError(f"{problem}, use a new workdir, or call train_and_evaluate(allow_config_change=True) to "
                          f"continue with the new values",
                          command_line=f"{problem}, use a new --workdir, or pass --allow_config_change to continue "
                                       f"with the new values")
    return [_describe(k, a, b) for k in refused + allowed]


# Model fields an evaluation may set differently from training: they change how the model computes,
# not which parameters it has or what they mean.


EVAL_MAY_CHANGE = ("model.dtype", "model.remat")


def check_eval_config(config_dict: dict, workdir: str) -> None:
    """Refuses to evaluate the checkpoints in `workdir` with a model other than the one they trained.

    The parameters only mean something in their own model: another size fails in the middle of the
    restore, and another kind of the same size (an attention or a filter swapped) would score quietly
    wrong numbers. Compares `config_dict` (`config.to_json_best_effort()`) with the run's config.json
    (no check without one) over the `model` fields, except `EVAL_MAY_CHANGE`. Data and evaluation
    settings may differ: scoring a run on another split or draw is what `--eval_only` is for.

    Raises:
      ConfigError: naming the model fields that differ.
    """
    path = os.path.join(workdir, "config.json")
    stored = _read_run_config(path)
    if stored is None:
        return
    a, b = _flatten(stored), _flatten(config_dict)
    changed = [k for k in sorted(set(a) | set(b)) if k.startswith("model.") and k not in EVAL_MAY_CHANGE
               and a.get(k) != b.get(k)]
    if changed:
        shown = ", ".join(_describe(k, a, b) for k in changed[:6])
        more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
        raise ConfigError(f"the checkpoints in {workdir} were trained with another model: {shown}{more}; "
                          f"evaluate them with the config they were trained with ({path})")
