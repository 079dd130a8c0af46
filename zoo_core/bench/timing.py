"""Benchmark timing: timed calls of compiled functions, the machine's measured peaks and roofline accounting,
and what the process and the accelerator used.

* `time_jitted` / `time_state_step`: median / min of `repeats` timed calls after `warmup` calls, with the
  compile time reported separately (compile is never inside a timed call).
* `reference_matmul` / `reference_bandwidth`: GFLOP/s of a float32 matmul and streaming GB/s measured
  *now*. A 2-core CPU shared with other processes loses half its throughput, so a benchmark times these
  in the same run and states results as ratios to them rather than as raw seconds only.
* `machine_bounds` / `best_bounds` (both peaks, measured in the same process) and `roofline` (achieved
  GFLOP/s and GB/s of a measured time, the fractions of the compute and memory bounds and the roofline
  time bound).
* `process_memory` / `reset_peak_rss` / `device_memory` / `default_max_bytes`: what the process and the
  accelerator actually used, and the memory a benchmark may claim.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:  # psutil comes with tensorflow-datasets; everything below works without it.
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

from zoo_core.costs import compile_timed

# Default fraction of free memory a single benchmark may claim (estimate from XLA's buffer
# assignment). The margin covers allocator fragmentation, XLA scratch and the other processes.
DEFAULT_MEMORY_FRACTION = 0.8


def check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def time_compiled(compiled: Callable, args: Sequence[Any], warmup: int,
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
    check_counts(warmup, repeats)
    compiled, compile_s = compile_timed(fn, args)
    return dict(time_compiled(compiled, args, warmup, repeats), compile_s=compile_s)


def reference_matmul(n: int = 2048, dtype: Any = jnp.float32, *, warmup: int = 1,
                     repeats: int = 5) -> float:
    """Measures the machine's matmul throughput right now, in GFLOP/s.

    GFLOP/s = 2 n^3 / (best of `repeats` times), as in platform.md §7 (about 200 f32 on an idle
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
    CPU, which would time the kernel's page zeroing rather than the memory. The array must be much larger than the
    last-level cache (default 256 MiB; on a GPU use 1-4 GiB).

    Returns:
      GB/s as a float.
    """
    check_counts(warmup, repeats)
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
    check_counts(warmup, repeats)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = step(state, *args)
        jax.block_until_ready(out)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        state = out[0] if isinstance(out, tuple) else out
    return dict(median_s=statistics.median(times), min_s=min(times), all_s=times), state


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
