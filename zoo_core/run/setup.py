"""A run's setup, each piece built once and checked as it is built.

`check_setup` builds what needs no prepared data (the optimiser and schedule, the task, the model, the
data builder with its options checked) and, where the dataset declares its feature shapes in advance,
traces the model on them; `RunSetup.prepare` then prepares the data and traces the model on a real
example. Between the two, the training loop checks the workdir and the resume (`zoo_core.run.loop`).
`restore_or_init` gives the state and `compile_steps` the compiled steps, which the training loop and
the benchmarks (`zoo_core.bench.train_step_setup`) share.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from zoo_core import costs, tasks
from zoo_core import data as data_lib
from zoo_core.data import pipeline
from zoo_core.run import checkpoint as ckpt_lib
from zoo_core.run import metrics as metrics_lib
from zoo_core.run import optim, sharding
from zoo_core.run.errors import ConfigError, config_error
from zoo_core.run.prepare import prepare_data
from zoo_core.run.setup_checks import (
    check_classes,
    check_eval_metrics,
    example_from_features,
    make_model,
    validate_config,
)
from zoo_core.run.steps import TrainState, eval_step, init_state, train_step


@dataclasses.dataclass
class RunSetup:
    """What a run is made of, built and checked before anything is written.

    Made by `check_setup` (no data prepared); `prepare` fills in the data sources, the example and the
    abstract state.
    """
    config: Any
    config_dict: dict
    model: Any                 # None when check_setup was given no build_model
    task: Any
    tx: Any
    schedule: Any
    builder: Any               # the dataset's builder, unprepared until `prepare`
    rng: jax.Array
    has_evaluators: bool
    train_source: Any = None
    eval_source: Any = None
    example: dict | None = None           # one example [1, ...] of the eval pipeline's numeric features
    packer: Any = None                    # data.packing: the packed training stream (`pipeline.make_packer`)
    abstract: TrainState | None = None    # the state's shapes and dtypes
    # (example shapes, abstract state) traced on the features the dataset declares before it is prepared
    _declared: tuple | None = None

    def prepare(self) -> "RunSetup":
        """Prepares the data (the builder made by `check_setup`), then checks the model on a real example:
        its initialisation, an eval step with checkpoint.best_metric among its metrics, and a classifier's
        class count. Every config error surfaces here, before any compile and before the workdir is made
        or the config is logged (as one ConfigError). Returns self."""
        config = self.config
        if self.model is None:
            raise ValueError("RunSetup.prepare needs the model: give check_setup a build_model")
        pcount, pindex = jax.process_count(), jax.process_index()
        try:
            with sharding.mesh_context(sharding.config_mesh(config)):
                self._prepare(pcount, pindex)
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise config_error(e) from e
        return self

    def _prepare(self, pcount: int, pindex: int) -> None:
        """`prepare` under the run's mesh; sets the sources, the example, the abstract state and the packer."""
        config = self.config
        train_source, eval_source = prepare_data(config, builder=self.builder)
        if len(train_source) < config.batch_size:   # found here, not after the first compile
            raise ValueError(f"batch_size {config.batch_size} exceeds the {len(train_source)} training "
                             f"examples of {config.data.name}")
        example = sharding.numeric(next(pipeline.eval_batches(
            eval_source, global_batch_size=config.eval_batch_size, process_index=pindex,
            process_count=pcount)))
        example = jax.tree_util.tree_map(lambda x: x[:1], example)
        sequence = config.parallel.get("sequence", 1)
        padding = sharding.sequence_padding(self.model)
        sharding.check_sequence_lengths(example, sequence, padding, config)
        if self._declared is not None and self._declared[0] == _shapes(example):
            abstract = self._declared[1]   # traced and checked on these very shapes by check_setup
        else:
            abstract = jax.eval_shape(functools.partial(init_state, model=self.model, tx=self.tx), self.rng,
                                      example)
            check_eval_metrics(config.checkpoint.best_metric, self.model, self.task, abstract.params, example,
                               has_evaluators=self.has_evaluators)
        check_classes(config, self.model, abstract.params, example, train_source)
        packer = None
        if config.data.get("packing", False):
            packer = pipeline.make_packer(train_source, keys=tasks.packed_features(config), seed=config.seed,
                                          pad_id=int(config.task.get("pad_id", 0)),
                                          factor=int(config.data.packing_factor))
            packed = dict(packer.rows(0, 1), example_mask=np.ones((1,), np.float32))
            sharding.check_sequence_lengths(packed, sequence, padding, config)
            # the model refuses a packed batch it cannot take (one line), here and not at the first step
            check_eval_metrics("", self.model, self.task, abstract.params, packed, has_evaluators=True)
        self.train_source, self.eval_source, self.example, self.abstract = (train_source, eval_source, example,
                                                                            abstract)
        self.packer = packer

    def train_batches(self, start_step: int):
        """This process's training batches from `start_step` on: packed rows (`data.packing`) or examples."""
        config = self.config
        where = dict(global_batch_size=config.batch_size, process_index=jax.process_index(),
                     process_count=jax.process_count(), start_step=start_step)
        if self.packer is not None:
            return pipeline.packed_train_batches(self.packer, **where)
        return pipeline.train_batches(self.train_source, seed=config.seed, **where)

    def init_state(self, replicated) -> TrainState:
        """A fresh state (`init_state` on the example) made directly in the `replicated` sharding."""
        init = functools.partial(init_state, model=self.model, tx=self.tx)
        return jax.jit(init, out_shardings=replicated)(self.rng, self.example)


def _shapes(tree) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def check_setup(config, build_model: Callable[..., Any] | None = None, *,
                has_evaluators: bool = False) -> RunSetup:
    """Every check that needs no prepared data and no compile, in the order a user would fix them.

    The config's ranges (`validate_config`), the optimiser and schedule, the task, the model's
    constructor (`build_model(**config.model)`, which validates its fields), the data options and paths
    (`data.check_options`: a file where a directory is expected and the reverse, an unknown option), and,
    when the dataset declares fixed feature shapes before it is prepared, the model's initialisation and
    an eval step on them (shapes only) with checkpoint.best_metric among its metrics (skipped with
    `has_evaluators`, which add metric names). Nothing is written.

    Returns:
      The `RunSetup` with what was built; `prepare()` it to train.

    Raises:
      ConfigError: one line naming the field or file and what is expected.
    """
    try:
        validate_config(config)
        with sharding.mesh_context(sharding.config_mesh(config)):   # a layer over 'sequence' traces in it
            return _check_setup(config, build_model, has_evaluators)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        raise config_error(e) from e


def _check_setup(config, build_model, has_evaluators: bool) -> RunSetup:
    """`check_setup` once the config's ranges are checked, under the run's mesh."""
    tx, schedule = optim.make_optimizer(config)
    task = tasks.make_task(config)
    model = make_model(build_model, config) if build_model is not None else None
    options = config.data.options.to_dict()
    builder = data_lib.check_options(config.data.name, config.data.data_dir, options)
    num_train = options.get("num_train")
    if isinstance(num_train, int) and 0 < num_train < config.batch_size:
        raise ValueError(f"batch_size {config.batch_size} exceeds the {num_train} training examples "
                         f"(data.options.num_train) of {config.data.name}")
    rng = jax.random.PRNGKey(config.seed)
    example = example_from_features(builder)
    declared = None
    if example is not None:   # the declared lengths against parallel.sequence, before any data is built
        sharding.check_sequence_lengths(example, config.parallel.get("sequence", 1),
                                        sharding.sequence_padding(model), config)
    if model is not None and example is not None:
        abstract = jax.eval_shape(functools.partial(init_state, model=model, tx=tx), rng, example)
        check_eval_metrics(config.checkpoint.best_metric, model, task, abstract.params, example,
                           has_evaluators=has_evaluators)
        declared = (_shapes(example), abstract)
    return RunSetup(config=config, config_dict=json.loads(config.to_json_best_effort()), model=model, task=task,
                    tx=tx, schedule=schedule, builder=builder, rng=rng, has_evaluators=has_evaluators,
                    _declared=declared)


def build_setup(config, build_model: Callable[..., Any], *, has_evaluators: bool = False) -> RunSetup:
    """`check_setup(...).prepare()`: the whole setup, checked, with the data prepared."""
    return check_setup(config, build_model, has_evaluators=has_evaluators).prepare()


def restore_or_init(s: RunSetup, workdir: str, replicated) -> tuple[ckpt_lib.Checkpoints, TrainState, int]:
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
        logging.info("no checkpoint in %s: starting from scratch", workdir)
        return checkpoints, s.init_state(replicated), 0
    start, state = restored
    logging.info("resumed from the checkpoint at step %d", start)
    return checkpoints, state, start


@dataclasses.dataclass
class Steps:
    """The compiled steps and how batches and states move between host and devices."""
    train: Callable[..., Any]      # (state, batch) -> (state, metrics); the state is donated (by default)
    eval: Callable[..., Any]       # (params, batch, feature_step) -> metric sums
    to_device: Callable[[Any], Any]
    host_state: Callable[[Any], Any]   # the single (unreplicated) copy of a state
    pmapped: bool
    # The same step without micro-batches (None when grad_accum_steps is 1), with the same donation,
    # only ever lowered: XLA's cost analysis counts a loop body once, so the costs are read from this one.
    whole: Callable[..., Any] = None


def step_flops(steps: Steps, state, batch) -> float | None:
    """FLOPs of one train step over all devices, from XLA's cost analysis of the step's lowering
    (`costs.cost_of`; no compile), None where the backend counts none.

    With micro-batches the lowered step is the one without them (`Steps.whole`): the cost analysis
    counts the body of the micro-batch loop once, which would undercount the step by their number.
    """
    flops = costs.flops_of((steps.whole or steps.train).lower(state, batch))
    # pmap lowers the per-device computation; a jitted step's lowering is the global one.
    return None if flops is None else flops * (jax.device_count() if steps.pmapped else 1)


def compile_steps(s: RunSetup, mesh, replicated, *, donate: bool = True) -> Steps:
    """`train_step` and `eval_step` jitted once: over the 'data' mesh (mode 'jit') or pmapped.

    `donate`: the train step donates its state (the loop's choice; a benchmark may keep it).
    """
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

    steps = dict(train=train(accum, donate), whole=None if accum == 1 else train(1, donate))
    if jitted:
        # parallel.sequence = P: the features the model takes padded, padded to a multiple of P
        sequence, padding = s.config.parallel.get("sequence", 1), sharding.sequence_padding(s.model)
        return Steps(
            **steps, eval=jax.jit(functools.partial(eval_step, model=s.model, task=s.task), out_shardings=replicated),
            to_device=lambda b: sharding.global_batch(sharding.pad_sequences(b, sequence, padding), mesh),
            host_state=lambda st: st, pmapped=False)
    return Steps(
        **steps, eval=jax.pmap(functools.partial(eval_step, model=s.model, task=s.task, axis_name="batch"),
                               axis_name="batch", in_axes=(0, 0, None)),
        to_device=sharding.pmap_batch, host_state=sharding.unreplicate, pmapped=True)
