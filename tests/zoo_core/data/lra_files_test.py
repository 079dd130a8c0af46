"""Tests of zoo_core.data.lra_files: the LRA text/retrieval/image/pathfinder file readers."""
import numpy as np
import pytest

from zoo_core import data as zoo_data
from zoo_core.data import lra_files, pipeline


def _build(name, tmp_path, **options):
    b = zoo_data.make_builder(name, str(tmp_path / "prepared"), **options)
    b.download_and_prepare()
    return b


def _records(builder, split):
    src = builder.as_data_source(split)
    return sorted((src[i] for i in range(len(src))), key=lambda r: r["label"])


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def test_text_bytes_labels_and_batches(tmp_path):
    src = tmp_path / "text"
    _write(src / "train.tsv", "0\tab\tc\n1\t\u00e9\n0\tlong text here\n1\tz\n")
    _write(src / "test.tsv", "1\txyz\n0\tq\n")
    b = _build("lra_text", tmp_path, source_dir=str(src), max_length=6)
    assert set(b.info.splits) == {"train", "test"}  # no validation.tsv, no validation split
    first, second = _records(b, "test")
    np.testing.assert_array_equal(first["inputs"], [ord("q") + 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(second["inputs"], [ord("x") + 1, ord("y") + 1, ord("z") + 1, 0, 0, 0])
    train = {tuple(r["inputs"]) for r in _records(b, "train")}
    # Tabs inside the text are bytes like any other (9 + 1); UTF-8 é is the two bytes 0xC3 0xA9;
    # long texts are truncated to max_length.
    assert (ord("a") + 1, ord("b") + 1, 10, ord("c") + 1, 0, 0) in train
    assert (0xC3 + 1, 0xA9 + 1, 0, 0, 0, 0) in train
    assert tuple(ord(c) + 1 for c in "long t") in train
    batch = next(pipeline.train_batches(b.as_data_source("train"), global_batch_size=4, seed=0))
    assert batch["inputs"].shape == (4, 6) and batch["inputs"].dtype == np.int32
    assert batch["label"].dtype == np.int64 and set(batch["label"]) == {0, 1}
    assert b.info.metadata["vocab_size"] == lra_files.TEXT_VOCAB_SIZE == 257


def test_retrieval_three_and_five_column_lines(tmp_path):
    src = tmp_path / "aan"
    _write(src / "train.tsv", "1\tab\tcd\n0.0\tid1\tid2\tef\tgh\n")
    _write(src / "validation.tsv", "1.0\ti\tj\tk\tl\n")
    _write(src / "test.tsv", "0\tm\tn\n")
    b = _build("lra_retrieval", tmp_path, source_dir=str(src), max_length=3)
    assert set(b.info.splits) == {"train", "validation", "test"}
    zero, one = _records(b, "train")
    np.testing.assert_array_equal(zero["inputs1"], [ord("e") + 1, ord("f") + 1, 0])
    np.testing.assert_array_equal(zero["inputs2"], [ord("g") + 1, ord("h") + 1, 0])
    np.testing.assert_array_equal(one["inputs1"], [ord("a") + 1, ord("b") + 1, 0])
    (val,) = _records(b, "validation")
    assert val["label"] == 1 and val["inputs1"][0] == ord("k") + 1
    batch = next(pipeline.eval_batches(b.as_data_source("train"), global_batch_size=4))
    assert {k: v.shape for k, v in batch.items()} == {
        "inputs1": (4, 3), "inputs2": (4, 3), "label": (4,), "example_mask": (4,)}


def test_image_gray_rgb_and_flat_inputs(tmp_path):
    src = tmp_path / "cifar"
    src.mkdir()
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, size=(6, 32, 32), dtype=np.uint8)
    np.savez(src / "train.npz", inputs=gray, label=np.arange(6) % 10)
    rgb = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    np.savez(src / "test.npz", inputs=rgb, label=np.array([9, 0, 4]))
    np.savez(src / "validation.npz", inputs=gray.reshape(6, 1024)[:2], label=np.array([1, 2]))
    b = _build("lra_image", tmp_path, source_dir=str(src))
    train = _records(b, "train")
    np.testing.assert_array_equal(np.stack([r["inputs"] for r in train]), gray.reshape(6, 1024).astype(np.int32))
    assert [r["label"] for r in train] == list(range(6))
    test = {r["label"]: r["inputs"] for r in _records(b, "test")}
    # tf.image.rgb_to_grayscale on uint8: trunc(255.5 * (w . rgb / 255)).
    expected = np.floor(255.5 * (rgb[1].reshape(1024, 3) / 255.0) @ np.array([0.2989, 0.5870, 0.1140]))
    assert np.abs(test[0] - expected).max() <= 1  # float32 vs float64 rounding at integer boundaries
    assert np.mean(test[0] == expected) > 0.99
    batch = next(pipeline.train_batches(b.as_data_source("train"), global_batch_size=2, seed=1))
    assert batch["inputs"].shape == (2, 1024) and batch["inputs"].dtype == np.int32
    assert b.info.metadata["num_classes"] == 10


def test_pathfinder_resolution_and_label_range(tmp_path):
    src = tmp_path / "pf"
    src.mkdir()
    images = np.arange(4 * 64, dtype=np.uint8).reshape(4, 8, 8)
    np.savez(src / "train.npz", inputs=images, label=np.array([0, 1, 1, 0]))
    np.savez(src / "test.npz", inputs=images[:2, :, :, None], label=np.array([1, 0]))
    b = _build("lra_pathfinder", tmp_path, source_dir=str(src), resolution=8)
    assert b.info.features["inputs"].shape == (64,)
    assert sorted(r["label"] for r in _records(b, "train")) == [0, 0, 1, 1]
    np.savez(src / "train.npz", inputs=images, label=np.array([0, 1, 2, 0]))
    with pytest.raises(ValueError, match=r"train\.npz: 'label'\[2\] = 2 is not in \[0, 2\)"):
        _build("lra_pathfinder", tmp_path / "again", source_dir=str(src), resolution=8)


def test_missing_files_messages(tmp_path):
    with pytest.raises(ValueError, match=r"pass source_dir=DIR with DIR/train\.tsv and DIR/test\.tsv"):
        zoo_data.make_builder("lra_text", str(tmp_path))
    with pytest.raises(ValueError, match=r"pass source_dir=DIR with DIR/train\.tsv"):   # '' = not given
        zoo_data.make_builder("lra_text", str(tmp_path), source_dir="")
    (tmp_path / "only_train").mkdir()
    np.savez(tmp_path / "only_train" / "train.npz", inputs=np.zeros((1, 32, 32), np.uint8), label=np.zeros(1, int))
    with pytest.raises(ValueError, match=r"missing .*only_train/test\.npz; put DIR/train\.npz and DIR/test\.npz"):
        zoo_data.make_builder("lra_image", str(tmp_path), source_dir=str(tmp_path / "only_train"))
    with pytest.raises(ValueError, match="has no option"):
        zoo_data.make_builder("lra_image", str(tmp_path), source_dir=str(tmp_path), max_length=10)


def test_malformed_lines_name_file_and_line(tmp_path):
    src = tmp_path / "bad"
    _write(src / "train.tsv", "1\tfine\n7\tbad label\n")
    _write(src / "test.tsv", "0\tok\n")
    with pytest.raises(ValueError, match=r"bad/train\.tsv, line 2: label b'7' is not an integer in \[0, 2\)"):
        _build("lra_text", tmp_path, source_dir=str(src))
    _write(src / "train.tsv", "1\tone\ttwo\n1\tonly one\n")
    _write(src / "validation.tsv", "0\ta\tb\n")   # required by retrieval
    with pytest.raises(ValueError, match=r"train\.tsv, line 2: expected 'label<TAB>text1<TAB>text2'"):
        _build("lra_retrieval", tmp_path, source_dir=str(src))


def test_retrieval_names_every_missing_file_before_reading_any(tmp_path):
    # LRA's release ships train/eval/test pairs and the configs select on validation: all three are
    # required, checked when the builder is made, so a malformed train.tsv is not even read.
    src = tmp_path / "aan"
    _write(src / "train.tsv", "7\tnot a pair\n")
    _write(src / "test.tsv", "0\ta\tb\n")
    prepared = tmp_path / "prepared"
    with pytest.raises(ValueError, match=r"lra_retrieval: missing \S*aan/validation\.tsv; put DIR/train\.tsv, "
                       r"DIR/validation\.tsv and DIR/test\.tsv \(LRA: \S*new_aan_pairs\.\{train,eval,test\}\.tsv, renamed\) there"):
        zoo_data.make_builder("lra_retrieval", str(prepared), source_dir=str(src))
    (src / "test.tsv").unlink()
    with pytest.raises(ValueError, match=r"missing \S*aan/validation\.tsv, \S*aan/test\.tsv; put") as e:
        zoo_data.make_builder("lra_retrieval", str(prepared), source_dir=str(src))
    assert "\n" not in str(e.value) and not prepared.exists()
    with pytest.raises(ValueError, match=r"pass source_dir=DIR with DIR/train\.tsv, DIR/validation\.tsv and "
                       r"DIR/test\.tsv \(LRA: "):
        zoo_data.make_builder("lra_retrieval", str(prepared))
