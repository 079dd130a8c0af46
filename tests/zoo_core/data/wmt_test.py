"""Tests of the `wmt14_en_de` reader on a tiny parallel corpus written here (SentencePiece vocabulary)."""
import numpy as np
import pytest

from zoo_core import data
from zoo_core.data import pipeline

spm = pytest.importorskip("sentencepiece")
from zoo_core.data import wmt  # noqa: E402  (after the skip: the module itself imports sentencepiece lazily)

_EN_DE = {"the": "das", "house": "Haus", "is": "ist", "small": "klein", "big": "groß", "red": "rot",
          "a": "ein", "cat": "Katze", "dog": "Hund", "sees": "sieht", "runs": "läuft", "quickly": "schnell",
          "and": "und", "but": "aber", "we": "wir", "they": "sie"}
MAX_LENGTH = 24


def _write_corpus(root, sizes=(("train", 200), ("dev", 12), ("test", 12))):
    rng = np.random.default_rng(0)
    words = sorted(_EN_DE)
    for stem, n in sizes:
        en, de = [], []
        for _ in range(n):
            sentence = [words[i] for i in rng.integers(0, len(words), rng.integers(3, 10))]
            en.append(" ".join(sentence).capitalize() + ".")
            de.append(" ".join(_EN_DE[w] for w in sentence).capitalize() + ".")
        (root / f"{stem}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
        (root / f"{stem}.de").write_text("\n".join(de) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    _write_corpus(corpus)
    builder = data.make_builder("wmt14_en_de", str(tmp_path_factory.mktemp("wmt")), source_dir=str(corpus),
                                vocab_size=80, model_type="bpe", max_length=MAX_LENGTH)
    builder.download_and_prepare()
    return builder


def test_shapes_and_round_trip(built):
    batch = next(pipeline.eval_batches(built.as_data_source("test"), global_batch_size=4))
    assert batch["inputs"].shape == (4, MAX_LENGTH) and batch["inputs"].dtype == np.int32
    assert batch["targets"].shape == (4, MAX_LENGTH) and batch["targets"].dtype == np.int32
    tokenizer = wmt.load_tokenizer(built)
    meta = built.info.metadata
    assert meta["vocab_size"] == tokenizer.get_piece_size() <= 80
    assert (tokenizer.pad_id(), tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.unk_id()) == (0, 1, 2, 3)
    src = built.as_data_source("validation")
    assert len(src) == 12
    for r in src.__getitems__(list(range(len(src)))):
        if r["targets"][-1] == wmt.PAD_ID:  # not truncated
            assert wmt.decode(tokenizer, r["targets"]) == r["target_text"].decode()
            assert wmt.decode(tokenizer, r["inputs"]) == r["source_text"].decode()
        assert wmt.EOS_ID in r["targets"]
    train = built.as_data_source("train")
    assert len(train) + meta["train_dropped"] == 200


def test_missing_files_error(tmp_path):
    (tmp_path / "train.en").write_text("a\n")
    with pytest.raises(ValueError, match="missing: train.de, dev.en, dev.de, test.en, test.de"):
        data.make_builder("wmt14_en_de", str(tmp_path / "out"), source_dir=str(tmp_path))
    with pytest.raises(ValueError, match="source_dir is required"):
        data.make_builder("wmt14_en_de", str(tmp_path / "out"))
    with pytest.raises(ValueError, match="model_type"):
        data.make_builder("wmt14_en_de", str(tmp_path / "out"), source_dir=str(tmp_path), model_type="word")
