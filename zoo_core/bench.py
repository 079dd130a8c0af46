"""Benchmark harness: timing, memory and scaling sweeps for jitted JAX functions.

What the architecture scaling scripts in `benchmarks/` share, in one namespace:

* `zoo_core.bench_timing`: `time_jitted`, `time_state_step`, the measured peaks (`reference_matmul`,
  `reference_bandwidth`, `machine_bounds`, `best_bounds`), `roofline`, and what the process and the
  accelerator used (`process_memory`, `reset_peak_rss`, `device_memory`).
* `zoo_core.costs`: XLA's own accounting of a compiled function (`cost_of`, `memory_of`,
  `compiled_memory`: argument, output, temp and generated-code bytes, known before anything runs,
  which is what the out-of-memory guard of `run_scaling` uses).
* `zoo_core.bench_sweep`: `run_scaling`, the sweep over cases x sequence lengths producing `Result`
  records, and their table (`format_table`).
* `zoo_core.bench_report`: `write_json`, `plot`, `machine_meta`, and the scaling scripts' command line
  (`scaling_parser`, `parse_scaling_args`, `run_and_report`).
* `train_step_setup` (here): the trainer's own compiled train step with its state and one fixed batch,
  built by the trainer's setup (`zoo_core.run_setup`), so that a benchmark times the step that trains.

A scaling script reduces to a `make_fn(case, n) -> (fn, args)` closure; see
`benchmarks/softmax_attention.py`.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

import jax
import numpy as np

from zoo_core import run_setup, sharding
from zoo_core.bench_report import (SCALING_LENGTHS, _measured_bytes, machine_meta, parse_scaling_args, plot,
                                   run_and_report, scaling_parser, write_json)
from zoo_core.bench_sweep import (CALIBRATE_MIN_BYTES, CPU_MEMORY_FACTOR, OK, OOM, SKIPPED, Result, format_table,
                                  materialize, run_scaling)
from zoo_core.bench_timing import (DEFAULT_MEMORY_FRACTION, ROOFLINE_HEADER, best_bounds, default_bandwidth_bytes,
                                   default_max_bytes, device_memory, format_roofline, machine_bounds,
                                   process_memory, reference_bandwidth, reference_matmul, reset_peak_rss, roofline,
                                   time_jitted, time_state_step)
from zoo_core.costs import compiled_memory, cost_of, memory_of
from zoo_core.data import pipeline

__all__ = [
    "SCALING_LENGTHS", "machine_meta", "parse_scaling_args", "plot", "run_and_report", "scaling_parser",
    "write_json", "CALIBRATE_MIN_BYTES", "CPU_MEMORY_FACTOR", "OK", "OOM", "SKIPPED", "Result", "format_table",
    "materialize", "run_scaling", "DEFAULT_MEMORY_FRACTION", "ROOFLINE_HEADER", "best_bounds",
    "default_bandwidth_bytes", "default_max_bytes", "device_memory", "format_roofline", "machine_bounds",
    "process_memory", "reference_bandwidth", "reference_matmul", "reset_peak_rss", "roofline", "time_jitted",
    "time_state_step", "compiled_memory", "cost_of", "memory_of", "train_step_setup", "_measured_bytes",
]

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
    mesh = sharding.make_mesh()
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
