"""Peers benchmark: the official PyTorch implementations against ours, on the same configs, in one run.

Step cases (one training step on a fixed batch, both sides in this process, interleaved A B A B):

| case | official (PyTorch) | ours (JAX, the shared trainer's jitted `train_step`) |
|---|---|---|
| `agf_listops` | AGF_LRA `ModelForSC`, `lra_config` listops + `best_agf.sh` (svd, jacobi K=5, a=2, b=-1, fixI, reg 0.01), AdamW + OneCycleLR | `configs/agf/lra_listops.py` |
| `agf_softmax` | the same model with `attn_type=softmax` (grad checkpointing as in `lra_config`) | `configs/agf/lra_listops.py:attention=softmax` |
| `samovar_fig4` | `models/AutoregressiveAlignment.py` `Model` (the goldens' file) with the Fig. 4 notebook's `ARMAConfig` values (batch 256, 64 steps x 2 channels = 128 tokens, d 32, 2 heads, 3 layers, dropout 0.1), the notebook's step (channel drop, MSE + AR loss, AdamW) | `configs/samovar/synthetic_var.py` |
| `lintrans` | `models/Autoregressive.py` `Model` on the last 8 steps (the notebook's LinTrans) | `configs/samovar/synthetic_var.py:kind=lintrans` |

(The notebook imports `visualization/AutoregressiveAlignment.py`, whose `Transformer.forward` iterates
`zip(self.attn)` and calls a tuple: it cannot run as stored; `models/` holds the working copy.)

Each side is built once, runs `--warmup` untimed steps, then `--rounds` rounds of `--steps` timed steps
(A = official, then B = ours, in every round). Reported: each side's median s/step over all timed steps,
the ratio official/ours (> 1: ours is faster) and its range over the rounds (from each round's two
medians), our step's roofline columns (XLA cost analysis against the f32 matmul peak and the streaming
bandwidth, each the best of the measurements this process makes before the first case and after every
step case: on a shared host they move by 2x within minutes), and the load average before and after.
Official steps run with `torch.set_num_threads(--threads)` (default 2) in float32 on the CPU (the LRA
code's CUDA autocast and GradScaler do nothing there, so they are off). With `--device cuda` (on a GPU
machine; our side runs on JAX's default backend, the GPU) they run there in each of `--precisions`
(default fp32, tf32 and amp: fp16 autocast + GradScaler, as the official `run_tasks.py`), every
precision a side of its own in the same interleaved rounds, each with its ratio to ours (a precision
whose model fails to build is recorded with its error). Both sides train on the same token ids /
series where the shapes allow it (our batch is converted for the official model).
Our steps run on the CPU devices that their configs' `parallel.cpu_devices` gives the training command
(one per core for these four, `zoo_core.run.sharding.cpu_device_count`); `--cpu_devices N` overrides it, e.g.
`--cpu_devices 1` for the single-device step. The count is per process, so the selected cases must agree.

End-to-end case `agf_uea_jv` (issue 17): the whole JapaneseVowels job, the official `run_agf_best.sh`
line (`AGF_UEA/main.py ... --epochs N`) against `python -m agf_jax.train --config
configs/agf/uea.py:dataset=JapaneseVowels` (same epochs, batch 16, test every 2 epochs plus the first), each in
a subprocess, alternating for `--uea_rounds` rounds: wall time, per-epoch training time and
per-evaluation time of each. The official side runs under `--official_python` (a venv with torch,
pandas < 3, matplotlib 3.8, scikit-learn, tensorboard, xlrd, xlwt, xlutils, tabulate, ipdb; see
benchmarks/README.md), on the copy of the data shipped in zoo_core (`--uea_data_dir`).

    python -m benchmarks.peers --agf_src ~/peers/agf --samovar_src ~/peers/samovar
    python -m benchmarks.peers --agf_src DIR --cases agf_uea_jv --epochs 20 --official_python DIR/venv/bin/python
    python -m benchmarks.peers --tiny --cases agf_listops,samovar_fig4    # CI smoke: our side only

A case whose official source is not given is reported as skipped with the reason (a source given
without the file a case needs is a usage error); with --tiny and no sources only our side is timed,
and the printout says so. Timings taken on a loaded machine are not results: the load average is
printed for that reason. No official code lives in this repository: pass the paths of checkouts made
outside it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:   # `python benchmarks/peers.py` as well as `python -m benchmarks.peers`
    sys.path.insert(0, str(REPO))

from benchmarks.peers_official import (  # noqa: E402
    OFFICIAL_FILES,
    OFFICIAL_REPOS,
    PRECISIONS,
    check_torch,
    official_source,
    official_step,
)
from zoo_core import checks  # noqa: E402  (after the path above)
from zoo_core.data import uea as uea_data  # noqa: E402

STEP_CASES = ("agf_listops", "agf_softmax", "samovar_fig4", "lintrans")
E2E_CASES = ("agf_uea_jv",)
CASES = STEP_CASES + E2E_CASES
DEFAULT_CASES = STEP_CASES + E2E_CASES

# Our configs per case: (config module, argument, argument with --tiny).
OUR_CONFIGS = {
    "agf_listops": ("zoo_core.configs.agf.lra_listops", None, "smoke"),
    "agf_softmax": ("zoo_core.configs.agf.lra_listops", "attention=softmax", "attention=softmax,smoke"),
    "samovar_fig4": ("zoo_core.configs.samovar.synthetic_var", None, "smoke"),
    "lintrans": ("zoo_core.configs.samovar.synthetic_var", "kind=lintrans", "kind=lintrans,smoke"),
}
UEA_DATASET = "JapaneseVowels"


def loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _median(xs):
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------------------------
# Our side.


def _our_build_model(case: str):
    if case.startswith("agf"):
        from agf_jax import model
        return model.Model
    from samovar_jax import train
    if hasattr(train, "build_model"):
        return train.build_model
    from samovar_jax import model  # the entry point's factory moved here (`main.run(model.Model)`)
    return model.Model


def our_config(case: str, tiny: bool):
    import importlib

    module, arg, tiny_arg = OUR_CONFIGS[case]
    return importlib.import_module(module).get_config(tiny_arg if tiny else arg)


class OurStep:
    """The shared trainer's jitted train step on one fixed batch (`bench.train_step_setup`)."""

    def __init__(self, case: str, tiny: bool):
        from zoo_core import bench

        self.setup = bench.train_step_setup(our_config(case, tiny), _our_build_model(case))
        self.state = self.setup["state"]
        self.batch = self.setup["batch"]
        self.step = self.setup["step"]

    def __call__(self) -> None:
        import jax

        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))

    def describe(self) -> dict[str, Any]:
        import numpy as np

        return dict(batch={k: list(np.shape(v)) for k, v in self.batch.items()},
                    num_params=self.setup["num_params"], compile_s=self.setup["compile_s"],
                    cost=self.setup["cost"])


# ----------------------------------------------------------------------------------------------
# Step cases: interleaved timing.


def interleave(sides: dict[str, Callable[[], None]], *, warmup: int, steps: int, rounds: int,
               log: Callable[[str], Any] | None = None) -> dict[str, dict[str, Any]]:
    """Times each side's step: `warmup` untimed steps each, then `rounds` rounds of `steps` timed
    steps of every side in turn (A B A B ...). Returns {side: dict(median_s, min_s, all_s, round_medians)}."""
    for fn in sides.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[list[float]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, fn in sides.items():
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            times[name].append(ts)
            if log:
                log(f"  round {r + 1}/{rounds} {name}: median {statistics.median(ts):.4g} s/step")
    out = {}
    for name, per_round in times.items():
        flat = [t for ts in per_round for t in ts]
        out[name] = dict(median_s=statistics.median(flat), min_s=min(flat), all_s=flat,
                         round_medians=[statistics.median(ts) for ts in per_round])
    return out


def run_step_case(case: str, args, log) -> dict[str, Any]:
    rec: dict[str, Any] = dict(case=case, kind="step", status="ok")
    src, reason = official_source(case, args)
    if src is not None:
        reason = check_torch()
        src = None if reason else src
    if src is None and not args.tiny:
        rec.update(status="skipped", reason=reason)
        return rec
    ours = OurStep(case, args.tiny)
    rec["ours"] = ours.describe()
    sides: dict[str, Callable[[], None]] = {}
    if src is not None:
        import torch

        torch.set_num_threads(args.threads)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device (a CPU-only torch wheel?)")
        for precision in args.precisions:
            try:
                step, info = official_step(src, case, ours, args.tiny, args.seed, args.device, precision)
            except Exception as err:  # noqa: BLE001 (one precision's failure must not hide the others)
                if len(args.precisions) == 1:
                    raise
                rec.setdefault("official_errors", {})[precision] = f"{type(err).__name__}: {err}"[:300]
                continue
            sides[_official_side(args, precision)] = step
            rec.setdefault("official", info)
    else:
        rec["official"] = dict(skipped=reason)
        rec["note"] = f"our side only ({reason})"
    sides["ours"] = ours
    rec["load_before"] = loadavg()
    timing = interleave(sides, warmup=args.warmup, steps=args.steps, rounds=args.rounds, log=log)
    rec["load_after"] = loadavg()
    if src is not None and _official_side(args, args.precisions[0]) != "official":
        # Several precisions: each under its own name; 'official' holds the first (fp32 by default).
        rec["official_by_precision"] = {p: timing.pop(_official_side(args, p)) for p in args.precisions
                                        if _official_side(args, p) in timing}
        if rec["official_by_precision"]:
            timing["official"] = next(iter(rec["official_by_precision"].values()))
        rec["ratios_official_over_ours"] = {p: t["median_s"] / timing["ours"]["median_s"]
                                            for p, t in rec["official_by_precision"].items()}
    for name, t in timing.items():
        rec.setdefault(name, {}).update(t)
    if "official" in timing:
        rec["ratio_official_over_ours"] = timing["official"]["median_s"] / timing["ours"]["median_s"]
        rec["ratio_per_round"] = round_ratios(timing)
    return rec


def _official_side(args, precision: str) -> str:
    """The side's name: 'official' for the CPU's one float32 side, else 'official_<precision>'."""
    return "official" if args.precisions == ["fp32"] and args.device == "cpu" else f"official_{precision}"


def round_ratios(timing: dict[str, dict[str, Any]]) -> list[float]:
    """official / ours per round, from the two sides' medians in the same round: on a shared host
    both sides drift by more than many changes are worth, and a round's two medians see the same
    drift, so the spread of these ratios says how far the overall ratio can be trusted."""
    return [o / u for o, u in zip(timing["official"]["round_medians"], timing["ours"]["round_medians"])]


# ----------------------------------------------------------------------------------------------
# The end-to-end UEA case.

_RUNTIME = r"{} runtime: ([\d.]+) hours, ([\d.]+) minutes, ([\d.]+) seconds"


def _runtimes(text: str, what: str) -> list[float]:
    return [float(h) * 3600 + float(m) * 60 + float(s) for h, m, s in re.findall(_RUNTIME.format(what), text)]


def official_uea_command(src: pathlib.Path, data_dir: pathlib.Path, out_dir: pathlib.Path, epochs: int,
                         python: str, seed: int | None) -> list[str]:
    """`run_agf_best.sh`'s JapaneseVowels line (with --epochs, the CPU and an output folder)."""
    cmd = [python, "main.py", "--output_dir", str(out_dir), "--comment", "classification for AGF",
           "--name", "JapaneseVowels_fromScratch", "--records_file", str(out_dir / "Classification_records.xls"),
           "--data_dir", str(data_dir), "--data_class", "tsra", "--pattern", "TRAIN", "--val_pattern", "TEST",
           "--epochs", str(epochs), "--lr", "0.001", "--batch_size", "16", "--optimizer", "RAdam",
           "--pos_encoding", "learnable", "--task", "classification", "--key_metric", "accuracy",
           "--model", "svd", "--eta", "0.01", "--poly_type", "legendre", "--K", "4", "--gpu", "-1"]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    return cmd


def our_uea_command(workdir: pathlib.Path, epochs: int, seed: int | None, tiny: bool) -> list[str]:
    config = "configs/agf/uea.py:dataset=JapaneseVowels" + (",smoke" if tiny else "")
    cmd = [sys.executable, "-m", "agf_jax.train", "--config", config, "--workdir", str(workdir)]
    if not tiny:
        from zoo_core.configs.agf import uea

        c = uea.get_config("dataset=JapaneseVowels")
        epoch = c.log_every_steps
        cmd += [f"--config.total_steps={epochs * epoch}"]
    if seed is not None:
        cmd += [f"--config.seed={seed}"]
    return cmd


def _our_uea_times(workdir: pathlib.Path, steps_per_epoch: int, eval_steps: set[int]) -> dict[str, Any]:
    """Per-epoch training and per-evaluation time of our run, from workdir/metrics.jsonl.

    The trainer logs `train/steps_per_second` once per epoch over the wall time since the previous
    log, which includes the evaluation (and checkpoint) made after the previous epoch. Epochs after an
    epoch without evaluation give the training time; epochs after an evaluation give training +
    evaluation, whose excess over the median training epoch is the evaluation time. The first epoch
    includes compiling.
    """
    windows = {}
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return dict(error=f"no {path}")
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        sps = rec.get("train/steps_per_second")
        if sps:
            windows[int(rec["step"])] = steps_per_epoch / float(sps)
    if not windows:
        return dict(error="no train/steps_per_second in metrics.jsonl")
    steps = sorted(windows)
    first = windows[steps[0]]
    plain = [windows[s] for s in steps[1:] if (s - steps_per_epoch) not in eval_steps]
    after_eval = [windows[s] for s in steps[1:] if (s - steps_per_epoch) in eval_steps]
    # Too few epochs for a window without an evaluation before it: the epoch time then includes one.
    epoch_s = _median(plain) if plain else _median(after_eval)
    eval_s = (_median(after_eval) - epoch_s) if after_eval and plain else None
    return dict(epoch_train_s=epoch_s, eval_s=eval_s, first_epoch_s=first, epochs_logged=len(steps),
                method="metrics.jsonl train/steps_per_second windows (see _our_uea_times)")


def _uea_data_dir(args) -> pathlib.Path:
    """The folder of JapaneseVowels_{TRAIN,TEST}.ts: --uea_data_dir, else the copy shipped in zoo_core."""
    if args.uea_data_dir:
        return pathlib.Path(args.uea_data_dir)
    return uea_data.SHIPPED_DIR / UEA_DATASET


def _run(cmd: list[str], cwd, env, log_path: pathlib.Path, timeout: float | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return dict(rc=rc, wall_s=time.perf_counter() - t0, log=str(log_path))


def run_uea_case(case: str, args, log) -> dict[str, Any]:
    rec: dict[str, Any] = dict(case=case, kind="end_to_end", status="ok", epochs=args.epochs)
    src, reason = official_source(case, args)
    data_dir = _uea_data_dir(args)
    if src is not None and not (data_dir / f"{UEA_DATASET}_TRAIN.ts").is_file():
        src, reason = None, f"no {UEA_DATASET}_TRAIN.ts in --uea_data_dir {data_dir}"
    if src is None and not args.tiny:
        rec.update(status="skipped", reason=reason)
        return rec
    out = pathlib.Path(args.uea_out or tempfile.mkdtemp(prefix="peers_uea_"))
    out.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if args.clear_xla_flags:
        env.pop("XLA_FLAGS", None)
    from zoo_core.configs.agf import uea
    from zoo_core.run import loop

    c = uea.get_config("dataset=JapaneseVowels" + (",smoke" if args.tiny else ""))
    steps_per_epoch = int(c.log_every_steps)
    total = steps_per_epoch * args.epochs if not args.tiny else int(c.total_steps)
    with c.unlocked():
        c.total_steps = total
    eval_steps = {s for s in range(1, total + 1) if loop.is_eval_step(c, s)}
    runs: dict[str, list[dict[str, Any]]] = dict(official=[], ours=[])
    rec["load_before"] = loadavg()
    for r in range(args.uea_rounds):
        if src is not None:
            odir = out / f"official_{r}"
            if odir.exists():
                shutil.rmtree(odir)
            odir.mkdir()
            cmd = official_uea_command(src, data_dir, odir, args.epochs, args.official_python, args.uea_seed)
            res = _run(cmd, src / "AGF_UEA", env, out / f"official_{r}.log", args.uea_timeout)
            text = pathlib.Path(res["log"]).read_text(errors="replace")
            epochs, evals = _runtimes(text, "Epoch"), _runtimes(text, "Validation")
            res.update(epoch_train_s=_median(epochs), eval_s=_median(evals), epochs_logged=len(epochs),
                       evals_logged=len(evals))
            runs["official"].append(res)
            log(f"  round {r + 1} official: rc={res['rc']} wall {res['wall_s']:.1f} s, epoch "
                f"{res['epoch_train_s']}, eval {res['eval_s']}")
        wdir = out / f"ours_{r}"
        if wdir.exists():   # a previous run's checkpoints would make this one resume, not train
            shutil.rmtree(wdir)
        cmd = our_uea_command(wdir, args.epochs, args.uea_seed, args.tiny)
        res = _run(cmd, REPO, env, out / f"ours_{r}.log", args.uea_timeout)
        res.update(_our_uea_times(wdir, steps_per_epoch, eval_steps))
        runs["ours"].append(res)
        log(f"  round {r + 1} ours: rc={res['rc']} wall {res['wall_s']:.1f} s, epoch "
            f"{res.get('epoch_train_s')}, eval {res.get('eval_s')}")
    rec["load_after"] = loadavg()
    rec["out_dir"] = str(out)
    for side, rs in runs.items():
        if not rs:
            rec[side] = dict(skipped=reason)
            continue
        rec[side] = dict(runs=rs, median_s=_median([x["wall_s"] for x in rs]),
                         epoch_train_s=_median([x["epoch_train_s"] for x in rs if x.get("epoch_train_s")]),
                         eval_s=_median([x["eval_s"] for x in rs if x.get("eval_s") is not None]))
        if any(x["rc"] != 0 for x in rs):
            rec["status"] = "failed"
            rec["reason"] = f"{side} exited with {[x['rc'] for x in rs]} (logs in {out})"
    if not runs["official"]:
        rec["note"] = f"our side only ({reason})"
    elif rec["status"] == "ok":
        rec["ratio_official_over_ours"] = rec["official"]["median_s"] / rec["ours"]["median_s"]
    return rec


# ----------------------------------------------------------------------------------------------
# The report.


def _fmt(v, spec=".4g"):
    return "-" if v is None else format(v, spec)


def format_report(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    from zoo_core import bench

    lines = [f"peers benchmark  {meta['time_utc']}  backend {meta['backend']} x {meta.get('device_count', 1)} "
             f"devices  torch threads {meta['threads']}"
             f"  tiny={meta['tiny']}",
             f"load average before: {meta['load_before']}   after: {meta['load_after']}",
             f"allocator (both sides): {meta.get('allocator', meta.get('glibc_tunables'))}",
             _bounds_line(meta),
             "",
             f"{'case':<14} {'status':>7} {'official_s':>10} {'ours_s':>10} {'off/ours':>8}  "
             + bench.ROOFLINE_HEADER + "  note"]
    for r in records:
        off, ours = r.get("official", {}), r.get("ours", {})
        note = r.get("reason") or r.get("note") or ""
        if r["kind"] == "end_to_end" and r["status"] != "skipped":
            note = (f"wall s; epoch train official {_fmt(off.get('epoch_train_s'))} / ours "
                    f"{_fmt(ours.get('epoch_train_s'))} s, eval {_fmt(off.get('eval_s'))} / "
                    f"{_fmt(ours.get('eval_s'))} s; {note}").rstrip("; ")
        if r.get("ratios_official_over_ours"):
            by = ", ".join(f"{p} {v:.2f}" for p, v in r["ratios_official_over_ours"].items())
            note = f"off/ours by precision {by}; {note}".rstrip("; ")
        if r.get("ratio_per_round"):
            note = (f"off/ours per round {min(r['ratio_per_round']):.2f}-{max(r['ratio_per_round']):.2f}; "
                    f"{note}").rstrip("; ")
        lines.append(f"{r['case']:<14} {r['status']:>7} {_fmt(off.get('median_s')):>10} "
                     f"{_fmt(ours.get('median_s')):>10} {_fmt(r.get('ratio_official_over_ours'), '.2f'):>8}  "
                     + bench.format_roofline(ours.get("roofline")) + f"  {note}")
    lines.append("official_s, ours_s: median s/step (end-to-end case: median wall s per job); "
                 "off/ours > 1: ours is faster; roofline columns: our step.")
    return "\n".join(lines)


def _bounds_line(meta: dict[str, Any]) -> str:
    best, seen = meta.get("bounds") or {}, meta.get("bounds_measured") or []
    if not best:
        return "bounds: not measured"
    low = {k: min(b[k] for b in seen) for k in ("peak_gflops", "peak_gbps")}
    return (f"bounds (best of {best['samples']} measurements in this run): f32 matmul "
            f"{best['peak_gflops']:.1f} GFLOP/s (seen {low['peak_gflops']:.1f}-{best['peak_gflops']:.1f}), "
            f"stream {best['peak_gbps']:.1f} GB/s (seen {low['peak_gbps']:.1f}-{best['peak_gbps']:.1f})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agf_src", default=os.environ.get("AGF_SRC"), help="checkout of jeongwhanchoi/agf")
    p.add_argument("--samovar_src", default=os.environ.get("SAMOVAR_SRC"),
                   help="checkout of LJC-FVNR/Structural-Aligned-Mixture-of-VAR")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated subset of {list(CASES)}")
    p.add_argument("--steps", type=checks.positive_int, default=7, help="timed steps per side per round")
    p.add_argument("--rounds", type=checks.positive_int, default=3, help="interleaved rounds (A B A B ...)")
    p.add_argument("--warmup", type=checks.nonnegative_int, default=2,
                   help="untimed steps per side before the rounds")
    p.add_argument("--threads", type=checks.positive_int, default=2,
                   help="torch threads (and OMP/MKL threads of subprocesses)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CI smoke); our side only without sources")
    p.add_argument("--epochs", type=checks.positive_int, default=100, help="agf_uea_jv: epochs of each job")
    p.add_argument("--uea_rounds", type=checks.positive_int, default=1,
                   help="agf_uea_jv: alternating rounds of the two jobs")
    p.add_argument("--uea_timeout", type=checks.positive_float, default=None, help="agf_uea_jv: seconds per job")
    p.add_argument("--uea_data_dir", default=None, help="folder with JapaneseVowels_{TRAIN,TEST}.ts "
                   "(default: the copy shipped in zoo_core/data/uea_files)")
    p.add_argument("--uea_out", default=None, help="agf_uea_jv: folder for the jobs' outputs and logs")
    p.add_argument("--official_python", default=sys.executable,
                   help="python for the official UEA job (needs its old pandas/matplotlib; see README)")
    p.add_argument("--clear_xla_flags", action="store_true", help="unset XLA_FLAGS for our subprocess")
    p.add_argument("--seed", type=int, default=0, help="step cases: official init / data seed")
    p.add_argument("--uea_seed", type=int, default=None,
                   help="agf_uea_jv: --seed of both jobs (default: each side's own default)")
    p.add_argument("--cpu_devices", type=checks.nonnegative_int, default=None,
                   help="step cases: run our steps on this many CPU devices instead of their configs' "
                        "parallel.cpu_devices (0: one per core), e.g. 1 to time the single-device step")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the official steps run (ours: JAX's default backend; run on a GPU machine "
                        "for cuda)")
    p.add_argument("--precisions", default=None,
                   help=f"official step precisions, subset of {list(PRECISIONS)} (default: fp32 on the CPU; "
                        "fp32,tf32,amp with --device cuda)")
    p.add_argument("--no_bounds", action="store_true", help="skip measuring the matmul/bandwidth bounds")
    p.add_argument("--out", default=None, help="write the records and meta as JSON here")
    args = p.parse_args(argv)
    args.cases = checks.choice_list(p, "--cases", args.cases, CASES)
    args.precisions = checks.choice_list(p, "--precisions", args.precisions or (
        ",".join(PRECISIONS) if args.device == "cuda" else "fp32"), PRECISIONS)
    if args.device == "cpu" and args.precisions != ["fp32"]:
        p.error(f"--precisions {','.join(args.precisions)}: only fp32 runs on --device cpu "
                "(tf32 and amp are CUDA's)")
    # A source that is given but wrong is a mistake, not a reason to skip: the run would time nothing.
    for case in args.cases:
        which = OFFICIAL_FILES[case][0]
        src, reason = official_source(case, args)
        if src is None and getattr(args, f"{which}_src"):
            p.error(f"{reason}: give the root of a checkout of {OFFICIAL_REPOS[which]} (case {case})")
    checks.check_output_paths(p, args, dirs=["uea_out"], files=["out"])
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    from zoo_core import bench
    from zoo_core.run import allocator, sharding

    # Our steps run on the CPU devices their configs start the training command with (one per core
    # for these cases); the count is per process, so every selected case must agree on it.
    counts = {case: sharding.config_cpu_devices(our_config(case, args.tiny), requested=args.cpu_devices)
              for case in args.cases if case in STEP_CASES}
    if len(set(counts.values())) > 1:
        raise SystemExit(f"error: these cases run on different CPU device counts {counts}; run them separately")
    if counts:
        import jax

        jax.config.update("jax_num_cpu_devices", next(iter(counts.values())))

    log = lambda s: print(s, flush=True)
    meta = dict(bench.machine_meta(), threads=args.threads, device=args.device, precisions=args.precisions,
                tiny=args.tiny, steps=args.steps, rounds=args.rounds,
                warmup=args.warmup, load_before=loadavg(), agf_src=args.agf_src, samovar_src=args.samovar_src,
                glibc_tunables=os.environ.get("GLIBC_TUNABLES"), allocator=allocator.describe())
    # The bounds are measured before the first case and after every step case; the roofline columns
    # use the best of them (`bench.best_bounds`), so a quiet moment anywhere in the run counts.
    measure_bounds = not args.no_bounds and any(c in STEP_CASES for c in args.cases)
    bound_samples: list[dict[str, Any]] = []

    def sample_bounds():
        if measure_bounds:
            bound_samples.append(bench.machine_bounds(matmul_n=256, bandwidth_bytes=16 * 2**20, repeats=2)
                                 if args.tiny else bench.machine_bounds())
    sample_bounds()
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        meta["torch"] = None
    records = []
    for case in args.cases:
        log(f"{case}:")
        try:
            if case in STEP_CASES:
                rec = run_step_case(case, args, log)
                sample_bounds()
            else:
                rec = run_uea_case(case, args, log)
        except Exception as err:  # noqa: BLE001 (one broken case must not hide the others' numbers)
            import traceback

            traceback.print_exc()
            rec = dict(case=case, kind="step" if case in STEP_CASES else "end_to_end", status="error",
                       reason=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300])
        if rec["status"] != "ok":
            log(f"  {rec['status']}: {rec['reason']}")
        records.append(rec)
    meta["load_after"] = loadavg()
    meta["bounds"] = bench.best_bounds(bound_samples) if bound_samples else {}
    meta["bounds_measured"] = [{k: b[k] for k in ("peak_gflops", "peak_gbps")} for b in bound_samples]
    for rec in records:
        if rec.get("kind") == "step" and rec["status"] == "ok":
            rec["ours"]["roofline"] = bench.roofline(rec["ours"]["cost"], rec["ours"]["median_s"],
                                                     meta["bounds"] or None)
    report = format_report(records, meta)
    print(report, flush=True)
    result = dict(meta=meta, records=records)
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    # Both sides (and the end-to-end subprocesses) run under the allocator the training commands use.
    from zoo_core.run import allocator

    allocator.restart_with_huge_pages()
    sys.exit(1 if any(r["status"] in ("error", "failed") for r in main()["records"]) else 0)
