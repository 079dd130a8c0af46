"""Benchmark reports: the machine's description (`machine_meta`), records written as JSON (`write_records`) and
plotted (`plot`), and the command line and report shared by the scaling scripts in benchmarks/
(`scaling_parser`, `parse_scaling_args`, `run_and_report`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from zoo_core import checks, extras
from zoo_core.bench.sweep import OK, Result, as_dicts, format_table, run_scaling
from zoo_core.bench.timing import default_bandwidth_bytes, default_max_bytes, psutil, reference_bandwidth, roofline
from zoo_core.run.metrics import write_json


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


def write_records(path: str | os.PathLike, records: Iterable[Result | dict],
                  meta: dict[str, Any] | None = None) -> pathlib.Path:
    """Writes `{'meta': machine_meta() | meta, 'records': [...]}` to `path` (parents created) with the
    trainer's atomic JSON writer (`zoo_core.run.metrics.write_json`).

    `meta['ref_gflops']` defaults to the best reference GFLOP/s among the records.

    Returns:
      The path written.
    """
    rows = as_dicts(records)
    full = machine_meta()
    refs = [r["ref_gflops"] for r in rows if r.get("ref_gflops")]
    full["ref_gflops"] = max(refs) if refs else None
    full.update(meta or {})
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, dict(meta=full, records=rows), default=_json_default)
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


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

    rows = as_dicts(records)
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
    extras.require_or_exit("plots", "the scaling benchmark's figure", ("matplotlib",))
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
    write_records(out / f"{name}.json", records, dict(meta, max_bytes=args.max_bytes, peak_gbps=peak_gbps))
    plot(records, out / f"{name}.png", max_bytes=args.max_bytes, title=title)
    print(format_table(records))
    print(f"wrote {out}/{name}.{{json,png}}")
    return records
