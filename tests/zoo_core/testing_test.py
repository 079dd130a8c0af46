"""The export helpers that let CPU tests judge the program an accelerator would run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core import testing


def _scan_sum(x):
    return jax.lax.scan(lambda c, row: (c + row.sum(), None), jnp.float32(0), x)[0]


def test_exported_program_resolves_platform_dependent_for_the_target():
    def per_platform(x):
        return jax.lax.platform_dependent(x, cpu=_scan_sum, default=jnp.sum)

    x = np.ones((16, 4), np.float32)
    assert testing.while_loops(testing.exported_program(_scan_sum, x)) == 1
    for platform in ("cuda", "tpu"):
        assert testing.while_loops(testing.exported_program(per_platform, x, platform=platform)) == 0
    assert testing.while_loops(testing.exported_program(per_platform, x, platform="cpu")) == 1
    spec = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    assert "stablehlo.reduce" in testing.exported_program(jnp.sum, spec, platform="tpu")


def test_the_golden_command_line_reports_every_file_then_fails(tmp_path, capsys):
    def check_file(path):
        if path == "broken":
            raise ValueError("not a golden")
        return [("output/y", -1.0), ("output/z", 0.5 if path == "bad" else -0.5)]

    assert testing.check_golden_files(["good"], check_file) == 0
    assert capsys.readouterr().out.splitlines() == ["good: output/y ok", "good: output/z ok",
                                                    "all within 1e-5 + 1e-5|golden|"]
    assert testing.check_golden_files(["broken", "bad", "good"], check_file) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "broken: ERROR ValueError: not a golden" and "bad: output/z FAIL" in out
    assert "good: output/z ok" in out and out[-1] == "golden check FAILED"
    (tmp_path / "g.npz").write_bytes(b"")
    parser = testing.golden_parser("python -m pkg.convert", "Goldens.", "golden files")
    assert parser.parse_args(["--check", str(tmp_path / "g.npz")]).check == [str(tmp_path / "g.npz")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--check", str(tmp_path / "missing.npz")])


def _raise(error):
    def call():
        raise error
    return call


def test_assert_refused_accepts_only_a_one_line_value_or_type_error_with_the_fragment():
    assert testing.assert_refused(_raise(ValueError("`x` must be >= 1, got 0")), "must be >= 1") \
        == "`x` must be >= 1, got 0"
    testing.assert_refused(_raise(TypeError("`x` must be an int")), "an int")
    for call, fragment, why in ((lambda: None, "x", "no ValueError or TypeError"),
                                (_raise(ValueError("`x` must be >= 1")), "`y`", "is not in the message"),
                                (_raise(ValueError("`x` bad\nsee the docs")), "bad", "not one line")):
        with pytest.raises(AssertionError, match=why):
            testing.assert_refused(call, fragment)
    with pytest.raises(KeyError):    # another exception is not a refusal: it propagates
        testing.assert_refused(_raise(KeyError("x")), "x")


def test_packed_segment_ids_cycle_the_runs_with_every_fourth_run_padding():
    ids = testing.packed_segment_ids(([2, 3], [1]), 9)
    assert ids.dtype == np.int32 and ids.shape == (2, 9)
    assert ids[0].tolist() == [0, 0, 2, 2, 2, 3, 3, 4, 4]        # row 0: run 0 (then 4, 8, ...) is padding
    assert ids[1].tolist() == [1, 2, 3, 0, 5, 6, 7, 0, 9]        # row 1: runs 3 and 7
