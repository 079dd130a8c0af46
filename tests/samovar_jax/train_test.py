"""End-to-end runs of `python -m samovar_jax.train` on the smoke configs, the model factory over every
kind, and the test-split evaluator."""
import json
import pathlib
import subprocess
import sys

import pytest

from samovar_jax import baselines, evaluation, model
from tests.environment import command_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _metrics(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    merged = {}
    for row in rows:
        merged.update(row)
    return merged


@pytest.mark.entry
def test_smoke_configs_train_checkpoint_and_evaluate(tmp_path):
    runs = {
        "var": "configs/samovar/synthetic_var.py:smoke",
        "vic": "configs/samovar/forecasting.py:smoke",
    }
    procs = {}
    for name, config in runs.items():   # both at once: the two cores each take one
        cmd = [sys.executable, "-m", "samovar_jax.train", "--config", config, "--workdir", str(tmp_path / name),
               f"--config.data.data_dir={tmp_path / ('data_' + name)}"]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} failed:\n{out[-3000:]}"
    for name in runs:
        work = tmp_path / name
        assert (work / "checkpoints" / "2").is_dir()
        assert (work / "best").is_dir()
        metrics = _metrics(work)
        assert metrics["eval/mse"] > 0 and metrics["train/loss"] > 0
    # Kinds with an AR loss log it; the forecasting configs also evaluate the test split.
    assert "train/loss/ar" in _metrics(tmp_path / "var")
    assert {"eval/test_mse", "eval/test_mae"} <= set(_metrics(tmp_path / "vic"))


def test_model_factory_dispatches_on_kind():
    dl = model.Model(kind="dlinear", num_channels=2, input_len=16, horizon=4)
    assert isinstance(dl, baselines.DLinear)
    sv = model.Model(kind="lintrans", num_channels=2, input_len=16, patch_len=4, variant="tiny")
    assert isinstance(sv, model.Forecaster) and sv.kind == "lintrans"
    with pytest.raises(ValueError, match="`kind` must be one of"):
        model.Model(kind="transformer", num_channels=2, input_len=16, patch_len=4)


def test_dlinear_forecasting_smoke_in_process_reports_test_metrics(tmp_path):
    from zoo_core import trainer
    from zoo_core.configs.samovar import forecasting

    # us_change (198 rows) prepares in a fraction of vic_elec's time; the CLI test covers vic_elec.
    config = forecasting.get_config("smoke,kind=dlinear,source=embedded:us_change")
    config.unlock()
    config.data.data_dir = str(tmp_path / "data")
    config.lock()
    result = trainer.train_and_evaluate(config, str(tmp_path / "work"), model.Model,
                                        evaluators=evaluation.evaluators_for(config))
    assert {"eval/mse", "eval/mae", "eval/test_mse", "eval/test_mae"} <= set(result)
    assert 0 < result["eval/test_mse"] < 10


def test_ett_without_its_csv_is_a_one_line_config_error(tmp_path):
    from zoo_core import trainer
    from zoo_core.configs.samovar import ett

    config = ett.get_config(f"smoke,csv_dir={tmp_path}")
    config.unlock()
    config.data.data_dir = str(tmp_path / "data")
    config.lock()
    with pytest.raises(trainer.ConfigError, match=r"ETTh1\.csv.*does not exist"):
        trainer.train_and_evaluate(config, str(tmp_path / "work"), model.Model)


@pytest.mark.parametrize("kind", ["samovar", "lintrans", "fixedvar"])
def test_synthetic_var_config_per_kind(kind):
    from zoo_core.configs.samovar import synthetic_var

    c = synthetic_var.get_config(f"kind={kind}")
    assert (c.total_steps, c.batch_size, c.optim.learning_rate, c.optim.b2) == (7900, 256, 6e-4, 0.95)
    assert (c.data.eval_split, c.checkpoint.best_metric, c.checkpoint.best_mode) == ("validation", "eval/mse", "min")
    m = model.Model(**c.model.to_dict())
    r = m.resolved
    assert (r.width, r.num_layers, r.num_patches) == (32, 3, 8 if kind == "lintrans" else 64)
    assert r.num_heads == (1 if kind == "fixedvar" else 2)
    assert (m.ar_loss_weight > 0) == (kind != "fixedvar")
    reduced = synthetic_var.get_config(f"kind={kind},steps=800")
    assert reduced.total_steps == 800 and reduced.schedule.warmup_steps == 80
