"""One-call accelerator check that finishes and diagnoses: tests, steps in f32 and bf16, the bf16 bisect,
scaling from 16K to 1M tokens, the official PyTorch steps, reference-budget runs and a profile.

    python -m benchmarks.device_check --out "$OUT/device_check.json" --work_dir build/device_work  # one GPU
    python -m benchmarks.device_check --tiny --out /tmp/dc/device_check.json             # CPU smoke (CI)

docs/device.md has the recipe for a lent GPU (the carried wheels, the official checkouts, the command).

Phases, in this order (`--phases`; `--profile` adds the profile), each within its own budget
(`--<phase>_budget_s`) and within what is left of `--budget_s` (default 450 s: with the process's start
the call ends inside 8 minutes):

- `bounds`: f32 and bf16 matmul peaks and the streaming bandwidth, in this process.
- `steps`: the shared trainer's jitted train step (`bench.train_step_setup`) for each main config and each
  `--dtypes` (float32, bfloat16): compile time, median s/step, XLA's cost, MFU, roofline, bf16 / f32.
- `bisect_bf16`: the AGF ListOps step in f32, in bf16, and in bf16 with each suspect of `--bisect_forms`
  swapped for its plain form (`with zoo_core.ops.xla_forms.plain(name):`), then all of them at once; ratio to f32 and
  the compiled program's scatter / while / convert counts.
- `tests`: the GPU test subset, one pytest subprocess per file with `--junitxml` and a per-file timeout,
  at `--test_precision` (default 'highest'); each outcome and failure message streamed as it happens
  (this module is also the pytest plugin that writes them), so a file killed at its timeout keeps them.
- `scaling`: benchmarks/{agf,samovar,htgn}_scaling.py per `--scaling_dtypes`, N = 16K, 64K, 256K, 1M on
  an accelerator (the small N are launch-bound), N = 64, 128 with --tiny; per case the time per token at
  each N and its ratio to the first N (target <= 1.3), causal over non-causal (target <= 2 for AGF).
- `peers`: `benchmarks/peers.py --device cuda` (official fp32, tf32, amp beside ours, same run) when
  --agf_src / --samovar_src are given (--tiny: our side only).
- `profile`: a `jax.profiler` trace of a few steps of one config, as profile.tar.gz beside --out.
- `throughput`: each main config's training command for `--throughput_steps` steps (no evaluation): its
  own steps/s end to end beside the bare step (target on a GPU: within 10%).
- `reference_runs`: AGF ListOps and its softmax control at the reference budget (5,000 steps), the best
  validation checkpoint scored on test, then the five UEA JapaneseVowels seeds; the run's own steps/s
  end to end beside the bare step. With --tiny the smoke configs.

On an accelerator JAX's persistent compilation cache (`--compile_cache`, default <work_dir>/jax_cache) is
shared with every subprocess, and no process preallocates the GPU's memory.

Planning: every item (a config, a test file, a script, a run) has an estimate, from compile and step
times measured earlier in the run or, before any, from `GUESS_S`; an item whose estimate does not fit
what is left of its phase is skipped with its estimate recorded, never started and killed. The JSON
summary (`--out`) is rewritten after every item, so a kill loses nothing done. Exit status 1 if any
phase failed.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:   # `python benchmarks/device_check.py` as well as `python -m benchmarks.device_check`
    sys.path.insert(0, str(REPO))

# On demand, not 75% of the GPU at the first touch: the tests, scaling and peers subprocesses (torch
# too) share the device with this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks import device_phases  # noqa: E402 - after the path above
from benchmarks.device_phases import GUESS_S, MAIN_CONFIGS, error_record  # noqa: E402,F401 (MAIN_CONFIGS: public)
from zoo_core import checks  # noqa: E402
from zoo_core.ops import xla_forms  # noqa: E402

# The GPU test subset: every package's forms-agree, ops and reference tests, and the export tests.
TEST_FILES = ("tests/agf_jax/ops_test.py", "tests/agf_jax/reference_test.py", "tests/agf_jax/softmax_test.py",
              "tests/samovar_jax/ops_test.py", "tests/samovar_jax/reference_test.py",
              "tests/htgn_jax/ops_test.py", "tests/htgn_jax/graph_causal_test.py",
              "tests/zoo_core/linear_attention_test.py", "tests/zoo_core/attention_test.py",
              "tests/zoo_core/xla_forms_test.py", "tests/zoo_core/testing_test.py", "tests/zoo_core/packing_test.py",
              "tests/agf_jax/packing_test.py")
TINY_TEST_FILES = ("tests/zoo_core/guard_test.py::test_reach_runs_to_the_end_or_to_the_next_document",)
PHASES = ("bounds", "steps", "bisect_bf16", "tests", "scaling", "peers", "profile", "throughput", "reference_runs")
DEFAULT_PHASES = tuple(p for p in PHASES if p != "profile")
DTYPES = ("float32", "bfloat16")
BISECT_FORMS = xla_forms.PLAIN_FORMS   # the suspects of the bf16 bisect (`xla_forms.plain`)
# Phase budgets in seconds, (--tiny, full): caps; what is left of --budget_s binds first.
# Cold, the H200 compiles the eight main steps in about 180 s (shared/gpu/README.md).
PHASE_BUDGET_S = dict(bounds=(20, 15), steps=(60, 170), bisect_bf16=(60, 100), tests=(60, 100),
                      scaling=(40, 60), peers=(60, 90), profile=(30, 30), throughput=(40, 90),
                      reference_runs=(120, 400))
_factory = device_phases.factory   # benchmarks/memory_options.py builds the same steps


def _config(name: str, tiny: bool):
    """A main config (its --tiny variant with `tiny`), as the steps phase times it in float32."""
    return device_phases.main_config(name, tiny)


class Clock:
    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.deadline = self.start + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Check:
    """What every phase shares: the arguments, the clock, the work folder and the summary, which
    `write` puts on disk (whole, through a rename) after every item."""

    def __init__(self, args, clock: Clock, work: pathlib.Path, out_path: pathlib.Path, summary: dict[str, Any]):
        self.args, self.clock, self.work, self.out_path, self.summary = args, clock, work, out_path, summary
        self.phase_deadline = clock.deadline

    def write(self) -> None:
        self.summary["wall_s"] = self.clock.elapsed()
        _write(self.out_path, self.summary)

    def left(self) -> float:
        """Seconds left to the current phase (its budget or the whole check's, whichever ends first)."""
        return min(self.phase_deadline, self.clock.deadline) - time.monotonic()

    def fits(self, rec: dict[str, Any], estimate_s: float) -> bool:
        """Records the estimate; False (and `rec` marked skipped for budget) if it exceeds what is left."""
        left = self.left()
        rec["estimate_s"] = round(float(estimate_s), 2)
        if estimate_s > left:
            rec.update(status="skipped", skipped_for="budget", left_s=round(left, 2),
                       reason=f"estimated {estimate_s:.0f} s > {max(left, 0):.0f} s left")
            return False
        return True

    @property
    def accelerator(self) -> bool:
        import jax

        return jax.default_backend() != "cpu"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a subprocess: this backend, the shared compilation cache."""
        import jax

        env = dict(os.environ, JAX_PLATFORMS=jax.default_backend(), **extra)
        if self.args.compile_cache:
            env.update(JAX_COMPILATION_CACHE_DIR=self.args.compile_cache,
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")
        return env


# ----------------------------------------------------------------------------------------------
# The tests phase.


def junit_results(path: pathlib.Path) -> dict[str, Any]:
    """Counts and failures (test id and message) of a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        kind = "failed"
        if bad is None:
            bad, kind = case.find("error"), "errors"
        if bad is not None:
            counts[kind] += 1
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            failures.append(dict(test=name, kind=kind, message=text.strip()[-1500:]))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return dict(counts=counts, failures=failures)


def _seen_in_log(text: str) -> dict[str, Any]:
    """What a killed pytest -v run had finished: test ids and outcomes from its log."""
    seen = {}
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            seen[parts[0]] = parts[1]
    return seen


def pytest_runtest_logreport(report) -> None:
    """pytest hook (the tests phase loads this module with `-p benchmarks.device_check`): appends each
    test's outcome, and a failure's message, to $DEVICE_CHECK_TEST_LOG as it happens, so a file killed
    at its timeout still has its failures' messages."""
    path = os.environ.get("DEVICE_CHECK_TEST_LOG")
    if not path or (report.when != "call" and report.passed):
        return
    rec = dict(test=report.nodeid, when=report.when, outcome=report.outcome, duration_s=round(report.duration, 3))
    if report.failed:
        rec["message"] = report.longreprtext[-1500:]
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _streamed_results(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def phase_tests(check: Check) -> dict[str, Any]:
    args = check.args
    files = args.tests or list(TINY_TEST_FILES if args.tiny else TEST_FILES)
    out: dict[str, Any] = dict(status="ok", files={}, failures=[], matmul_precision=args.test_precision,
                               counts=dict(passed=0, failed=0, errors=0, skipped=0))
    check.summary["phases"]["tests"] = out
    guess = GUESS_S["test_file_tiny" if args.tiny else "test_file"]
    walls: list[float] = []
    junit_dir = check.work / "junit"
    junit_dir.mkdir(parents=True, exist_ok=True)
    for i, target in enumerate(files):
        rec: dict[str, Any] = dict(status="ok")
        out["files"][target] = rec
        estimate = max(walls) if walls else guess
        if not check.fits(rec, estimate):
            check.write()
            continue
        timeout = max(min(args.test_file_timeout_s, check.left()), 1)
        xml = junit_dir / f"{i:02d}.xml"
        log = junit_dir / f"{i:02d}.log"
        streamed = junit_dir / f"{i:02d}.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:xdist", "-p", "no:cacheprovider",
               "-p", "benchmarks.device_check", f"--junitxml={xml}", target]
        env = check.env(JAX_DEFAULT_MATMUL_PRECISION=args.test_precision, DEVICE_CHECK_TEST_LOG=str(streamed),
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.perf_counter() - t0
        walls.append(wall)
        rec.update(rc=rc, wall_s=round(wall, 2), timeout_s=round(timeout, 1))
        if xml.exists():
            res = junit_results(xml)
            rec["counts"] = res["counts"]
            for failure in res["failures"]:
                out["failures"].append(dict(failure, file=target))
            for k, v in res["counts"].items():
                out["counts"][k] += v
        text = log.read_text(errors="replace")
        if rc == "timeout":
            # No junit file from a killed pytest: what this module's hook streamed, else the -v log.
            results = _streamed_results(streamed)
            seen = {r["test"]: r["outcome"] for r in results} or _seen_in_log(text)
            rec.update(status="timeout", finished=len(seen),
                       counts={k: sum(1 for v in seen.values() if v.lower() == k)
                               for k in ("passed", "failed", "skipped")})
            messages = {r["test"]: r.get("message", "") for r in results if r["outcome"] == "failed"}
            failed = [t for t, v in seen.items() if v.lower() in ("failed", "error")]
            out["failures"] += [dict(test=t, kind="failed before the timeout", file=target,
                                     message=messages.get(t) or "(message lost with the kill)") for t in failed]
            for k, v in rec["counts"].items():
                out["counts"][k] += v
        elif rc != 0:
            rec["status"] = "failed"
            if not xml.exists():
                rec["tail"] = text[-1500:]
        if rec["status"] != "ok":
            out["status"] = "failed"
        check.write()
    return out


# ----------------------------------------------------------------------------------------------


def _fmt(v, spec=".4g"):
    return "-" if v is None else format(v, spec)


def report(summary: dict[str, Any]) -> str:
    meta, ph = summary["meta"], summary["phases"]
    lines = [f"device check  {meta['time_utc']}  backend {meta['backend']} ({meta['device_kind']})  jax "
             f"{meta['jax']}  tiny={summary['tiny']}  wall {summary['wall_s']:.0f} s of budget "
             f"{summary['budget_s']:.0f} s",
             f"load average before {summary['load_before']} after {summary.get('load_after')}"]
    for name, p in ph.items():
        lines.append(f"phase {name}: {p.get('status')}  wall {_fmt(p.get('wall_s'), '.1f')} s  compile "
                     f"{_fmt(p.get('compile_s'), '.1f')} s  {p.get('reason') or p.get('error') or ''}")
    t = ph.get("tests", {})
    if t.get("counts"):
        lines.append(f"tests: {t['counts']} at matmul precision {t.get('matmul_precision')}")
        lines += [f"  FAILED {f['test']}: {f['message'].splitlines()[0] if f['message'] else ''}"[:200]
                  for f in t.get("failures", [])[:20]]
    b = ph.get("bounds", {})
    if b.get("status") == "ok":
        lines.append(f"bounds: f32 {_fmt(b.get('peak_gflops'), '.1f')} GFLOP/s, bf16 "
                     f"{_fmt(b.get('peak_gflops_bf16'), '.1f')} GFLOP/s, stream {_fmt(b.get('peak_gbps'), '.1f')} GB/s")
    lines.append(f"{'step':<32} {'status':>7} {'s/step':>9} {'steps/s':>8} {'compile':>8} {'MFU_f32':>8} {'vs f32':>7}")
    rows = list(ph.get("steps", {}).get("records", {}).items())
    rows += [(f"bisect {k}", r) for k, r in ph.get("bisect_bf16", {}).get("records", {}).items()]
    for name, r in rows:
        lines.append(f"{name:<32} {r['status']:>7} {_fmt(r.get('median_s')):>9} {_fmt(r.get('steps_per_s'), '.3g'):>8} "
                     f"{_fmt(r.get('compile_s'), '.3g'):>8} {_fmt(r.get('mfu_f32'), '.3f'):>8} "
                     f"{_fmt(r.get('over_f32'), '.3g'):>7}  {r.get('error') or r.get('reason') or ''}")
    for key, r in ph.get("scaling", {}).get("scripts", {}).items():
        lines.append(f"scaling {key}: {r['status']} {r.get('reason', '')}")
        for case, c in (r.get("cases") or {}).items():
            flat = c.get("max_ratio_to_first")
            lines.append(f"  {case:<18} N<={c.get('largest_n')}  s/token@N {c.get('s_per_token')}  "
                         f"max ratio to first N {_fmt(flat, '.3g')}")
        for pair, ratios in (r.get("causal_over_noncausal") or {}).items():
            lines.append(f"  {pair}: {ratios}")
    pe = ph.get("peers", {})
    for rec in pe.get("records", []) or []:
        lines.append(f"peers {rec.get('case')}: {rec.get('status')} ratios {rec.get('ratios')} {rec.get('reason', '')}")
    for name, r in ph.get("throughput", {}).get("runs", {}).items():
        lines.append(f"throughput {name}: {r['status']} {r.get('reason', '')} train steps/s "
                     f"{_fmt(r.get('train_steps_per_s'), '.3g')} bare {_fmt(r.get('bare_steps_per_s'), '.3g')} "
                     f"ratio {_fmt(r.get('train_over_bare'), '.3f')}")
    for name, r in ph.get("reference_runs", {}).get("runs", {}).items():
        lines.append(f"run {name}: {r['status']} {r.get('reason', '')} test {r.get('test_metrics')} "
                     f"train steps/s {_fmt(r.get('train_steps_per_s'), '.3g')} "
                     f"bare {_fmt(r.get('bare_steps_per_s'), '.3g')}")
    pr = ph.get("profile", {})
    if pr.get("archive"):
        lines.append(f"profile: {pr['archive']} ({pr.get('archive_bytes')} bytes)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes and small budgets (CPU smoke run)")
    p.add_argument("--out", default=None, help="JSON summary (default: <work_dir>/device_check.json); the "
                                               "report and the profile archive go beside it")
    p.add_argument("--work_dir", default=None, help="junit files, scaling JSONs, run workdirs (default: a temp folder)")
    p.add_argument("--budget_s", type=checks.positive_float, default=None, help="whole check (default 450; --tiny 240)")
    for phase in PHASES:
        tiny, full = PHASE_BUDGET_S[phase]
        p.add_argument(f"--{phase}_budget_s", type=checks.positive_float, default=None,
                       help=f"cap of phase {phase} (default {full}; --tiny {tiny})")
    p.add_argument("--phases", default=",".join(DEFAULT_PHASES), help=f"comma-separated subset of {list(PHASES)}")
    p.add_argument("--bisect_bf16", action="store_true", help="add the bisect_bf16 phase to --phases")
    p.add_argument("--profile", action="store_true", help="add the profile phase to --phases")
    p.add_argument("--steps", type=checks.positive_int, default=None,
                   help="timed steps per record (default 10; --tiny 2)")
    p.add_argument("--warmup", type=checks.nonnegative_int, default=2)
    p.add_argument("--configs", default=None,
                   help="step configs (default all of benchmarks.device_phases.MAIN_CONFIGS)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="compute dtypes of the steps phase")
    p.add_argument("--bisect_forms", default=",".join(BISECT_FORMS), help="plain forms the bisect swaps in")
    p.add_argument("--tests", default=None, help="comma-separated pytest paths / node ids (default: the subset)")
    p.add_argument("--test_precision", default="highest", choices=("highest", "high", "default"),
                   help="JAX_DEFAULT_MATMUL_PRECISION of the tests phase")
    p.add_argument("--test_file_timeout_s", type=checks.positive_float, default=60.0, help="per test file")
    p.add_argument("--scaling_scripts", default="agf_scaling,samovar_scaling,htgn_scaling")
    p.add_argument("--scaling_dtypes", default=",".join(DTYPES))
    p.add_argument("--lengths", type=checks.positive_ints, default=None,
                   help="scaling N (default 16K,64K,256K,1M on an accelerator, 1K..64K on a CPU; --tiny 64,128)")
    p.add_argument("--max_n", type=checks.positive_int, default=2**20, help="largest scaling N (default 1M)")
    p.add_argument("--scaling_max_run_s", type=checks.positive_float, default=5.0, help="stop a case past this median")
    p.add_argument("--agf_src", default=os.environ.get("AGF_SRC"), help="official AGF checkout (peers phase)")
    p.add_argument("--samovar_src", default=os.environ.get("SAMOVAR_SRC"), help="official SAMoVAR checkout")
    p.add_argument("--throughput_steps", type=checks.positive_int, default=1000,
                   help="steps of each throughput run (--tiny 20)")
    p.add_argument("--uea_seeds", type=checks.nonnegative_int, default=5, help="JapaneseVowels seeds after ListOps")
    p.add_argument("--profile_config", default="agf_listops")
    p.add_argument("--profile_dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--compile_cache", default=None,
                   help="JAX's persistent compilation cache, shared with the subprocesses (default on an "
                        "accelerator: <work_dir>/jax_cache; 'none' turns it off; never on a CPU by default)")
    args = p.parse_args(argv)
    args.configs = checks.choice_list(p, "--configs", args.configs or ",".join(device_phases.MAIN_CONFIGS),
                                      device_phases.MAIN_CONFIGS)
    args.dtypes = checks.choice_list(p, "--dtypes", args.dtypes, DTYPES)
    args.scaling_dtypes = checks.choice_list(p, "--scaling_dtypes", args.scaling_dtypes, DTYPES)
    args.bisect_forms = checks.choice_list(p, "--bisect_forms", args.bisect_forms, BISECT_FORMS)
    args.scaling_scripts = checks.choice_list(p, "--scaling_scripts", args.scaling_scripts,
                                              device_phases.SCALING_SCRIPTS)
    args.tests = [x for x in args.tests.split(",") if x] if args.tests else None
    args.phases = checks.choice_list(p, "--phases", args.phases, PHASES)
    for flag in ("bisect_bf16", "profile"):
        if getattr(args, flag) and flag not in args.phases:
            args.phases.append(flag)
    args.phases = [ph for ph in PHASES if ph in args.phases]   # always in the planned order
    if args.budget_s is None:
        args.budget_s = 240.0 if args.tiny else 450.0
    if args.steps is None:
        args.steps = 2 if args.tiny else 10
    for phase in PHASES:
        key = f"{phase}_budget_s"
        if getattr(args, key) is None:
            setattr(args, key, float(PHASE_BUDGET_S[phase][0 if args.tiny else 1]))
    checks.check_output_paths(p, args, dirs=["work_dir"], files=["out"])
    return args


def _write(path: pathlib.Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    import jax

    from zoo_core import bench

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="device_check_"))
    work.mkdir(parents=True, exist_ok=True)
    out_path = pathlib.Path(args.out) if args.out else work / "device_check.json"
    if args.compile_cache is None and jax.default_backend() != "cpu":
        args.compile_cache = str(work / "jax_cache")
    if args.compile_cache == "none":
        args.compile_cache = None
    cache_error = None
    if args.compile_cache:
        try:
            jax.config.update("jax_compilation_cache_dir", args.compile_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        except (AttributeError, KeyError, ValueError) as err:   # an option this jax does not know
            cache_error = f"compilation cache off: jax {jax.__version__} refused its options ({err})"
            args.compile_cache = None
    summary: dict[str, Any] = dict(meta=bench.machine_meta(), tiny=args.tiny, budget_s=args.budget_s,
                                   argv=sys.argv[1:] if argv is None else list(argv), phases_planned=args.phases,
                                   load_before=list(os.getloadavg()), work_dir=str(work),
                                   compile_cache=args.compile_cache, compile_cache_error=cache_error, phases={})
    check = Check(args, clock, work, out_path, summary)
    ph = summary["phases"]
    functions = dict(tests=phase_tests, **device_phases.PHASE_FUNCTIONS)
    for name in PHASES:
        if name not in args.phases:
            ph[name] = dict(status="skipped", reason="not in --phases")
            continue
        budget = getattr(args, f"{name}_budget_s")
        check.phase_deadline = time.monotonic() + budget
        start = clock.elapsed()
        print(f"[{start:6.1f} s] {name} (budget {budget:.0f} s, {clock.left():.0f} s left) ...", flush=True)
        if clock.left() < 1:
            ph[name] = dict(status="skipped", skipped_for="budget", reason="the whole check's budget is spent")
        else:
            try:
                ph[name] = functions[name](check)
            except Exception as err:  # noqa: BLE001 (record it, go on with the next phase)
                ph[name] = dict(ph.get(name) or {}, **error_record(err))   # with the items it had done
        ph[name].update(started_s=round(start, 2), wall_s=round(clock.elapsed() - start, 2), budget_s=budget)
        check.write()   # a partial summary survives a kill
    summary["load_after"] = list(os.getloadavg())
    summary["ok"] = all(p.get("status") in ("ok", "skipped") for p in ph.values())
    check.write()
    text = report(summary)
    out_path.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"wrote {out_path}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
