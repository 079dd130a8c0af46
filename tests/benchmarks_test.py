"""Smoke tests of the peers benchmark (`--tiny`, CPU, subprocesses; the device check's are in
tests/device_check_test.py), and the
bad arguments of every script (benchmarks, the golden converters, the notebook runner): usage errors,
parsed in-process.

Timings printed here mean nothing (tiny shapes, a shared CI machine); only the structure is checked.
"""
import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from tests.environment import command_env

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(args, tmp_path, timeout=600):
    # One device, as a user runs the scripts; the tests' fast compiles (the timings are not checked).
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=command_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_peers_tiny_times_our_side_only_without_sources(tmp_path):
    out = tmp_path / "peers.json"
    stdout = _run(["benchmarks/peers.py", "--tiny", "--cases", "agf_listops", "--agf_src", "", "--samovar_src", "",
                   "--steps", "2", "--rounds", "2", "--warmup", "1", "--out", str(out)], tmp_path)
    data = json.loads(out.read_text())
    (step,) = data["records"]
    assert step["case"] == "agf_listops" and step["status"] == "ok"
    assert "our side only" in step["note"] and "ratio_official_over_ours" not in step
    assert step["ours"]["median_s"] > 0 and len(step["ours"]["all_s"]) == 4
    assert len(step["ours"]["round_medians"]) == 2 and step["ours"]["roofline"]["gflops"] > 0
    assert len(data["meta"]["load_before"]) == 3 and len(data["meta"]["load_after"]) == 3
    # Bounds before the case and after it; the roofline uses the best of each.
    seen = data["meta"]["bounds_measured"]
    assert len(seen) == 2 and data["meta"]["bounds"]["peak_gbps"] == max(b["peak_gbps"] for b in seen)
    for text in ("load average before:", "off/ours", "agf_listops", "our side only", "GFLOP/s",
                 "best of 2 measurements"):
        assert text in stdout


def test_peers_ratio_per_round_pairs_each_rounds_medians():
    from benchmarks import peers
    timing = {"official": {"round_medians": [2.0, 3.0, 1.5]}, "ours": {"round_medians": [1.0, 1.0, 0.5]}}
    assert peers.round_ratios(timing) == [2.0, 3.0, 3.0]


def test_peers_uea_timing_parsers(tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import peers
    finally:
        sys.path.remove(str(REPO))
    log = ("Epoch runtime: 0.0 hours, 0.0 minutes, 3.5 seconds\n"
           "Validation runtime: 0.0 hours, 0.0 minutes, 1.25 seconds\n"
           "Epoch runtime: 0.0 hours, 1.0 minutes, 2.0 seconds\n")
    assert peers._runtimes(log, "Epoch") == [3.5, 62.0]
    assert peers._runtimes(log, "Validation") == [1.25]
    # 10 steps per epoch; evaluations after epochs 1, 2, 4 (steps 10, 20, 40); one log per epoch.
    windows = {10: 9.0, 20: 3.0, 30: 4.0, 40: 3.0, 50: 4.0}   # seconds per epoch window
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "train/steps_per_second": 10 / w}) + "\n" for s, w in windows.items()))
    times = peers._our_uea_times(tmp_path, 10, {10, 20, 40})
    # Windows after a plain epoch: step 40 (after 30) -> 3 s; after an eval: 20, 30, 50 -> 3, 4, 4.
    assert times["epoch_train_s"] == 3.0 and times["eval_s"] == 1.0 and times["first_epoch_s"] == 9.0


def test_memory_options_tiny_records_memory_and_time_per_variant(tmp_path):
    out = tmp_path / "memory.json"
    stdout = _run(["benchmarks/memory_options.py", "--tiny", "--configs", "samovar_fig4", "--variants",
                   "f32,bf16+remat", "--out", str(out)], tmp_path)
    data = json.loads(out.read_text())
    assert [(r["config"], r["variant"]) for r in data["records"]] == [("samovar_fig4", "f32"),
                                                                       ("samovar_fig4", "bf16+remat")]
    for r in data["records"]:
        assert r["temp_bytes"] > 0 and r["total_bytes"] >= r["temp_bytes"]
        assert r["median_s"] > 0 and r["time_over_ref"] > 0
    assert "| samovar_fig4 | bf16+remat |" in stdout and "load average" in stdout


# (script, arguments, text of the one `error:` line; '{file}' an existing file, '{dir}' a folder). Parsed
# in-process: nothing is measured.
BAD_ARGUMENTS = [
    ("peers", "--steps 0", "argument --steps: must be an integer >= 1, got '0'"),
    ("peers", "--warmup -1", "argument --warmup: must be an integer >= 0, got '-1'"),
    ("peers", "--uea_timeout nan", "argument --uea_timeout: must be a finite number > 0, got 'nan'"),
    ("peers", "--out {dir}", "is an existing directory; expected a file"),
    ("peers", "--cases samovar_fig4 --samovar_src {dir}/nowhere",
     "--samovar_src {dir}/nowhere has no models/AutoregressiveAlignment.py: give the root of a checkout of "
     "github:LJC-FVNR/Structural-Aligned-Mixture-of-VAR (case samovar_fig4)"),
    ("peers", "--cases agf_listops --agf_src {dir}", "--agf_src {dir} has no AGF_LRA/model_wrapper.py"),
    ("device_check", "--tiny --max_n 0", "argument --max_n: must be an integer >= 1"),
    ("device_check", "--tiny --budget_s -5", "argument --budget_s: must be a finite number > 0"),
    ("device_check", "--tiny --out {file}/summary.json", "is a file, so no directory can be made under it"),
    ("device_check", "--tiny --work_dir {file}", "is an existing file; expected a directory"),
    ("memory_options", "--tiny --steps -1", "argument --steps: must be an integer >= 1, got '-1'"),
    ("matmul_peak", "--sizes 512,abc", "argument --sizes: must be a comma-separated list of integers >= 1"),
    ("matmul_peak", "--out_dir {file}", "is an existing file; expected a directory"),
    ("softmax_attention", "--lengths 0", "argument --lengths: must be a comma-separated list of integers >= 1"),
    ("softmax_attention", "--max_gib -1", "argument --max_gib: must be a finite number > 0"),
    ("softmax_attention", "--heads 0", "argument --heads: must be an integer >= 1"),
    ("agf_scaling", "--chunk_size 0", "argument --chunk_size: must be an integer >= 1"),
    ("agf_scaling", "--lengths 64,32", "--lengths must be increasing, got 64,32"),
    ("agf_scaling", "--cases agf,softmax,agf", "--cases names agf more than once"),
    ("peers", "--cases lintrans,lintrans", "--cases names lintrans more than once"),
    ("peers", "--cases nosuch", "unknown --cases ['nosuch']; choose from ['agf_listops'"),
    ("peers", "--cases ,", "--cases names none of ['agf_listops'"),
    ("device_check", "--tiny --phases steps,nosuch", "unknown --phases ['nosuch']; choose from ['bounds', "),
    ("device_check", "--tiny --dtypes float16", "unknown --dtypes ['float16']; choose from ['float32'"),
    ("device_check", "--tiny --bisect_forms embed,nosuch", "unknown --bisect_forms ['nosuch']; choose from ['embed'"),
    ("device_check", "--tiny --lengths 64,0", "argument --lengths: must be a comma-separated list of integers >= 1"),
    ("peers", "--precisions fp32,amp", "--precisions fp32,amp: only fp32 runs on --device cpu"),
    ("peers", "--device cuda --precisions fp16", "unknown --precisions ['fp16']; choose from ['fp32', 'tf32', 'amp']"),
    ("device_check", "--tiny --configs agf_listops,agf_listops", "--configs names agf_listops more than once"),
    ("memory_options", "--tiny --variants f32,fp8", "unknown --variants ['fp8']; choose from ['f32'"),
    ("samovar_scaling", "--cases ,", "--cases names none of"),
    ("softmax_attention", "--lengths 64,64", "--lengths must be increasing, got 64,64"),
    ("htgn_scaling", "--window -1", "argument --window: must be an integer >= 0"),
    ("samovar_scaling", "--repeats 0", "argument --repeats: must be an integer >= 1"),
    ("agf_jax.convert", "--check {dir}/none.npz", "argument --check: '{dir}/none.npz' does not exist; expected a file"),
    ("samovar_jax.convert", "--check {dir}", "argument --check: '{dir}' is a directory; expected a file"),
    ("notebooks.run_notebooks", "--timeout 0", "argument --timeout: must be an integer >= 1"),
    ("notebooks.run_notebooks", "--output-dir {file}", "--output-dir '{file}' is an existing file"),
    # A folder that permissions call writable but that takes no new entries (procfs; root may "write" there).
    ("notebooks.run_notebooks", "--output-dir /proc/zoo_nb", "--output-dir '/proc/zoo_nb' cannot be made: '/proc' "
     "takes no new entries"),
    ("notebooks.run_notebooks", "--platform nosuch", "--platform 'nosuch': JAX cannot start it here"),
    ("peers", "--out /proc/zoo_peers/p.json", "--out '/proc/zoo_peers/p.json' cannot be made: '/proc' takes no new"),
    ("attention_scaling", "--cases linformer_causal", "unknown --cases ['linformer_causal']; choose from ['agf'"),
    ("attention_scaling", "--chunk_size 0", "argument --chunk_size: must be an integer >= 1"),
]


def test_a_leading_tilde_in_a_script_path_is_the_home_folder(tmp_path, monkeypatch):
    from agf_jax import convert
    from benchmarks import matmul_peak

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "g.npz").write_bytes(b"")
    assert matmul_peak.parse_args(["--out_dir=~/results"]).out_dir == str(tmp_path / "results")
    assert convert.parse_args(["--check", "~/g.npz"]).check == [str(tmp_path / "g.npz")]


@pytest.mark.parametrize("script,args,expected", BAD_ARGUMENTS, ids=[f"{s} {a}" for s, a, _ in BAD_ARGUMENTS])
def test_a_bad_script_argument_is_a_usage_error(tmp_path, capsys, script, args, expected):
    (tmp_path / "file").write_text("")
    argv = args.format(file=tmp_path / "file", dir=tmp_path).split()
    expected = expected.format(file=tmp_path / "file", dir=tmp_path)
    if script.startswith("notebooks."):   # a script folder, not a package
        spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "notebooks" / "run_notebooks.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(script if "." in script else f"benchmarks.{script}")
    with pytest.raises(SystemExit) as e:
        module.parse_args(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line or line.startswith("error: ")]
    assert e.value.code == 2 and len(errors) == 1 and expected in errors[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]     # nothing made


def test_attention_scaling_tiny_measures_every_registered_mechanism(tmp_path, capsys):
    """The registry-driven sweep: a case per self-attention name and per causal one, each record
    with a time and XLA's compiled-memory estimate (two cases run here, at 16 tokens)."""
    from benchmarks import attention_scaling
    from zoo_core import attention

    cases = attention_scaling.cases()
    assert set(cases) == set(attention.names("self")) | {f"{n}_causal" for n in attention.names("causal")}
    records = attention_scaling.main(["--lengths", "16", "--cases", "linformer,agf_causal", "--repeats", "1",
                                      "--ref_n", "64", "--heads", "2", "--head_dim", "8", "--chunk_size", "4",
                                      "--out_dir", str(tmp_path)])
    assert [(r.case, r.n, r.status) for r in records] == [("linformer", 16, "ok"), ("agf_causal", 16, "ok")]
    assert all(r.median_s > 0 and r.est_bytes > 0 for r in records)
    assert records[0].info["options"] == {"max_length": 16} and records[1].info["options"] == {"chunk_size": 4}
    data = json.loads((tmp_path / "attention_scaling.json").read_text())
    assert len(data["records"]) == 2 and len(data["meta"]["load_before"]) == 3
    assert "load average before:" in capsys.readouterr().out
