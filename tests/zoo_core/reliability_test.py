"""Runs the real CLI in subprocesses: SIGKILL + resume is exact, SIGTERM saves, config errors are one line."""
import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.environment import command_env, run_entry_in_process
from zoo_core import mlp_classifier

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.entry


def _cmd(workdir, data_dir, *overrides):
    return [sys.executable, "-m", "zoo_core.train", "--config", "configs/core/synthetic.py",
            "--workdir", str(workdir), f"--config.data.data_dir={data_dir}", "--config.progress_bar=False",
            "--config.eval_every_steps=0", *overrides]


LONG = ("--config.total_steps=300", "--config.checkpoint_every_steps=25", "--config.log_every_steps=25")


def _params(workdir, step):
    mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    mngr.close()
    return state["params"], state["opt_state"]


def _wait_for(path, proc, timeout=120):
    t0 = time.time()
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(workdir, data_dir) of one uninterrupted LONG run, trained once per test session: xdist workers
    share it through their common temporary root, the first to take the lock trains it."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    work, data, done = root / "uninterrupted_run", root / "uninterrupted_data", root / "uninterrupted.done"
    with open(root / "uninterrupted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            subprocess.run(_cmd(work, data, *LONG), cwd=ROOT, env=command_env(), check=True, capture_output=True,
                           text=True)
            done.touch()
    return work, data


def test_sigkill_then_resume_gives_exactly_the_uninterrupted_parameters(uninterrupted, tmp_path):
    full, data = uninterrupted
    work = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(work, data, *LONG), cwd=ROOT, env=command_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(work / "checkpoints" / "100", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(int(s) for s in os.listdir(work / "checkpoints") if s.isdigit())
    assert 300 not in done, "the run finished before it could be killed"
    subprocess.run(_cmd(work, data, *LONG), cwd=ROOT, env=command_env(), check=True, capture_output=True, text=True)
    p_full, o_full = _params(str(full), 300)
    p_res, o_res = _params(str(work), 300)
    for a, b in zip(jax.tree_util.tree_leaves((p_full, o_full)), jax.tree_util.tree_leaves((p_res, o_res))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_or_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, sig):
    work = tmp_path / "term"
    # SIGINT at its default disposition, as in a terminal (a test runner's worker may ignore it).
    proc = subprocess.Popen(_cmd(work, tmp_path / "data", *LONG), cwd=ROOT, env=command_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(work / "checkpoints" / "50", proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert f"after {signal.Signals(sig).name}" in err and "Traceback" not in err, err[-2000:]
    steps = sorted(int(s) for s in os.listdir(work / "checkpoints") if s.isdigit())
    assert steps[-1] >= 50 and steps[-1] < 300


# One case of each table runs the real `python -m zoo_core.train` (REAL); the others run the function its
# `__main__` calls in this process (tests.environment.run_entry_in_process: the same flag parsing, checks
# and exit), with the same assertions.
def _refusal(real: bool, argv, capfd) -> tuple[int, str]:
    """(exit status, stderr) of `python -m zoo_core.train <argv>`: a subprocess if `real`, else in-process."""
    if real:
        proc = subprocess.run([sys.executable, "-m", "zoo_core.train", *map(str, argv)], cwd=ROOT,
                              env=command_env(), capture_output=True, text=True)
        return proc.returncode, proc.stderr
    status, _, err = run_entry_in_process("zoo_core.train", mlp_classifier.Model, argv, capfd)
    return status, err


@pytest.mark.parametrize("override,expected,real", [
    ("--config.nope=3", "invalid config override: nope", False),
    ("--config.total_steps=abc", "bad flag", False),
    ("--config.optim.name=sgdd", "unknown optim.name 'sgdd'", False),
    ("--config.model.hidden=-4", "hidden must be >= 1", True),   # the deepest: refused by the model's setup
    ("--eval_split=test", "only used with --eval_only", False),
])
def test_config_mistakes_exit_2_with_one_line(tmp_path, capfd, override, expected, real):
    status, stderr = _refusal(real, _cmd(tmp_path / "w", tmp_path / "data", "--config.total_steps=2", override)[3:],
                              capfd)
    assert status == 2 and not (tmp_path / "data").exists() and not (tmp_path / "w").exists()
    errors = [l for l in stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], stderr[-1500:]
    assert "Traceback" not in stderr


@pytest.mark.parametrize("config,expected,real", [
    ("configs/core/synthetic.py:bogus", "unknown config argument 'bogus'", True),
    ("configs/core/no_such_file.py", "No such file or directory", False),
])
def test_a_config_file_that_does_not_load_exits_2_with_one_line(tmp_path, capfd, config, expected, real):
    status, stderr = _refusal(real, ["--config", config, "--workdir", tmp_path / "w"], capfd)
    assert status == 2
    assert stderr.strip().splitlines() == [stderr.strip()] and expected in stderr, stderr
    assert stderr.startswith("error: bad flag:")


def test_eval_only_scores_a_finished_run_on_another_split(uninterrupted, tmp_path, capfd):
    full, data = uninterrupted
    cmd = _cmd(full, data, *LONG, "--eval_only", "--eval_split=test", "--checkpoint=latest")
    proc = subprocess.run(cmd, cwd=ROOT, env=command_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 300 and 0.0 <= result["eval/accuracy"] <= 1.0
    assert json.load(open(os.path.join(full, "eval_latest_test.json"))) == result
    # Nothing was trained: the newest checkpoint is still step 300.
    assert sorted(int(n) for n in os.listdir(os.path.join(full, "checkpoints")))[-1] == 300
    # No checkpoint: refused in one line (in-process: the same function as the command above).
    status, stderr = _refusal(False, _cmd(tmp_path / "none", data, "--eval_only")[3:], capfd)
    errors = [l for l in stderr.splitlines() if l.startswith("error: ")]
    assert status == 2 and len(errors) == 1 and "no checkpoint" in errors[0], stderr[-1500:]


def test_the_default_workdir_names_the_config_and_its_args():
    from zoo_core.run.main import default_workdir
    assert default_workdir("configs/agf/lra_listops.py") == os.path.join("runs", "lra_listops")
    assert default_workdir("configs/agf/lra_listops.py:smoke") == os.path.join("runs", "lra_listops_smoke")
    assert default_workdir("c/uea_japanese_vowels.py:smoke,attention=softmax") == os.path.join(
        "runs", "uea_japanese_vowels_smoke_attention-softmax")


def test_run_json_files_are_replaced_whole(tmp_path):
    # config.json and the eval results are written to a temporary file and renamed into place, so a kill
    # mid-write cannot leave a torn config.json that a resume would refuse to read.
    from zoo_core.run import metrics
    path = tmp_path / "config.json"
    path.write_text('{"seed": 0}')
    (tmp_path / "config.json.tmp").write_text('{"se')          # left by a write killed earlier
    metrics.write_json(str(path), {"seed": 1, "model": {"hidden": 32}})
    assert json.loads(path.read_text()) == {"seed": 1, "model": {"hidden": 32}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


# A training command started as `python -c RESTORE_SIGPIPE <flags>`: with SIGPIPE at its default, as a
# program that runs the trainer may set it (Python itself ignores it), a write to a closed pipe ends the
# process at once.
RESTORE_SIGPIPE = ("import runpy, signal, sys; signal.signal(signal.SIGPIPE, signal.SIG_DFL); "
                   "sys.argv[0] = 'zoo_core.train'; runpy.run_module('zoo_core.train', run_name='__main__')")


@pytest.mark.parametrize("streams", ["stdout", "stdout_and_stderr", "sigpipe_default"])
def test_ctrl_c_through_a_closed_pipe_still_saves_the_checkpoint(tmp_path, streams):
    """`... | tee out.log` then Ctrl-C: tee ends first, so the run's output goes to a closed pipe. It still
    saves its checkpoint at the step it stopped and exits 0 with no traceback (the summary line raised
    BrokenPipeError, exit 1; with `2>&1 | tee` the progress bar's write raised inside the loop and no
    checkpoint was saved)."""
    work = tmp_path / "run"
    cmd = _cmd(work, tmp_path / "data", "--config.total_steps=100000", "--config.checkpoint_every_steps=0",
               "--config.log_every_steps=5", "--config.progress_bar=True")
    if streams == "sigpipe_default":
        cmd = [sys.executable, "-c", RESTORE_SIGPIPE, *cmd[3:]]
    read, write = os.pipe()
    err_log = open(tmp_path / "err.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=command_env(), stdout=write,
                            stderr=err_log if streams == "stdout" else write,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(write)
    os.set_blocking(read, False)
    metrics, t0 = work / "metrics.jsonl", time.time()
    while not (metrics.exists() and '"train/' in metrics.read_text()):
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        assert time.time() - t0 < 300, "no training step logged"
        try:
            while os.read(read, 1 << 16):   # the pipe's reader (tee) while it runs
                pass
        except BlockingIOError:
            pass
        time.sleep(0.05)
    os.close(read)   # tee ended by the Ctrl-C
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, (proc.returncode, (tmp_path / "err.log").read_text()[-2000:])
    err_log.close()
    saved = [int(s) for s in os.listdir(work / "checkpoints") if s.isdigit()]
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train/' in line]
    assert len(saved) == 1 and saved[0] >= logged[-1], (saved, logged)
    _params(str(work), saved[0])   # complete: it restores
    if streams == "stdout":
        err = (tmp_path / "err.log").read_text()
        assert f"saved the checkpoint at step {saved[0]} after SIGINT" in err and "Traceback" not in err, err[-2000:]
