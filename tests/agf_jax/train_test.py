"""`python -m agf_jax.train` end to end on the smoke configs (2 steps, tiny model, tiny data), with
AGF and with every other self-attention of the registry in the LRA model.

The AGF runs (UEA and ListOps) start together as subprocesses of the real command (their start-up is
mostly single-threaded import and compile work, so they overlap well on two cores); the other registry
names run in this process through the function that command calls. Each must exit 0, write a
checkpoint and log eval/accuracy to metrics.jsonl.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from agf_jax import model
from tests.environment import command_env, run_entry_in_process
from zoo_core import attention
from zoo_core.configs.agf import lra_listops, uea
from zoo_core.run import sharding

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.entry

CONFIGS = {
    "uea_japanese_vowels": "configs/agf/uea.py:dataset=JapaneseVowels,smoke",
    "lra_listops": "configs/agf/lra_listops.py:smoke",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    procs = {}
    for name, config in CONFIGS.items():
        work = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, "-m", "agf_jax.train", "--config", config, "--workdir", str(work),
               f"--config.data.data_dir={data / name}"]
        procs[name] = (work, subprocess.Popen(cmd, cwd=ROOT, env=command_env(), stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
    results = {}
    for name, (work, proc) in procs.items():
        out, _ = proc.communicate(timeout=300)
        results[name] = (work, proc.returncode, out)
    return results


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_smoke_run_trains_checkpoints_and_evaluates(runs, name):
    assert "agf" in attention.names("self")   # the registry name the ListOps run stands for (below)
    work, returncode, out = runs[name]
    assert returncode == 0, out[-3000:]
    steps = sorted(int(s) for s in os.listdir(work / "checkpoints") if s.isdigit())
    assert steps == [2]
    with open(work / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals and evals[-1]["step"] == 2
    assert 0.0 <= evals[-1]["eval/accuracy"] <= 1.0
    assert any("train/loss/orthogonality" in r for r in records), "the AGF regulariser reaches the loss"
    # The LRA configs run one CPU device per core (parallel.cpu_devices = 0), the UEA ones one device.
    c = uea.get_config("dataset=JapaneseVowels,smoke") if name.startswith("uea") else lra_listops.get_config("smoke")
    devices = sharding.config_cpu_devices(c)
    assert (name == "lra_listops") == (c.parallel.cpu_devices == 0)
    assert f"devices: {devices} total" in out, out[-3000:]
    assert json.loads((work / "config.json").read_text())["model"]["attention"] == "agf"


@pytest.fixture(scope="module")
def registry_data(tmp_path_factory):
    """One data folder for the registry runs: the first prepares ListOps smoke, the others read it (the
    attention name does not change the data)."""
    return tmp_path_factory.mktemp("registry_data")


# 'agf' itself is the real command's ListOps run, checked the same way (attention name in config.json
# included) by test_smoke_run_trains_checkpoints_and_evaluates[lra_listops]; every other registry name is here.
@pytest.mark.parametrize("name", [n for n in attention.names("self") if n != "agf"])
def test_lra_model_trains_with_every_registry_self_attention(registry_data, tmp_path, capfd, name):
    # The AGF LRA model takes any self-attention name of the registry (issue 40), from the config
    # argument `attention=NAME` to a trained, checkpointed and evaluated smoke run, through the function
    # the command calls, in this process (a subprocess per name cost its own JAX import and data preparation).
    work = tmp_path / f"lra_listops_{name}"
    returncode, out, err = run_entry_in_process(
        "agf_jax.train", model.Model, ["--config", f"configs/agf/lra_listops.py:attention={name},smoke",
                                       "--workdir", work, f"--config.data.data_dir={registry_data}"], capfd)
    assert returncode == 0, (out + err)[-3000:]
    assert json.loads((work / "config.json").read_text())["model"]["attention"] == name
    assert sorted(int(s) for s in os.listdir(work / "checkpoints") if s.isdigit()) == [2]
    with open(work / "metrics.jsonl") as f:
        evals = [r for r in map(json.loads, f) if "eval/accuracy" in r]
    assert evals and evals[-1]["step"] == 2 and 0.0 <= evals[-1]["eval/accuracy"] <= 1.0
