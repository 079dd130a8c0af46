"""End-to-end runs of `python -m htgn_jax.train` on the smoke configs: number-words (seq2seq, with its BLEU
evaluator) as the real command in a subprocess, digits in this process through the function the command
calls (`main.run(model.Model, evaluators_fn=decoding.evaluators_for)`: the same flags, setup and loop)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from htgn_jax import decoding, model
from tests.environment import command_env, run_entry_in_process

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.entry


def _start(config, workdir, data_dir):
    cmd = [sys.executable, "-m", "htgn_jax.train", "--config", f"configs/htgn/{config}.py:smoke",
           "--workdir", str(workdir), f"--config.data.data_dir={data_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=command_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The number-words smoke run of the real command."""
    root = tmp_path_factory.mktemp("htgn_train")
    proc = _start("number_words", root / "number_words", root / "data")
    log, _ = proc.communicate(timeout=600)
    return {"number_words": (proc.returncode, log, root / "number_words")}


def _final_eval(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("eval/") for k in r)][-1]


def _check_run(run):
    code, log, workdir = run
    assert code == 0, log[-3000:]
    assert (workdir / "checkpoints" / "2").is_dir(), sorted(os.listdir(workdir))
    return _final_eval(workdir)


def test_number_words_smoke_trains_checkpoints_and_scores_bleu(runs):
    metrics = _check_run(runs["number_words"])
    for key in ("eval/bleu", "eval/chrf", "eval/exact_match", "eval/token_accuracy",
                "eval/loss/kl"):
        assert key in metrics, sorted(metrics)
    assert 0.0 <= metrics["eval/bleu"] <= 100.0 and 0.0 <= metrics["eval/exact_match"] <= 1.0


def test_digits_smoke_trains_and_checkpoints(tmp_path, capfd):
    workdir = tmp_path / "digits"
    code, out, err = run_entry_in_process(
        "htgn_jax.train", model.Model, ["--config", "configs/htgn/digits.py:smoke", "--workdir", workdir,
                                        f"--config.data.data_dir={tmp_path / 'data'}"],
        capfd, evaluators_fn=decoding.evaluators_for)
    metrics = _check_run((code, out + err, workdir))
    assert "eval/accuracy" in metrics and "eval/bleu" not in metrics
