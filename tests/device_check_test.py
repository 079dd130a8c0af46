"""The one-call device check (`benchmarks.device_check`): every phase planned and recorded with --tiny on
the CPU, a test failure recorded by name and message, an item skipped for its budget with its estimate,
and the pure parts (junit parsing, the scaling summary, the budget check) on fixed inputs.

Timings here mean nothing (tiny shapes, a shared CI machine); only the records are checked.
"""
import json
import pathlib
import subprocess
import sys
import time
import types

import pytest

from tests.environment import command_env

REPO = pathlib.Path(__file__).resolve().parent.parent

FAILING_TEST = '''
def test_passes():
    assert 1 + 1 == 2


def test_fails():
    assert 1 + 1 == 3, "arithmetic is broken"
'''


def test_the_check_runs_tests_that_exist():
    """The GPU check's test targets name files and tests of this tree (tests move between files)."""
    from benchmarks import device_check

    for target in device_check.TEST_FILES + device_check.TINY_TEST_FILES:
        path, _, name = target.partition("::")
        assert (REPO / path).is_file(), target
        assert not name or f"def {name}(" in (REPO / path).read_text(), target


def test_tiny_check_plans_and_records_every_phase(tmp_path):
    from benchmarks import device_check

    failing = tmp_path / "one_fails_test.py"
    failing.write_text(FAILING_TEST)
    out = tmp_path / "out" / "dc.json"
    cmd = [sys.executable, "-m", "benchmarks.device_check", "--tiny", "--profile", "--configs", "agf_listops",
           "--bisect_forms", "embed", "--scaling_scripts", "agf_scaling", "--scaling_dtypes", "float32",
           "--scaling_budget_s", "60", "--peers_budget_s", "1", "--reference_runs_budget_s", "2", "--uea_seeds", "1",
           "--tests", f"{device_check.TINY_TEST_FILES[0]},{failing}",
           "--work_dir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=command_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]   # the failing test fails the check
    summary = json.loads(out.read_text())
    ph = summary["phases"]
    assert summary["tiny"] is True and summary["ok"] is False
    assert list(ph) == ["bounds", "steps", "bisect_bf16", "tests", "scaling", "peers", "profile", "throughput",
                        "reference_runs"]
    assert all("wall_s" in p and "budget_s" in p and "started_s" in p for p in ph.values())
    assert ph["bounds"]["peak_gflops"] > 0 and ph["bounds"]["peak_gflops_bf16"] > 0
    # Steps: both dtypes, compile and run time, the bf16 / f32 ratio.
    steps = ph["steps"]
    for dtype in ("float32", "bfloat16"):
        rec = steps["records"][f"agf_listops/{dtype}"]
        assert rec["status"] == "ok" and rec["median_s"] > 0 and rec["compile_s"] > 0 and rec["estimate_s"] > 0
    assert steps["bf16_over_f32"]["agf_listops"] > 0 and steps["compile_s"] > 0 and steps["run_s"] > 0
    # The bisect: f32 and bf16 from the steps phase (same process), the plain embedding timed beside them.
    bisect = ph["bisect_bf16"]["records"]
    assert list(bisect) == ["float32", "bfloat16", "bfloat16+plain:embed"]
    assert bisect["float32"]["reused_from"] == "steps" and bisect["float32"]["over_f32"] == 1.0
    plain = bisect["bfloat16+plain:embed"]
    assert plain["status"] == "ok" and plain["plain"] == ["embed"] and plain["over_f32"] > 0 and plain["over_bf16"] > 0
    # Tests: one subprocess per target; the failure by name and message.
    tests = ph["tests"]
    assert tests["status"] == "failed" and tests["counts"] == dict(passed=2, failed=1, errors=0, skipped=0)
    (failure,) = tests["failures"]
    assert failure["test"].endswith("::test_fails") and "arithmetic is broken" in failure["message"]
    assert failure["file"] == str(failing) and tests["files"][str(failing)]["status"] == "failed"
    # Scaling: time per token and its ratio to the first N, per case that ran.
    scaling = ph["scaling"]["scripts"]["agf_scaling/float32"]
    assert ph["scaling"]["lengths"] == [64, 128] and scaling["status"] == "ok", scaling
    agf = scaling["cases"]["agf"]
    assert agf["largest_n"] >= 64 and agf["ratio_to_first"]["64"] == 1.0 and agf["s_per_token"]["64"] > 0
    # Skipped for budget, with the estimate: never started.
    assert ph["peers"]["status"] == "skipped" and ph["peers"]["skipped_for"] == "budget"
    assert ph["peers"]["estimate_s"] > ph["peers"]["left_s"]
    # The training command's own steps/s beside the bare step.
    run = ph["throughput"]["runs"]["agf_listops"]
    assert run["status"] == "ok" and run["steps"] == 20 and run["train_steps_per_s"] > 0 and run["train_over_bare"] > 0
    runs = ph["reference_runs"]["runs"]
    assert runs["agf_listops_reference"]["skipped_for"] == "budget" and runs["agf_listops_reference"]["estimate_s"] > 2
    assert runs["agf_listops_reference"]["bare_steps_per_s"] > 0
    assert "no step time" in runs["listops_softmax_control"]["reason"]
    assert runs["uea_japanese_vowels_seed0"]["skipped_for"] == "budget"
    # The profile: one archive beside the summary (what a device run brings back).
    profile = ph["profile"]
    assert profile["status"] == "ok" and profile["archive_bytes"] > 0 and profile["files"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["dc.json", "dc.txt", "profile.tar.gz"]
    assert "FAILED" in proc.stdout and "device check" in proc.stdout


FAIL_THEN_HANG = '''
import time


def test_fails_first():
    assert 2 + 2 == 5, "counting is broken"


def test_hangs():
    time.sleep(120)
'''


def test_a_file_killed_at_its_timeout_keeps_its_failures_messages(tmp_path):
    from benchmarks import device_check

    hangs = tmp_path / "hangs_test.py"
    hangs.write_text(FAIL_THEN_HANG)
    args = types.SimpleNamespace(tests=[str(hangs)], tiny=True, test_precision="highest", test_file_timeout_s=8.0,
                                 compile_cache=None)
    check = device_check.Check(args, device_check.Clock(100.0), tmp_path / "work", tmp_path / "dc.json",
                               dict(phases={}))
    out = device_check.phase_tests(check)
    rec = out["files"][str(hangs)]
    assert rec["status"] == "timeout" and rec["rc"] == "timeout" and rec["counts"]["failed"] == 1
    (failure,) = out["failures"]
    assert failure["test"].endswith("hangs_test.py::test_fails_first") and "counting is broken" in failure["message"]
    assert json.loads((tmp_path / "dc.json").read_text())["phases"]["tests"]["failures"] == out["failures"]


def test_junit_results_give_counts_and_each_failure(tmp_path):
    from benchmarks import device_check

    xml = ('<testsuites><testsuite><testcase classname="t" name="a"/>'
           '<testcase classname="t" name="b"><failure message="assert 2 == 3">trace</failure></testcase>'
           '<testcase classname="t" name="c"><error message="boom"/></testcase>'
           '<testcase classname="t" name="d"><skipped/></testcase></testsuite></testsuites>')
    (tmp_path / "j.xml").write_text(xml)
    res = device_check.junit_results(tmp_path / "j.xml")
    assert res["counts"] == dict(passed=1, failed=1, errors=1, skipped=1)
    assert [(f["test"], f["kind"], f["message"]) for f in res["failures"]] == [
        ("t::b", "failed", "assert 2 == 3\ntrace"), ("t::c", "errors", "boom")]


def test_a_killed_pytest_log_still_names_its_finished_tests():
    from benchmarks import device_check

    log = ("tests/x_test.py::test_a PASSED                 [ 50%]\n"
           "tests/x_test.py::test_b[1-2] FAILED           [100%]\nsomething else\n")
    assert device_check._seen_in_log(log) == {"tests/x_test.py::test_a": "PASSED",
                                              "tests/x_test.py::test_b[1-2]": "FAILED"}


def test_scaling_summary_ratios_per_token_and_causal_over_noncausal():
    from benchmarks import device_phases

    records = [dict(case="agf", n=n, status="ok", median_s=s) for n, s in ((100, 1.0), (200, 2.6), (400, 4.0))]
    records += [dict(case="agf_causal", n=100, status="ok", median_s=3.0),
                dict(case="agf_causal", n=200, status="skipped", median_s=None, reason="budget")]
    out = device_phases.summarise_scaling(records, "agf_scaling")
    agf = out["cases"]["agf"]
    assert agf["s_per_token"] == pytest.approx({100: 0.01, 200: 0.013, 400: 0.01})
    assert agf["ratio_to_first"] == pytest.approx({100: 1.0, 200: 1.3, 400: 1.0})
    assert agf["max_ratio_to_first"] == pytest.approx(1.3) and agf["largest_n"] == 400
    assert out["cases"]["agf_causal"]["stopped"] == "n=200: skipped (budget)"
    assert out["causal_over_noncausal"] == {"agf_causal/agf": {100: pytest.approx(3.0)}}


def test_an_item_past_the_budget_is_skipped_with_its_estimate():
    from benchmarks import device_check

    clock = device_check.Clock(100.0)
    check = device_check.Check(types.SimpleNamespace(), clock, REPO, REPO / "unused.json", {})
    check.phase_deadline = time.monotonic() + 10.0
    rec = {}
    assert check.fits(rec, 5.0) and rec == dict(estimate_s=5.0)
    rec = {}
    assert not check.fits(rec, 30.0)
    assert rec["status"] == "skipped" and rec["skipped_for"] == "budget" and rec["estimate_s"] == 30.0
    assert 0 < rec["left_s"] <= 10.0 and "estimated 30 s > " in rec["reason"]
