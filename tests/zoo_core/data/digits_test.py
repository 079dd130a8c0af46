"""Tests of the `digits` dataset (scikit-learn's 8x8 digits with a seeded stratified split)."""
import numpy as np
import pytest

from zoo_core import data
from zoo_core.data import digits, pipeline


def _all(builder, split):
    src = builder.as_data_source(split)
    return pipeline.stack_records(src.__getitems__(list(range(len(src)))))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    builder = data.make_builder("digits", str(tmp_path_factory.mktemp("digits")))
    builder.download_and_prepare()
    return builder


def test_shapes_dtypes_through_pipeline(built):
    batch = next(pipeline.eval_batches(built.as_data_source("test"), global_batch_size=16))
    assert batch["image"].shape == (16, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (16,) and batch["label"].dtype == np.int64
    train = next(pipeline.train_batches(built.as_data_source("train"), global_batch_size=32, seed=0))
    assert train["image"].shape == (32, 8, 8, 1)


def test_split_is_stratified_disjoint_and_complete(built):
    train, test = _all(built, "train"), _all(built, "test")
    assert len(train["label"]) + len(test["label"]) == 1797
    assert not set(train["index"]) & set(test["index"])
    images, labels = digits.load_arrays()
    for k in range(digits.NUM_CLASSES):
        assert (test["label"] == k).sum() == round(0.2 * (labels == k).sum())
    np.testing.assert_array_equal(test["image"], images[test["index"]])
    np.testing.assert_array_equal(test["label"], labels[test["index"]])
    assert 0.0 <= train["image"].min() and train["image"].max() == 1.0


def test_seed_and_validation_split():
    labels = digits.load_arrays()[1]
    a = digits.split_indices(labels, digits.DigitsConfig(name="t"))
    b = digits.split_indices(labels, digits.DigitsConfig(name="t"))
    c = digits.split_indices(labels, digits.DigitsConfig(name="t", seed=1, validation_fraction=0.1))
    np.testing.assert_array_equal(a["test"], b["test"])
    assert not np.array_equal(a["test"], c["test"]) and set(c) == {"train", "validation", "test"}
    assert sum(len(v) for v in c.values()) == len(labels)
    assert not set(c["validation"]) & set(c["test"])


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="test_fraction"):
        data.make_builder("digits", str(tmp_path), test_fraction=1.0)
    with pytest.raises(ValueError, match="no option"):
        data.make_builder("digits", str(tmp_path), split=0.2)


@pytest.mark.slow
def test_direct_read_matches_load_digits():
    from sklearn.datasets import load_digits

    images, labels = digits.load_arrays()
    bunch = load_digits()
    np.testing.assert_array_equal(images[..., 0] * 16.0, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)
