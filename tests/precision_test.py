"""The bfloat16 precision envelope as a gate: every mechanism of the registry and SAMoVAR's VAR chain, in
bfloat16 compute with float32 parameters, stays within `BOUND` of a float64 reference with the same
parameters and inputs, in its outputs, its input gradients and every parameter gradient that is not
mathematically ~0 (`benchmarks.precision`, whose docstring defines the relative error; the table at
T = 256, 8K and 64K is in benchmarks/RESULTS.md).

One form per mechanism and mode: the chunked form of a causal mechanism that has one (the form of long
sequences, its state crossing chunks: 4 chunks here), else its parallel form; the forms agree in float32
by each package's own tests.
"""
import functools
import json

import numpy as np
import pytest

from benchmarks import precision
from zoo_core import attention

T, CHUNK, BATCH = 128, 32, 2
# Relative error (||bf16 - float64|| / ||float64||) allowed for every mechanism, Reformer included: its
# hash reads a float32 projection, so the layer's own rounding no longer moves buckets.
BOUND = 2e-2


def _gated_cases() -> list[precision.Case]:
    by_mode: dict[tuple[str, str], list[precision.Case]] = {}
    for case in precision.cases():
        by_mode.setdefault((case.name, case.mode), []).append(case)
    return [next((c for c in forms if c.form == "chunked"), forms[0]) for forms in by_mode.values()]


CASES = _gated_cases()


@functools.lru_cache(maxsize=None)
def _record(case: precision.Case) -> dict:
    return precision.measure(case, T, batch=BATCH, chunk_size=CHUNK)


def test_every_mechanism_and_mode_is_gated():
    names = {c.name for c in CASES}
    assert names == set(attention.names()) | {precision.VAR_CHAIN}
    for name in attention.names("causal"):
        assert any(c.name == name and c.mode == "causal" for c in CASES), name
    for name in attention.names("self"):
        assert any(c.name == name and c.mode == "full" for c in CASES), name


@pytest.mark.parametrize("case", CASES, ids=[c.label.replace(" ", "-") for c in CASES])
def test_bfloat16_is_within_the_envelope(case):
    r = _record(case)
    assert r["status"] == "ok", r
    # The layer did compute in bfloat16 (a dtype that did not reach it would give float32's 1e-7).
    assert r["output"] > 1e-4, r["output"]
    bad = {k: r[k] for k in ("output", "inputs", "params") if not r[k] <= BOUND}
    bad.update({f"leaf {k}": v for k, v in r["leaves"].items() if not v <= BOUND})
    assert not bad, f"{case.label}: beyond {BOUND:g} of float64: {bad}"
    assert 1 <= r["leaves_counted"] <= r["leaves_total"]


def test_a_mathematically_zero_gradient_is_not_counted():
    """Softmax's key bias adds one constant to every logit of a row, which the softmax removes: its
    gradient is 0 up to rounding, and the threshold leaves it out."""
    r = _record(precision.Case("softmax", "full", "parallel"))
    assert "key/bias" not in r["leaves"] and "query/kernel" in r["leaves"]
    assert r["leaves_counted"] == r["leaves_total"] - 1


def test_param_errors_counts_leaves_above_the_fraction_and_pools_them():
    ref = {"a": np.array([3.0, 4.0]), "b": np.array([1e-4, 0.0]), "c": np.array([0.0, 1.0])}
    got = {"a": np.array([3.0, 4.5]), "b": np.array([5.0, 5.0]), "c": np.array([0.0, 1.0])}
    e = precision.param_errors(got, ref)
    assert set(e["leaves"]) == {"a", "c"} and e["leaves_counted"] == 2 and e["leaves_total"] == 3
    assert e["leaves"]["a"] == pytest.approx(0.1) and e["leaves"]["c"] == 0.0
    assert e["params"] == pytest.approx(0.5 / np.sqrt(26.0))
    assert e["worst_leaf"] == pytest.approx(0.1) and e["worst_leaf_name"] == "a"
    assert precision.rel(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == float("inf")


def test_the_script_writes_its_records_and_table(tmp_path, capsys):
    out = tmp_path / "precision.json"
    records = precision.main(["--lengths", "32", "--long_lengths", "none", "--names", "linformer", "--batch", "1",
                              "--out", str(out)])
    assert [(r["name"], r["mode"], r["form"], r["t"], r["status"]) for r in records] == [
        ("linformer", "full", "parallel", 32, "ok")]
    data = json.loads(out.read_text())
    assert data["records"] == json.loads(json.dumps(records)) and data["meta"]["leaf_fraction"] == precision.LEAF_FRACTION
    table = capsys.readouterr().out
    assert "| mechanism | mode | form | T = 32 |" in table and "| linformer | full | parallel | " in table


def test_the_long_lengths_run_the_causal_chunked_linear_forms_only():
    args = precision.parse_args(["--lengths", "256", "--long_lengths", "65536"])
    long = [(c.name, c.mode, c.form) for c, t in precision.plan(args) if t == 65536]
    assert sorted(long) == sorted(precision.LONG_FORMS)


@pytest.mark.parametrize("argv,expected", [
    ("--lengths 0", "argument --lengths: must be a comma-separated list of integers >= 1"),
    ("--names agf,nosuch", "unknown --names ['nosuch']; choose from ['agf'"),
    ("--budget_s -1", "argument --budget_s: must be a finite number > 0"),
    ("--out {dir}", "is an existing directory; expected a file"),
])
def test_a_bad_argument_is_a_usage_error(tmp_path, capsys, argv, expected):
    expected = expected.format(dir=tmp_path)
    with pytest.raises(SystemExit) as e:
        precision.parse_args(argv.format(dir=tmp_path).split())
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert e.value.code == 2 and len(errors) == 1 and expected in errors[0], errors
