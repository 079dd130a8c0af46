"""A file-based split prepares at any size with TensorFlow unimportable (issue 41: TFDS's shuffler spills a
split over 1 GB through `tf.io.gfile`; `base.GeneratorBuilder` spills through plain files instead).

TensorFlow is made uninstalled by wrapping every finder on `sys.meta_path` so that none finds it
(`importlib.util.find_spec('tensorflow')` is None and the import raises ModuleNotFoundError, as without
it), not by `sys.modules['tensorflow'] = None`: etils counts a key in sys.modules as "TensorFlow is
loaded", and TFDS then fails on a dtype check before it reads anything.
"""
import importlib.abc
import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest
from tensorflow_datasets.core import shuffle as tfds_shuffle

from zoo_core import data as zoo_data
from zoo_core.data import base


class _WithoutTensorflow(importlib.abc.MetaPathFinder):
    """A finder of `sys.meta_path` that finds what it finds, except TensorFlow."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            return None
        return self.inner.find_spec(name, path, target)

    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()


@pytest.fixture
def no_tensorflow(monkeypatch):
    if "tensorflow" in sys.modules:
        pytest.skip("TensorFlow was imported by an earlier test; the block cannot take effect")
    monkeypatch.setattr(sys, "meta_path", [_WithoutTensorflow(f) for f in sys.meta_path])
    assert importlib.util.find_spec("tensorflow") is None
    with pytest.raises(ModuleNotFoundError):
        import tensorflow  # noqa: F401
    assert "tensorflow" not in sys.modules


def _write_text_split(folder, lines: int, text_bytes: int):
    """label<TAB>text lines, the text `text_bytes` long and unique per line."""
    folder.mkdir(parents=True, exist_ok=True)
    filler = b"abcdefgh" * (text_bytes // 8 + 1)
    with open(folder / "train.tsv", "wb") as f:
        for i in range(lines):
            head = b"%d " % i
            f.write(b"%d\t" % (i % 2) + head + filler[:text_bytes - len(head)] + b"\n")
    (folder / "test.tsv").write_bytes(b"0\tab\n1\tcd\n")


def _prepare(tmp_path, source, name, max_length):
    b = zoo_data.make_builder("lra_text", str(tmp_path / name), source_dir=str(source), max_length=max_length)
    b.download_and_prepare()
    return b


def test_spilled_split_equals_the_in_memory_one(tmp_path, monkeypatch, no_tensorflow):
    source = tmp_path / "src"
    _write_text_split(source, lines=300, text_bytes=40)
    reference = _prepare(tmp_path, source, "memory", 16).as_data_source("train")
    spilled = []
    monkeypatch.setattr(tfds_shuffle, "MAX_MEM_BUFFER_SIZE", 2000)   # spill after ~20 records
    monkeypatch.setattr(base._FileBucket, "add", _recording(base._FileBucket.add, spilled))
    b = _prepare(tmp_path, source, "spilled", 16)
    assert spilled, "the split did not spill into buckets"
    got = b.as_data_source("train")
    assert len(got) == len(reference) == 300
    for i in range(300):   # same records, same order
        assert got[i]["label"] == reference[i]["label"]
        np.testing.assert_array_equal(got[i]["inputs"], reference[i]["inputs"])
    leftovers = [f for d, _, fs in os.walk(tmp_path / "spilled") for f in fs if f.endswith(".tmp")]
    assert leftovers == []


def _recording(add, calls):
    def wrapped(self, key, data):
        calls.append(key)
        return add(self, key, data)
    return wrapped


def _write_retrieval_split(folder, lines: int, text_bytes: int):
    """label<TAB>text1<TAB>text2 lines of two `text_bytes`-long texts of 2-byte UTF-8 characters (byte ids
    >= 128 take two bytes each in the serialized record, as most of a real split's would not)."""
    folder.mkdir(parents=True, exist_ok=True)
    filler = "\u00e9".encode() * (text_bytes // 2)
    with open(folder / "train.tsv", "wb") as f:
        for i in range(lines):
            f.write(b"%d\t%d %s\t%s\n" % (i % 2, i, filler, filler))
    for split in ("validation", "test"):
        (folder / f"{split}.tsv").write_bytes(b"0\tab\tcd\n1\tef\tgh\n")


@pytest.mark.slow
def test_a_split_over_1gb_prepares(tmp_path, monkeypatch, no_tensorflow):
    """A Retrieval-sized split: 70,000 pairs of 8,000-byte texts (a 1.1 GB train.tsv), 4,000 ids each, about
    16 KB per serialized record: 1.1 GB through TFDS's shuffler, which spills past 1 GB. 7 min on a shared
    2-core CPU (1 min of it CPU time, the rest disk); about 1.2 GB of memory; the files are deleted at the end."""
    source = tmp_path / "src"
    lines = 70_000
    try:
        _write_retrieval_split(source, lines=lines, text_bytes=8_000)
        assert os.path.getsize(source / "train.tsv") > 1 << 30
        spilled = []
        monkeypatch.setattr(base._FileBucket, "add", _recording(base._FileBucket.add, spilled))
        b = zoo_data.make_builder("lra_retrieval", str(tmp_path / "prepared"), source_dir=str(source),
                                  max_length=4000)
        b.download_and_prepare()
        assert b.info.splits["train"].num_examples == lines
        assert len(spilled) == lines   # past 1 GB every record went through the buckets
        src = b.as_data_source("train")
        record = src[len(src) - 1]
        assert record["inputs1"].shape == (4000,) and record["inputs2"][-1] == 0xA9 + 1
    finally:   # not kept for pytest's last three runs
        shutil.rmtree(tmp_path, ignore_errors=True)
