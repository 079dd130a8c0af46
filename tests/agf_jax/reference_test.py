"""Parity with the goldens recorded from jeongwhanchoi/agf (tests/testdata/agf, README there)."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from agf_jax import convert
from agf_jax.layers import AGFAttention
from tests.environment import command_env
from zoo_core.testing import TESTDATA, Golden

GOLDENS = sorted((TESTDATA / "agf").glob("*.npz"))
REPO = pathlib.Path(__file__).resolve().parents[2]


def test_goldens_present():
    assert len(GOLDENS) >= 5, GOLDENS


@pytest.mark.reference
@pytest.mark.parametrize("path", GOLDENS, ids=lambda p: p.stem)
def test_golden(path):
    result = convert.check_golden(path)
    golden = Golden(path)
    assert set(result) == set(golden.outputs)
    bad = {name: r for name, r in result.items() if r[1] > 0}
    assert not bad, f"outside |port - golden| <= 1e-5 + 1e-5|golden|: {bad}"


@pytest.mark.reference
def test_cli_check_subprocess():
    # One run of the CLI as a user would (cwd = repo root so `-m` finds agf_jax). One file keeps
    # it short; every golden runs through the same code in test_golden.
    files = [TESTDATA / "agf" / "agf_lra_model.npz"]
    env = command_env()
    proc = subprocess.run([sys.executable, "-m", "agf_jax.convert", "--check", *map(str, files)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "max_abs_diff=" in ln]
    n_outputs = sum(len(Golden(p).outputs) for p in files)
    assert len(lines) == n_outputs and all(ln.endswith(" ok") for ln in lines), proc.stdout


@pytest.mark.reference
def test_cli_fails_on_a_wrong_golden(tmp_path, capsys):
    src = TESTDATA / "agf" / "agf_uea_attention_jacobi_fixI.npz"
    with np.load(src) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["output/y"] = arrays["output/y"] + np.float32(1e-3)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    assert convert.main(["--check", str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def _uea_layer_sd():
    golden = Golden(TESTDATA / "agf" / "agf_uea_attention_jacobi_fixI.npz")
    return golden, AGFAttention(num_heads=3, head_dim=8, order=6, alpha=1.5, beta=-1.5)


def test_convert_maps_the_reference_attention():
    golden, layer = _uea_layer_sd()
    params = convert.convert_attention(golden.params, layer)
    assert params["query"]["kernel"].shape == (24, 3, 8)
    assert params["theta"].shape == (6,) and "theta_0" not in params


def test_convert_maps_the_reference_model():
    golden = Golden(TESTDATA / "agf" / "agf_lra_model.npz")
    _, model = convert.module_from_meta(golden.meta)
    variables = convert.convert(golden.params, model)
    assert variables["params"]["encoder"]["block_01"]["attention"]["theta"].shape == (4,)


def test_softmax_attention_round_trip():
    # The baseline layer converts from the same reference names (no Sigma projection, no thetas).
    from agf_jax.layers import SoftmaxAttention

    h, d, e = 2, 3, 5
    rng = np.random.default_rng(0)
    sd = {}
    for name in ("query_projection", "key_projection", "value_projection"):
        sd[f"{name}.weight"] = rng.normal(size=(h * d, e)).astype(np.float32)
        sd[f"{name}.bias"] = rng.normal(size=(h * d,)).astype(np.float32)
    sd["out_projection.weight"] = rng.normal(size=(e, h * d)).astype(np.float32)
    sd["out_projection.bias"] = rng.normal(size=(e,)).astype(np.float32)
    layer = SoftmaxAttention(num_heads=h, head_dim=d)
    params = convert.convert(sd, layer)["params"]
    assert set(params) == {"query", "key", "value", "out"}
    # Head split (B, T, H*D) -> (B, T, H, D): kernel[:, h, d] is weight row h*D + d.
    np.testing.assert_array_equal(np.asarray(params["key"]["kernel"])[:, 1, 2], sd["key_projection.weight"][5])
    np.testing.assert_array_equal(np.asarray(params["out"]["kernel"])[1, 0], sd["out_projection.weight"][:, 3])
    with pytest.raises(ValueError, match="Sigma_projection"):
        convert.convert_attention({**sd, "Sigma_projection.weight": np.zeros((6, 5))}, layer)
