"""Benchmark harness: timing, memory and scaling sweeps for jitted JAX functions.

What the architecture scaling scripts in `benchmarks/` share, in one namespace (`from zoo_core import
bench`; `bench.run_scaling`, `bench.train_step_setup`, ...):

* `zoo_core.bench.timing`: `time_jitted`, `time_state_step`, the measured peaks (`reference_matmul`,
  `reference_bandwidth`, `machine_bounds`, `best_bounds`), `roofline`, and what the process and the
  accelerator used (`process_memory`, `reset_peak_rss`, `device_memory`).
* `zoo_core.costs`: XLA's own accounting of a compiled function (`cost_of`, `memory_of`,
  `compiled_memory`: argument, output, temp and generated-code bytes, known before anything runs,
  which is what the out-of-memory guard of `run_scaling` uses). A leaf module outside this package,
  since the trainer reads it too and must not import the harness.
* `zoo_core.bench.sweep`: `run_scaling`, the sweep over cases x sequence lengths producing `Result`
  records, and their table (`format_table`).
* `zoo_core.bench.report`: `write_records`, `plot`, `machine_meta`, and the scaling scripts' command line
  (`scaling_parser`, `parse_scaling_args`, `run_and_report`).
* `zoo_core.bench.train_step`: `train_step_setup`, the trainer's own compiled train step with its state
  and one fixed batch, built by the trainer's setup (`zoo_core.run.setup`), so that a benchmark times
  the step that trains.

A scaling script reduces to a `make_fn(case, n) -> (fn, args)` closure; see
`benchmarks/softmax_attention.py`.
"""
from zoo_core import moved
from zoo_core.bench.report import (
                                   SCALING_LENGTHS,
                                   _measured_bytes,
                                   machine_meta,
                                   parse_scaling_args,
                                   plot,
                                   run_and_report,
                                   scaling_parser,
                                   write_records,
)
from zoo_core.bench.sweep import (
                                   CALIBRATE_MIN_BYTES,
                                   CPU_MEMORY_FACTOR,
                                   OK,
                                   OOM,
                                   SKIPPED,
                                   Result,
                                   format_table,
                                   materialize,
                                   run_scaling,
)
from zoo_core.bench.timing import (
                                   DEFAULT_MEMORY_FRACTION,
                                   ROOFLINE_HEADER,
                                   best_bounds,
                                   default_bandwidth_bytes,
                                   default_max_bytes,
                                   device_memory,
                                   format_roofline,
                                   machine_bounds,
                                   process_memory,
                                   reference_bandwidth,
                                   reference_matmul,
                                   reset_peak_rss,
                                   roofline,
                                   time_jitted,
                                   time_state_step,
)
from zoo_core.bench.train_step import train_step_setup
from zoo_core.costs import compiled_memory, cost_of, memory_of

__all__ = [
    "SCALING_LENGTHS", "machine_meta", "parse_scaling_args", "plot", "run_and_report", "scaling_parser",
    "write_records", "CALIBRATE_MIN_BYTES", "CPU_MEMORY_FACTOR", "OK", "OOM", "SKIPPED", "Result", "format_table",
    "materialize", "run_scaling", "DEFAULT_MEMORY_FRACTION", "ROOFLINE_HEADER", "best_bounds",
    "default_bandwidth_bytes", "default_max_bytes", "device_memory", "format_roofline", "machine_bounds",
    "process_memory", "reference_bandwidth", "reference_matmul", "reset_peak_rss", "roofline", "time_jitted",
    "time_state_step", "compiled_memory", "cost_of", "memory_of", "train_step_setup", "_measured_bytes",
]


# The names of 0.1.0 that were renamed warn and give the new function (zoo_core.moved.RENAMED).
__getattr__ = moved.renamed_getattr(__name__)
