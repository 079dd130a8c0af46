"""Running a study's grid: one subprocess per run, resumable, with a progress line and an ETA per run.

Each run is `python -m <module> --config <config> --workdir DIR/<cell>/seed_<s> --config.seed=<s>
<overrides>` (or a benchmark cell's command) started in the working directory, its output appended to
`<run folder>/log.txt`. Its outcome goes to `<run folder>/study_run.json` (`MARKER`): status 'done' or
'failed', the exit status, the one-line error (the trainer's last `error: ...` line, else the output's
last line), the wall time and the command. A rerun skips the 'done' runs and starts the others again;
the trainer resumes a killed run from its last checkpoint in the same folder.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from zoo_core.study import Run, Study

MARKER = "study_run.json"
PACKAGES_DIR = pathlib.Path(__file__).resolve().parents[2]


def train_command(study: Study, run: Run, run_dir: str, extra: Sequence[str] = ()) -> list[str]:
    """The run's command as an argv: the training command, or a benchmark cell's command with '{run_dir}'
    filled in. `extra`: the study command's `--config.<field>=value` flags, last so that they win."""
    cell = run.cell
    if cell.is_benchmark:
        return [sys.executable] + [a.replace("{run_dir}", run_dir) for a in cell.command]
    cmd = [sys.executable, "-m", cell.module or study.module, "--config", cell.config or study.config,
           "--workdir", run_dir]
    # The bar's carriage returns would fill log.txt; the study prints its own progress line per run.
    cmd.append("--config.progress_bar=False")
    if run.seed is not None:
        cmd.append(f"--config.seed={run.seed}")
    return cmd + list(study.overrides) + list(cell.overrides) + list(extra)


def eval_command(study: Study, run: Run, run_dir: str, extra: Sequence[str] = ()) -> list[str] | None:
    """The evaluation command run after training (`Study.evaluate`), or None."""
    if run.cell.is_benchmark or not study.evaluate:
        return None
    return train_command(study, run, run_dir, extra) + list(study.evaluate)


def read_marker(run_dir: str) -> dict | None:
    """The run's `study_run.json`, or None (never finished: not started, running or killed)."""
    path = os.path.join(run_dir, MARKER)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_done(run_dir: str) -> bool:
    marker = read_marker(run_dir)
    return bool(marker) and marker.get("status") == "done"


def error_line(output: str, returncode: int) -> str:
    """The one line that says why a command failed: its last `error: ...` line, else its last line."""
    lines = [line.strip() for line in output.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1][len("error:"):].strip()
    last = lines[-1] if lines else "no output"
    return f"{last} (exit status {returncode})"


class Stopped(Exception):
    """The study was told to stop (SIGTERM or Ctrl-C): its runs were stopped, their checkpoints kept."""


_CHILDREN: set[subprocess.Popen] = set()
_STOPPING = threading.Event()


def _execute(cmd: list[str], log_path: str) -> tuple[int, str]:
    """Runs `cmd` in the working directory, with the packages' folder first on PYTHONPATH (a checkout
    need not be installed), appending its output to `log_path`: (exit status, output). Its
    `configs/...` names resolve as the trainer resolves them (`zoo_core.configs.resolve`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGES_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        start = log.tell()
        if _STOPPING.is_set():
            raise Stopped
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        _CHILDREN.add(proc)
        try:
            proc.wait()
        finally:
            _CHILDREN.discard(proc)
    if _STOPPING.is_set():   # its exit status says it was stopped, not that its run failed
        raise Stopped
    with open(log_path) as f:
        f.seek(start)
        return proc.returncode, f.read()


def stop_children() -> None:
    """Asks every running run to stop with SIGTERM: the trainer saves a checkpoint and exits, and the
    run (left without a marker) resumes from it when the study is run again."""
    _STOPPING.set()
    for proc in list(_CHILDREN):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def execute(study: Study, run: Run, root: str, extra: Sequence[str] = ()) -> dict:
    """Runs one run (training, then its evaluation command) and writes its marker; returns the marker."""
    run_dir = os.path.join(root, run.folder)
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "log.txt")
    t0 = time.time()
    cmd = train_command(study, run, run_dir, extra)
    rc, output = _execute(cmd, log_path)
    evaluation = eval_command(study, run, run_dir, extra)
    if rc == 0 and evaluation is not None:
        rc, output = _execute(evaluation, log_path)
    marker = {"status": "done" if rc == 0 else "failed", "returncode": rc,
              "error": None if rc == 0 else error_line(output, rc), "wall_s": round(time.time() - t0, 2),
              "command": shlex.join(cmd), "evaluate": shlex.join(evaluation) if evaluation else None,
              "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    tmp = os.path.join(run_dir, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, MARKER))   # atomic: a kill never leaves half a marker
    return marker


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def run_study(study: Study, root: str, *, runs: Sequence[Run] | None = None, extra: Sequence[str] = (),
              parallel: int = 1, after_run: Callable[[], None] = lambda: None, out=sys.stdout) -> tuple[int, int]:
    """Runs every run of `study` (or of `runs`, a part of it) under `root` not done yet, `parallel` at a
    time, calling `after_run` (the report) after each and printing one progress line per run; returns
    (done, failed)."""
    runs = list(study.runs() if runs is None else runs)
    todo = [r for r in runs if not is_done(os.path.join(root, r.folder))]
    total = len(runs)
    if len(todo) < total:
        print(f"{study.name}: {total - len(todo)} of {total} runs finished earlier: skipped", file=out, flush=True)
    done = failed = 0
    walls: dict[str, list[float]] = {"done": [], "failed": []}
    count = total - len(todo)
    _STOPPING.clear()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel))
    try:
        futures = {pool.submit(execute, study, r, root, extra): r for r in todo}
        for future in concurrent.futures.as_completed(futures):
            run = futures[future]
            try:
                marker = future.result()
            except Stopped:
                continue
            count += 1
            walls[marker["status"]].append(marker["wall_s"])
            left = total - count
            # The mean run that finished so far (a cell failing in seconds, e.g. without its data, would
            # make it far too short), `parallel` at a time.
            basis = walls["done"] or walls["failed"]
            eta = sum(basis) / len(basis) * left / min(max(1, parallel), max(1, left))
            seed = "" if run.seed is None else f" seed {run.seed}"
            if marker["status"] == "done":
                done += 1
                what = f"done in {_duration(marker['wall_s'])}"
            else:
                failed += 1
                what = f"FAILED in {_duration(marker['wall_s'])}: {marker['error']}"
            after_run()
            print(f"[{count}/{total}] {study.name} {run.cell.label}{seed}: {what}; "
                  f"ETA {_duration(eta) if left else 'done'}", file=out, flush=True)
    except KeyboardInterrupt:
        stop_children()
        pool.shutdown(wait=True, cancel_futures=True)
        raise Stopped from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        pool.shutdown(wait=True)
    return done, failed


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
