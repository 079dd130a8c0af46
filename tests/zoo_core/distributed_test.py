"""A 2-process jax.distributed run on localhost trains and matches the single-process run."""
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.environment import command_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.entry
STEPS = ("--config.total_steps=20", "--config.checkpoint_every_steps=20", "--config.log_every_steps=10",
         "--config.eval_every_steps=20", "--config.progress_bar=False")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(workdir, data_dir, *extra):
    return [sys.executable, "-m", "zoo_core.train", "--config", "configs/core/synthetic.py",
            "--workdir", str(workdir), f"--config.data.data_dir={data_dir}", *STEPS, *extra]


def _final_state(workdir, like=None):
    """Restores step 20; `like` (a restored state) gives shapes and puts every leaf on this process's device 0."""
    target = None
    if like is not None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
    mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
    state = mngr.restore(20, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    mngr.close()
    return state


def test_two_processes_match_one(tmp_path):
    env = command_env()
    data = tmp_path / "data"
    subprocess.run(_cmd(tmp_path / "single", data), cwd=ROOT, env=env, check=True, capture_output=True)
    port = _free_port()
    procs = [subprocess.Popen(_cmd(tmp_path / "multi", data, f"--coordinator_address=127.0.0.1:{port}",
                                   "--num_processes=2", f"--process_id={i}"),
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    single = _final_state(tmp_path / "single")
    multi = _final_state(tmp_path / "multi", like=single)
    assert int(multi["step"]) == 20
    for a, b in zip(jax.tree_util.tree_leaves(single["params"]), jax.tree_util.tree_leaves(multi["params"])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    with open(tmp_path / "multi" / "metrics.jsonl") as f:
        assert '"eval/accuracy"' in f.read()   # process 0 wrote the metrics
    # Evaluation-only across 2 processes: each loads the checkpoint onto its own device and the
    # global parameters are assembled from those copies; the result is the run's own last eval.
    port = _free_port()
    procs = [subprocess.Popen(_cmd(tmp_path / "multi", data, "--eval_only", "--checkpoint=latest",
                                   f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                   f"--process_id={i}"),
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    with open(tmp_path / "multi" / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f if '"eval/accuracy"' in line][-1]
    with open(tmp_path / "multi" / "eval_latest_test.json") as f:
        again = json.load(f)
    assert again["step"] == logged["step"] == 20 and again["eval/accuracy"] == logged["eval/accuracy"]
    np.testing.assert_allclose(again["eval/loss"], logged["eval/loss"], rtol=1e-5)


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    """A preemption notice may reach one host only: every process must save the same step and exit."""
    env = command_env()
    port = _free_port()
    work = tmp_path / "multi"
    cmd = lambda i: [sys.executable, "-m", "zoo_core.train", "--config", "configs/core/synthetic.py",
                     "--workdir", str(work), f"--config.data.data_dir={tmp_path / 'data'}",
                     "--config.total_steps=100000", "--config.checkpoint_every_steps=20",
                     "--config.eval_every_steps=0", "--config.progress_bar=False",
                     f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"]
    logs = [open(tmp_path / f"process_{i}.log", "w") for i in range(2)]   # files: a pipe nobody reads fills up
    procs = [subprocess.Popen(cmd(i), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=logs[i])
             for i in range(2)]
    try:
        _stop_one_and_check_both(procs, logs, work, tmp_path)
    finally:   # a hung process (the failure this test guards against) must not outlive it
        for p in procs:
            if p.poll() is None:
                p.kill()


def _stop_one_and_check_both(procs, logs, work, tmp_path):
    saved_any = lambda: (work / "checkpoints").is_dir() and any(
        d.isdigit() for d in os.listdir(work / "checkpoints"))
    for _ in range(600):   # until training is under way (a first checkpoint exists)
        if saved_any() or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    assert saved_any() and all(p.poll() is None for p in procs), "the run did not get going"
    procs[1].send_signal(signal.SIGTERM)
    errs = []
    for i, p in enumerate(procs):
        p.wait(timeout=120)
        logs[i].close()
        errs.append((tmp_path / f"process_{i}.log").read_text())
        assert p.returncode == 0, errs[-1][-3000:]
    saved = [re.search(r"saved the checkpoint at step (\d+) after SIGTERM", e) for e in errs]
    assert all(saved), [e[-1500:] for e in errs]
    assert saved[0].group(1) == saved[1].group(1)
    assert (work / "checkpoints" / saved[0].group(1)).exists()


def test_a_data_error_on_process_0_ends_every_process(tmp_path):
    """Process 0 prepares the data while the others wait: its failure must reach them, not hang them."""
    env = command_env()
    src = tmp_path / "text"
    src.mkdir()
    (src / "train.tsv").write_text("1\tfine\n7\tbad label\n")   # line 2 fails while preparing
    (src / "test.tsv").write_text("0\tok\n")
    port = _free_port()
    cmd = lambda i: [sys.executable, "-m", "agf_jax.train", "--config", "configs/agf/lra_text.py:smoke",
                     "--workdir", str(tmp_path / "w"), f"--config.data.data_dir={tmp_path / 'data'}",
                     f"--config.data.options.source_dir={src}", f"--coordinator_address=127.0.0.1:{port}",
                     "--num_processes=2", f"--process_id={i}"]
    procs = [subprocess.Popen(cmd(i), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [2, 2], [e[-1500:] for e in errs]
    assert "line 2" in errs[0] and "process 0 could not prepare lra_text" in errs[1]
