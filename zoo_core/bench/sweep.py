"""The scaling sweep of the benchmarks: `run_scaling` over cases x sequence lengths, guarding memory before
anything runs, producing `Result` records (and their table rows, `format_table`).

A scaling script reduces to a `make_fn(case, n) -> (fn, args)` closure; see
`benchmarks/softmax_attention.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core.bench.timing import (
    check_counts,
    default_max_bytes,
    device_memory,
    process_memory,
    reference_matmul,
    reset_peak_rss,
    time_compiled,
)
from zoo_core.costs import compile_timed, cost_of, flops_of, memory_of

_GIB = 1024**3
# The guard multiplies XLA's estimate by this on CPU. XLA:CPU hands parts of the graph to library
# fusions (YNNPACK `__ynn_fusion`) that allocate scratch outside the buffer assignment: softmax
# attention fwd+bwd (jax 0.10.2) grew the process RSS by up to 1.94x the compiled estimate.
CPU_MEMORY_FACTOR = 2.0
# Records with a smaller estimate do not recalibrate the guard factor: their RSS growth is noise
# (allocator caches, runtime set-up), not the executable's buffers.
CALIBRATE_MIN_BYTES = 32 * 2**20

# Status values of a `Result`.
OK, SKIPPED, OOM = "ok", "skipped", "oom"


def _is_oom(err: BaseException) -> bool:
    text = str(err)
    return (isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in text
            or "out of memory" in text.lower())


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
    compiled, compile_s = compile_timed(fn, args)
    memory = memory_of(compiled)
    est = memory["total_bytes"]
    res = Result(case=case, n=n, status=SKIPPED, compile_s=compile_s, est_bytes=est,
                 guard_factor=factor, memory=memory,
                 flops=info.pop("flops", None) or flops_of(compiled),
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
    timing = time_compiled(compiled, concrete, warmup, repeats)
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
    check_counts(warmup, repeats)
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


def as_dicts(records: Iterable[Result | dict]) -> list[dict[str, Any]]:
    return [r.to_dict() if isinstance(r, Result) else dict(r) for r in records]


def format_table(records: Iterable[Result | dict], header: bool = True) -> str:
    """Fixed-width table: case, n, status, median, GFLOP/s, fraction of peak, GB/s, fraction of the
    roofline bound, memory, reason."""
    def num(v, width, spec):
        return ("-" if v is None else format(v, spec)).rjust(width)

    lines = []
    if header:
        lines.append(f"{'case':<20} {'n':>7} {'status':>7} {'median_s':>10} {'GFLOP/s':>8} "
                     f"{'frac_pk':>7} {'GB/s':>7} {'f_roof':>6} {'est_mem':>11} {'peak_rss':>11}  reason")
    for r in as_dicts(records):
        lines.append(f"{r['case']:<20} {r['n']:>7} {r['status']:>7} "
                     f"{num(r['median_s'], 10, '.4g')} {num(r['gflops'], 8, '.1f')} "
                     f"{num(r['frac_peak'], 7, '.2f')} {num(r.get('gbps'), 7, '.1f')} "
                     f"{num(r.get('frac_roofline'), 6, '.2f')} {_fmt_bytes(r['est_bytes']):>11} "
                     f"{_fmt_bytes(r['peak_rss_bytes']):>11}  {r['reason'] or ''}")
    return "\n".join(lines)
