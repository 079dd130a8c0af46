"""The study runner (`python -m zoo_core.study`): a smoke study end to end, a rerun that skips the finished
runs and resumes the one without its marker, a failing cell recorded while the others complete, `--dry_run`
of every study file, one `error:` line for bad input, and the results (mean ± std, CSV, figures) from
hand-written run folders.

The end-to-end cases start the real command (each run is a training subprocess, 15-30 s under load);
the rest run in-process.
"""
import csv
import json
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tests.environment import command_env
from zoo_core import attention
from zoo_core import study as st
from zoo_core.study import __main__ as cli
from zoo_core.study import report, runner

ROOT = pathlib.Path(__file__).resolve().parents[2]
STUDY_FILES = sorted(p for p in (ROOT / "configs" / "studies").glob("*.py") if p.name != "__init__.py")


def _study_command(args, timeout=600):
    return subprocess.run([sys.executable, "-m", "zoo_core.study", *args], cwd=ROOT, env=command_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory):
    """samovar_fig4:smoke (SAMoVAR, 2-step runs, seeds 1 and 2) run once under a fresh folder."""
    root = tmp_path_factory.mktemp("fig4")
    proc = _study_command(["configs/studies/samovar_fig4.py:smoke", "--workdir", str(root)])
    return root, proc


def test_smoke_study_runs_end_to_end_and_writes_its_results(smoke_study):
    root, proc = smoke_study
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[1/2] samovar_fig4 samovar code seed 1: done" in proc.stdout and "ETA" in proc.stdout
    for seed in (1, 2):
        marker = json.loads((root / "samovar_code" / f"seed_{seed}" / runner.MARKER).read_text())
        assert marker["status"] == "done" and marker["error"] is None
        assert f"--config.seed={seed}" in marker["command"]
    md = (root / "results.md").read_text()
    assert "| samovar code |" in md and "(n=2)" in md and "Failed runs" not in md
    rows = (root / "results.csv").read_text().splitlines()
    head, row = rows[0].split(","), dict(zip(rows[0].split(","), rows[1].split(",")))
    assert len(rows) == 2 and "min eval/mse mean" in head
    values = [min(v for s, v in st.metrics.series(str(root / "samovar_code" / f"seed_{s}"), "eval/mse"))
              for s in (1, 2)]
    assert float(row["min eval/mse mean"]) == pytest.approx(sum(values) / 2, rel=1e-5)
    assert row["min eval/mse n"] == "2" and row["steps"] == "2" and row["runs_done"] == "2/2"
    assert (root / "samovar_fig4.png").stat().st_size > 0   # the validation curves


def test_rerun_skips_finished_runs_and_resumes_the_unfinished_one(smoke_study):
    root, proc = smoke_study
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = (root / "samovar_code" / "seed_1" / runner.MARKER).read_text()
    (root / "samovar_code" / "seed_2" / runner.MARKER).unlink()   # as if the study was killed in that run
    again = _study_command(["configs/studies/samovar_fig4.py:smoke", "--workdir", str(root)])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 of 2 runs finished earlier: skipped" in again.stdout
    assert "[2/2] samovar_fig4 samovar code seed 2: done" in again.stdout
    assert (root / "samovar_code" / "seed_1" / runner.MARKER).read_text() == kept
    log = (root / "samovar_code" / "seed_2" / "log.txt").read_text()
    assert log.count("$ ") == 2 and "nothing to train" in log   # the trainer resumed from its checkpoint
    assert "(n=2)" in (root / "results.md").read_text()


def test_a_failing_cell_is_recorded_and_the_others_complete(tmp_path):
    study_file = tmp_path / "mixed.py"
    study_file.write_text(textwrap.dedent("""
        from zoo_core import study

        WRITE = ("import json, sys; json.dump({'records': [{'case': 'x', 'n': 4, 'status': 'ok', "
                 "'median_s': 0.5}]}, open(sys.argv[1] + '/bench.json', 'w'))")

        def get_study(arg=None):
            return study.Study(
                name="mixed", title="a bad override, then a cell that works", module="samovar_jax.train",
                config="configs/samovar/synthetic_var.py:smoke",
                cells=[study.Cell("bad", overrides=["--config.model.no_such_field=1"]),
                       study.Cell("ok", command=["-c", WRITE, "{run_dir}"])],
                seeds=[0], metrics=[study.BenchRecords("median_s", "time (s)")])
        """))
    proc = _study_command([str(study_file), "--workdir", str(tmp_path / "out")])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "[1/2] mixed bad seed 0: FAILED" in proc.stdout and "[2/2] mixed ok: done" in proc.stdout
    marker = json.loads((tmp_path / "out" / "bad" / "seed_0" / runner.MARKER).read_text())
    assert marker["status"] == "failed" and marker["returncode"] == 2
    assert "no_such_field" in marker["error"] and "\n" not in marker["error"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"- bad seed 0 (`bad/seed_0`): {marker['error']}" in md
    assert "| ok | x | 4 | 0.5 (n=1) |" in md
    csv_rows = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert any(r.startswith("bad,") and "no_such_field" in r for r in csv_rows)


@pytest.mark.parametrize("arg", ["", ":smoke"])
@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: p.stem)
def test_dry_run_lists_every_run_of_every_study(path, arg, tmp_path, capsys):
    spec = f"configs/studies/{path.name}{arg}"
    assert cli.main([spec, "--dry_run", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    study = cli.load_study(spec)
    runs = study.runs()
    assert out[1] == f"{len(runs)} runs under {tmp_path}:"
    listed = [line for line in out if line.startswith("[")]
    assert len(listed) == len(runs) and not list(tmp_path.iterdir()), "a dry run creates nothing"
    for line, run in zip(listed, runs):
        assert str(tmp_path / run.folder) in line and line.split(": ", 1)[1].startswith("python -m ")
    assert f"python -m zoo_core.study configs/studies/{path.name}:smoke" in cli._load_module(str(path), "doc").__doc__


def test_only_runs_the_matching_cells(tmp_path, capsys):
    assert cli.main(["configs/studies/agf_order.py", "--only", "^K=(2|4)$", "--dry_run", "--workdir", str(tmp_path)]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in listed] == [f"[{i}/6] K-{k}/seed_{s}" for i, (k, s) in enumerate(
        [(k, s) for k in (2, 4) for s in (666, 1, 2)], 1)]


def test_htgn_studies_run_on_either_task():
    for name in ("htgn_ablation", "htgn_rank_heads"):
        words, digits = (cli.load_study(f"configs/studies/{name}.py:task={t}") for t in ("number_words", "digits"))
        assert [c.label for c in words.cells] == [c.label for c in digits.cells]
        assert words.evaluate == ("--eval_only", "--eval_split=test") and digits.evaluate == ()
        assert words.metrics[0].key == "eval/bleu" and digits.metrics[0].key == "eval/accuracy"
        assert all("configs/htgn/digits.py" in (c.config or digits.config) for c in digits.cells)


def test_mechanism_studies_read_the_registry_at_load_time():
    cells = cli.load_study("configs/studies/agf_uea.py").cells
    assert {c.params["attention"] for c in cells} == set(attention.names("self"))
    assert len({c.params["dataset"] for c in cells}) == 10
    lra = cli.load_study("configs/studies/agf_lra.py")
    assert {c.params["attention"] for c in lra.cells} == set(attention.names("self"))
    assert lra.evaluate == ("--eval_only", "--eval_split=test")


@pytest.mark.parametrize("argv, message", [
    (["configs/studies/no_such_study.py"], "unknown study 'configs/studies/no_such_study.py'"),
    (["configs/studies/agf_order.py:no_such_arg=1"], "unknown config argument 'no_such_arg'"),
    (["configs/studies/agf_order.py:orders=1-x"], "give integers joined by '-'"),
    (["configs/studies/htgn_ablation.py:task=mnist"], "task='mnist'; choose one of number_words, digits"),
    (["configs/studies/samovar_fig4.py:smoke", "--set", "model.no_such_field=1"],
     "--set model.no_such_field: configs/samovar/synthetic_var.py:kind=samovar,protocol=code,smoke has no field"),
    (["configs/studies/samovar_fig4.py:smoke", "--set", "total_steps"], "give field=value"),
    # A value that is not of the field's type stopped every run, after writing their results files.
    (["configs/studies/samovar_fig4.py:smoke", "--set", "total_steps=abc"],
     "--set total_steps=abc: invalid literal for int() with base 10: 'abc' (in configs/samovar/synthetic_var.py"),
    (["configs/studies/samovar_fig4.py:smoke", "--set", "total_steps=3", "--set", "optim.learning_rate=fast"],
     "--set optim.learning_rate=fast: could not convert string to float: 'fast'"),
    (["configs/studies/samovar_fig4.py:smoke", "--parallel", "0"], "--parallel must be >= 1"),
    (["configs/studies/samovar_fig4.py:smoke", "--only", "no such cell"], "--only 'no such cell' matches no cell"),
])
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--workdir", str(tmp_path / "w")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("cells, message", [
    ("[study.Cell('a', overrides=['model.x=1'])]", "cell 'a': overrides must be --config.<field>=<value>"),
    ("[study.Cell('K=1'), study.Cell('K-1')]", "cells share the folder name(s) K-1"),
    ("[]", "has no cells"),
])
def test_a_study_file_with_a_mistake_is_one_error_line(cells, message, tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("from zoo_core import study\n\ndef get_study(arg=None):\n    return study.Study("
                    f"name='b', title='t', module='samovar_jax.train', config='c', cells={cells}, "
                    "metrics=[study.Last('eval/mse')])\n")
    with pytest.raises(SystemExit) as e:
        cli.main([str(path), "--dry_run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err, err


def _fake_run(root, folder, records, status="done", error=None):
    run_dir = root / folder
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / runner.MARKER).write_text(json.dumps({"status": status, "error": error, "wall_s": 10.0}))


def test_report_means_stds_csv_and_figures(tmp_path):
    cells = [st.Cell(f"K={k}", dict(K=k), overrides=[f"--config.model.order={k}"]) for k in (1, 2)]
    study = st.Study(name="toy", title="toy", module="agf_jax.train", config="configs/agf/uea.py", cells=cells,
                     seeds=[0, 1, 2], metrics=[st.Best("eval/accuracy"), st.Last("eval/accuracy"),
                                               st.AtBest("eval/test", by="eval/accuracy", mode="max")],
                     plot=st.Curve(x="K"))
    for k, accs in ((1, (0.5, 0.7, None)), (2, (0.8, 0.9, 0.6))):
        for seed, acc in enumerate(accs):
            if acc is None:   # K=1 seed 2 failed
                _fake_run(tmp_path, f"K-{k}/seed_{seed}", [], status="failed", error="boom")
                continue
            _fake_run(tmp_path, f"K-{k}/seed_{seed}", [
                {"step": 1, "train/loss": 1.0}, {"step": 2, "eval/accuracy": acc, "eval/test": acc / 2},
                {"step": 4, "eval/accuracy": acc - 0.1, "eval/test": 0.0}])
    paths = report.write(study, str(tmp_path))
    rows, failed = report.collect(study, str(tmp_path))
    assert failed == [{"cell": "K=1", "seed": 2, "folder": "K-1/seed_2", "error": "boom"}]
    mean, std, n = rows[0]["max eval/accuracy"]
    assert (mean, n) == (pytest.approx(0.6), 2) and std == pytest.approx(math.sqrt(0.02))
    assert rows[1]["last eval/accuracy"][0] == pytest.approx((0.7 + 0.8 + 0.5) / 3)
    assert rows[1]["eval/test at max eval/accuracy"][0] == pytest.approx((0.8 + 0.9 + 0.6) / 6)
    assert rows[0]["steps"] == "4" and rows[0]["runs"] == "2/3"
    assert "- K=1 seed 2 (`K-1/seed_2`): boom" in (tmp_path / "results.md").read_text()
    assert str(tmp_path / "toy.png") in paths
    steps = st.Study(**{**study.__dict__, "name": "toy_steps", "plot": st.StepCurves("eval/accuracy")})
    assert str(tmp_path / "toy_steps.png") in report.write(steps, str(tmp_path))
    with open(tmp_path / "curves.csv") as f:   # the figure's points: K=1 has seeds 0, 1 (seed 2 failed)
        curve = [r for r in csv.DictReader(f) if r["cell"] == "K=1"]
    assert [(r["step"], r["n"]) for r in curve] == [("2", "2"), ("4", "2")]
    assert float(curve[0]["eval/accuracy mean"]) == pytest.approx(0.6)
    assert float(curve[1]["eval/accuracy std"]) == pytest.approx(math.sqrt(0.02))


def test_benchmark_records_become_rows_per_case_and_length(tmp_path):
    run_dir = tmp_path / "bench"
    run_dir.mkdir()
    (run_dir / "bench.json").write_text(json.dumps({"records": [
        {"case": "agf", "n": 64, "status": "ok", "median_s": 0.1, "memory": {"total_bytes": 2 ** 20}},
        {"case": "agf", "n": 128, "status": "skipped", "median_s": None, "memory": None}]}))
    time_rows = st.BenchRecords("median_s", "time (s)").rows(str(run_dir))
    mem_rows = st.BenchRecords("memory.total_bytes", "MiB", scale=2.0 ** -20).rows(str(run_dir))
    assert time_rows == [{"case": "agf", "n": 64, "time (s)": 0.1}] and mem_rows == [{"case": "agf", "n": 64, "MiB": 1.0}]


def test_error_line_is_the_last_error_else_the_last_line():
    assert runner.error_line("x\nerror: first\nerror: data set Heartbeat is missing\n", 2) == \
        "data set Heartbeat is missing"
    assert runner.error_line("Traceback ...\nValueError: bad\n", 1) == "ValueError: bad (exit status 1)"


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["configs/studies/agf_filter.py:smoke", "configs/studies/htgn_rank_heads.py:smoke",
                                  "configs/studies/agf_cost.py:smoke", "configs/studies/htgn_ablation.py:smoke",
                                  "configs/studies/htgn_rank_heads.py:task=digits,smoke"])
def test_agf_and_htgn_smoke_studies_run_end_to_end(spec, tmp_path):
    proc = _study_command([spec, "--workdir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Failed runs" not in (tmp_path / "results.md").read_text()
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    headline = cli.load_study(spec).metrics[0].name
    assert rows and math.isfinite(float(rows[0][f"{headline} mean"]))
