"""Tests of the `synthetic_var` dataset (SAMoVAR synthetic VAR experiment, samovar.md §10)."""
import numpy as np
import pytest

from zoo_core import data
from zoo_core.data import pipeline
from zoo_core.data import synthetic_var as sv

TINY = dict(num_train=48, num_validation=24)


def _config(**options):
    return sv.SyntheticVarConfig(name="t", **options)


def _var_prediction(inputs, coefficients, order):
    """sum_{j<=p} A_j x_{L_I - j} from the stored window and coefficients: [C]."""
    return sum(coefficients[j - 1] @ inputs[-j] for j in range(1, order + 1))


def _reference_series(seed, num_train, num_val, length=65, channels=2):
    """A literal transcription of the released generator (per-step loops), run sequentially."""
    rs = np.random.RandomState(seed)
    out = []
    for (lo, hi), coef, num in (((1, 3), 0.5, num_train), ((3, 5), 0.25, num_val)):
        for i in range(num):
            p = rs.randint(lo, hi)
            rs.seed(i)
            rs.rand()
            x = np.zeros((channels, length), np.float32)
            for t in range(p):
                x[:, t] = rs.normal(0, 1.0, size=(channels,))
            mats = [rs.uniform(-coef, coef, size=(channels, channels)).astype(np.float32) for _ in range(p)]
            for t in range(p, length):
                noise = rs.normal(0, 0.05, size=(channels,))
                val = np.zeros(channels, np.float32)
                for j in range(p):
                    val += mats[j].dot(x[:, t - 1 - j])
                val += noise
                x[:, t] = val
            np.clip(x, -15, 15, out=x)
            x[~np.isfinite(x)] = 0.0
            out.append((p, x.T, mats))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    builder = data.make_builder("synthetic_var", str(tmp_path_factory.mktemp("var")), **TINY)
    builder.download_and_prepare()
    return builder


def test_shapes_dtypes_through_pipeline(built):
    src = built.as_data_source("validation")
    assert len(src) == TINY["num_validation"]
    batch = next(pipeline.eval_batches(src, global_batch_size=8))
    assert batch["inputs"].shape == (8, 64, 2) and batch["inputs"].dtype == np.float32
    assert batch["target"].shape == (8, 1, 2) and batch["target"].dtype == np.float32
    assert batch["coefficients"].shape == (8, 5, 2, 2) and batch["coefficients"].dtype == np.float32
    assert batch["order"].shape == (8,) and batch["order"].dtype == np.int64
    train = next(pipeline.train_batches(built.as_data_source("train"), global_batch_size=16, seed=0))
    assert train["inputs"].shape == (16, 64, 2)


@pytest.mark.parametrize("protocol", ["paper", "code"])
def test_orders_and_coefficient_ranges(protocol):
    arrays = sv.generate(_config(protocol=protocol, num_train=400, num_validation=200))
    for split in ("train", "validation"):
        (lo, hi), half = sv.PROTOCOLS[protocol][split]
        order, coefs = arrays[split]["order"], arrays[split]["coefficients"]
        assert set(np.unique(order)) == set(range(lo, hi + 1))
        assert coefs.shape[1] == sv.max_order(protocol)
        assert np.abs(coefs).max() <= half
        beyond = np.arange(coefs.shape[1])[None, :] >= order[:, None]
        assert np.all(coefs[beyond] == 0) and np.all(np.abs(coefs[~beyond]).max(axis=(-1, -2)) > 0)


def test_stored_target_is_var_recursion_plus_noise(built):
    src = built.as_data_source("train")
    records = src.__getitems__(list(range(len(src))))
    residuals = []
    for r in records:
        window = np.concatenate([r["inputs"], r["target"]])
        if np.abs(window).max() >= 15:  # clipped series leave the recursion
            continue
        residuals.append(r["target"][0] - _var_prediction(r["inputs"], r["coefficients"], int(r["order"])))
    residuals = np.asarray(residuals)
    assert len(residuals) > 40
    # 2 * ~46 draws of N(0, 0.05^2): the sample std is within 0.035..0.065 with overwhelming probability.
    assert 0.035 < residuals.std() < 0.065


def test_zero_noise_target_equals_recursion():
    arrays = sv.generate(_config(noise_std=0.0, num_train=300, num_validation=100))
    for split in ("train", "validation"):
        a = arrays[split]
        for x, y, coefs, p in zip(a["inputs"], a["target"], a["coefficients"], a["order"]):
            if np.abs(np.concatenate([x, y])).max() >= 15:
                continue
            pred = _var_prediction(x.astype(np.float64), coefs.astype(np.float64), int(p))
            np.testing.assert_allclose(y[0], pred, rtol=1e-5, atol=1e-6)


def test_code_protocol_reproduces_released_generator():
    # Order counts of the regenerated data, notebook seed 2025 (samovar.md §10).
    arrays = sv.generate(_config(protocol="code"))
    assert dict(zip(*np.unique(arrays["train"]["order"], return_counts=True))) == {1: 10059, 2: 9941}
    assert dict(zip(*np.unique(arrays["validation"]["order"], return_counts=True))) == {3: 993, 4: 1007}
    # The series themselves, against a literal per-step transcription of the reference.
    small = sv.generate(_config(protocol="code", num_train=30, num_validation=10))
    reference = _reference_series(2025, 30, 10)
    ours = [(s, i) for s in ("train", "validation") for i in range(len(small[s]["order"]))]
    for (split, i), (p, series, mats) in zip(ours, reference):
        a = small[split]
        assert a["order"][i] == p
        np.testing.assert_array_equal(a["coefficients"][i][:p], np.stack(mats))
        np.testing.assert_allclose(np.concatenate([a["inputs"][i], a["target"][i]]), series,
                                   rtol=1e-5, atol=1e-6)


def test_deterministic_and_seeded():
    a = sv.generate(_config(num_train=20, num_validation=5))
    b = sv.generate(_config(num_train=20, num_validation=5))
    c = sv.generate(_config(num_train=20, num_validation=5, seed=7))
    for k in a["train"]:
        np.testing.assert_array_equal(a["train"][k], b["train"][k])
    assert not np.array_equal(a["train"]["order"], c["train"]["order"])


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="no option"):
        data.make_builder("synthetic_var", str(tmp_path), orders=3)
    with pytest.raises(ValueError, match="protocol"):
        data.make_builder("synthetic_var", str(tmp_path), protocol="both")
    with pytest.raises(ValueError, match="num_train"):
        data.make_builder("synthetic_var", str(tmp_path), num_train=0)
    with pytest.raises(ValueError, match="noise_std must be a finite number >= 0"):
        data.make_builder("synthetic_var", str(tmp_path), noise_std=float("nan"))
    with pytest.raises(ValueError, match="clip_value a finite number > 0"):
        data.make_builder("synthetic_var", str(tmp_path), clip_value=float("inf"))
    with pytest.raises(ValueError, match=r"validation_seed_offset must be an int in \[0, 2\*\*32\)"):
        data.make_builder("synthetic_var", str(tmp_path), validation_seed_offset=-1)
    with pytest.raises(ValueError, match=r"validation_seed_offset \+ num_validation - 1 must stay below"):
        data.make_builder("synthetic_var", str(tmp_path), validation_seed_offset=2**32 - 1)
