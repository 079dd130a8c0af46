"""A 2-process jax.distributed run on localhost trains and matches the single-process run."""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

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
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS="")
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
