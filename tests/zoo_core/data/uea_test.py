"""Tests of zoo_core.data.uea: the .ts parser, mvts-style preprocessing and the TFDS builder."""
import numpy as np
import pytest

from zoo_core import data as zoo_data
from zoo_core.data import pipeline, uea

TRAIN_TS = """# A toy file: 2 dimensions, unequal lengths, one missing value.
@problemName Toy
@timeStamps false
@missing true
@univariate false
@dimensions 2
@equalLength false
@classLabel true up down flat

@data
1,2,3:10,20,30:up
4,?,8,10:0,0,0,0:down
5,5:1,1:flat
"""

TEST_TS = """@problemName Toy
@dimensions 2
@classLabel true up down flat
@data
0,1,2,3,4:5,6,7,8,9:down
2:3:up
"""


@pytest.fixture
def source_dir(tmp_path):
    folder = tmp_path / "archive" / "Toy"
    folder.mkdir(parents=True)
    (folder / "Toy_TRAIN.ts").write_text(TRAIN_TS)
    (folder / "Toy_TEST.ts").write_text(TEST_TS)
    return str(tmp_path / "archive")


def _records(builder, split):
    src = builder.as_data_source(split)
    return sorted((src[i] for i in range(len(src))), key=lambda r: (int(r["mask"].sum()), r["label"]))


def test_parse_ts_values_labels_and_missing(source_dir):
    f = uea.parse_ts(f"{source_dir}/Toy/Toy_TRAIN.ts")
    assert f.labels == ["up", "down", "flat"] and f.class_names == ["up", "down", "flat"]
    assert [x.shape for x in f.series] == [(3, 2), (4, 2), (2, 2)]
    np.testing.assert_array_equal(f.series[0], [[1, 10], [2, 20], [3, 30]])
    assert np.isnan(f.series[1][1, 0])
    np.testing.assert_array_equal(uea.fill_missing(f.series[1])[:, 0], [4, 6, 8, 10])
    ends = uea.fill_missing(np.array([[np.nan], [2.0], [np.nan], [np.nan]]))
    np.testing.assert_array_equal(ends[:, 0], [2, 2, 2, 2])  # ends held, as pandas limit_direction='both'


@pytest.mark.parametrize("bad_line, match", [
    ("1,2,x:3,4,5:up", r"line 4: bad value"),
    ("1,2:3,4,5:up", r"line 4: dimensions of one case differ in length"),
    ("1,2:up", r"line 4: 1 dimensions, expected 2"),
    ("1,2:3,4:sideways", r"line 4: label 'sideways' is not among the declared classes"),
    ("1,inf:3,4:up", r"line 4: an infinite value \(a missing value is written '\?'\)"),
    ("1,2:-Infinity,4:up", r"line 4: an infinite value"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, match):
    path = tmp_path / "Bad_TRAIN.ts"
    path.write_text(f"@dimensions 2\n@classLabel true up down\n@data\n{bad_line}\n")
    with pytest.raises(ValueError, match=rf"Bad_TRAIN\.ts, {match}"):
        uea.parse_ts(str(path))


def test_a_byte_order_mark_and_windows_line_ends_are_read(tmp_path):
    path = tmp_path / "Bom_TRAIN.ts"
    path.write_bytes("\ufeff@dimensions 1\r\n@classLabel true a b\r\n@data\r\n1,NaN,3:a\r\n4,5,6:b\r\n".encode())
    f = uea.parse_ts(str(path))
    assert f.labels == ["a", "b"] and f.header["dimensions"] == "1"
    np.testing.assert_array_equal(uea.fill_missing(f.series[0])[:, 0], [1, 2, 3])


def test_not_a_classification_file(tmp_path):
    path = tmp_path / "Reg_TRAIN.ts"
    path.write_text("@dimensions 1\n@targetLabel true\n@data\n1,2:0.5\n")
    with pytest.raises(ValueError, match=r"Reg_TRAIN\.ts, line 3: not a classification file"):
        uea.parse_ts(str(path))


def test_build_pads_masks_normalises_and_maps_labels(source_dir, tmp_path):
    b = zoo_data.make_builder("uea", str(tmp_path / "prepared"), dataset="Toy", source_dir=source_dir)
    b.download_and_prepare()
    assert uea.class_names(b) == ["down", "flat", "up"]  # sorted, as pandas categorical codes
    assert b.info.features["inputs"].shape == (5, 2)     # longest series of both splits
    steps = np.array([[1, 10], [2, 20], [3, 30], [4, 0], [6, 0], [8, 0], [10, 0], [5, 1], [5, 1]], float)
    mean, std = steps.mean(0), steps.std(0, ddof=1)
    train = _records(b, "train")
    assert [(int(r["mask"].sum()), r["label"]) for r in train] == [(2, 1), (3, 2), (4, 0)]
    for r, raw in zip(train, ([[5, 1], [5, 1]], [[1, 10], [2, 20], [3, 30]], [[4, 0], [6, 0], [8, 0], [10, 0]])):
        t = len(raw)
        np.testing.assert_allclose(r["inputs"][:t], (np.array(raw) - mean) / std, rtol=1e-6, atol=1e-6)
        assert (r["inputs"][t:] == 0).all() and r["mask"][:t].all() and not r["mask"][t:].any()
    batch = next(pipeline.train_batches(b.as_data_source("train"), global_batch_size=2, seed=0))
    assert batch["inputs"].shape == (2, 5, 2) and batch["inputs"].dtype == np.float32
    assert batch["mask"].shape == (2, 5) and batch["mask"].dtype == np.bool_
    assert batch["label"].dtype == np.int64
    evals = list(pipeline.eval_batches(b.as_data_source("test"), global_batch_size=4))
    assert len(evals) == 1 and evals[0]["example_mask"].tolist() == [1, 1, 0, 0]


def test_max_length_train_truncates_and_none_normalisation(source_dir, tmp_path):
    b = uea.make_builder(str(tmp_path), dataset="Toy", source_dir=source_dir, max_length="train",
                         normalization="none")
    b.download_and_prepare()
    assert b.info.features["inputs"].shape == (4, 2)  # the harness: longest TRAIN series
    longest = _records(b, "test")[-1]
    np.testing.assert_array_equal(longest["inputs"], [[0, 5], [1, 6], [2, 7], [3, 8]])
    assert longest["mask"].all() and longest["label"] == 0
    b = uea.make_builder(str(tmp_path), dataset="Toy", source_dir=source_dir, max_length=7, normalization=None)
    assert b.info.features["mask"].shape == (7,)


def test_shipped_datasets(tmp_path):
    assert uea.shipped_datasets() == ["BasicMotions", "JapaneseVowels"]
    b = uea.make_builder(str(tmp_path), dataset="JapaneseVowels")
    b.download_and_prepare()
    assert b.info.features["inputs"].shape == (29, 12)
    assert (b.info.splits["train"].num_examples, b.info.splits["test"].num_examples) == (270, 370)
    meta = b.info.metadata
    assert meta["train_max_length"] == 26 and meta["num_classes"] == 9
    batch = next(pipeline.train_batches(b.as_data_source("train"), global_batch_size=16, seed=0))
    assert batch["inputs"].shape == (16, 29, 12) and (batch["label"] < 9).all()
    lengths = batch["mask"].sum(1)
    assert ((lengths >= 7) & (lengths <= 26)).all()
    # Standardised with TRAIN statistics: real steps have mean ~0 and std ~1 per channel.
    src = b.as_data_source("train")
    steps = np.concatenate([src[i]["inputs"][src[i]["mask"]] for i in range(len(src))])
    np.testing.assert_allclose(steps.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(steps.std(0, ddof=1), 1, atol=1e-5)
    b = uea.make_builder(str(tmp_path), dataset="BasicMotions", normalization="none")
    b.download_and_prepare()
    assert b.info.features["inputs"].shape == (100, 6)
    assert uea.class_names(b) == ["Badminton", "Running", "Standing", "Walking"]
    reopened = uea.make_builder(str(tmp_path), dataset="BasicMotions", normalization="none")
    assert reopened.is_prepared() and reopened.info.features["inputs"].shape == (100, 6)


def test_missing_files_and_bad_options(tmp_path):
    with pytest.raises(ValueError, match=r"put Nope/Nope_TRAIN\.ts and Nope/Nope_TEST\.ts .* under source_dir="):
        uea.make_builder(str(tmp_path), dataset="Nope", source_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"^uea: Nope is not shipped \(only BasicMotions, JapaneseVowels are\) and could not fetch .*Nope\.zip"):
        uea.make_builder(str(tmp_path), dataset="Nope")
    # '' (how configs spell "not given") means the shipped files, not the current directory.
    with pytest.raises(ValueError, match=r"^uea: Nope is not shipped \(only BasicMotions, JapaneseVowels are\) and could not fetch .*Nope\.zip"):
        uea.make_builder(str(tmp_path), dataset="Nope", source_dir="")
    with pytest.raises(ValueError, match="max_length"):
        uea.make_builder(str(tmp_path), dataset="Toy", max_length=0)
    with pytest.raises(ValueError, match="normalization"):
        uea.make_builder(str(tmp_path), dataset="Toy", normalization="zscore")
    with pytest.raises(ValueError, match="has no option"):
        uea.make_builder(str(tmp_path), name="Toy")
