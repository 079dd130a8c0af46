"""One-call accelerator check: tests, step throughput / MFU, scaling sweep, reference-budget runs.

    python -m benchmarks.device_check --out benchmarks/results/device_check.json     # one GPU, <= 8 min
    python -m benchmarks.device_check --tiny --out /tmp/device_check.json            # CPU smoke (CI)

Phases, in order, each within what is left of `--budget_s` (default 470 s, so the whole check ends
inside 8 minutes; `--tiny`: 120 s):

1. `tests`: the equivalence and golden tests (tests/*/ops_test.py, tests/*/reference_test.py,
   tests/zoo_core/linear_attention_test.py) in a pytest subprocess on the current default backend
   (JAX_PLATFORMS is set to this process's backend: tests/conftest.py would otherwise pin the CPU), with
   float32 matmuls at `--test_precision` (default 'highest': a GPU's TF32 default would fail the
   float32 tolerances). With --tiny only tests/zoo_core/linear_attention_test.py runs.
2. `bounds`: the f32 and bf16 matmul peaks and the streaming bandwidth, measured in this process.
3. `steps`: the shared trainer's jitted train step (`bench.train_step_setup`) on a fixed batch for the
   three main configs (AGF LRA ListOps, SAMoVAR Fig. 4, HTGN number_words) and the ListOps softmax
   control: compile time, median s/step, steps/s, XLA's FLOPs and bytes, MFU against the f32 and the
   bf16 peak, and the roofline fractions. With --tiny the configs' `smoke` variants.
4. `scaling`: benchmarks/{agf,samovar,htgn}_scaling.py in subprocesses, N = 1K, 2K, ... up to
   `--max_n` (default 1M; --tiny: N = 64 only), each with its share of `--scaling_budget_s` passed as
   --budget_s (records past it are skipped, so the JSON is always written); per case the largest N
   that ran.
5. `reference_runs`: in the time left, the LRA ListOps softmax control and the AGF ListOps run at the
   reference budget (5,000 steps each, `python -m agf_jax.train --config configs/agf/lra_listops.py`),
   each only if its estimate (from phase 3's step time plus evaluations, data generation and compile)
   fits in what is left; otherwise skipped with the estimate. Never with --tiny.

Everything goes into one JSON summary (`--out`), also printed as a short report. A phase that fails is
recorded with its error and the check goes on; the exit status is 1 if any phase failed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:   # `python benchmarks/device_check.py` as well as `python -m benchmarks.device_check`
    sys.path.insert(0, str(REPO))

from zoo_core import checks  # noqa: E402 - after the path above

TEST_FILES = ("tests/agf_jax/ops_test.py", "tests/agf_jax/reference_test.py", "tests/samovar_jax/ops_test.py",
              "tests/samovar_jax/reference_test.py", "tests/htgn_jax/ops_test.py",
              "tests/zoo_core/linear_attention_test.py")
# --tiny: two quick tests of the shared kernels (the whole subset takes minutes on a 2-core CPU).
TINY_TEST_FILES = ("tests/zoo_core/linear_attention_test.py::test_step_loop_and_state_carry",
                   "tests/zoo_core/linear_attention_test.py::test_bad_arguments_raise")
# name -> (config module, argument, --tiny argument, model factory "module:attr").
MAIN_CONFIGS = {
    "agf_listops": ("configs.agf.lra_listops", None, "smoke", "agf_jax.model:Model"),
    "samovar_fig4": ("configs.samovar.synthetic_var", None, "smoke",
                     "samovar_jax.train:build_model|samovar_jax.model:Model"),
    "htgn_number_words": ("configs.htgn.number_words", None, "smoke", "htgn_jax.model:Model"),
    "agf_listops_softmax": ("configs.agf.lra_listops", "attention=softmax", "attention=softmax,smoke",
                            "agf_jax.model:Model"),
}
SCALING_SCRIPTS = ("agf_scaling", "samovar_scaling", "htgn_scaling")
PHASES = ("tests", "bounds", "steps", "scaling", "reference_runs")
# Reference-budget runs: name -> (config argument, the step record whose time estimates the run).
REFERENCE_RUNS = {
    "listops_softmax_control": ("attention=softmax", "agf_listops_softmax"),
    "agf_listops_reference": (None, "agf_listops"),
}
REFERENCE_OVERHEAD_S = 150.0   # ListOps generation (~80 s on one core), compiles, checkpoints


class Clock:
    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.deadline = self.start + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _factory(spec: str):
    """The first `module:attr` of a '|'-separated list that exists (the packages' entry points move)."""
    errors = []
    for option in spec.split("|"):
        module, attr = option.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            errors.append(f"{option}: {err}")
    raise ImportError("; ".join(errors))


def _config(name: str, tiny: bool):
    module, arg, tiny_arg, _ = MAIN_CONFIGS[name]
    return importlib.import_module(module).get_config(tiny_arg if tiny else arg)


def _error(err: BaseException) -> dict[str, Any]:
    return dict(status="error", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500],
                traceback=traceback.format_exc()[-2000:])


# ----------------------------------------------------------------------------------------------
# Phases.


def phase_tests(args, clock: Clock) -> dict[str, Any]:
    import jax

    files = args.tests or list(TINY_TEST_FILES if args.tiny else TEST_FILES)
    timeout = max(min(args.tests_budget_s, clock.left() - 10), 5)
    env = dict(os.environ, JAX_PLATFORMS=jax.default_backend(),
               JAX_DEFAULT_MATMUL_PRECISION=args.test_precision)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", out[-3000:])}
    status = "ok" if rc == 0 else ("timeout" if rc == "timeout" else "failed")
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
    return dict(status=status, rc=rc, wall_s=time.perf_counter() - t0, files=files, counts=counts,
                failed=failed[:50], backend=jax.default_backend(), matmul_precision=args.test_precision,
                tail=out[-1500:])


def phase_bounds(args) -> dict[str, Any]:
    import jax.numpy as jnp

    from zoo_core import bench

    if args.tiny:
        kw = dict(matmul_n=256, bandwidth_bytes=16 * 2**20, repeats=2)
    else:
        kw = dict(repeats=5)
    bounds = bench.machine_bounds(**kw)
    bounds["peak_gflops_bf16"] = bench.reference_matmul(bounds["matmul_n"], jnp.bfloat16, repeats=kw["repeats"])
    bounds["status"] = "ok"
    return bounds


def phase_steps(args, clock: Clock, bounds: dict[str, Any]) -> dict[str, Any]:
    from zoo_core import bench

    out: dict[str, Any] = dict(status="ok", records={})
    bounds = bounds or {}
    for name in args.configs:
        if clock.left() < 20:
            out["records"][name] = dict(status="skipped", reason="time budget spent")
            continue
        try:
            setup = bench.train_step_setup(_config(name, args.tiny), _factory(MAIN_CONFIGS[name][3]))
            timing, _ = bench.time_state_step(setup["step"], setup["state"], setup["batch"], warmup=args.warmup,
                                              repeats=args.steps)
            roof = bench.roofline(setup["cost"], timing["median_s"], bounds)
            flops = setup["cost"]["flops"]
            rec = dict(status="ok", config=f"{MAIN_CONFIGS[name][0]}:{MAIN_CONFIGS[name][2 if args.tiny else 1] or ''}",
                       batch={k: list(v.shape) for k, v in setup["batch"].items()}, num_params=setup["num_params"],
                       compile_s=setup["compile_s"], median_s=timing["median_s"], min_s=timing["min_s"],
                       steps_per_s=1.0 / timing["median_s"], cost=setup["cost"], roofline=roof,
                       mfu_f32=_mfu(flops, timing["median_s"], bounds.get("peak_gflops")),
                       mfu_bf16=_mfu(flops, timing["median_s"], bounds.get("peak_gflops_bf16")))
            del setup
        except Exception as err:  # noqa: BLE001 (record it, go on with the next config)
            rec = _error(err)
            out["status"] = "failed"
        out["records"][name] = rec
    return out


def _mfu(flops, seconds, peak_gflops):
    return flops / seconds / 1e9 / peak_gflops if flops and peak_gflops else None


def _lengths(max_n: int, tiny: bool) -> list[int]:
    if tiny:
        return [64]
    return [1024 * 2**i for i in range(int(math.log2(max(max_n, 1024) // 1024)) + 1)]


def phase_scaling(args, clock: Clock, out_dir: pathlib.Path) -> dict[str, Any]:
    import jax

    out: dict[str, Any] = dict(status="ok", scripts={})
    lengths = _lengths(args.max_n, args.tiny)
    ref_n = 64 if args.tiny else (2048 if jax.default_backend() == "cpu" else 8192)
    scripts = args.scaling_scripts
    for i, script in enumerate(scripts):
        share = min(args.scaling_budget_s, clock.left() - 30) / (len(scripts) - i)
        if share < 5:
            out["scripts"][script] = dict(status="skipped", reason="time budget spent")
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{script}", "--lengths", ",".join(map(str, lengths)),
               "--repeats", "1" if args.tiny else "3", "--ref_n", str(ref_n), "--budget_s", f"{share:.0f}",
               "--max_run_s", str(args.scaling_max_run_s), "--out_dir", str(out_dir)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=share + 120)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        rec: dict[str, Any] = dict(status="ok" if rc == 0 else "failed", rc=rc, wall_s=time.perf_counter() - t0,
                                   budget_s=share, command=" ".join(cmd[1:]))
        path = out_dir / f"{script}.json"
        if rc == 0 and path.exists():
            data = json.loads(path.read_text())
            cases: dict[str, Any] = {}
            for r in data["records"]:
                c = cases.setdefault(r["case"], dict(largest_n=None, median_s=None, gflops=None, gbps=None,
                                                     stopped=None))
                if r["status"] == "ok":
                    c.update(largest_n=r["n"], median_s=r["median_s"], gflops=r["gflops"], gbps=r.get("gbps"))
                elif c["stopped"] is None:
                    c["stopped"] = f"n={r['n']}: {r['status']} ({r['reason']})"
            rec.update(json=str(path), cases=cases)
        else:
            rec["tail"] = tail
            out["status"] = "failed"
        out["scripts"][script] = rec
    return out


def _estimate_reference_s(step_s: float, config) -> float:
    """Seconds for the whole run: the steps, the evaluations (a forward pass costs about a third of a
    training step per example) and REFERENCE_OVERHEAD_S."""
    from zoo_core import loop

    total = int(config.total_steps)
    n_evals = loop.evals_between(config, 0, total)
    n_eval = int(config.data.options.get("num_validation", 2000) or 2000)
    eval_s = n_evals * (n_eval / config.batch_size) * step_s / 3
    return total * step_s + eval_s + REFERENCE_OVERHEAD_S


def phase_reference_runs(args, clock: Clock, steps: dict[str, Any], out_dir: pathlib.Path) -> dict[str, Any]:
    from configs.agf import lra_listops

    out: dict[str, Any] = dict(status="ok", runs={})
    for name, (arg, step_name) in REFERENCE_RUNS.items():
        if args.tiny:
            out["runs"][name] = dict(status="skipped", reason="--tiny: the reference-budget runs only run in a "
                                                              "full check")
            continue
        step = steps.get("records", {}).get(step_name, {})
        if step.get("status") != "ok":
            out["runs"][name] = dict(status="skipped", reason=f"no step time for {step_name} (phase steps)")
            continue
        config = lra_listops.get_config(arg)
        estimate = _estimate_reference_s(step["median_s"], config)
        left = clock.left() - 10
        if estimate > left:
            out["runs"][name] = dict(status="skipped", estimate_s=estimate, left_s=left,
                                     reason=f"estimated {estimate:.0f} s > {left:.0f} s left")
            continue
        workdir = out_dir / name
        config_path = "configs/agf/lra_listops.py" + (f":{arg}" if arg else "")
        cmd = [sys.executable, "-m", "agf_jax.train", "--config", config_path, "--workdir", str(workdir)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=left)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        rec: dict[str, Any] = dict(status="ok" if rc == 0 else "failed", rc=rc, wall_s=time.perf_counter() - t0,
                                   estimate_s=estimate, command=" ".join(cmd[1:]))
        metrics = workdir / "metrics.jsonl"
        if metrics.exists():
            evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"eval/' in line]
            if evals:
                rec["last_eval"] = evals[-1]
                acc = [e["eval/accuracy"] for e in evals if "eval/accuracy" in e]
                rec["best_eval_accuracy"] = max(acc) if acc else None
        if rc != 0:
            rec["tail"] = tail
            out["status"] = "failed"
        out["runs"][name] = rec
    return out


# ----------------------------------------------------------------------------------------------


def _fmt(v, spec=".4g"):
    return "-" if v is None else format(v, spec)


def report(summary: dict[str, Any]) -> str:
    meta, ph = summary["meta"], summary["phases"]
    lines = [f"device check  {meta['time_utc']}  backend {meta['backend']} ({meta['device_kind']})  tiny={summary['tiny']}"
             f"  wall {summary['wall_s']:.0f} s of budget {summary['budget_s']:.0f} s",
             f"load average before {summary['load_before']} after {summary['load_after']}"]
    t = ph.get("tests", {})
    lines.append(f"tests: {t.get('status')} {t.get('counts')} in {_fmt(t.get('wall_s'), '.0f')} s "
                 f"(matmul precision {t.get('matmul_precision')})")
    b = ph.get("bounds", {})
    lines.append(f"bounds: f32 {_fmt(b.get('peak_gflops'), '.1f')} GFLOP/s, bf16 {_fmt(b.get('peak_gflops_bf16'), '.1f')}"
                 f" GFLOP/s, stream {_fmt(b.get('peak_gbps'), '.1f')} GB/s")
    lines.append(f"{'step':<22} {'status':>7} {'s/step':>9} {'steps/s':>8} {'compile':>8} {'MFU_f32':>8} "
                 f"{'MFU_bf16':>8} {'f_bound':>7}")
    for name, r in ph.get("steps", {}).get("records", {}).items():
        lines.append(f"{name:<22} {r['status']:>7} {_fmt(r.get('median_s')):>9} {_fmt(r.get('steps_per_s'), '.3g'):>8} "
                     f"{_fmt(r.get('compile_s'), '.3g'):>8} {_fmt(r.get('mfu_f32'), '.3f'):>8} "
                     f"{_fmt(r.get('mfu_bf16'), '.3f'):>8} {_fmt((r.get('roofline') or {}).get('frac_bound'), '.2f'):>7}"
                     f"  {r.get('error') or r.get('reason') or ''}")
    for script, r in ph.get("scaling", {}).get("scripts", {}).items():
        cases = ", ".join(f"{c}: N<={v['largest_n']}" for c, v in (r.get("cases") or {}).items())
        lines.append(f"scaling {script}: {r['status']} {cases or r.get('reason', '')}")
    for name, r in ph.get("reference_runs", {}).get("runs", {}).items():
        wall = "" if r.get("wall_s") is None else f" wall {r['wall_s']:.0f} s"
        best = r.get("best_eval_accuracy")
        best = "" if best is None else f" best eval/accuracy {best:.4f}"
        lines.append(f"reference run {name}: {r['status']} {r.get('reason', '')}{wall}{best}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run, about a minute)")
    p.add_argument("--out", default=None, help="JSON summary (default: <work_dir>/device_check.json)")
    p.add_argument("--work_dir", default=None, help="scaling JSONs and run workdirs (default: a temp folder)")
    p.add_argument("--budget_s", type=checks.positive_float, default=None,
                   help="whole check (default 470; --tiny 120)")
    p.add_argument("--tests_budget_s", type=checks.positive_float, default=None,
                   help="test phase cap (default 180; --tiny 60)")
    p.add_argument("--scaling_budget_s", type=checks.positive_float, default=None,
                   help="scaling phase (default 150; --tiny 30)")
    p.add_argument("--scaling_max_run_s", type=checks.positive_float, default=20.0,
                   help="stop a scaling case past this median")
    p.add_argument("--max_n", type=checks.positive_int, default=2**20, help="largest scaling N (default 1M)")
    p.add_argument("--steps", type=checks.positive_int, default=None,
                   help="timed steps per config (default 10; --tiny 2)")
    p.add_argument("--warmup", type=checks.nonnegative_int, default=2)
    p.add_argument("--test_precision", default="highest", choices=("highest", "high", "default"),
                   help="JAX_DEFAULT_MATMUL_PRECISION of the test phase")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {list(PHASES)}")
    p.add_argument("--tests", default=None, help="comma-separated pytest paths / node ids (default: the subset)")
    p.add_argument("--configs", default=",".join(MAIN_CONFIGS), help=f"step configs, subset of {list(MAIN_CONFIGS)}")
    p.add_argument("--scaling_scripts", default=",".join(SCALING_SCRIPTS),
                   help=f"subset of {list(SCALING_SCRIPTS)}")
    args = p.parse_args(argv)
    args.tests = [x for x in args.tests.split(",") if x] if args.tests else None
    args.configs = checks.choice_list(p, "--configs", args.configs, MAIN_CONFIGS)
    args.scaling_scripts = checks.choice_list(p, "--scaling_scripts", args.scaling_scripts, SCALING_SCRIPTS)
    defaults = dict(budget_s=(120, 470), tests_budget_s=(60, 180), scaling_budget_s=(30, 150), steps=(2, 10))
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    args.phases = checks.choice_list(p, "--phases", args.phases, PHASES)
    checks.check_output_paths(p, args, dirs=["work_dir"], files=["out"])
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    from zoo_core import bench

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="device_check_"))
    work.mkdir(parents=True, exist_ok=True)
    out_path = pathlib.Path(args.out) if args.out else work / "device_check.json"
    summary: dict[str, Any] = dict(meta=bench.machine_meta(), tiny=args.tiny, budget_s=args.budget_s,
                                   load_before=list(os.getloadavg()), work_dir=str(work), phases={})
    ph = summary["phases"]

    def run(name, fn, *a):
        if name not in args.phases:
            ph[name] = dict(status="skipped", reason="not in --phases")
            return
        print(f"[{clock.elapsed():6.1f} s] {name} ...", flush=True)
        try:
            ph[name] = fn(*a)
        except Exception as err:  # noqa: BLE001
            ph[name] = _error(err)
        ph[name]["phase_s"] = clock.elapsed()
        _write(out_path, summary)   # a partial summary survives a kill

    run("tests", phase_tests, args, clock)
    run("bounds", phase_bounds, args)
    bounds = ph["bounds"] if ph["bounds"].get("status") == "ok" else None
    run("steps", phase_steps, args, clock, bounds)
    run("scaling", phase_scaling, args, clock, work / "scaling")
    run("reference_runs", phase_reference_runs, args, clock, ph.get("steps", {}), work / "runs")
    summary["wall_s"] = clock.elapsed()
    summary["load_after"] = list(os.getloadavg())
    summary["ok"] = all(p.get("status") in ("ok", "skipped") for p in ph.values())
    _write(out_path, summary)
    print(report(summary))
    print(f"wrote {out_path}")
    return summary


def _write(path: pathlib.Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
