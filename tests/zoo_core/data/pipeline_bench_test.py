"""`benchmarks/pipeline.py --tiny`: the smoke configs' data prepared in a temp folder, both paths timed,
the JSON record written; its bad arguments. Rates measured here mean nothing (a shared CI machine)."""
import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import pipeline as bench_pipeline
from tests.environment import command_env

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_tiny_run_writes_a_record_per_config(tmp_path):
    out = tmp_path / "pipeline.json"
    proc = subprocess.run([sys.executable, "benchmarks/pipeline.py", "--tiny", "--seconds", "0.1", "--warmup", "2",
                           "--data_dir", str(tmp_path / "data"), "--out", str(out)], cwd=REPO, env=command_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["memory_limit_bytes"] > 0 and result["meta"]["read_threads"] >= 2
    assert [r["config"] for r in result["records"]] == list(bench_pipeline.MAIN_CONFIGS)
    for record in result["records"]:
        assert record["tiny"] is True and record["examples"] >= record["batch_size"] > 0
        assert set(record["paths"]) == {"memory", "stream"}
        for path, rate in record["paths"].items():
            assert rate["batches"] > 0 and rate["batches_per_s"] > 0 and rate["seconds"] >= 0.1
            assert all(s > 0 for s in rate["first_batch_s"]) and len(rate["decode_s"]) == 1
            assert (rate["decode_s"][0] > 0) == (path == "memory")
        assert len(record["load_before"]) == len(record["load_after"]) == 3
        assert f"{record['config']}: {record['examples']} examples" in proc.stdout
    assert "load average" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    (["--paths", "memory,disk"], "--paths: disk"),
    (["--seconds", "0"], "--seconds"),
    (["--rounds", "0"], "--rounds"),
    (["--out", "/proc/zoo_pipeline/p.json"], "--out '/proc/zoo_pipeline/p.json' cannot be made"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_pipeline.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_config_that_does_not_exist_is_named():
    with pytest.raises(ValueError, match="--config 'configs/agf/nothing.py': no such config file"):
        bench_pipeline.load_config("configs/agf/nothing.py", tiny=True)
    config = bench_pipeline.load_config("configs/samovar/synthetic_var.py:kind=lintrans", tiny=True)
    assert config.model.kind == "lintrans" and config.total_steps == 2   # the argument and the smoke variant


def test_synthetic_splits_time_the_memory_path(tmp_path, capsys):
    out = tmp_path / "synthetic.json"
    result = bench_pipeline.main(["--synthetic", "40,100", "--batch_size", "8", "--seconds", "0.1", "--warmup", "1",
                                  "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(r["config"], r["examples"], r["batch_size"]) for r in result["records"]] == [
        ("synthetic:40", 40, 8), ("synthetic:100", 100, 8)]
    for record in result["records"]:
        rate = record["paths"]["memory"]
        assert set(record["paths"]) == {"memory"} and rate["batches"] > 0 and rate["batches_per_cpu_s"] > 0
        assert len(record["load_before"]) == len(record["load_after"]) == 3
    printed = capsys.readouterr().out
    assert "synthetic:100: 100 examples, batch 8: memory" in printed and "per CPU-second); load average" in printed


@pytest.mark.parametrize("argv,message", [
    (["--synthetic", "8", "--batch_size", "16"], "--synthetic: 8 examples < --batch_size 16"),
    (["--synthetic", "0"], "--synthetic"),
    (["--synthetic", "40", "--config", "configs/agf/lra_listops.py"], "give it or --config, not both"),
])
def test_bad_synthetic_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_pipeline.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
