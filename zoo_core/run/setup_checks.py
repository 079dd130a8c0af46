"""Checks of a run's setup that need no compile: the config's ranges, the workdir, the model's
constructor, the eval metrics and the class count (shapes only). Each raises one line naming the problem.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core import checks, tasks
from zoo_core.run import optim, sharding
from zoo_core.run.errors import ConfigError
from zoo_core.run.steps import eval_step, feature_step_kwargs, uses_feature_step

PARALLEL_MODES = ("jit", "pmap")


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
    # eval_also_at_step past total_steps is no evaluation in this run, as eval_every_steps past it is:
    # a shorter --config.total_steps needs no second field changed.
    for name, value in (("eval_every_steps", config.eval_every_steps),
                        ("eval_also_at_step", config.eval_also_at_step),
                        ("checkpoint_every_steps", config.checkpoint_every_steps),
                        ("eval_max_examples", config.eval_max_examples),
                        ("optim.grad_clip_norm", config.optim.grad_clip_norm),
                        ("schedule.warmup_steps", config.schedule.warmup_steps)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    sequence = config.parallel.get("sequence", 1)
    sharding.check_sequence(sequence, jax.device_count())
    if sequence > 1 and mode == "pmap":
        raise ValueError("parallel.sequence > 1 needs parallel.mode='jit' (a 'data' x 'sequence' mesh)")
    check_packing(config)
    # data-parallel devices: the others split each sequence
    devices = jax.device_count() // sequence
    accum = int(config.optim.grad_accum_steps)
    # Applied by the training command before JAX starts (zoo_core.run.main); checked here for every caller.
    sharding.check_cpu_devices(config.parallel.cpu_devices)
    if accum < 1:
        raise ValueError(f"optim.grad_accum_steps must be >= 1, got {accum}")
    if config.batch_size % (devices * accum):
        what = "devices" if sequence == 1 else "data-parallel devices (devices / parallel.sequence)"
        raise ValueError(f"batch_size {config.batch_size} must be divisible by {what} ({devices}) x "
                         f"optim.grad_accum_steps ({accum})")
    patience = config.checkpoint.patience
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
        raise ValueError(f"checkpoint.patience must be an int >= 0, got {patience!r}")
    if patience and not (config.checkpoint.best_metric and config.eval_every_steps):
        raise ValueError("checkpoint.patience stops on evaluations without a new best, so it needs "
                         "checkpoint.best_metric and eval_every_steps > 0")
    if config.eval_batch_size % devices:
        raise ValueError(f"eval_batch_size {config.eval_batch_size} must be divisible by the {devices} "
                         f"{'devices' if sequence == 1 else 'data-parallel devices'}")
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


def check_packing(config) -> None:
    """`data.packing` (a bool) and `data.packing_factor` (an int >= 1); packing needs a task that can pack
    (`tasks.packed_features`)."""
    packing, factor = config.data.get("packing", False), config.data.get("packing_factor", 1)
    if not isinstance(packing, bool):
        raise ValueError(f"data.packing must be True or False, got {packing!r}")
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"data.packing_factor must be an int >= 1, got {factor!r}")
    if factor > 1 and not packing:
        raise ValueError(f"data.packing_factor={factor} sizes packed rows: it needs data.packing=True")
    if packing:
        tasks.packed_features(config)


def make_model(build_model: Callable[..., Any], config):
    """`build_model(**config.model)`; a field it has not, or one it needs and the config lacks, most
    often means a config written for another architecture's train command."""
    try:
        model = build_model(**config.model.to_dict())
        return with_sequence_axis(build_model, config, model)
    except TypeError as e:
        if not re.search(r"unexpected keyword argument|missing \d+ required", str(e)):
            raise
        detail = re.sub(r"^\S*\(\) ", "", str(e).splitlines()[0])
        raise ConfigError(f"config.model does not fit {build_model.__module__}.{build_model.__qualname__}: "
                          f"{detail}; is the config written for another architecture's train command?") from None


def with_sequence_axis(build_model: Callable[..., Any], config, model):
    """With parallel.sequence > 1, a model that has a `sequence_axis` field (its layers' context-parallel
    forms) built again with it set to the mesh's 'sequence' axis, unless the config sets it; any other
    model as it is (XLA partitions its steps over the sequence axis: the same numbers)."""
    if config.parallel.get("sequence", 1) == 1 or "sequence_axis" not in {f.name for f in fields_of(model)}:
        return model
    given = config.model.get("sequence_axis", None)
    if given not in (None, sharding.SEQUENCE_AXIS):
        raise ValueError(f"model.sequence_axis={given!r}: with parallel.sequence > 1 the mesh's sequence axis is "
                         f"{sharding.SEQUENCE_AXIS!r} (leave the field unset)")
    return build_model(**{**config.model.to_dict(), "sequence_axis": sharding.SEQUENCE_AXIS})


def fields_of(module) -> tuple:
    return dataclasses.fields(module) if dataclasses.is_dataclass(module) else ()


def example_from_features(builder) -> dict[str, np.ndarray] | None:
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


def check_eval_metrics(name: str, model, task, params, example, *, has_evaluators: bool) -> None:
    """Traces one eval step (shapes only) so that a model/task mismatch, e.g. a forecast of the wrong
    shape, fails now and not at the first compile; and checks that checkpoint.best_metric names one of
    its metrics, not at the first eval many steps on."""
    if name and not name.startswith("eval/"):
        raise ValueError(f"checkpoint.best_metric must name an eval metric 'eval/<name>', got {name!r}")
    feature_step = (jnp.zeros([], jnp.int32),) if uses_feature_step(model) else ()
    sums = jax.eval_shape(functools.partial(eval_step, model=model, task=task), params, example, *feature_step)
    if not name or has_evaluators:   # host-side evaluators add names (e.g. eval/bleu) known only when they run
        return
    known = sorted(f"eval/{k}" for k in sums)
    if name not in known:
        raise ValueError(f"checkpoint.best_metric {name!r} is not an eval metric of this task and model "
                         f"(they are: {', '.join(known)})")


def check_classes(config, model, params, example, source) -> None:
    """A classifier's output width must be the data's class count (`info.metadata['num_classes']`,
    where the data set records it): a model with more outputs trains silently on classes that never
    occur, one with fewer fails only at the first logged step. Shapes only, no compile."""
    info = getattr(source, "dataset_info", None)
    want = (info.metadata or {}).get("num_classes") if info is not None else None
    if config.task.name != "classification" or want is None:
        return
    feature_step = feature_step_kwargs(model, jnp.zeros([], jnp.int32))
    outputs, _ = jax.eval_shape(lambda p: model.apply({"params": p}, example, train=False, **feature_step), params)
    got = jax.tree_util.tree_leaves(outputs)[0].shape[-1]
    if got != int(want):
        raise ValueError(f"the model has {got} outputs but {config.data.name} has {want} classes: set "
                         f"--config.model.num_classes={want}")


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
