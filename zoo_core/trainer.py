"""The one trainer of the zoo: `train_and_evaluate(config, workdir, build_model)`.

Architectures plug in through `build_model` (called as `build_model(**config.model)`), whose module maps
`(batch, train=...)` to `(outputs, aux)`. The task (`config.task`) turns outputs into per-example
metrics, and every `aux['loss/<name>']` scalar is added to the task loss, so regularisers need no fork
of this loop. A model whose forward pass depends on the training step (HTGN's FAVOR+ redraws its random
features every k steps) says so with a true `uses_feature_step` attribute and then receives the index as
`feature_step=` in every call (`feature_step_kwargs`).

`evaluate_checkpoint` is the evaluation-only entry: a saved checkpoint (the best one by default) on any
split, e.g. the LRA protocol's "select on validation, report test".

This module is the trainer's public face; each concern lives in its own module of the `zoo_core.run`
package (see its docstring for the walk from the command line to the step):

* `zoo_core.run.steps`: `TrainState` and the pure `train_step` / `eval_step` (the same `train_step`
  serves jit over a 'data' mesh and pmap).
* `zoo_core.run.setup_checks`: checks that need no compile (`validate_config`, `check_workdir`, ...).
* `zoo_core.run.prepare`: `prepare_data`, the dataset built on first use.
* `zoo_core.run.setup`: the run's setup, built once and checked as it is built (`check_setup`,
  `build_setup`), the state restored or initialised, and the compiled steps (`compile_steps`).
* `zoo_core.run.resume`: which config changes a resumed run may make (`check_resume`, `SAFE_ON_RESUME`).
* `zoo_core.run.loop`: `train_and_evaluate` and the loop's hooks (log, eval with the best checkpoint and
  early stopping after `checkpoint.patience` evaluations without a new best, checkpoint, signal), and
  the run's closing summary line.
* `zoo_core.run.evaluation`: `evaluate_checkpoint`, `evaluate_params`, `load_params`.
* `zoo_core.run.guard` (SIGTERM / Ctrl-C, the workdir lock) and `zoo_core.run.log` (what a run logs).
* `zoo_core.run.errors`: `ConfigError`, `NonFiniteError`.
* `zoo_core.run.main`: the command line of every `python -m <package>.train`.
"""
import warnings

from zoo_core.run.errors import ConfigError, NonFiniteError
from zoo_core.run.evaluation import evaluate_checkpoint, evaluate_params, load_params, with_eval_split
from zoo_core.run.log import parameter_overview
from zoo_core.run.loop import evals_between, is_eval_step, train_and_evaluate
from zoo_core.run.prepare import prepare_data
from zoo_core.run.resume import (
    EVAL_MAY_CHANGE,
    SAFE_ON_RESUME,
    check_eval_config,
    check_resume,
    resume_changes,
    stored_run_config,
)
from zoo_core.run.setup import check_setup, step_flops
from zoo_core.run.setup_checks import PARALLEL_MODES, check_workdir, validate_config
from zoo_core.run.steps import (
    WEIGHT_PREFIX,
    TrainState,
    batch_loss_weight,
    eval_feature_step,
    eval_step,
    feature_step_kwargs,
    init_state,
    train_step,
    uses_feature_step,
)

__all__ = [
    "ConfigError", "NonFiniteError", "evaluate_checkpoint", "evaluate_params", "load_params", "with_eval_split",
    "evals_between", "is_eval_step", "train_and_evaluate", "prepare_data", "EVAL_MAY_CHANGE", "SAFE_ON_RESUME",
    "check_eval_config", "check_resume", "resume_changes", "stored_run_config", "parameter_overview",
    "check_setup", "step_flops", "PARALLEL_MODES", "check_workdir", "validate_config", "WEIGHT_PREFIX",
    "TrainState", "batch_loss_weight", "eval_feature_step", "eval_step", "feature_step_kwargs", "init_state",
    "train_step", "uses_feature_step",
]

# Deprecated names of the training-step index helpers (`step` names only the one-token method).
_RENAMED = {"uses_step": "uses_feature_step", "step_kwargs": "feature_step_kwargs",
            "eval_step_index": "eval_feature_step"}


def __getattr__(name: str):
    """The old names of `_RENAMED`, deprecated: they warn and return the new functions."""
    if name in _RENAMED:
        warnings.warn(f"zoo_core.trainer.{name} is deprecated; use {_RENAMED[name]} (models now take "
                      "feature_step=)", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
