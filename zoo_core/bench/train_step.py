"""The trainer's own compiled train step for a benchmark (`train_step_setup`).

Built by the trainer's setup (`zoo_core.run.setup`), so that a benchmark times the step that trains.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

import jax
import numpy as np

from zoo_core.costs import cost_of
from zoo_core.data import pipeline
from zoo_core.run import setup as run_setup
from zoo_core.run import sharding

# Data options shrunk by `train_step_setup` (the generated data sets): only a fixed batch is needed.
_SIZE_OPTIONS = ("num_train", "num_validation", "num_test")


def train_step_setup(config, build_model: Callable[..., Any], *, num_examples: int | None = None,
                     donate: bool = True) -> dict[str, Any]:
    """The shared trainer's compiled train step, its initial state and one fixed training batch.

    Built by the trainer's own setup: `run_setup.build_setup` (the checks, the model, task, optimiser
    and data, each built once), `RunSetup.init_state` on the 'data' mesh and `run_setup.compile_steps`,
    whose jitted `train_step` is the one `train_and_evaluate` runs; the batch is the first of
    `pipeline.train_batches` (streamed: `in_memory=False`), put on the mesh. The step is always the jit
    one (parallel.mode 'jit').

    Args:
      config: a resolved config (not changed; a copy is).
      build_model: the architecture's `Model` factory (`agf_jax.model.Model`, ...).
      num_examples: where the data set is generated (`config.data.options.num_train` etc.), generate
        only this many examples per split (default: 2 batches); the shapes are unchanged.
      donate: donate the state as the trainer does (then always thread the returned state).

    Returns:
      dict(step: the jitted step, compiled: it compiled for (state, batch), state, batch, model,
      config: the copy used, compile_s, num_params, cost: `cost_of` the step (on CPU summed over
      its devices; with `optim.grad_accum_steps` > 1, of the same step without micro-batches),
      devices: the mesh's size).
    """
    config = copy.deepcopy(config)
    num_examples = num_examples or 2 * int(config.batch_size)
    with config.unlocked():
        config.parallel.mode = "jit"
        options = config.data.get("options", None)
        for key in _SIZE_OPTIONS:
            if options is not None and key in options and options[key]:
                need = num_examples if key == "num_train" else min(num_examples,
                                                                   int(config.eval_batch_size))
                options[key] = min(int(options[key]), max(need, 1))
    # A benchmark runs no evaluation: checkpoint.best_metric may name an evaluator's metric.
    s = run_setup.build_setup(config, build_model, has_evaluators=True)
    mesh = sharding.config_mesh(config)   # parallel.sequence too: the benchmark times the training step
    replicated = sharding.replicated(mesh)
    steps = run_setup.compile_steps(s, mesh, replicated, donate=donate)
    # One batch: streamed, not a whole split decoded into memory for it.
    host = sharding.numeric(next(pipeline.train_batches(
        s.train_source, global_batch_size=config.batch_size, seed=config.seed, process_index=0,
        process_count=1, start_step=0, in_memory=False)))
    batch = steps.to_device(host)
    state = s.init_state(replicated)
    t0 = time.perf_counter()
    compiled = steps.train.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    # XLA's cost analysis counts the micro-batch loop's body once: with micro-batches the step's cost
    # is that of the same step on the whole batch at once (`Steps.whole`).
    whole = compiled if steps.whole is None else steps.whole.lower(state, batch).compile()
    cost = cost_of(None, compiled=whole)
    if jax.default_backend() == "cpu":
        # XLA counts a partitioned step per device; CPU devices share the machine's cores, whose
        # bounds `machine_bounds` measures, so the step's cost is the sum over devices.
        cost = {k: None if v is None else v * mesh.size for k, v in cost.items()}
    return dict(step=steps.train, compiled=compiled, state=state, batch=batch, model=s.model, config=config,
                compile_s=compile_s, num_params=num_params, cost=cost, devices=int(mesh.size))
