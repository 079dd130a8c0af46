"""The one trainer of the zoo: `train_and_evaluate(config, workdir, build_model)`.

Architectures plug in through `build_model` (called as `build_model(**config.model)`), whose module maps
`(batch, train=...)` to `(outputs, aux)`. The task (`config.task`) turns outputs into per-example
metrics, and every `aux['loss/<name>']` scalar is added to the task loss, so regularisers need no fork
of this loop. A model whose forward pass depends on the training step (HTGN's FAVOR+ redraws its random
features every k steps) says so with a true `uses_step` attribute and then receives `step=` in every
call (`step_kwargs`).

`evaluate_checkpoint` is the evaluation-only entry: a saved checkpoint (the best one by default) on any
split, e.g. the LRA protocol's "select on validation, report test".

`train_and_evaluate` is three parts: setup and restore (`check_setup`, `check_resume`, `_setup`
prepares the data and builds the model and optimiser, `_restore_or_init` restores the newest
checkpoint or initialises the state directly in its sharding), the compiled steps (`_compile_steps`:
`train_step` and `eval_step`, pure module-level functions; the same `train_step` serves jit over a
'data' mesh (default) and pmap (`axis_name`)), and the loop (`_train_loop`) with the named hooks of
`_Loop` after every step: log, eval (with the best checkpoint and early stopping), checkpoint, signal
(SIGTERM). With `checkpoint.patience` > 0 the loop stops early after that many evaluations in a row
without a new best `checkpoint.best_metric` (counted from the best checkpoint's step, so a resumed run
keeps its count and a finished one stays finished).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import socket
import time
from typing import Any, Callable, Iterable, Mapping

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from zoo_core import checkpoint as ckpt_lib
from zoo_core import data as data_lib
from zoo_core import metrics as metrics_lib
from zoo_core import checks, costs, optim, sharding, tasks
from zoo_core.data import pipeline

PARALLEL_MODES = ("jit", "pmap")


class ConfigError(ValueError):
    """A configuration mistake found before compiling (the CLI prints its one line and exits 2)."""


def _config_error(e: Exception) -> ConfigError:
    """A setup exception as a one-line ConfigError (naming its type unless it is the zoo's ValueError)."""
    line = str(e).splitlines()[0] if str(e) else ""
    if type(e) is ValueError and line:
        return ConfigError(line)
    return ConfigError(f"{type(e).__name__}: {line}")


class NonFiniteError(FloatingPointError):
    """The loss or the gradient became NaN or infinite; the run stops without saving that state."""


@flax.struct.dataclass
class TrainState:
    """Everything a step changes. The model, optimiser and task are static and live outside.

    Attributes:
      step: int32 [], optimiser steps taken.
      params: the model's parameter tree.
      opt_state: the optimiser's state (over the raveled parameter vector, `zoo_core.optim`).
      rng: uint32 [2], the run's dropout key; step `s` uses fold_in(rng, s), so a resumed run draws the
        same masks as an uninterrupted one.
      bad_step: int32 [], the first step whose loss or gradient was non-finite, or -1. A non-finite step
        leaves params and opt_state untouched, and the host stops the run when it sees bad_step >= 0.
    """
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    bad_step: jax.Array


def init_state(rng: jax.Array, batch: Mapping[str, jax.Array], *, model, tx) -> TrainState:
    """Initialises parameters on `batch` and the optimiser state; pure, so it can be eval_shape'd/jitted."""
    param_rng, dropout_rng = jax.random.split(rng)
    params = model.init({"params": param_rng, "dropout": dropout_rng}, batch, train=False,
                        **step_kwargs(model, jnp.zeros([], jnp.int32)))["params"]
    return TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.fold_in(rng, 1), bad_step=jnp.full([], -1, jnp.int32))


def uses_step(model) -> bool:
    """Whether `model`'s forward pass depends on the training step (a true `uses_step` attribute)."""
    return bool(getattr(model, "uses_step", False))


def step_kwargs(model, step) -> dict[str, Any]:
    """{'step': step} for a model that `uses_step`, else {}: what every model call here passes along.

    While training, `step` is the index of the update being computed (state.step); at evaluation it is
    `eval_step_index(steps_done)`, the index of the last update, so evaluation and decoding use the random
    features the parameters were last trained with (frozen between redraws).
    """
    return {"step": step} if uses_step(model) else {}


def eval_step_index(steps_done):
    """The training-step index whose step-dependent state (e.g. random features) evaluation uses.

    After `steps_done` updates the last one had index steps_done - 1 (0 before any update).
    """
    if isinstance(steps_done, (int, np.integer)):
        return max(int(steps_done) - 1, 0)
    return jnp.maximum(jnp.asarray(steps_done) - 1, 0)


WEIGHT_PREFIX = "weight/"   # train_step metrics under it are weights, not logged (see _mean_metrics)


def _loss_and_metrics(params, batch, rng, step, *, model, task, train: bool, axis_name: str | None = None,
                      loss_weight: jax.Array | None = None):
    """(loss, (metric sums, aux losses)) of one batch: the task's weighted mean loss plus the aux losses.

    `loss_weight`, when given, divides the loss sum instead of this batch's own weight: a micro-batch's
    share of its whole batch's weight (`train_step`).
    """
    outputs, aux = model.apply({"params": params}, batch, train=train, rngs={"dropout": rng} if train else {},
                               **step_kwargs(model, step))
    sums = tasks.reduce_metrics(task(outputs, batch), batch.get("example_mask"))
    aux_losses = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items() if k.startswith("loss/")}
    for k, v in aux_losses.items():
        if v.ndim:
            raise ValueError(f"aux[{k!r}] must be a scalar, got shape {v.shape}")
    total, weight = sums["loss"]
    weight = _device_share(weight, axis_name) if loss_weight is None else loss_weight
    loss = total / weight + sum(aux_losses.values(), jnp.zeros([], jnp.float32))
    return loss, (sums, aux_losses)


def _device_share(weight: jax.Array, axis_name: str | None) -> jax.Array:
    """The loss weight one device divides by: its own without pmap; under pmap the global weight over
    the device count. Each device holds part of the batch, and its loss is then its share of the global
    weighted mean (times the device count, which the caller's pmean divides out), so that tokens weigh
    the same on every device, as in the jit step over the whole batch."""
    if axis_name is None:
        return weight
    return jax.lax.psum(jax.lax.stop_gradient(weight), axis_name) / jax.lax.psum(1, axis_name)


def batch_loss_weight(params, batch, rng, step, *, model, task) -> jax.Array:
    """The weight of `batch`'s loss (examples or tokens, times its example mask), without running the model.

    A task's weights are a function of the batch alone (`zoo_core.tasks`), so the task is evaluated on
    zero outputs of the model's output shapes (`jax.eval_shape`, no compute); XLA drops everything but
    the weights' sum.
    """
    shapes = jax.eval_shape(lambda p, b: model.apply({"params": p}, b, train=True, rngs={"dropout": rng},
                                                     **step_kwargs(model, step))[0], params, batch)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.stop_gradient(tasks.reduce_metrics(task(zeros, batch), batch.get("example_mask"))["loss"][1])


def train_step(state: TrainState, batch: Mapping[str, jax.Array], *, model, tx, task, schedule,
               accum_steps: int = 1, axis_name: str | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimiser step on a global batch.

    With `accum_steps > 1` the batch is split into that many micro-batches whose gradients are summed
    (a lax.scan, so only one micro-batch's activations are live) before one optimiser update. The loss
    is the whole batch's weighted mean: each micro-batch's loss sum is divided by its share of the whole
    batch's weight (`batch_loss_weight`), so its examples or tokens weigh what they weigh in the whole
    batch; aux losses are averaged over the micro-batches, and each micro-batch draws its own dropout.

    Args:
      state: the train state (donated by the caller's jit).
      batch: dict of [B, ...] arrays (B the global batch; under pmap the per-device batch).
      model, tx, task, schedule: static pieces bound with functools.partial.
      accum_steps: micro-batches per step.
      axis_name: the pmap axis; gradients and metrics are averaged over it.

    Returns:
      (new state, metrics): scalar train metrics (loss, task metrics, aux losses, l2 norms, lr).
    """
    rng = jax.random.fold_in(state.rng, state.step)
    if axis_name is not None:
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
    grad_fn = jax.value_and_grad(functools.partial(_loss_and_metrics, model=model, task=task, train=True,
                                                   axis_name=axis_name), has_aux=True)
    if accum_steps == 1:
        (loss, (sums, aux_losses)), grads = grad_fn(state.params, batch, rng, state.step)
    else:
        # Strided micro-batches (rows i, i + accum, ...): each device's shard of the batch then holds
        # its part of every micro-batch, so the scan stays data-parallel. Contiguous blocks would put
        # a whole micro-batch on one device and make XLA gather the batch onto every device.
        micro = jax.tree_util.tree_map(
            lambda x: jnp.swapaxes(x.reshape(-1, accum_steps, *x.shape[1:]), 0, 1), batch)

        share = _device_share(batch_loss_weight(state.params, batch, rng, state.step, model=model, task=task),
                              axis_name) / accum_steps

        def accumulate(carry, inputs):
            i, mb = inputs
            out, g = grad_fn(state.params, mb, jax.random.fold_in(rng, i), state.step, loss_weight=share)
            return jax.tree_util.tree_map(jnp.add, carry, (out, g)), None

        zero_out = jax.eval_shape(functools.partial(grad_fn, loss_weight=share), state.params,
                                  jax.tree_util.tree_map(lambda x: x[0], micro), rng, state.step)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zero_out)
        total, _ = jax.lax.scan(accumulate, zeros, (jnp.arange(accum_steps), micro))
        (loss, (sums, aux_losses)), grads = total
        loss = loss / accum_steps
        aux_losses = {k: v / accum_steps for k, v in aux_losses.items()}
        grads = jax.tree_util.tree_map(lambda g: g / accum_steps, grads)
    if axis_name is not None:
        grads, loss, aux_losses = jax.lax.pmean((grads, loss, aux_losses), axis_name)
        sums = jax.lax.psum(sums, axis_name)
    # The update runs on one vector of all parameters (zoo_core.optim says why).
    params, unravel = ravel_pytree(state.params)
    grads = ravel_pytree(grads)[0]
    updates, opt_state = tx.update_vector(grads, state.opt_state, params, tx.layout(state.params))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(
        step=state.step + 1,
        params=unravel(jnp.where(finite, optax.apply_updates(params, updates), params)),
        opt_state=keep(opt_state, state.opt_state),
        bad_step=jnp.where(finite | (state.bad_step >= 0), state.bad_step, state.step))
    metrics = {f"train/{k}": s / jnp.maximum(n, 1e-12) for k, (s, n) in sums.items()}
    # The weights (examples or tokens) too, so that the logged average over steps is weighted like an eval.
    metrics.update({f"{WEIGHT_PREFIX}train/{k}": n for k, (s, n) in sums.items()})
    metrics.update({f"train/{k}": v for k, v in aux_losses.items()})
    metrics.update({
        "train/total_loss": loss,
        "train/l2_grads": grad_norm,
        "train/l2_params": optax.tree.norm(params),
        "train/l2_updates": optax.tree.norm(updates),
        "train/learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
    })
    return new_state, metrics


def eval_step(params, batch: Mapping[str, jax.Array], step=None, *, model, task,
              axis_name: str | None = None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Weighted metric sums {name: (sum, weight)} of one eval batch (additive over batches).

    `step` (int32 []) is required for a model that `uses_step`: `eval_step_index(steps_done)`.
    """
    if step is None and uses_step(model):
        raise ValueError(f"eval_step: {type(model).__name__} depends on the training step (uses_step); pass "
                         "step=eval_step_index(steps_done)")
    _, (sums, aux_losses) = _loss_and_metrics(params, batch, None, step, model=model, task=task, train=False)
    count = sums["loss"][1]
    sums = dict(sums, **{k: (v * count, count) for k, v in aux_losses.items()})
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    return sums


# ----------------------------------------------------------------------------------------------------
# Host side.


def validate_config(config) -> None:
    """Checks that need no compile. Raises ValueError with one line naming the problem."""
    mode = config.parallel.mode
    if mode not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel.mode {mode!r}; choose one of {', '.join(PARALLEL_MODES)}")
    if mode == "pmap" and jax.process_count() > 1:
        raise ValueError("parallel.mode='pmap' is single-process only here; use the default 'jit' mode "
                         "across processes")
    for name in ("total_steps", "batch_size", "eval_batch_size", "log_every_steps"):
        if int(config[name]) < 1:
            raise ValueError(f"{name} must be >= 1, got {config[name]}")
    for name, value in (("eval_every_steps", config.eval_every_steps),
                        ("checkpoint_every_steps", config.checkpoint_every_steps),
                        ("eval_max_examples", config.eval_max_examples),
                        ("optim.grad_clip_norm", config.optim.grad_clip_norm),
                        ("schedule.warmup_steps", config.schedule.warmup_steps)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not 0 <= int(config.eval_also_at_step) <= int(config.total_steps):
        raise ValueError(f"eval_also_at_step must be in [0, total_steps={config.total_steps}], "
                         f"got {config.eval_also_at_step}")
    devices = jax.device_count()
    accum = int(config.optim.grad_accum_steps)
    # Applied by the training command before JAX starts (zoo_core.main); checked here for every caller.
    sharding.check_cpu_devices(config.parallel.cpu_devices)
    if accum < 1:
        raise ValueError(f"optim.grad_accum_steps must be >= 1, got {accum}")
    if config.batch_size % (devices * accum):
        raise ValueError(f"batch_size {config.batch_size} must be divisible by devices ({devices}) x "
                         f"optim.grad_accum_steps ({accum})")
    patience = config.checkpoint.patience
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
        raise ValueError(f"checkpoint.patience must be an int >= 0, got {patience!r}")
    if patience and not (config.checkpoint.best_metric and config.eval_every_steps):
        raise ValueError("checkpoint.patience stops on evaluations without a new best, so it needs "
                         "checkpoint.best_metric and eval_every_steps > 0")
    if config.eval_batch_size % devices:
        raise ValueError(f"eval_batch_size {config.eval_batch_size} must be divisible by the {devices} devices")
    seed = config.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if int(config.checkpoint.keep) < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {config.checkpoint.keep}")
    if config.checkpoint.best_mode not in ("max", "min"):
        raise ValueError(f"checkpoint.best_mode must be 'max' or 'min', got {config.checkpoint.best_mode!r}")
    best = config.checkpoint.best_metric
    if best and not str(best).startswith("eval/"):
        raise ValueError(f"checkpoint.best_metric must name an eval metric 'eval/<name>', got {best!r}")
    for role in ("train_split", "eval_split"):
        split = config.data[role]
        if not isinstance(split, str) or not split:
            raise ValueError(f"data.{role} must be a split name such as 'train', got {split!r}")
    optim.check_ranges(config)


def check_setup(config, build_model: Callable[..., Any] | None = None, *, has_evaluators: bool = False) -> None:
    """Every check that needs no prepared data and no compile, in the order a user would fix them.

    The config's ranges (`validate_config`), the optimiser and schedule (built, which is cheap), the task,
    the model's constructor (`build_model(**config.model)`, which validates its fields), the data
    options and paths (`data.check_options`: a file where a directory is expected and the reverse, an
    unknown option), and, when the dataset declares fixed feature shapes before it is prepared, the
    model's initialisation and an eval step on them (shapes only) with checkpoint.best_metric among
    its metrics (skipped with `has_evaluators`, which add metric names). Nothing is written.

    Raises:
      ConfigError: one line naming the field or file and what is expected.
    """
    try:
        validate_config(config)
        tx, _ = optim.make_optimizer(config)
        task = tasks.make_task(config)
        model = _build_model(build_model, config) if build_model is not None else None
        options = config.data.options.to_dict()
        builder = data_lib.check_options(config.data.name, config.data.data_dir, options)
        num_train = options.get("num_train")
        if isinstance(num_train, int) and 0 < num_train < config.batch_size:
            raise ValueError(f"batch_size {config.batch_size} exceeds the {num_train} training examples "
                             f"(data.options.num_train) of {config.data.name}")
        example = _example_from_features(builder)
        if model is not None and example is not None:
            key = (config.to_json_best_effort(), id(build_model), has_evaluators)
            if key not in _SHAPES_CHECKED:
                abstract = jax.eval_shape(functools.partial(init_state, model=model, tx=tx),
                                          jax.random.PRNGKey(0), example)
                _check_eval_metrics(config.checkpoint.best_metric, model, task, abstract.params, example,
                                    has_evaluators=has_evaluators)
                _SHAPES_CHECKED.clear()
                _SHAPES_CHECKED.add(key)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        raise _config_error(e) from e


def _build_model(build_model: Callable[..., Any], config):
    """`build_model(**config.model)`; a field it has not, or one it needs and the config lacks, most
    often means a config written for another architecture's train command."""
    try:
        return build_model(**config.model.to_dict())
    except TypeError as e:
        if not re.search(r"unexpected keyword argument|missing \d+ required", str(e)):
            raise
        detail = re.sub(r"^\S*\(\) ", "", str(e).splitlines()[0])
        raise ConfigError(f"config.model does not fit {build_model.__module__}.{build_model.__qualname__}: "
                          f"{detail}; is the config written for another architecture's train command?") from None


_SHAPES_CHECKED: set = set()   # the last config whose shapes check_setup traced (the CLI checks twice)


def _example_from_features(builder) -> dict[str, np.ndarray] | None:
    """A zero batch of one example with the shapes and dtypes the builder declares before it is
    prepared, as the eval pipeline would give it; None when some shape is not fixed in advance (then
    the records are not the stored features, e.g. forecasting windows)."""
    try:
        features = builder.info.features
    except Exception:  # noqa: BLE001 - some builders know their shapes only once prepared
        return None
    example = {}
    for name, feature in features.items():
        shape, dtype = getattr(feature, "shape", None), getattr(feature, "np_dtype", None)
        if shape is None or dtype is None:
            return None
        if np.dtype(dtype).kind not in "biuf":
            continue   # text: host-only, dropped before the device (sharding.numeric)
        if any(d is None for d in shape):
            return None
        example[name] = np.zeros((1, *shape), dtype)
    example["example_mask"] = np.ones((1,), np.float32)
    return example


def check_workdir(workdir: str) -> None:
    """`workdir` is a directory or can be made one (`checks.output_path_problem`); nothing is created here.

    Raises:
      ConfigError: it (or a folder above it) is an existing file, or the nearest existing folder above
        it is not writable.
    """
    if not workdir:
        raise ConfigError("--workdir is empty; give a directory for checkpoints and metrics")
    problem = checks.output_path_problem(workdir, directory=True)
    if problem:
        raise ConfigError(f"workdir {workdir!r} {problem}")


# Config fields that may change between a run and its resumption: they decide what is logged,
# evaluated or kept, not what is trained. `total_steps` may grow when the schedule does not depend on
# it (see `resume_changes`). Every other difference is refused unless the caller allows it.
SAFE_ON_RESUME = ("log_every_steps", "eval_every_steps", "eval_also_at_step", "eval_max_examples",
                  "eval_batch_size", "checkpoint_every_steps", "progress_bar", "checkpoint.keep",
                  "checkpoint.best_metric", "checkpoint.best_mode", "checkpoint.patience", "data.data_dir",
                  "data.eval_split", "test_split", "decode.", "parallel.cpu_devices")
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
    placeholder) equals an absent one: both leave the value to the model or dataset.
    """
    a, b = _flatten(dict(stored)), _flatten(dict(new))
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
        raise ConfigError(f"the run in {workdir} was trained with another config: {shown}{more}; resume it "
                          f"with its own config, use a new --workdir, or pass --allow_config_change "
                          f"(train_and_evaluate(allow_config_change=True)) to continue with the new values")
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


def evals_between(config, after: int, upto: int) -> int:
    """How many evaluations the loop makes after the steps after+1 .. upto (`is_eval_step`'s count)."""
    every = config.eval_every_steps
    if not every:
        return 0
    extra = {int(config.total_steps), int(config.eval_also_at_step)}
    return upto // every - after // every + sum(1 for s in extra if after < s <= upto and s % every)


def is_eval_step(config, step: int) -> bool:
    """Whether the loop evaluates after `step`: every eval_every_steps, at the end, at eval_also_at_step."""
    return evals_between(config, step - 1, step) > 0


def _check_eval_metrics(name: str, model, task, params, example, *, has_evaluators: bool) -> None:
    """Traces one eval step (shapes only) so that a model/task mismatch, e.g. a forecast of the wrong
    shape, fails now and not at the first compile; and checks that checkpoint.best_metric names one of
    its metrics, not at the first eval many steps on."""
    if name and not name.startswith("eval/"):
        raise ValueError(f"checkpoint.best_metric must name an eval metric 'eval/<name>', got {name!r}")
    step = (jnp.zeros([], jnp.int32),) if uses_step(model) else ()
    sums = jax.eval_shape(functools.partial(eval_step, model=model, task=task), params, example, *step)
    if not name or has_evaluators:   # host-side evaluators add names (e.g. eval/bleu) known only when they run
        return
    known = sorted(f"eval/{k}" for k in sums)
    if name not in known:
        raise ValueError(f"checkpoint.best_metric {name!r} is not an eval metric of this task and model "
                         f"(they are: {', '.join(known)})")


def _check_classes(config, model, params, example, source) -> None:
    """A classifier's output width must be the data's class count (`info.metadata['num_classes']`,
    where the data set records it): a model with more outputs trains silently on classes that never
    occur, one with fewer fails only at the first logged step. Shapes only, no compile."""
    info = getattr(source, "dataset_info", None)
    want = (info.metadata or {}).get("num_classes") if info is not None else None
    if config.task.name != "classification" or want is None:
        return
    step = step_kwargs(model, jnp.zeros([], jnp.int32))
    outputs, _ = jax.eval_shape(lambda p: model.apply({"params": p}, example, train=False, **step), params)
    got = jax.tree_util.tree_leaves(outputs)[0].shape[-1]
    if got != int(want):
        raise ValueError(f"the model has {got} outputs but {config.data.name} has {want} classes: set "
                         f"--config.model.num_classes={want}")


def prepare_data(config) -> tuple[Any, Any]:
    """Builds the dataset on first use (process 0 first, the others wait), returns (train, eval) sources."""
    d = config.data
    data_dir = pipeline.resolve_data_dir(d.data_dir)
    make_builder = lambda: data_lib.make_builder(d.name, data_dir, **d.options.to_dict())
    builder = make_builder()
    failure = None
    if jax.process_index() == 0:
        from zoo_core.data import base as data_base
        data_base.explain_rebuild(builder)
        # The folders a failed preparation would leave behind (outermost first), removed on failure.
        config_name = builder.builder_config.name if builder.builder_config else ""
        created = [p for p in (data_dir, os.path.join(data_dir, builder.name),
                               os.path.join(data_dir, builder.name, config_name)) if not os.path.exists(p)]
        try:
            builder.download_and_prepare()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the other processes
            if created:
                shutil.rmtree(created[0], ignore_errors=True)
            if not isinstance(e, Exception):   # Ctrl-C: stop now, leaving no half-made folder behind
                raise
            failure = e
            if isinstance(e, OSError):   # the data dir cannot be written (e.g. a read-only mount): name it
                failure = ValueError(f"could not prepare {d.name} in data.data_dir {data_dir!r}: "
                                     f"{type(e).__name__}: {e}; give a writable data.data_dir or $ZOO_DATA_DIR")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        # Doubles as the barrier; without it a failure on process 0 would leave the others waiting.
        ok = multihost_utils.process_allgather(np.int32(failure is None))
        if failure is not None:
            raise failure
        if not np.all(ok):
            raise ValueError(f"process 0 could not prepare {d.name} (its log names the problem)")
        # A builder made before process 0 wrote the data has empty info: make it again to read it.
        builder = make_builder()
        builder.download_and_prepare()   # a no-op read of what process 0 wrote
    elif failure is not None:
        raise failure
    roles = [("data.train_split", d.train_split), ("data.eval_split", d.eval_split)]
    if config.get("test_split", ""):
        roles.append(("test_split", config.test_split))
    for role, split in roles:
        name = split.split("[")[0]   # 'train[:90%]' slices a split
        if name not in builder.info.splits:
            raise ValueError(f"{role} {split!r} is not a split of {d.name} "
                             f"(it has: {', '.join(sorted(builder.info.splits))})")
        try:
            selected = builder.info.splits[split].num_examples
        except ValueError as e:   # a slice TFDS cannot parse
            raise ValueError(f"{role} {split!r}: {' '.join(str(e).split()[:40])}") from None
        if selected <= 0:
            raise ValueError(f"{role} {split!r} selects no examples ({name} has "
                             f"{builder.info.splits[name].num_examples})")
    try:
        sources = builder.as_data_source(d.train_split), builder.as_data_source(d.eval_split)
        for source in sources:   # a damaged or missing record file fails here, not steps into training
            source[0], source[len(source) - 1]
    except (RuntimeError, OSError) as e:   # what the record reader raises for a short or missing file
        reason = (str(e).splitlines() or [""])[0][:300]
        raise ValueError(f"the prepared {d.name} in {str(builder.data_dir)!r} cannot be read ({type(e).__name__}: "
                         f"{reason}); delete that folder to prepare it again") from e
    return sources


def parameter_overview(params) -> str:
    """A table of parameter paths, shapes and sizes, with the total."""
    rows = [(jax.tree_util.keystr(p), tuple(x.shape), int(np.prod(x.shape)))
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    width = max([len(r[0]) for r in rows] + [4])
    lines = [f"{'name':<{width}}  {'shape':<20} {'size':>10}"]
    lines += [f"{n:<{width}}  {str(s):<20} {c:>10,}" for n, s, c in rows]
    lines.append(f"{'total':<{width}}  {'':<20} {sum(r[2] for r in rows):>10,}")
    return "\n".join(lines)


def _mean_metrics(history: list[dict[str, jax.Array]]) -> dict[str, float]:
    """The average of the steps' metrics since the last log; a metric with a `weight/<name>` entry (a task
    metric: examples or tokens) is weighted by it, and the weights themselves are not logged."""
    fetched = jax.device_get(history)
    out = {}
    for key in fetched[0]:
        if key.startswith(WEIGHT_PREFIX):
            continue
        values = np.array([np.asarray(m[key]) for m in fetched], np.float64)
        if WEIGHT_PREFIX + key in fetched[0]:
            weights = np.array([np.asarray(m[WEIGHT_PREFIX + key]) for m in fetched], np.float64)
            out[key] = float(np.sum(values * weights) / max(np.sum(weights), 1e-12))
        else:
            out[key] = float(np.mean(values))
    return out


class _TqdmStream:
    """A text stream that writes through `tqdm.write`, so that a log line clears the progress bar,
    is printed on its own line, and the bar is redrawn below it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> None:
        from tqdm.auto import tqdm
        if text:
            tqdm.write(text, file=self._stream, end="")

    def flush(self) -> None:
        self._stream.flush()


def _log_through_tqdm() -> Callable[[], None]:
    """Routes absl's stderr log lines (and Python logging's console handlers) through tqdm.write while
    a progress bar is shown; returns the function that undoes it."""
    import logging as py_logging
    import sys
    targets = []
    absl_handler = logging.get_absl_handler().python_handler
    handlers = [absl_handler] + [h for h in py_logging.getLogger().handlers
                                 if isinstance(h, py_logging.StreamHandler) and h is not absl_handler]
    for h in handlers:
        stream = getattr(h, "stream", None)
        if stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__):
            targets.append((h, stream))
            h.stream = _TqdmStream(stream)

    def restore():
        for h, stream in targets:
            h.stream = stream
    return restore


class _Terminate:
    """Turns SIGTERM and Ctrl-C (SIGINT) into a flag the loop polls, so the run can save and exit cleanly.

    A second Ctrl-C stops at once (KeyboardInterrupt, the previous checkpoint is kept). A SIGINT that the
    process was started to ignore (a background job of a non-interactive shell) stays ignored.
    """

    def __init__(self):
        self.requested = None      # the name of the first signal received
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) is not signal.default_int_handler:
                continue
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:   # not the main thread (e.g. inside a notebook worker): no handler
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        logging.warning("%s received: saving a checkpoint and exiting%s", name,
                        " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "")
        self.requested = self.requested or name

    def any_requested(self) -> bool:
        """Whether any process got SIGTERM or Ctrl-C. All processes must leave the loop at the same step (the
        save is collective), so with several processes they agree on the flag every step."""
        if jax.process_count() == 1:
            return bool(self.requested)
        from jax.experimental import multihost_utils
        return bool(np.max(multihost_utils.process_allgather(np.int32(bool(self.requested)))))

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


@dataclasses.dataclass
class _Setup:
    """What a run is made of, built and checked before anything is written (`_setup`)."""
    config: Any
    config_dict: dict
    model: Any
    task: Any
    tx: Any
    schedule: Any
    train_source: Any
    eval_source: Any
    rng: jax.Array
    example: dict
    abstract: TrainState


def _setup(config, build_model: Callable[..., Any], *, has_evaluators: bool) -> _Setup:
    """Prepares the data and builds the model, task and optimiser; every config error surfaces here,
    before any compile and before the workdir is made or the config is logged (as one ConfigError)."""
    pcount, pindex = jax.process_count(), jax.process_index()
    rng = jax.random.PRNGKey(config.seed)
    try:
        train_source, eval_source = prepare_data(config)
        if len(train_source) < config.batch_size:   # found here, not after the first compile
            raise ValueError(f"batch_size {config.batch_size} exceeds the {len(train_source)} training examples "
                             f"of {config.data.name}")
        model = build_model(**config.model.to_dict())
        task = tasks.make_task(config)
        tx, schedule = optim.make_optimizer(config)
        example = sharding.numeric(next(pipeline.eval_batches(
            eval_source, global_batch_size=config.eval_batch_size, process_index=pindex, process_count=pcount)))
        example = jax.tree_util.tree_map(lambda x: x[:1], example)
        abstract = jax.eval_shape(functools.partial(init_state, model=model, tx=tx), rng, example)
        _check_eval_metrics(config.checkpoint.best_metric, model, task, abstract.params, example,
                            has_evaluators=has_evaluators)
        _check_classes(config, model, abstract.params, example, train_source)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise _config_error(e) from e
    return _Setup(config=config, config_dict=json.loads(config.to_json_best_effort()), model=model, task=task,
                  tx=tx, schedule=schedule, train_source=train_source, eval_source=eval_source, rng=rng,
                  example=example, abstract=abstract)


def _log_run(s: _Setup, workdir: str, changes: list[str], *, allow_config_change: bool) -> None:
    logging.info("config:\n%s", s.config)
    logging.info("devices: %d total, %d local, process %d/%d: %s", jax.device_count(), jax.local_device_count(),
                 jax.process_index(), jax.process_count(), jax.devices())
    if changes:
        logging.warning("resuming %s with a changed config (%s): %s", workdir,
                        "allowed by allow_config_change" if allow_config_change else "fields safe to change",
                        "; ".join(changes))
    logging.info("parameters:\n%s", parameter_overview(s.abstract.params))
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(s.abstract.params))
    logging.info("parameter count: %s", f"{num_params:,}")


def _restore_or_init(s: _Setup, workdir: str, replicated) -> tuple[ckpt_lib.Checkpoints, TrainState, int]:
    """(checkpoints, state, start step): the newest checkpoint of `workdir` restored, or a fresh state,
    directly in the `replicated` sharding; writes config.json once the workdir is known to be this run's."""
    ck = s.config.checkpoint
    abstract_sharded = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), s.abstract)
    checkpoints = ckpt_lib.Checkpoints(workdir, keep=ck.keep, best_metric=ck.best_metric or None,
                                       best_mode=ck.best_mode)
    try:
        restored = checkpoints.restore_latest(abstract_sharded, s.config_dict)
    except ckpt_lib.CheckpointMismatch as e:   # the workdir holds another model's run: leave it as it was
        checkpoints.close(discard_created=True)
        raise ConfigError(str(e)) from e
    if jax.process_index() == 0:   # only now: a mismatching workdir keeps its own config.json
        metrics_lib.write_json(os.path.join(workdir, "config.json"), s.config_dict)
    if restored is None:
        init = functools.partial(init_state, model=s.model, tx=s.tx)
        logging.info("no checkpoint in %s: starting from scratch", workdir)
        return checkpoints, jax.jit(init, out_shardings=replicated)(s.rng, s.example), 0
    start, state = restored
    logging.info("resumed from the checkpoint at step %d", start)
    return checkpoints, state, start


@dataclasses.dataclass
class _Steps:
    """The compiled steps and how batches and states move between host and devices."""
    train: Callable[..., Any]      # (state, batch) -> (state, metrics); the state is donated
    eval: Callable[..., Any]       # (params, batch, step index) -> metric sums
    to_device: Callable[[Any], Any]
    host_state: Callable[[Any], Any]   # the single (unreplicated) copy of a state
    pmapped: bool
    # The same step without micro-batches (`train` itself when grad_accum_steps is 1), only ever
    # lowered: XLA's cost analysis counts a loop body once, so the FLOPs are read from this one.
    whole: Callable[..., Any] = None


def step_flops(steps: _Steps, state, batch) -> float | None:
    """FLOPs of one train step over all devices, from XLA's cost analysis of the step's lowering
    (`costs.cost_of`; no compile), None where the backend counts none.

    With micro-batches the lowered step is the one without them (`_Steps.whole`): the cost analysis
    counts the body of the micro-batch loop once, which would undercount the step by their number.
    """
    flops = costs.flops_of((steps.whole or steps.train).lower(state, batch))
    # pmap lowers the per-device computation; a jitted step's lowering is the global one.
    return None if flops is None else flops * (jax.device_count() if steps.pmapped else 1)


def _compile_steps(s: _Setup, mesh, replicated) -> _Steps:
    """`train_step` and `eval_step` jitted once: over the 'data' mesh (mode 'jit') or pmapped."""
    accum = int(s.config.optim.grad_accum_steps)
    step_kw = dict(model=s.model, tx=s.tx, task=s.task, schedule=s.schedule)
    jitted = s.config.parallel.mode == "jit"

    def train(accum_steps, donate):
        donate_argnums = (0,) if donate else ()
        if jitted:
            return jax.jit(functools.partial(train_step, accum_steps=accum_steps, **step_kw),
                           donate_argnums=donate_argnums, out_shardings=(replicated, replicated))
        return jax.pmap(functools.partial(train_step, axis_name="batch", accum_steps=accum_steps, **step_kw),
                        axis_name="batch", donate_argnums=donate_argnums)

    steps = dict(train=train(accum, True), whole=None if accum == 1 else train(1, False))
    if jitted:
        return _Steps(
            **steps, eval=jax.jit(functools.partial(eval_step, model=s.model, task=s.task), out_shardings=replicated),
            to_device=lambda b: sharding.global_batch(b, mesh), host_state=lambda st: st, pmapped=False)
    return _Steps(
        **steps, eval=jax.pmap(functools.partial(eval_step, model=s.model, task=s.task, axis_name="batch"),
                               axis_name="batch", in_axes=(0, 0, None)),
        to_device=sharding.pmap_batch, host_state=sharding.unreplicate, pmapped=True)


class _Loop:
    """The training loop's hooks, called after every step in this order: `log`, `eval` (with the best
    checkpoint and early stopping), `checkpoint`, `signal`. `eval` and `signal` return True to stop."""

    def __init__(self, s: _Setup, steps: _Steps, checkpoints: ckpt_lib.Checkpoints, writer, workdir: str,
                 start: int, evaluators, progress=None):
        self.s, self.steps, self.checkpoints, self.writer = s, steps, checkpoints, writer
        self.config, self.workdir, self.start = s.config, workdir, start
        self.evaluators, self.progress = evaluators, progress
        self.history: list[dict[str, jax.Array]] = []
        self.last_eval: dict[str, float] = {}
        self.t0, self.steps_since = time.time(), 0
        self.flops: float | None = None   # of one train step, once the first one has run

    def patience_spent(self, step: int) -> bool:
        """Early stopping: checkpoint.patience evaluations in a row without a new best."""
        ck = self.config.checkpoint
        best = self.checkpoints.best_step
        if best is None or best > step:
            # No usable best (none yet, its metric unreadable or changed, or left by a run whose
            # checkpoints are gone): count from where this run started.
            best = self.start
        return bool(ck.patience) and evals_between(self.config, best, step) >= ck.patience

    def check_finite(self, state) -> None:
        bad = int(jax.device_get(self.steps.host_state(state).bad_step))
        if bad >= 0:
            last = self.checkpoints.last.latest_step()
            kept = (f"the last good checkpoint (step {last}) in {self.workdir} is kept" if last is not None
                    else f"no checkpoint had been saved in {self.workdir} yet")
            raise NonFiniteError(f"non-finite loss or gradient at step {bad + 1} (also what a label outside "
                                 f"the model's classes gives): stopping; {kept}")

    def save(self, state, step: int, *, force: bool = False) -> None:
        self.check_finite(state)
        self.checkpoints.save(step, self.steps.host_state(state), self.s.config_dict, force=force)

    def after_step(self, metrics) -> None:
        self.history.append(metrics if not self.steps.pmapped else sharding.unreplicate(metrics))
        self.steps_since += 1
        if self.progress is not None:
            self.progress.update(1)

    def log(self, state, step: int) -> None:
        """Train metrics averaged since the last log, every log_every_steps and at the end."""
        if not (step % self.config.log_every_steps == 0 or step == self.config.total_steps):
            return
        self.check_finite(state)
        summary = _mean_metrics(self.history)
        summary["train/steps_per_second"] = self.steps_since / max(time.time() - self.t0, 1e-9)
        if self.flops is not None:   # achieved, all devices (the step's FLOPs as XLA counts them)
            summary["train/gflops_per_second"] = self.flops * summary["train/steps_per_second"] / 1e9
        self.history, self.t0, self.steps_since = [], time.time(), 0
        self.writer.write(step, summary)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{summary['train/total_loss']:.4g}")

    def eval(self, state, step: int) -> bool:
        """Evaluation at `is_eval_step`, the best checkpoint, and early stopping (True: stop)."""
        if not is_eval_step(self.config, step):
            return False
        self.check_finite(state)
        host = self.steps.host_state(state)
        result = evaluate_params(state.params, step, p_eval=self.steps.eval, eval_source=self.s.eval_source,
                                 config=self.config, model=self.s.model, to_device=self.steps.to_device,
                                 pmapped=self.steps.pmapped, evaluators=self.evaluators,
                                 host_params=host.params)
        self.writer.write(step, result)
        logging.info("step %d eval: %s", step, ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.items())))
        self.last_eval = result
        self.checkpoints.maybe_save_best(step, self.steps.host_state(state), self.s.config_dict, result)
        if not self.patience_spent(step):
            return False
        self.save(state, step, force=True)
        ck = self.config.checkpoint
        logging.info("early stop at step %d: no new best %s in %d evaluations (best: step %s)", step,
                     ck.best_metric, ck.patience, self.checkpoints.best_step)
        return True

    def checkpoint(self, state, step: int) -> None:
        """A checkpoint every checkpoint_every_steps and at the end."""
        every = self.config.checkpoint_every_steps
        if (every and step % every == 0) or step == self.config.total_steps:
            self.save(state, step)

    def signal(self, state, step: int, term: "_Terminate") -> bool:
        """SIGTERM or Ctrl-C (on any process): a checkpoint now, then stop (True)."""
        if not term.any_requested():
            return False
        self.save(state, step, force=True)
        logging.warning("saved the checkpoint at step %d after %s; exiting", step,
                        term.requested or "SIGTERM or Ctrl-C on another process")
        return True


def _train_loop(loop: _Loop, state, train_iter) -> None:
    """Steps start+1 .. total_steps, each followed by the hooks; at most one step in flight."""
    steps = loop.steps
    in_flight = None  # the metrics of the step still computing
    with _Terminate() as term:
        for step in range(loop.start + 1, loop.config.total_steps + 1):
            batch = steps.to_device(next(train_iter))  # host work overlaps the step in flight
            if in_flight is not None:
                # Without this wait, async dispatch lets the loop queue steps up to the next blocking
                # log or eval, so a SIGTERM would be answered only after all of them had run (minutes
                # in a long-sequence run, past a preemption's grace period) and the progress bar would
                # run ahead of the work.
                jax.block_until_ready(in_flight)
            state, metrics = steps.train(state, batch)
            if step == loop.start + 1:
                loop.flops = step_flops(steps, state, batch)
            in_flight = metrics
            loop.after_step(metrics)
            loop.log(state, step)
            if loop.eval(state, step):
                break
            loop.checkpoint(state, step)
            if loop.signal(state, step, term):
                break


def train_and_evaluate(config, workdir: str, build_model: Callable[..., Any], *,
                       evaluators: Iterable[Callable[..., Mapping[str, float]]] = (),
                       allow_config_change: bool = False) -> dict[str, float]:
    """Trains `build_model(**config.model)` on `config.data` and evaluates it; resumes from `workdir`.

    Args:
      config: the resolved ml_collections config (see configs/common.py for every field).
      workdir: where checkpoints, metrics.jsonl, TensorBoard files and config.json go.
      build_model: the architecture's `Model` factory.
      evaluators: extra host-side evaluations `fn(params, model, config, **step_kwargs(model, i))` ->
        {name: value} (i = `eval_step_index`; no keyword for a model without `uses_step`) run with every
        eval (e.g. decoding + BLEU); their results are logged under 'eval/'.
      allow_config_change: resume a run in `workdir` whose stored config.json differs from `config` in
        fields that change what is trained (see `check_resume`); the differences are logged and
        config.json is replaced. Without it such a resume is refused (`SAFE_ON_RESUME` fields, and a
        longer total_steps under a step-free schedule, are always allowed).

    Returns:
      The last eval metrics ({} when there was nothing left to train: the run had reached
      total_steps, or had stopped early, before this call).

    Raises:
      ConfigError: a configuration problem (or a refused resume), before anything is compiled or written.
      NonFiniteError: the loss or gradient became non-finite (the message names the step).
    """
    evaluators = list(evaluators)
    check_setup(config, build_model, has_evaluators=bool(evaluators))
    check_workdir(workdir)
    changes = check_resume(json.loads(config.to_json_best_effort()), workdir,
                           allow_config_change=allow_config_change)
    s = _setup(config, build_model, has_evaluators=bool(evaluators))
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:   # e.g. under /proc, which os.access calls writable
        raise ConfigError(f"workdir {workdir!r} cannot be made: {e.strerror}") from None
    lock = _lock_workdir(workdir)
    try:
        return _train_in(s, workdir, changes, evaluators, allow_config_change=allow_config_change)
    finally:
        if lock is not None:
            lock.close()   # releases the lock (so does the process ending, however it ends)


def _lock_workdir(workdir: str):
    """An exclusive lock on `workdir`/.lock held by process 0 while it trains there, or None (another
    process of a multi-host run, or a system without fcntl). Two runs writing one workdir interleave
    their checkpoints and metrics; the second is refused instead. The lock goes with its process
    (a killed run leaves none behind).

    Raises:
      ConfigError: another process holds it.
    """
    if jax.process_index() != 0:
        return None
    try:
        import fcntl
    except ImportError:   # Windows: no advisory locks; nothing checked
        return None
    path = os.path.join(workdir, ".lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"workdir {workdir!r} is in use by a run still going ({holder}); wait for it to end "
                          "or use another --workdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def _train_in(s: _Setup, workdir: str, changes: list[str], evaluators, *, allow_config_change: bool) -> dict:
    """`train_and_evaluate` once the workdir is checked, made and locked."""
    config = s.config
    _log_run(s, workdir, changes, allow_config_change=allow_config_change)
    mesh = sharding.make_mesh()
    replicated = sharding.replicated(mesh)
    checkpoints, state, start = _restore_or_init(s, workdir, replicated)
    if start >= config.total_steps:   # its last evaluation came before its last checkpoint
        logging.info("the run in %s has reached total_steps=%d: nothing to train (a larger "
                     "--config.total_steps trains on; --eval_only scores a checkpoint)", workdir, config.total_steps)
        checkpoints.close()
        return {}
    steps = _compile_steps(s, mesh, replicated)
    if steps.pmapped:
        state = sharding.replicate_for_pmap(jax.device_get(state))

    is_main = jax.process_index() == 0
    loop = _Loop(s, steps, checkpoints, None, workdir, start, evaluators)
    if loop.patience_spent(start):
        logging.info("the run stopped early at step %d (no new best %s in %d evaluations): nothing to do",
                     start, config.checkpoint.best_metric, config.checkpoint.patience)
        checkpoints.close()
        return {}
    loop.writer = metrics_lib.MetricWriter(workdir, enabled=is_main, resume_step=start)
    if start == 0:
        loop.writer.write_text("config", f"```\n{config}\n```")
    train_iter = pipeline.train_batches(s.train_source, global_batch_size=config.batch_size, seed=config.seed,
                                        process_index=jax.process_index(), process_count=jax.process_count(),
                                        start_step=start)
    restore_logging = lambda: None
    if is_main and config.progress_bar:
        from tqdm.auto import tqdm
        loop.progress = tqdm(total=config.total_steps, initial=start, desc="train", unit="step",
                             dynamic_ncols=True)
        restore_logging = _log_through_tqdm()
    try:
        _train_loop(loop, state, train_iter)
    finally:
        if loop.progress is not None:
            restore_logging()
            loop.progress.close()
        loop.writer.flush()
        loop.writer.close()
        checkpoints.close()
    return loop.last_eval


def evaluate_params(params, steps_done: int, *, p_eval, eval_source, config, model, to_device,
                    pmapped: bool = False, evaluators: Iterable[Callable[..., Mapping[str, float]]] = (),
                    host_params=None) -> dict[str, float]:
    """{'eval/<metric>': value} of `params` (after `steps_done` updates) over `eval_source`, plus evaluators.

    `p_eval` is the compiled `eval_step`; under pmap (`pmapped`) `params` are replicated and `host_params`
    is the single copy the host-side evaluators get.
    """
    pindex, pcount = jax.process_index(), jax.process_count()
    index = np.int32(eval_step_index(steps_done))
    totals: dict[str, list[float]] = {}
    for batch in pipeline.eval_batches(eval_source, global_batch_size=config.eval_batch_size,
                                       process_index=pindex, process_count=pcount,
                                       max_examples=config.eval_max_examples or None):
        sums = jax.device_get(p_eval(params, to_device(batch), index))
        if pmapped:
            sums = sharding.unreplicate(sums)
        for k, (v, n) in sums.items():
            acc = totals.setdefault(k, [0.0, 0.0])
            acc[0] += float(v)
            acc[1] += float(n)
    result = {f"eval/{k}": v / max(n, 1e-12) for k, (v, n) in totals.items()}
    host_params = params if host_params is None else host_params
    for evaluator in evaluators:
        found = evaluator(host_params, model, config, **step_kwargs(model, int(index)))
        result.update({f"eval/{k}": float(v) for k, v in found.items()})
    return result


def evaluate_checkpoint(config, workdir: str, build_model: Callable[..., Any], *, which: str = "best",
                        split: str | None = None,
                        evaluators: Iterable[Callable[..., Mapping[str, float]]] = ()) -> dict[str, float]:
    """Evaluates a saved checkpoint of a run on one split; nothing is trained or changed in the run.

    Writes the result to `workdir/eval_<which>_<split>.json` (with the checkpoint's step) and returns it.

    Args:
      config: the run's config (the same model and data options as the training run).
      workdir: the training run's directory.
      build_model: the architecture's `Model` factory.
      which: 'best' (the best checkpoint by config.checkpoint.best_metric) or 'latest'.
      split: the split to evaluate; None = config.data.eval_split. The evaluators must have been made
        for a config with this split (`with_eval_split`).
      evaluators: extra host-side evaluations, as in `train_and_evaluate`.

    Returns:
      {'eval/<metric>': value, ...} and 'step', the checkpoint's step.

    Raises:
      ConfigError: a bad `which`, an unknown split, a model other than the run's (`check_eval_config`)
        or a config problem (one line).
      FileNotFoundError: no such checkpoint in workdir.
    """
    if which not in ("best", "latest"):
        raise ConfigError(f"which must be 'best' or 'latest', got {which!r}")
    if split is not None:
        config = with_eval_split(config, split)
    # Before the data is built (minutes for some data sets): an empty or mistyped workdir fails at once.
    folder = "best" if which == "best" else "checkpoints"
    ckpt_lib.require_checkpoints(workdir, folder)
    check_eval_config(json.loads(config.to_json_best_effort()), workdir)
    try:
        validate_config(config)
        _, eval_source = prepare_data(config)
        model = build_model(**config.model.to_dict())
        task = tasks.make_task(config)
    except (ValueError, TypeError, KeyError) as e:
        raise _config_error(e) from e
    mesh = sharding.make_mesh()
    replicated = sharding.replicated(mesh)
    # Restored straight into the global replicated sharding: each process reads its own shards.
    _, params, step = load_params(workdir, build_model, config, which=folder, target_sharding=replicated)
    p_eval = jax.jit(functools.partial(eval_step, model=model, task=task), out_shardings=replicated)
    result = evaluate_params(params, step, p_eval=p_eval, eval_source=eval_source, config=config, model=model,
                             to_device=lambda b: sharding.global_batch(b, mesh), evaluators=evaluators)
    result["step"] = int(step)
    name = f"eval_{which}_{config.data.eval_split}.json"
    if jax.process_index() == 0:
        metrics_lib.write_json(os.path.join(workdir, name), result)
    logging.info("%s checkpoint (step %d) on %s: %s", which, step, config.data.eval_split,
                 ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.items()) if k != "step"))
    return result


def with_eval_split(config, split: str):
    """A copy of `config` whose data.eval_split is `split`."""
    if not isinstance(split, str) or not split:
        raise ConfigError(f"the evaluation split must be a non-empty name, got {split!r}")
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.data.eval_split = split
    return config


def load_params(workdir: str, build_model: Callable[..., Any], config, *, which: str = "checkpoints",
                target_sharding: jax.sharding.Sharding | None = None):
    """The run's model and the parameters of its newest checkpoint in workdir/<which> (notebooks, decoding).

    The restore itself is `checkpoint.restore_params`.

    The checkpoint may come from any topology (8 accelerators, 2 processes): the state is restored
    against its own stored shapes and dtypes in `target_sharding`, by default this process's first local
    device, so a laptop reads a TPU run's checkpoint.

    Args:
      workdir, build_model, config: the run's directory, `Model` factory and config.
      which: 'checkpoints' (the newest) or 'best'.
      target_sharding: where every array goes (e.g. a replicated `NamedSharding` over all processes);
        None means `jax.local_devices()[0]`.

    Returns:
      (model, params, step).
    """
    model = build_model(**config.model.to_dict())
    params, step = ckpt_lib.restore_params(workdir, which=which, target_sharding=target_sharding)
    return model, params, step
