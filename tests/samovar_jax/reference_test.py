"""Parity with goldens recorded from the reference PyTorch code (tests/testdata/samovar/, README there):
conversion of the official state_dicts, every output in eval and train mode, and the CLI."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from samovar_jax import convert
from tests.environment import command_env
from zoo_core.testing import TESTDATA, Golden

GOLDENS = sorted((TESTDATA / "samovar").glob("*.npz"))
REPO_ROOT = pathlib.Path(convert.__file__).resolve().parent.parent


def test_goldens_present():
    assert [p.name for p in GOLDENS] == ["fixedvar.npz", "lintrans.npz", "samovar_padded.npz",
                                         "samovar_synthetic.npz"]


@pytest.mark.reference
@pytest.mark.parametrize("path", GOLDENS, ids=lambda p: p.stem)
def test_golden_parity(path):
    results = convert.check_golden(path)   # jit: each golden has its own shapes
    assert {r.name for r in results} == {"forecast", "forecast_train", "ar_loss"}
    for r in results:
        assert r.ok, f"{path.name}: {r.name} [{r.mode}] max|diff| {r.max_abs:.3e} exceeds the golden criterion"


@pytest.mark.reference
def test_cli_checks_all_goldens():
    env = command_env()
    proc = subprocess.run([sys.executable, "-m", "samovar_jax.convert", "--check", *map(str, GOLDENS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "max|diff|" in line]
    assert len(lines) == 3 * len(GOLDENS) and all(line.endswith(" ok") for line in lines), proc.stdout


def test_cli_fails_on_a_wrong_golden(tmp_path, capsys):
    g = np.load(TESTDATA / "samovar" / "lintrans.npz")
    data = {k: g[k] for k in g.files}
    data["output/forecast"] = data["output/forecast"] + 1e-3         # beyond 1e-5 + 1e-5 |golden|
    bad = tmp_path / "bad.npz"
    np.savez(bad, **data)
    assert convert.main(["--check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "forecast        [eval ]" in out and "FAIL" in out and "forecast_train  [train]" in out


def test_cli_names_a_file_that_is_not_a_golden_and_checks_the_rest(tmp_path, capsys):
    (tmp_path / "text.npz").write_text("not an archive")
    np.savez(tmp_path / "no_meta.npz", a=np.ones(3))
    files = [tmp_path / "text.npz", tmp_path / "no_meta.npz", TESTDATA / "samovar" / "lintrans.npz"]
    assert convert.main(["--check", *map(str, files)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"{files[0]}: ERROR ValueError: {files[0]} is not a golden file: not an .npz archive" in lines
    assert f"{files[1]}: ERROR ValueError: {files[1]} is not a golden file: it has no 'meta' record " \
           "(tests/testdata/README.md)" in lines
    assert any(line.startswith(f"{files[2]}: ") and line.endswith(" ok") for line in lines), lines


def test_conversion_maps_the_reference_keys():
    g = Golden(TESTDATA / "samovar" / "samovar_padded.npz")
    model = convert.model_from_meta(g.meta)
    params = convert.convert_state_dict(g.params, model)              # pns.* accepted (no effect)
    assert params["var"]["layer_01"]["query"]["kernel"].shape == (32, 32)
    np.testing.assert_array_equal(params["var"]["layer_00"]["query"]["kernel"],
                                  g.params["transformer.attn.0.q_proj.weight"].T)
    np.testing.assert_array_equal(params["embedding"]["type"], g.params["pos_emb_2"][0, 0])


def test_reference_config_mapping():
    meta = Golden(TESTDATA / "samovar" / "fixedvar.npz").meta
    assert convert.kind_from_meta(meta) == "fixedvar"
    kw = convert.model_kwargs_from_reference(meta["constructor_args"]["configs"], "fixedvar")
    assert kw == dict(kind="fixedvar", variant="paper", num_channels=2, input_len=40, patch_len=2, num_targets=0,
                      width=32, num_heads=2, num_layers=2, mlp_ratio=4, dropout=0.0, univariate=False)


def test_leading_broadcast_axes_are_dropped_only_down_to_the_parameter_rank():
    """A single-target model's channel table keeps its size-1 channel axis ([1, C_t=1, 2N, d] -> [1, 2N, d])."""
    ref = np.zeros((1, 1, 26, 32), np.float32)
    assert convert._transform(ref, convert._SQUEEZE, None, 3).shape == (1, 26, 32)
    assert convert._transform(ref, convert._SQUEEZE, None, 2).shape == (26, 32)
