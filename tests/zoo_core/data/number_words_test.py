"""Tests of the `number_words` dataset (num2words En -> De, htgn.md §6) and `zoo_core.tasks.textmetrics`."""
import numpy as np
import pytest

from zoo_core import data
from zoo_core.data import number_words as nw
from zoo_core.data import pipeline
from zoo_core.tasks import textmetrics

TINY = dict(num_train=40, num_validation=12, num_test=12)


def _records(builder, split):
    src = builder.as_data_source(split)
    return src.__getitems__(list(range(len(src))))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    builder = data.make_builder("number_words", str(tmp_path_factory.mktemp("nw")), **TINY)
    builder.download_and_prepare()
    return builder


def test_shapes_dtypes_through_pipeline(built):
    batch = next(pipeline.eval_batches(built.as_data_source("test"), global_batch_size=8))
    assert batch["inputs"].shape == (8, 15) and batch["inputs"].dtype == np.int32
    assert batch["targets"].shape == (8, 12) and batch["targets"].dtype == np.int32
    assert batch["source_text"].shape == (8,) and batch["target_text"].shape == (8,)
    meta = built.info.metadata
    assert (meta["source_vocab_size"], meta["target_vocab_size"]) == nw.vocab_sizes("en_de") == (38, 37)
    assert batch["inputs"].max() < 38 and batch["targets"].max() < 37


def test_disjoint_numbers_across_splits(built):
    numbers = {s: {int(r["numbers"][0]) for r in _records(built, s)} for s in ("train", "validation", "test")}
    assert [len(v) for v in numbers.values()] == [40, 12, 12]
    assert not (numbers["train"] & numbers["validation"] or numbers["train"] & numbers["test"]
                or numbers["validation"] & numbers["test"])


def test_records_encode_the_texts(built):
    for r in _records(built, "validation"):
        n = int(r["numbers"][0])
        source, target = r["source_text"].decode(), r["target_text"].decode()
        assert source == nw.number_text(n, "en")
        assert nw.decode(r["inputs"], "en") == nw.tokenize(source, "en")
        assert nw.ids_to_text(r["targets"], "de") == target
        assert nw.detokenize(target.split(), "de") == nw.number_text(n, "de")
        # EOS ends both sequences, PAD after it.
        for ids in (r["inputs"], r["targets"]):
            end = list(ids).index(nw.EOS_ID)
            assert np.all(ids[end + 1:] == nw.PAD_ID) and np.all(ids[:end] > nw.UNK_ID)


def test_number_text_equals_num2words():
    from num2words import num2words

    sample = [1000, 1001, 1100, 2099, 101000, 100001, 999999] + list(
        np.random.default_rng(0).integers(1000, nw.MAX_NUMBER + 1, 150))
    for n in sample:
        for lang in ("en", "de"):
            assert nw.number_text(n, lang) == num2words(int(n), lang=lang), (n, lang)


def test_tokenisation_round_trip_and_example():
    source = nw.number_text(777777, "en")
    tokens = nw.tokenize(source, "en")
    assert len(tokens) == 14 and tokens[3:6] == ["seventy", "-", "seven"]
    assert nw.detokenize(nw.decode(nw.encode(tokens, "en", length=20), "en"), "en") == source
    german = nw.tokenize(nw.number_text(777777, "de"), "de")
    assert " ".join(german) == "sieben hundert sieben und siebzig tausend sieben hundert sieben und siebzig"
    assert nw.tokenize("siebzehn", "de") == ["siebzehn"] and nw.tokenize("dreißig", "de") == ["dreißig"]
    assert nw.decode([nw.BOS_ID, 5, nw.EOS_ID, 6], "en") == ["one"]
    np.testing.assert_array_equal(nw.decoder_inputs(np.array([[7, 8, nw.EOS_ID, 0]])),
                                  [[nw.BOS_ID, 7, 8, nw.EOS_ID]])
    with pytest.raises(ValueError, match="cannot segment"):
        nw.segment_german("einsx")
    with pytest.raises(ValueError, match="do not fit"):
        nw.encode(tokens, "en", length=14)


def test_multi_number_examples_and_reverse_direction(tmp_path):
    builder = data.make_builder("number_words", str(tmp_path), direction="de_en", max_numbers_per_example=3,
                                num_train=20, num_validation=6, num_test=6, seed=3)
    builder.download_and_prepare()
    records = _records(builder, "train")
    assert records[0]["inputs"].shape == (3 * 11 + 3,) and records[0]["targets"].shape == (3 * 14 + 3,)
    test_numbers = {int(n) for r in _records(builder, "test") for n in r["numbers"] if n >= 0}
    train_numbers = {int(n) for r in records for n in r["numbers"] if n >= 0}
    assert not test_numbers & train_numbers
    r = next(r for r in records if (r["numbers"] >= 0).sum() > 1)
    k = int((r["numbers"] >= 0).sum())
    assert nw.decode(r["targets"], "en").count(";") == k - 1
    spelled = "; ".join(nw.number_text(n, "en") for n in r["numbers"][:k])
    assert nw.detokenize(nw.decode(r["targets"], "en"), "en") == spelled
    assert r["source_text"].decode() == "; ".join(nw.number_text(n, "de") for n in r["numbers"][:k])


def test_deterministic_splits():
    config = nw.NumberWordsConfig(name="t", **TINY)
    assert nw.split_numbers(config) == nw.split_numbers(config)
    assert nw.split_numbers(config) != nw.split_numbers(nw.NumberWordsConfig(name="t", seed=1, **TINY))


def test_text_metrics(built):
    refs = [r["target_text"] for r in _records(built, "test")]
    perfect = textmetrics.translation_metrics(refs, refs)
    assert perfect == pytest.approx({"bleu": 100.0, "chrf": 100.0, "exact_match": 1.0})
    hyps = [nw.ids_to_text(r["targets"], "de") for r in _records(built, "test")]
    hyps[0] = "null"
    worse = textmetrics.translation_metrics(hyps, refs)
    assert worse["bleu"] < 100 and worse["chrf"] < 100 and worse["exact_match"] == pytest.approx(11 / 12)
    # Short sentences only: standard corpus BLEU is 0, effective order scores them.
    assert textmetrics.corpus_bleu(["null", "ein und zwanzig"], ["null", "ein und zwanzig"]) == 0.0
    assert textmetrics.corpus_bleu(["null"], ["null"], effective_order=True) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="differ in number"):
        textmetrics.exact_match(["a"], ["a", "b"])


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="direction"):
        data.make_builder("number_words", str(tmp_path), direction="en_fr")
    with pytest.raises(ValueError, match="max_number"):
        data.make_builder("number_words", str(tmp_path), max_number=1_000_000)
    with pytest.raises(ValueError, match="distinct numbers"):
        data.make_builder("number_words", str(tmp_path), max_number=50, num_train=50)
