"""Benchmark harness: timing, memory and scaling sweeps for jitted JAX functions.

Everything the architecture scaling scripts in `benchmarks/` share lives here:

* `time_jitted`: median / min of `repeats` timed calls after `warmup` calls, with the compile time
  reported separately (compile is never inside a timed call).
* `compiled_memory`: XLA's own buffer-assignment figures for a compiled executable (argument,
  output, temp, generated-code bytes). They are known *before* anything is run, which is what the
  out-of-memory guard of `run_scaling` uses.
* `process_memory` / `reset_peak_rss` / `device_memory`: what the process and the accelerator
  actually used.
* `reference_matmul`: GFLOP/s of a float32 matmul measured *now*. A 2-core CPU shared with other
  processes loses half its throughput (platform spec §7), so a benchmark times this reference in
  the same run and states results as ratios to it rather than as raw seconds only.
* `run_scaling`: the sweep over cases × sequence lengths, producing `Result` records; `write_json`
  and `plot` store them.
* Roofline accounting: `cost_of` (XLA's FLOP and byte counts of a compiled function),
  `reference_bandwidth` (streaming GB/s measured now), `machine_bounds` (both peaks, measured in the
  same process) and `roofline` (achieved GFLOP/s and GB/s of a measured time, the fractions of the
  compute and memory bounds and the roofline time bound).
* `train_step_setup`: the shared trainer's jitted `train_step` with its state and one fixed batch, built
  as `trainer.train_and_evaluate` builds them (peers benchmark, device check).

A scaling script reduces to a `make_fn(case, n) -> (fn, args)` closure; see
`benchmarks/softmax_attention.py`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:  # psutil comes with tensorflow-datasets; everything below works without it.
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

from zoo_core import checks
from zoo_core.costs import compile_timed as _compile
from zoo_core.costs import compiled_memory, cost_of, flops_of as _flops_of, memory_of  # noqa: F401 (compiled_memory: public)

_GIB = 1024**3
# Default fraction of free memory a single benchmark may claim (estimate from XLA's buffer
# assignment). The margin covers allocator fragmentation, XLA scratch and the other processes.
DEFAULT_MEMORY_FRACTION = 0.8
# The guard multiplies XLA's estimate by this on CPU. XLA:CPU hands parts of the graph to library
# fusions (YNNPACK `__ynn_fusion`) that allocate scratch outside the buffer assignment: softmax
# attention fwd+bwd (jax 0.10.2) grew the process RSS by up to 1.94x the compiled estimate.
CPU_MEMORY_FACTOR = 2.0
# Records with a smaller estimate do not recalibrate the guard factor: their RSS growth is noise
# (allocator caches, runtime set-up), not the executable's buffers.
CALIBRATE_MIN_BYTES = 32 * 2**20

# Status values of a `Result`.
OK, SKIPPED, OOM = "ok", "skipped", "oom"


# ----------------------------------------------------------------------------------------------
# Timing.


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def _time_compiled(compiled: Callable, args: Sequence[Any], warmup: int,
                   repeats: int) -> dict[str, Any]:
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return dict(median_s=statistics.median(times), min_s=min(times), all_s=times)


def time_jitted(fn: Callable, *args: Any, warmup: int = 1, repeats: int = 5) -> dict[str, Any]:
    """Times `jax.jit(fn)(*args)`: compile once, `warmup` untimed calls, then `repeats` timed ones.

    Every call is followed by `block_until_ready` on all outputs, so the times are device times
    plus dispatch, never just dispatch.

    Args:
      fn: a function of arrays (jitted or not; it is jitted here).
      *args: concrete arrays (pytrees of arrays) to call it with.
      warmup: untimed calls after compiling (>= 0).
      repeats: timed calls (>= 1).

    Returns:
      dict(median_s, min_s, all_s: list of `repeats` floats, compile_s: lower+compile time).
    """
    _check_counts(warmup, repeats)
    compiled, compile_s = _compile(fn, args)
    return dict(_time_compiled(compiled, args, warmup, repeats), compile_s=compile_s)


def reference_matmul(n: int = 2048, dtype: Any = jnp.float32, *, warmup: int = 1,
                     repeats: int = 5) -> float:
    """Measures the machine's matmul throughput right now, in GFLOP/s.

    GFLOP/s = 2 n^3 / (best of `repeats` times), as in platform spec §7 (about 200 f32 on an idle
    2-core CPU, about half that under load). On a GPU use a larger `n` (e.g. 8192): 2048 is
    dominated by launch overhead there.

    Args:
      n: the square matrix size.
      dtype: operand dtype.
      warmup: untimed calls.
      repeats: timed calls; the best one counts.

    Returns:
      GFLOP/s as a float.
    """
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32), dtype)
    t = time_jitted(jnp.matmul, a, b, warmup=warmup, repeats=repeats)
    return 2.0 * n**3 / t["min_s"] / 1e9


def reference_bandwidth(n_bytes: int = 256 * 2**20, *, warmup: int = 1, repeats: int = 5) -> float:
    """Measures the streaming memory bandwidth right now, in GB/s (1e9 bytes per second).

    Times a jitted, donated `x + 1` over a float32 array of `n_bytes` (one read and one write of the
    whole array: 2 * n_bytes moved per call); best of `repeats`. The buffer is donated so the write
    lands in pages already mapped: a fresh output of this size is page-faulted on every call on a
    CPU (measured: 5.6 GB/s that way against 44 GB/s donated, 2 cores), which would time the
    kernel's page zeroing rather than the memory. The array must be much larger than the
    last-level cache (default 256 MiB; on a GPU use 1-4 GiB).

    Returns:
      GB/s as a float.
    """
    _check_counts(warmup, repeats)
    n = max(int(n_bytes) // 4, 1)
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = step(jnp.zeros((n,), jnp.float32))
    for _ in range(warmup):
        x = step(x)
    jax.block_until_ready(x)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = step(x)
        jax.block_until_ready(x)
        best = min(best, time.perf_counter() - t0)
    del x
    return 2.0 * 4 * n / best / 1e9


def default_bandwidth_bytes() -> int:
    """The buffer `reference_bandwidth` streams by default here: 256 MiB on CPU, 2 GiB on accelerators."""
    return 256 * 2**20 if jax.default_backend() == "cpu" else 2 * 2**30


def machine_bounds(*, matmul_n: int | None = None, dtype: Any = jnp.float32,
                   bandwidth_bytes: int | None = None, repeats: int = 5) -> dict[str, float]:
    """The compute and memory peaks of this machine measured now, in this process.

    `peak_gflops` is `reference_matmul(matmul_n, dtype)` (default n = 2048 on CPU, 8192 on
    accelerators) and `peak_gbps` is `reference_bandwidth(bandwidth_bytes)` (default 256 MiB on
    CPU, 2 GiB on accelerators). Both are lower bounds of the true peaks, so the fractions that
    `roofline` computes from them are upper bounds.
    """
    matmul_n = matmul_n or (2048 if jax.default_backend() == "cpu" else 8192)
    bandwidth_bytes = bandwidth_bytes or default_bandwidth_bytes()
    return dict(peak_gflops=reference_matmul(matmul_n, dtype, repeats=repeats),
                peak_gbps=reference_bandwidth(bandwidth_bytes, repeats=repeats),
                matmul_n=matmul_n, matmul_dtype=jnp.dtype(dtype).name,
                bandwidth_bytes=int(bandwidth_bytes))


def best_bounds(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The highest peaks among several `machine_bounds()` measurements of one run.

    On a shared host the same measurement moves by 2x within minutes (seen on the 2-core CPU: the
    streaming bandwidth 39 to 85 GB/s in one afternoon). Each measurement is a lower bound of what the
    machine can do, so the best one is the tightest; a roofline fraction computed against it is the
    honest (lowest) one. The other fields come from the first sample, plus `samples` (how many).
    """
    if not samples:
        raise ValueError("best_bounds needs at least one machine_bounds() sample")
    best = dict(samples[0])
    for key in ("peak_gflops", "peak_gbps"):
        best[key] = max(s[key] for s in samples)
    best["samples"] = len(samples)
    return best


def roofline(cost: dict[str, float | None], seconds: float,
             bounds: dict[str, float] | None = None) -> dict[str, float | None]:
    """Roofline accounting of one call that took `seconds`.

    Args:
      cost: `cost_of(...)` (flops, bytes_accessed).
      seconds: the measured time per call (e.g. a median).
      bounds: `machine_bounds()` (peak_gflops, peak_gbps); None: only the achieved rates.

    Returns:
      dict(seconds, gflop, gbyte, gflops (achieved GFLOP/s), gbps (achieved GB/s),
      frac_compute = gflops / peak_gflops, frac_memory = gbps / peak_gbps,
      bound_s = max(flops / peak, bytes / bandwidth), the time the roofline allows,
      frac_bound = bound_s / seconds (1.0 = at the roofline), bound = 'compute' or 'memory'
      (the larger of the two lower bounds)). Entries are None where a count or a peak is missing.
    """
    if seconds is None or seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    flops, nbytes = cost.get("flops"), cost.get("bytes_accessed")
    out: dict[str, Any] = dict(seconds=seconds, gflop=None if flops is None else flops / 1e9,
                               gbyte=None if nbytes is None else nbytes / 1e9,
                               gflops=None if flops is None else flops / seconds / 1e9,
                               gbps=None if nbytes is None else nbytes / seconds / 1e9,
                               frac_compute=None, frac_memory=None, bound_s=None, frac_bound=None,
                               bound=None)
    if bounds:
        t_compute = t_memory = None
        if out["gflops"] is not None and bounds.get("peak_gflops"):
            out["frac_compute"] = out["gflops"] / bounds["peak_gflops"]
            t_compute = flops / (bounds["peak_gflops"] * 1e9)
        if out["gbps"] is not None and bounds.get("peak_gbps"):
            out["frac_memory"] = out["gbps"] / bounds["peak_gbps"]
            t_memory = nbytes / (bounds["peak_gbps"] * 1e9)
        known = [(t, name) for t, name in ((t_compute, "compute"), (t_memory, "memory"))
                 if t is not None]
        if known:
            out["bound_s"], out["bound"] = max(known)
            out["frac_bound"] = out["bound_s"] / seconds
    return out


ROOFLINE_HEADER = (f"{'GFLOP':>8} {'GB':>7} {'GFLOP/s':>8} {'GB/s':>7} {'f_comp':>6} {'f_mem':>6} "
                   f"{'bound_s':>8} {'f_bound':>7}")


def format_roofline(r: dict[str, Any] | None) -> str:
    """One fixed-width row of `roofline(...)` under `ROOFLINE_HEADER`."""
    r = r or {}

    def num(key, width, spec):
        v = r.get(key)
        return ("-" if v is None else format(v, spec)).rjust(width)

    return (f"{num('gflop', 8, '.2f')} {num('gbyte', 7, '.2f')} {num('gflops', 8, '.1f')} "
            f"{num('gbps', 7, '.1f')} {num('frac_compute', 6, '.2f')} {num('frac_memory', 6, '.2f')} "
            f"{num('bound_s', 8, '.4g')} {num('frac_bound', 7, '.2f')}")


def time_state_step(step: Callable, state: Any, *args: Any, warmup: int = 1,
                    repeats: int = 5) -> tuple[dict[str, Any], Any]:
    """Times a compiled `step(state, *args) -> (state, ...)` that threads its state (and may
    donate it): `warmup` untimed then `repeats` timed calls, each ended by `block_until_ready`.

    Returns:
      (dict(median_s, min_s, all_s), the final state).
    """
    _check_counts(warmup, repeats)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = step(state, *args)
        jax.block_until_ready(out)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        state = out[0] if isinstance(out, tuple) else out
    return dict(median_s=statistics.median(times), min_s=min(times), all_s=times), state


# Data options shrunk by `train_step_setup` (the generated data sets): only a fixed batch is needed.
_SIZE_OPTIONS = ("num_train", "num_validation", "num_test")


def train_step_setup(config, build_model: Callable[..., Any], *, num_examples: int | None = None,
                     donate: bool = True) -> dict[str, Any]:
    """The shared trainer's jitted train step, its initial state and one fixed training batch.

    Built as `zoo_core.trainer.train_and_evaluate` builds them: `trainer.prepare_data`, the model
    from `build_model(**config.model)`, `tasks.make_task`, `optim.make_optimizer`,
    `trainer.init_state` on the first example, the batch from `pipeline.train_batches` put on the
    'data' mesh, and `jax.jit(partial(trainer.train_step, ...), donate_argnums=(0,))`.

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
    import copy

    from zoo_core import optim, sharding, tasks, trainer
    from zoo_core.data import pipeline

    config = copy.deepcopy(config)
    num_examples = num_examples or 2 * int(config.batch_size)
    with config.unlocked():
        options = config.data.get("options", None)
        for key in _SIZE_OPTIONS:
            if options is not None and key in options and options[key]:
                need = num_examples if key == "num_train" else min(num_examples,
                                                                   int(config.eval_batch_size))
                options[key] = min(int(options[key]), max(need, 1))
    trainer.validate_config(config)
    train_source, _ = trainer.prepare_data(config)
    model = build_model(**config.model.to_dict())
    task = tasks.make_task(config)
    tx, schedule = optim.make_optimizer(config)
    host = sharding.numeric(next(pipeline.train_batches(
        train_source, global_batch_size=config.batch_size, seed=config.seed, process_index=0,
        process_count=1, start_step=0)))
    mesh = sharding.make_mesh()
    replicated = sharding.replicated(mesh)
    batch = sharding.global_batch(host, mesh)
    example = jax.tree_util.tree_map(lambda x: np.asarray(x)[:1], host)
    init = functools.partial(trainer.init_state, model=model, tx=tx)
    state = jax.jit(init, out_shardings=replicated)(jax.random.PRNGKey(config.seed), example)
    step_kw = dict(model=model, tx=tx, task=task, schedule=schedule,
                   accum_steps=int(config.optim.grad_accum_steps))
    step = jax.jit(functools.partial(trainer.train_step, **step_kw),
                   donate_argnums=(0,) if donate else (), out_shardings=(replicated, replicated))
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    if step_kw["accum_steps"] > 1:
        # XLA's cost analysis counts the micro-batch loop's body once: the step's cost is that of
        # the same step on the whole batch at once.
        whole = jax.jit(functools.partial(trainer.train_step, **dict(step_kw, accum_steps=1)),
                        donate_argnums=(0,) if donate else (), out_shardings=(replicated, replicated))
        cost = cost_of(None, compiled=whole.lower(state, batch).compile())
    else:
        cost = cost_of(None, compiled=compiled)
    if jax.default_backend() == "cpu":
        # XLA counts a partitioned step per device; CPU devices share the machine's cores, whose
        # bounds `machine_bounds` measures, so the step's cost is the sum over devices.
        cost = {k: None if v is None else v * mesh.size for k, v in cost.items()}
    return dict(step=step, compiled=compiled, state=state, batch=batch, model=model, config=config,
                compile_s=compile_s, num_params=num_params, cost=cost, devices=int(mesh.size))


# ----------------------------------------------------------------------------------------------
# Memory.

def reset_peak_rss() -> bool:
    """Resets the process's peak-RSS mark (Linux `/proc/self/clear_refs`); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def process_memory() -> dict[str, int | None]:
    """Current and peak resident set size of this process, in bytes.

    The peak is the high-water mark since process start or since the last successful
    `reset_peak_rss()`; it includes the Python/JAX baseline (a few hundred MB).
    """
    status = {}
    try:  # Linux: both values from one read, so peak >= current always holds.
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    status[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    rss, peak = status.get("VmRSS"), status.get("VmHWM")
    if rss is None and psutil is not None:
        info = psutil.Process().memory_info()
        rss, peak = info.rss, getattr(info, "peak_wset", None)  # peak_wset: Windows only
    if peak is None:
        try:
            import resource

            # ru_maxrss is in KiB on Linux and in bytes on macOS.
            scale = 1 if sys.platform == "darwin" else 1024
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        except ImportError:  # pragma: no cover (Windows)
            pass
    return dict(rss_bytes=rss, peak_rss_bytes=peak)


def device_memory(device: Any = None) -> dict[str, int] | None:
    """`device.memory_stats()` (GPU/TPU: bytes_in_use, peak_bytes_in_use, bytes_limit, ...).

    Returns None on backends that keep no statistics (CPU). The peak is a lifetime high-water mark.
    """
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    return None if not stats else {k: int(v) for k, v in stats.items()}


def default_max_bytes(fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """`fraction` of the accelerator's memory limit, or of the host's available RAM on CPU."""
    stats = device_memory()
    if stats and "bytes_limit" in stats:
        return int(fraction * stats["bytes_limit"])
    if psutil is not None:
        available = psutil.virtual_memory().available
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(fraction * available)


def _is_oom(err: BaseException) -> bool:
    text = str(err)
    return (isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in text
            or "out of memory" in text.lower())


# ----------------------------------------------------------------------------------------------
# Records and the scaling sweep.


@dataclasses.dataclass
class Result:
    """One (case, n) measurement.

    Attributes:
      case: the case name (one line in the plots).
      n: the swept size (sequence length).
      status: 'ok', 'skipped' (guard: estimate above max_bytes) or 'oom' (allocation failed).
      reason: why it was skipped / failed, or a note (e.g. the case stopped on `max_run_s`).
      median_s, min_s, all_s: timed calls (seconds); None unless status == 'ok'.
      compile_s: lower + compile time.
      est_bytes: compiled-memory estimate (`compiled_memory(...)['total_bytes']`).
      guard_factor: the factor the guard applied to `est_bytes` (see `run_scaling`).
      memory: the full `compiled_memory` dict.
      flops: FLOPs per call (XLA cost analysis, or `info['flops']` from `make_fn`).
      gflops: flops / median_s / 1e9.
      bytes_accessed: bytes read + written per call (XLA cost analysis).
      gbps: bytes_accessed / median_s / 1e9 (achieved GB/s).
      ref_gflops: reference matmul GFLOP/s measured just before this record.
      frac_peak: gflops / ref_gflops (fraction of the machine's measured peak).
      time_over_ref: median_s / time of one reference matmul (machine-independent-ish time).
      bound_s, frac_roofline: the roofline's time bound max(flops / ref_gflops, bytes / bandwidth)
        and bound_s / median_s (1.0 = at the roofline); set by `run_and_report`, which measures the
        streaming bandwidth once in the same process (`roofline`).
      rss_base_bytes: process RSS before the timed calls (inputs already allocated).
      peak_rss_bytes: process RSS high-water mark during the calls (per record where
        `peak_rss_per_record`, else since process start).
      peak_rss_per_record: whether the peak mark was reset before this record.
      device_peak_bytes: accelerator peak bytes in use (lifetime mark), None on CPU.
      info: extra values returned by `make_fn` (e.g. heads, head width).
    """
    case: str
    n: int
    status: str
    reason: str | None = None
    median_s: float | None = None
    min_s: float | None = None
    all_s: list[float] | None = None
    compile_s: float | None = None
    est_bytes: int | None = None
    guard_factor: float | None = None
    memory: dict[str, int | None] = dataclasses.field(default_factory=dict)
    flops: float | None = None
    gflops: float | None = None
    bytes_accessed: float | None = None
    gbps: float | None = None
    ref_gflops: float | None = None
    frac_peak: float | None = None
    time_over_ref: float | None = None
    bound_s: float | None = None
    frac_roofline: float | None = None
    rss_base_bytes: int | None = None
    peak_rss_bytes: int | None = None
    peak_rss_per_record: bool = False
    device_peak_bytes: int | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def materialize(args: Any, seed: int = 0) -> Any:
    """Replaces every `jax.ShapeDtypeStruct` leaf by an array (standard normal if float, else 0).

    Concrete leaves pass through unchanged.
    """
    rng = np.random.default_rng(seed)

    def make(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.asarray(rng.standard_normal(leaf.shape, dtype=np.float32), leaf.dtype)
        return jnp.zeros(leaf.shape, leaf.dtype)

    return jax.tree_util.tree_map(make, args)


def _fmt_bytes(b: float | None) -> str:
    return "-" if b is None else f"{b / _GIB:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"


def _measure(case: str, n: int, make_fn: Callable, *, warmup: int, repeats: int, max_bytes: int,
             factor: float, ref_n: int | None) -> Result:
    made = make_fn(case, n)
    if len(made) not in (2, 3):
        raise ValueError(f"make_fn must return (fn, args) or (fn, args, info), "
                         f"got {len(made)} items")
    fn, args = made[0], tuple(made[1])
    info = dict(made[2]) if len(made) == 3 else {}
    compiled, compile_s = _compile(fn, args)
    memory = memory_of(compiled)
    est = memory["total_bytes"]
    res = Result(case=case, n=n, status=SKIPPED, compile_s=compile_s, est_bytes=est,
                 guard_factor=factor, memory=memory,
                 flops=info.pop("flops", None) or _flops_of(compiled),
                 bytes_accessed=cost_of(None, compiled=compiled)["bytes_accessed"], info=info)
    if est is None:
        res.reason = "no compiled memory analysis on this backend: memory guard inactive"
    elif est * factor > max_bytes:
        res.reason = (f"estimated {_fmt_bytes(est)} x {factor:.2f} > max_bytes "
                      f"{_fmt_bytes(max_bytes)}")
        return res
    concrete = materialize(args)
    if ref_n:
        res.ref_gflops = reference_matmul(ref_n, repeats=3)
    res.peak_rss_per_record = reset_peak_rss()
    res.rss_base_bytes = process_memory()["rss_bytes"]
    timing = _time_compiled(compiled, concrete, warmup, repeats)
    res.peak_rss_bytes = process_memory()["peak_rss_bytes"]
    res.device_peak_bytes = (device_memory() or {}).get("peak_bytes_in_use")
    res.status = OK
    res.median_s, res.min_s, res.all_s = timing["median_s"], timing["min_s"], timing["all_s"]
    if res.flops:
        res.gflops = res.flops / res.median_s / 1e9
    if res.bytes_accessed:
        res.gbps = res.bytes_accessed / res.median_s / 1e9
    if res.ref_gflops:
        res.time_over_ref = res.median_s / (2.0 * ref_n**3 / (res.ref_gflops * 1e9))
        if res.gflops:
            res.frac_peak = res.gflops / res.ref_gflops
    return res


def run_scaling(cases: Iterable[str], lengths: Iterable[int],
                make_fn: Callable[[str, int], tuple], *, warmup: int = 1, repeats: int = 3,
                max_bytes: int | None = None, mem_factor: float | None = None,
                max_run_s: float | None = None, ref_n: int | None = 2048,
                log: Callable[[str], Any] | None = None,
                deadline: float | None = None) -> list[Result]:
    """Sweeps every case over increasing lengths, guarding memory before anything runs.

    For each (case, n): `make_fn(case, n)` gives `(fn, args)` or `(fn, args, info)`, where `args`
    are arrays or (better) `jax.ShapeDtypeStruct`s, materialised with random data only after the
    guard passed, and `info` is a dict stored in the record (an `info['flops']` overrides XLA's
    count). The function is compiled, its compiled-memory estimate times a factor compared with
    `max_bytes`, and only then are inputs allocated and calls timed. The factor starts at
    `mem_factor` and, where the process peak RSS is measured per record, rises to the largest
    measured (peak RSS growth / estimate) ratio seen so far in the case (records estimated at
    >= `CALIBRATE_MIN_BYTES`), so an estimate that proves low at moderate n is corrected before
    the large n. A case stops after its first record that is skipped by the guard or runs out of
    memory (that record says why), and after its first record whose median exceeds `max_run_s`.
    Other exceptions propagate.

    Args:
      cases: case names.
      lengths: sizes to sweep, ascending.
      make_fn: `(case, n) -> (fn, args[, info])`.
      warmup: untimed calls per record.
      repeats: timed calls per record.
      max_bytes: memory guard; None means `default_max_bytes()` (80% of available RAM on CPU,
        80% of the accelerator's limit on GPU).
      mem_factor: initial guard factor on the estimate; None means `CPU_MEMORY_FACTOR` (2.0) on
        CPU and 1.0 on accelerators (their allocators follow XLA's buffer assignment).
      max_run_s: stop a case once its median time exceeds this (None: no limit).
      ref_n: size of the float32 reference matmul timed before each record (None: skip it).
      log: called with one line per record (e.g. `print`), or None.
      deadline: a `time.monotonic()` value: the time left is shared equally among the cases not yet
        run (what a case leaves unused goes to the later ones); once a case's share has passed, its
        remaining lengths are recorded as skipped ('time budget spent') without compiling (None: no
        limit). A record that started in time runs to its end.

    Returns:
      The records, in sweep order.
    """
    _check_counts(warmup, repeats)
    lengths = list(lengths)
    if lengths != sorted(lengths):
        raise ValueError(f"lengths must be ascending (a case stops at its first failure), "
                         f"got {lengths}")
    if max_bytes is None:
        max_bytes = default_max_bytes()
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if mem_factor is None:
        mem_factor = CPU_MEMORY_FACTOR if jax.default_backend() == "cpu" else 1.0
    if mem_factor <= 0:
        raise ValueError(f"mem_factor must be positive, got {mem_factor}")
    cases = list(cases)
    with _collections_see_only_new_objects():
        records = []
        for i, case in enumerate(cases):
            factor = mem_factor
            case_deadline = None
            if deadline is not None:
                now = time.monotonic()
                case_deadline = now + max(deadline - now, 0.0) / (len(cases) - i)
            for n in lengths:
                if case_deadline is not None and time.monotonic() > case_deadline:
                    res = Result(case=case, n=n, status=SKIPPED, reason="time budget spent")
                    records.append(res)
                    if log is not None:
                        log(format_table([res], header=False))
                    continue
                try:
                    res = _measure(case, n, make_fn, warmup=warmup, repeats=repeats,
                                   max_bytes=max_bytes, factor=factor, ref_n=ref_n)
                except Exception as err:  # noqa: BLE001 (only out-of-memory is recorded; see _is_oom)
                    if not _is_oom(err):
                        raise
                    res = Result(case=case, n=n, status=OOM, reason=f"{type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:300] if str(err) else ''}")
                gc.collect()  # drop this record's inputs before the next, larger one
                if (res.status == OK and res.peak_rss_per_record
                        and (res.est_bytes or 0) >= CALIBRATE_MIN_BYTES):
                    factor = max(factor, (res.peak_rss_bytes - res.rss_base_bytes) / res.est_bytes)
                stop = res.status != OK
                if not stop and max_run_s is not None and res.median_s > max_run_s:
                    res.reason = f"median {res.median_s:.1f} s > max_run_s {max_run_s}: case stopped"
                    stop = True
                records.append(res)
                if log is not None:
                    log(format_table([res], header=False))
                if stop:
                    break
        return records


@contextlib.contextmanager
def _collections_see_only_new_objects():
    """Freezes the caller's objects (`gc.freeze`) for the sweep, so that the collection after each record
    traverses only what the sweep made: in a long-lived process (a notebook, a test run) a full collection
    of its heap took 1.3 s, per record. Left as it is if the caller froze objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ----------------------------------------------------------------------------------------------
# Output: JSON, table, plot.


def machine_meta() -> dict[str, Any]:
    """Versions, backend, device and CPU facts, load and the XLA settings that affect timings."""
    dev = jax.devices()[0]
    try:
        cpus_usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (macOS)
        cpus_usable = os.cpu_count()
    meta = dict(
        time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(), jax=jax.__version__,
        jaxlib=_jaxlib_version(),
        backend=jax.default_backend(), device_kind=dev.device_kind, device_count=jax.device_count(),
        cpu_count=os.cpu_count(), cpus_usable=cpus_usable, machine=platform.machine(),
        total_ram_bytes=psutil.virtual_memory().total if psutil is not None else None,
        loadavg=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        # The test conftest turns this on; timings taken with it are not representative.
        jax_disable_most_optimizations=_config_value("jax_disable_most_optimizations"),
    )
    return meta


def _config_value(name: str) -> Any:
    try:
        return jax.config.read(name)
    except (AttributeError, KeyError):  # pragma: no cover (older/newer config API)
        return None


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):  # pragma: no cover
        return None


def _as_dicts(records: Iterable[Result | dict]) -> list[dict[str, Any]]:
    return [r.to_dict() if isinstance(r, Result) else dict(r) for r in records]


def write_json(path: str | os.PathLike, records: Iterable[Result | dict],
               meta: dict[str, Any] | None = None) -> pathlib.Path:
    """Writes `{'meta': machine_meta() | meta, 'records': [...]}` to `path` (parents created).

    `meta['ref_gflops']` defaults to the best reference GFLOP/s among the records.

    Returns:
      The path written.
    """
    rows = _as_dicts(records)
    full = machine_meta()
    refs = [r["ref_gflops"] for r in rows if r.get("ref_gflops")]
    full["ref_gflops"] = max(refs) if refs else None
    full.update(meta or {})
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(meta=full, records=rows), indent=1, default=_json_default)
    path.write_text(text + "\n")
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def format_table(records: Iterable[Result | dict], header: bool = True) -> str:
    """Fixed-width table: case, n, status, median, GFLOP/s, fraction of peak, GB/s, fraction of the
    roofline bound, memory, reason."""
    def num(v, width, spec):
        return ("-" if v is None else format(v, spec)).rjust(width)

    lines = []
    if header:
        lines.append(f"{'case':<20} {'n':>7} {'status':>7} {'median_s':>10} {'GFLOP/s':>8} "
                     f"{'frac_pk':>7} {'GB/s':>7} {'f_roof':>6} {'est_mem':>11} {'peak_rss':>11}  reason")
    for r in _as_dicts(records):
        lines.append(f"{r['case']:<20} {r['n']:>7} {r['status']:>7} "
                     f"{num(r['median_s'], 10, '.4g')} {num(r['gflops'], 8, '.1f')} "
                     f"{num(r['frac_peak'], 7, '.2f')} {num(r.get('gbps'), 7, '.1f')} "
                     f"{num(r.get('frac_roofline'), 6, '.2f')} {_fmt_bytes(r['est_bytes']):>11} "
                     f"{_fmt_bytes(r['peak_rss_bytes']):>11}  {r['reason'] or ''}")
    return "\n".join(lines)


def _measured_bytes(r: dict[str, Any]) -> int | None:
    if r["device_peak_bytes"]:
        return r["device_peak_bytes"]
    if r["peak_rss_per_record"] and r["peak_rss_bytes"] and r["rss_base_bytes"] is not None:
        growth = r["peak_rss_bytes"] - r["rss_base_bytes"]
        # No growth means the process already held the memory (e.g. from a larger earlier record):
        # nothing was measured, which is not the same as a 0-byte peak.
        return growth if growth > 0 else None
    return None


def plot(records: Iterable[Result | dict], path: str | os.PathLike, *, title: str | None = None,
         max_bytes: int | None = None) -> pathlib.Path:
    """Log-log plots of median time and memory against n, one line per case (PNG via Agg).

    Memory shows the compiled estimate (solid) and, dotted, the measured accelerator peak or, on
    CPU, the growth of the process peak RSS during the timed calls (`peak_rss_bytes -
    rss_base_bytes`, where the peak was reset per record). A record skipped by the memory guard
    appears as an 'x' at its compiled estimate.

    Returns:
      The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _as_dicts(records)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    has_data = {ax_t: any(r["status"] == OK for r in rows),
                ax_m: any(r["status"] == OK or r["est_bytes"] for r in rows)}
    for i, case in enumerate(dict.fromkeys(r["case"] for r in rows)):
        color = f"C{i}"
        ok = [r for r in rows if r["case"] == case and r["status"] == OK]
        bad = [r for r in rows if r["case"] == case and r["status"] != OK and r["est_bytes"]]
        ax_t.plot([r["n"] for r in ok], [r["median_s"] for r in ok], "o-", color=color, label=case)
        ax_m.plot([r["n"] for r in ok], [r["est_bytes"] for r in ok], "o-", color=color,
                  label=f"{case} (compiled)")
        measured = [(r["n"], _measured_bytes(r)) for r in ok if _measured_bytes(r)]
        if measured:
            ax_m.plot(*zip(*measured), ":", color=color, label=f"{case} (measured)")
        if bad:
            ax_m.plot([r["n"] for r in bad], [r["est_bytes"] for r in bad], "x", color=color,
                      markersize=10, label=f"{case} ({bad[0]['status']}, compiled)")
    if max_bytes:
        ax_m.axhline(max_bytes, color="gray", linestyle="--", label="max_bytes")
    for ax, ylabel in ((ax_t, "median time [s]"), (ax_m, "memory [bytes]")):
        ax.set_xlabel("n")
        ax.set_ylabel(ylabel)
        if not has_data[ax]:   # e.g. every record skipped: an empty panel, not a log-scale error
            ax.text(0.5, 0.5, "no record ran", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------
# The command line and the report shared by the scaling scripts in benchmarks/.

SCALING_LENGTHS = tuple(1024 * 2**i for i in range(7))   # 1K ... 64K


def scaling_parser(description: str, cases: Sequence[str], *, out_dir: str | os.PathLike,
                   max_run_s: float = 60.0, default_cases: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with the flags every scaling script has; add the script's own to it.

    Flags: --lengths (comma-separated N), --cases (subset of `cases`, default all or `default_cases`),
    --budget_s (time budget of the sweep, see `run_scaling(deadline=...)`),
    --repeats, --max_gib and --mem_factor (memory guard), --max_run_s, --ref_n (reference matmul),
    --out_dir.
    Parse with `parse_scaling_args`.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--lengths", type=checks.positive_ints, default=list(SCALING_LENGTHS),
                   help="comma-separated sequence lengths N")
    p.add_argument("--cases", default=default_cases or ",".join(cases),
                   help=f"comma-separated subset of {list(cases)}")
    p.add_argument("--repeats", type=checks.positive_int, default=3)
    p.add_argument("--max_gib", type=checks.positive_float, default=None,
                   help="memory guard in GiB (default: 80%% of available RAM / device memory)")
    p.add_argument("--mem_factor", type=checks.positive_float, default=None,
                   help="initial guard factor on XLA's memory estimate (default 2.0 on CPU, 1.0 on "
                        "accelerators; it rises to the peak-RSS ratio measured in each case)")
    p.add_argument("--max_run_s", type=checks.positive_float, default=max_run_s,
                   help="stop a case once its median time exceeds this")
    p.add_argument("--ref_n", type=checks.positive_int, default=2048, help="reference matmul size (GPU: 8192)")
    p.add_argument("--budget_s", type=checks.positive_float, default=None,
                   help="time budget of the whole sweep; later records are skipped once it is spent")
    p.add_argument("--out_dir", default=str(out_dir))
    return p


def parse_scaling_args(parser: argparse.ArgumentParser, cases: Sequence[str],
                       argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses `argv`: cases become a list (an unknown case, a number out of range, lengths not increasing
    and an --out_dir that cannot be written are usage errors), and `max_bytes` is the resolved memory guard."""
    args = parser.parse_args(argv)
    if args.lengths != sorted(set(args.lengths)):   # a case stops at its first failure: smallest first
        parser.error(f"--lengths must be increasing, got {','.join(map(str, args.lengths))}")
    args.cases = checks.choice_list(parser, "--cases", args.cases, cases)
    checks.check_output_paths(parser, args, dirs=["out_dir"])
    args.max_bytes = int(args.max_gib * 2**30) if args.max_gib else default_max_bytes()
    return args


def run_and_report(args: argparse.Namespace, make_fn: Callable, *, name: str, meta: dict[str, Any],
                   title: str) -> list[Result]:
    """`run_scaling` with the parsed flags, then `<out_dir>/<name>.json` (meta + max_bytes), the plot
    `<name>.png` and the table on stdout.

    The streaming bandwidth is measured once, before the sweep, in this process (`meta['peak_gbps']`);
    with each record's reference matmul it gives the record's roofline bound (`bound_s`,
    `frac_roofline`).
    """
    budget = getattr(args, "budget_s", None)
    deadline = time.monotonic() + budget if budget else None
    peak_gbps = reference_bandwidth(default_bandwidth_bytes())
    records = run_scaling(args.cases, args.lengths, make_fn, repeats=args.repeats,
                          max_bytes=args.max_bytes, mem_factor=args.mem_factor,
                          max_run_s=args.max_run_s, ref_n=args.ref_n, log=print, deadline=deadline)
    for r in records:
        if r.status == OK:
            line = roofline(dict(flops=r.flops, bytes_accessed=r.bytes_accessed), r.median_s,
                            dict(peak_gflops=r.ref_gflops, peak_gbps=peak_gbps))
            r.bound_s, r.frac_roofline = line["bound_s"], line["frac_bound"]
    out = pathlib.Path(args.out_dir)
    write_json(out / f"{name}.json", records, dict(meta, max_bytes=args.max_bytes, peak_gbps=peak_gbps))
    plot(records, out / f"{name}.png", max_bytes=args.max_bytes, title=title)
    print(format_table(records))
    print(f"wrote {out}/{name}.{{json,png}}")
    return records
