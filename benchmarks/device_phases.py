"""The device check's in-process and subprocess phases (`benchmarks.device_check` plans and records them):
bounds, steps (per dtype), bisect_bf16, scaling, peers, reference_runs, profile.

Each `phase_<name>(check) -> dict` puts its record into the summary first and calls `check.write()` after
every item, and asks `check.fits(rec, estimate_s)` before starting one.
"""
from __future__ import annotations

import gc
import importlib
import json
import pathlib
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
# Estimates before anything is measured: the H200's compile and step seconds (shared/gpu/README.md),
# and on a CPU with --tiny a smoke config's.
GUESS_S = dict(compile=dict(agf_listops=17.0, samovar_fig4=10.0, htgn_number_words=36.0, agf_listops_softmax=14.0),
               compile_tiny=8.0, step=0.05, step_tiny=0.5, test_file=40.0, test_file_tiny=15.0,
               peers=100.0, peers_tiny=40.0, uea_run=60.0, uea_run_tiny=20.0, profile=25.0)
BF16_STEP_FACTOR = 40.0   # bf16 step estimate over f32 (the H200's AGF bf16 step was 35x its f32 step)

# name -> (config module, argument, --tiny argument, model factory "module:attr").
# The two whose bf16 step was slow first (the steps phase times them in this order).
MAIN_CONFIGS = {
    "agf_listops": ("zoo_core.configs.agf.lra_listops", None, "smoke", "agf_jax.model:Model"),
    "agf_listops_softmax": ("zoo_core.configs.agf.lra_listops", "attention=softmax", "attention=softmax,smoke",
                            "agf_jax.model:Model"),
    "samovar_fig4": ("zoo_core.configs.samovar.synthetic_var", None, "smoke",
                     "samovar_jax.train:build_model|samovar_jax.model:Model"),
    "htgn_number_words": ("zoo_core.configs.htgn.number_words", None, "smoke", "htgn_jax.model:Model"),
}
SCALING_SCRIPTS = ("agf_scaling", "samovar_scaling", "htgn_scaling")
# Causal form over its non-causal one, per scaling script (the AGF target: within 2x at every N).
CAUSAL_PAIRS = {"agf_scaling": (("agf_causal", "agf"), ("agf_causal_scan", "agf")),
                "htgn_scaling": (("favor_causal", "favor"), ("gat_causal", "gat"))}
ACCELERATOR_LENGTHS = (16384, 65536, 262144, 1048576)
# On an accelerator the token-scan form (a recurrent decoding form, launch-bound) is left out.
ACCELERATOR_CASES = {"samovar_scaling": "var_masked,var_chunked,softmax"}
TINY_LENGTHS = (64, 128)
# Reference-budget runs: name -> (config argument, the step record whose time estimates the run).
REFERENCE_RUNS = {"agf_listops_reference": (None, "agf_listops/float32"),
                  "listops_softmax_control": ("attention=softmax", "agf_listops_softmax/float32")}
# ListOps generation, compiles, checkpoints, the test evaluation (full, --tiny).
REFERENCE_OVERHEAD_S = (150.0, 20.0)
PROFILE_MAX_BYTES = 15 * 2**20


def error_record(err: BaseException) -> dict[str, Any]:
    return dict(status="error", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500],
                traceback=traceback.format_exc()[-2000:])


def factory(spec: str):
    """The first `module:attr` of a '|'-separated list that exists (the packages' entry points move)."""
    errors = []
    for option in spec.split("|"):
        module, attr = option.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            errors.append(f"{option}: {err}")
    raise ImportError("; ".join(errors))


def main_config(name: str, tiny: bool, dtype: str = "float32"):
    module, arg, tiny_arg, _ = MAIN_CONFIGS[name]
    config = importlib.import_module(module).get_config(tiny_arg if tiny else arg)
    with config.unlocked():
        if dtype != "float32":
            config.model.dtype = dtype
    return config


def _hlo_counts(compiled) -> dict[str, int] | None:
    """How many scatters, while loops, converts and custom calls the compiled program has."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 (a diagnostic only)
        return None
    return {op: text.count(f" {op}(") for op in ("scatter", "while", "convert", "custom-call", "fusion")}


def time_step(check, name: str, dtype: str, plain: tuple[str, ...] = ()) -> dict[str, Any]:
    """Compiles and times the trainer's step of a main config: one record. `plain` names the parts
    traced in their plain form (`zoo_core.ops.xla_forms.plain`, read while the step is traced, so the
    step is set up, compiled and run inside it)."""
    from zoo_core.ops import xla_forms

    with xla_forms.plain(*plain):
        return _time_step(check, name, dtype, plain)


def _time_step(check, name: str, dtype: str, plain: tuple[str, ...]) -> dict[str, Any]:
    from zoo_core import bench

    args = check.args
    setup = bench.train_step_setup(main_config(name, args.tiny, dtype), factory(MAIN_CONFIGS[name][3]))
    try:
        timing, _ = bench.time_state_step(setup["step"], setup["state"], setup["batch"], warmup=args.warmup,
                                          repeats=args.steps)
        bounds = check.summary["phases"].get("bounds", {})
        bounds = bounds if bounds.get("status") == "ok" else None
        flops = setup["cost"].get("flops")
        median = timing["median_s"]
        return dict(status="ok", config=name, dtype=dtype, plain=list(plain), compile_s=setup["compile_s"],
                    median_s=median, min_s=timing["min_s"], steps_per_s=1.0 / median,
                    run_s=sum(timing["all_s"]) * (args.steps + args.warmup) / args.steps,
                    batch={k: list(v.shape) for k, v in setup["batch"].items()}, num_params=setup["num_params"],
                    cost=setup["cost"], roofline=bench.roofline(setup["cost"], median, bounds),
                    mfu_f32=_mfu(flops, median, (bounds or {}).get("peak_gflops")),
                    mfu_bf16=_mfu(flops, median, (bounds or {}).get("peak_gflops_bf16")),
                    hlo=_hlo_counts(setup["compiled"]))
    finally:
        del setup
        gc.collect()


def _mfu(flops, seconds, peak_gflops):
    return flops / seconds / 1e9 / peak_gflops if flops and peak_gflops else None


def _step_estimate(check, name: str, dtype: str, measured: dict[str, Any]) -> float:
    """Compile plus warm-up and timed steps, from this run's records of `name` or from GUESS_S."""
    args = check.args
    f32 = measured.get(f"{name}/float32", {})
    if "median_s" in f32:
        compile_s, step_s = f32["compile_s"] * 1.3, f32["median_s"]
    else:
        compile_s = GUESS_S["compile_tiny"] if args.tiny else GUESS_S["compile"].get(name, 30.0)
        step_s = GUESS_S["step_tiny" if args.tiny else "step"]
    if dtype != "float32":
        step_s *= BF16_STEP_FACTOR
    return compile_s + (args.warmup + args.steps) * step_s


def _phase_totals(out: dict[str, Any], records: dict[str, Any]) -> None:
    ok = [r for r in records.values() if r.get("status") == "ok" and "reused_from" not in r]
    out["compile_s"] = round(sum(r.get("compile_s", 0.0) for r in ok), 2)
    out["run_s"] = round(sum(r.get("run_s", 0.0) for r in ok), 2)


# ----------------------------------------------------------------------------------------------


def phase_bounds(check) -> dict[str, Any]:
    import jax.numpy as jnp

    from zoo_core import bench

    kw = dict(matmul_n=256, bandwidth_bytes=16 * 2**20, repeats=2) if check.args.tiny else dict(repeats=5)
    t0 = time.perf_counter()
    bounds = bench.machine_bounds(**kw)
    bounds["peak_gflops_bf16"] = bench.reference_matmul(bounds["matmul_n"], jnp.bfloat16, repeats=kw["repeats"])
    bounds.update(status="ok", run_s=time.perf_counter() - t0)
    return bounds


def phase_steps(check) -> dict[str, Any]:
    """Every main config's step in every --dtypes; bf16 / f32 per config."""
    args = check.args
    out: dict[str, Any] = dict(status="ok", records={}, bf16_over_f32={})
    check.summary["phases"]["steps"] = out
    for name in args.configs:
        for dtype in args.dtypes:
            key = f"{name}/{dtype}"
            rec: dict[str, Any] = dict(status="planned", config=name, dtype=dtype)
            out["records"][key] = rec
            if check.fits(rec, _step_estimate(check, name, dtype, out["records"])):
                try:
                    rec.update(time_step(check, name, dtype))
                except Exception as err:  # noqa: BLE001 (record it, go on with the next config)
                    rec.update(error_record(err))
                    out["status"] = "failed"
            f32, low = out["records"].get(f"{name}/float32", {}), out["records"].get(f"{name}/bfloat16", {})
            if f32.get("status") == "ok" and low.get("status") == "ok":
                out["bf16_over_f32"][name] = low["median_s"] / f32["median_s"]
                low["over_f32"] = out["bf16_over_f32"][name]
            _phase_totals(out, out["records"])
            check.write()
    return out


def phase_bisect_bf16(check) -> dict[str, Any]:
    """The AGF ListOps step in f32, bf16 and bf16 with each suspect in its plain form, then all of them."""
    args = check.args
    forms = list(args.bisect_forms)
    variants = [("float32", ()), ("bfloat16", ())] + [("bfloat16", (f,)) for f in forms]
    if len(forms) > 1:
        variants.append(("bfloat16", tuple(forms)))
    out: dict[str, Any] = dict(status="ok", config="agf_listops", records={}, forms=forms)
    check.summary["phases"]["bisect_bf16"] = out
    for dtype, plain in variants:
        key = dtype if not plain else "bfloat16+plain:" + (plain[0] if len(plain) == 1 else "all")
        rec: dict[str, Any] = dict(status="planned", dtype=dtype, plain=list(plain))
        out["records"][key] = rec
        # The steps phase's f32 and bf16 steps of this config, timed in this process, stand beside these.
        done = check.summary["phases"].get("steps", {}).get("records", {})
        if not plain and "median_s" in done.get(f"agf_listops/{dtype}", {}):
            rec.update(done[f"agf_listops/{dtype}"], reused_from="steps")
            rec.pop("over_f32", None)
            continue
        measured = {f"agf_listops/{k}": v for k, v in out["records"].items() if k == "float32"}
        if check.fits(rec, _step_estimate(check, "agf_listops", dtype, measured)):
            try:
                rec.update(time_step(check, "agf_listops", dtype, plain))
            except Exception as err:  # noqa: BLE001
                rec.update(error_record(err))
                out["status"] = "failed"
        f32, bf16 = out["records"].get("float32", {}), out["records"].get("bfloat16", {})
        for r in out["records"].values():
            if r.get("status") == "ok" and f32.get("status") == "ok":
                r["over_f32"] = r["median_s"] / f32["median_s"]
            if r.get("status") == "ok" and bf16.get("status") == "ok":
                r["over_bf16"] = r["median_s"] / bf16["median_s"]
        _phase_totals(out, out["records"])
        check.write()
    return out


# ----------------------------------------------------------------------------------------------


def scaling_lengths(check) -> list[int]:
    args = check.args
    if args.lengths:
        return list(args.lengths)
    if args.tiny:
        return list(TINY_LENGTHS)
    if check.accelerator:
        return [n for n in ACCELERATOR_LENGTHS if n <= args.max_n] or [args.max_n]
    return [n for n in (1024 * 2**i for i in range(7)) if n <= args.max_n] or [args.max_n]


def summarise_scaling(records: list[dict[str, Any]], script: str) -> dict[str, Any]:
    """Per case: seconds per token at each N and its ratio to the first N; causal over non-causal per N."""
    cases: dict[str, Any] = {}
    for r in records:
        c = cases.setdefault(r["case"], dict(largest_n=None, s_per_token={}, ratio_to_first={}, stopped=None))
        if r["status"] == "ok":
            per_token = r["median_s"] / r["n"]
            c["s_per_token"][r["n"]] = per_token
            first = next(iter(c["s_per_token"].values()))
            c["ratio_to_first"][r["n"]] = per_token / first
            c["largest_n"] = r["n"]
        elif c["stopped"] is None:
            c["stopped"] = f"n={r['n']}: {r['status']} ({r.get('reason')})"
    for c in cases.values():
        c["max_ratio_to_first"] = max(c["ratio_to_first"].values()) if c["ratio_to_first"] else None
    pairs = {}
    for causal, plain in CAUSAL_PAIRS.get(script, ()):
        a, b = cases.get(causal, {}).get("s_per_token", {}), cases.get(plain, {}).get("s_per_token", {})
        if a and b:
            pairs[f"{causal}/{plain}"] = {n: a[n] / b[n] for n in a if n in b}
    return dict(cases=cases, causal_over_noncausal=pairs)


def phase_scaling(check) -> dict[str, Any]:
    args = check.args
    out: dict[str, Any] = dict(status="ok", scripts={}, lengths=scaling_lengths(check))
    check.summary["phases"]["scaling"] = out
    items = [(s, d) for s in args.scaling_scripts for d in args.scaling_dtypes]
    ref_n = 256 if args.tiny else (8192 if check.accelerator else 2048)
    for i, (script, dtype) in enumerate(items):
        key = f"{script}/{dtype}"
        rec: dict[str, Any] = dict(status="ok")
        out["scripts"][key] = rec
        share = check.left() / (len(items) - i)
        # A subprocess needs its imports and at least one compile (20 s on an accelerator, 5 s with --tiny).
        if not check.fits(rec, 5.0 if args.tiny else 20.0):
            check.write()
            continue
        folder = check.work / "scaling" / dtype
        cmd = [sys.executable, "-m", f"benchmarks.{script}", "--lengths", ",".join(map(str, out["lengths"])),
               "--dtype", dtype, "--repeats", "1" if args.tiny else "3", "--ref_n", str(ref_n),
               "--budget_s", f"{max(share - 10, 1):.0f}", "--max_run_s", str(args.scaling_max_run_s),
               "--out_dir", str(folder)]
        if check.accelerator and script in ACCELERATOR_CASES:
            cmd += ["--cases", ACCELERATOR_CASES[script]]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=check.env(), capture_output=True, text=True,
                                  timeout=max(share, 1))
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        rec.update(rc=rc, wall_s=round(time.perf_counter() - t0, 2), budget_s=round(share, 1),
                   command=" ".join(cmd[2:]))
        path = folder / f"{script}.json"
        if path.exists():
            rec.update(summarise_scaling(json.loads(path.read_text())["records"], script))
        if rc != 0:
            rec.update(status="failed", tail=tail)
            out["status"] = "failed"
        check.write()
    return out


# ----------------------------------------------------------------------------------------------


def phase_peers(check) -> dict[str, Any]:
    """benchmarks/peers.py on this device: official fp32 / tf32 / amp beside our step, same run."""
    args = check.args
    out: dict[str, Any] = dict(status="ok")
    check.summary["phases"]["peers"] = out
    cases = [c for c, src in (("agf_listops", args.agf_src), ("agf_softmax", args.agf_src),
                              ("samovar_fig4", args.samovar_src)) if src]
    if not cases and not args.tiny:
        out.update(status="skipped", reason="no --agf_src / --samovar_src (docs/device.md: carry the checkouts)")
        return out
    device = "cuda" if check.accelerator else "cpu"
    cmd = [sys.executable, "-m", "benchmarks.peers", "--device", device, "--out", str(check.work / "peers.json"),
           "--agf_src", args.agf_src or "", "--samovar_src", args.samovar_src or ""]
    if args.tiny:
        cmd += ["--tiny", "--steps", "2", "--rounds", "1", "--warmup", "1", "--no_bounds",
                "--cases", ",".join(cases or ["agf_listops"])]
    else:
        # The bounds phase measured them: peers' own measurement would only spend the budget.
        cmd += ["--steps", "10", "--rounds", "3", "--warmup", "3", "--no_bounds", "--cases", ",".join(cases)]
    if not check.fits(out, GUESS_S["peers_tiny" if args.tiny else "peers"] * max(len(cases), 1) / 3):
        return out
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=check.env(), capture_output=True, text=True,
                              timeout=max(check.left(), 1))
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    out.update(rc=rc, run_s=round(time.perf_counter() - t0, 2), command=" ".join(cmd[2:]))
    path = check.work / "peers.json"
    if path.exists():
        data = json.loads(path.read_text())
        out["records"] = [dict(case=r["case"], status=r["status"], reason=r.get("reason", ""),
                               ours_median_s=(r.get("ours") or {}).get("median_s"),
                               compile_s=(r.get("ours") or {}).get("compile_s"),
                               official={k: v.get("median_s")
                                         for k, v in (r.get("official_by_precision") or {}).items()},
                               official_errors=r.get("official_errors"),
                               ratios=r.get("ratios_official_over_ours") or (
                                   {"fp32": r["ratio_official_over_ours"]} if "ratio_official_over_ours" in r else {}))
                          for r in data["records"]]
    if rc != 0:
        out.update(status="failed", tail=tail)
    return out


# ----------------------------------------------------------------------------------------------


def _run_logged(cmd, check, log: pathlib.Path, timeout: float) -> tuple[Any, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=check.env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.perf_counter() - t0


def train_rate(workdir: pathlib.Path) -> float | None:
    """The training command's own steps/s end to end: the median of its logged windows after the first
    (which holds the compile)."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return None
    rates = [json.loads(line).get("train/steps_per_second") for line in path.read_text().splitlines()]
    rates = [float(r) for r in rates if r]
    return statistics.median(rates[1:] or rates) if rates else None


def _best_eval(workdir: pathlib.Path) -> float | None:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return None
    acc = [json.loads(line).get("eval/accuracy") for line in path.read_text().splitlines()]
    acc = [a for a in acc if a is not None]
    return max(acc) if acc else None


def _command_of(name: str, tiny: bool) -> tuple[list[str], Any]:
    """The training command of a main config (`python -m <package>.train --config <file>:<arg>`) and the
    config it resolves to."""
    module, arg, tiny_arg, _ = MAIN_CONFIGS[name]
    arg = tiny_arg if tiny else arg
    folder = module.split(".")[-2]     # zoo_core.configs.<folder>.<file>, named configs/<folder>/<file>.py
    package = {"agf": "agf_jax", "samovar": "samovar_jax", "htgn": "htgn_jax"}[folder]
    path = "configs/" + "/".join(module.split(".")[-2:]) + ".py" + (f":{arg}" if arg else "")
    return [sys.executable, "-m", f"{package}.train", "--config", path], main_config(name, tiny)


def phase_throughput(check) -> dict[str, Any]:
    """Each main config's training command for a few hundred steps (no evaluation, one checkpoint at the
    end, a smaller generated split): its own steps/s end to end beside the bare step of the steps phase."""
    args = check.args
    out: dict[str, Any] = dict(status="ok", runs={})
    check.summary["phases"]["throughput"] = out
    steps = check.summary["phases"].get("steps", {}).get("records", {})
    total, log_every = (20, 5) if args.tiny else (args.throughput_steps, max(args.throughput_steps // 10, 1))
    for name in args.configs:
        rec: dict[str, Any] = dict(status="planned", config=name, steps=total)
        out["runs"][name] = rec
        step = steps.get(f"{name}/float32", {})
        if "median_s" not in step:
            rec.update(status="skipped", reason=f"no step time for {name}/float32 (phase steps)")
            check.write()
            continue
        rec["bare_steps_per_s"] = step["steps_per_s"]
        overhead = 10.0 if args.tiny else 30.0   # process start, data generation, checkpoint
        if not check.fits(rec, overhead + step["compile_s"] + 2 * total * step["median_s"]):
            check.write()
            continue
        cmd, config = _command_of(name, args.tiny)
        workdir = check.work / "throughput" / name
        workdir.parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--workdir", str(workdir), f"--config.total_steps={total}", "--config.eval_every_steps=0",
                "--config.checkpoint_every_steps=0", f"--config.log_every_steps={log_every}"]
        options = config.data.get("options", None) or {}
        for key, keep in (("num_train", 100 * int(config.batch_size)), ("num_validation", int(config.eval_batch_size)),
                          ("num_test", int(config.eval_batch_size))):
            if options.get(key):
                cmd.append(f"--config.data.options.{key}={min(int(options[key]), keep)}")
        rc, wall = _run_logged(cmd, check, workdir.parent / f"{name}.log", check.left())
        rec.update(status="ok" if rc == 0 else "failed", rc=rc, wall_s=round(wall, 2), command=" ".join(cmd[2:]),
                   train_steps_per_s=train_rate(workdir))
        if rec["train_steps_per_s"]:
            rec["train_over_bare"] = rec["train_steps_per_s"] / rec["bare_steps_per_s"]
        if rc != 0:
            rec["tail"] = (workdir.parent / f"{name}.log").read_text(errors="replace")[-1500:]
            out["status"] = "failed"
        check.write()
    return out


def _estimate_run_s(step_s: float, config, tiny: bool) -> float:
    """The steps, the evaluations (a forward pass: about a third of a training step per example) and
    REFERENCE_OVERHEAD_S."""
    from zoo_core.run import loop

    total = int(config.total_steps)
    n_evals = loop.evals_between(config, 0, total)
    n_eval = int(config.data.options.get("num_validation", 2000) or 2000)
    return total * step_s + n_evals * (n_eval / config.batch_size) * step_s / 3 + REFERENCE_OVERHEAD_S[tiny]


def phase_reference_runs(check) -> dict[str, Any]:
    from zoo_core.configs.agf import lra_listops

    args = check.args
    out: dict[str, Any] = dict(status="ok", runs={})
    check.summary["phases"]["reference_runs"] = out
    steps = check.summary["phases"].get("steps", {}).get("records", {})
    runs = [(name, "configs/agf/lra_listops.py", ",".join(x for x in (arg, "smoke" if args.tiny else None) if x),
             step_name) for name, (arg, step_name) in REFERENCE_RUNS.items()]
    runs += [(f"uea_japanese_vowels_seed{s}", "configs/agf/uea.py",
              "dataset=JapaneseVowels" + (",smoke" if args.tiny else ""), s) for s in range(args.uea_seeds)]
    for name, config_file, config_arg, extra in runs:
        rec: dict[str, Any] = dict(status="ok", config=f"{config_file}:{config_arg}")
        out["runs"][name] = rec
        seed = extra if isinstance(extra, int) else None
        if seed is None:
            step = steps.get(extra, {})
            if step.get("status") != "ok":
                rec.update(status="skipped", reason=f"no step time for {extra} (phase steps)")
                check.write()
                continue
            rec["bare_steps_per_s"] = step["steps_per_s"]
            estimate = _estimate_run_s(step["median_s"], lra_listops.get_config(config_arg or None), args.tiny)
        else:
            done = [r for k, r in out["runs"].items() if k.startswith("uea_") and "rc" in r]
            if any(r["rc"] != 0 for r in done):
                rec.update(status="skipped", reason="an earlier JapaneseVowels seed failed (see its tail)")
                check.write()
                continue
            # The seeds' runs are alike: the last one's wall time estimates the next.
            estimate = done[-1]["wall_s"] + done[-1].get("test_wall_s", 0.0) if done else \
                GUESS_S["uea_run_tiny" if args.tiny else "uea_run"]
        if not check.fits(rec, estimate):
            check.write()
            continue
        workdir = check.work / "runs" / name
        workdir.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "agf_jax.train", "--config", f"{config_file}:{config_arg}", "--workdir",
               str(workdir)] + ([f"--config.seed={seed}"] if seed is not None else [])
        rc, wall = _run_logged(cmd, check, check.work / "runs" / f"{name}.log", check.left())
        rec.update(rc=rc, wall_s=round(wall, 2), command=" ".join(cmd[2:]), train_steps_per_s=train_rate(workdir),
                   best_eval_accuracy=_best_eval(workdir))
        if rec.get("train_steps_per_s") and rec.get("bare_steps_per_s"):
            rec["train_over_bare"] = rec["train_steps_per_s"] / rec["bare_steps_per_s"]
        if rc == 0 and check.left() > 5:
            test_cmd = cmd + ["--eval_only", "--eval_split=test", "--checkpoint=best"]
            trc, twall = _run_logged(test_cmd, check, check.work / "runs" / f"{name}_test.log", check.left())
            result = workdir / "eval_best_test.json"
            rec.update(test_rc=trc, test_wall_s=round(twall, 2))
            if result.exists():
                rec["test_metrics"] = json.loads(result.read_text())
        if rc != 0:
            rec.update(status="failed", tail=(check.work / "runs" / f"{name}.log").read_text(errors="replace")[-1500:])
            out["status"] = "failed"
        check.write()
    return out


# ----------------------------------------------------------------------------------------------


def phase_profile(check) -> dict[str, Any]:
    """A jax.profiler trace of a few steps of --profile_config in --profile_dtype, archived beside --out."""
    import jax

    from zoo_core import bench

    args = check.args
    out: dict[str, Any] = dict(status="ok", config=args.profile_config, dtype=args.profile_dtype)
    check.summary["phases"]["profile"] = out
    if not check.fits(out, GUESS_S["compile_tiny"] if args.tiny else GUESS_S["profile"]):
        return out
    if not hasattr(jax.profiler, "trace"):
        raise RuntimeError(f"jax {jax.__version__} has no jax.profiler.trace: run without --profile")
    setup = bench.train_step_setup(main_config(args.profile_config, args.tiny, args.profile_dtype),
                                   factory(MAIN_CONFIGS[args.profile_config][3]))
    out["compile_s"] = setup["compile_s"]
    state, step, batch = setup["state"], setup["step"], setup["batch"]
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    trace_dir = check.work / "profile"
    t0 = time.perf_counter()
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(3):
            state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
    out["run_s"] = time.perf_counter() - t0
    archive = check.out_path.parent / "profile.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(trace_dir, arcname="profile")
    if archive.stat().st_size > PROFILE_MAX_BYTES:   # what a device run brings back: 16 MiB a file
        with tarfile.open(archive, "w:gz") as tar:
            for path in trace_dir.rglob("*.trace.json.gz"):
                tar.add(path, arcname=f"profile/{path.relative_to(trace_dir)}")
        out["note"] = "the xplane.pb files left out (over the size limit): the trace.json.gz files only"
    out.update(archive=str(archive), archive_bytes=archive.stat().st_size,
               files=sorted(str(p.relative_to(trace_dir)) for p in trace_dir.rglob("*") if p.is_file()))
    return out


PHASE_FUNCTIONS = dict(bounds=phase_bounds, steps=phase_steps, bisect_bf16=phase_bisect_bf16, scaling=phase_scaling,
                       peers=phase_peers, profile=phase_profile, throughput=phase_throughput,
                       reference_runs=phase_reference_runs)
