"""Tests of zoo_core.data.listops: the LRA ListOps generator, tokenisation and the TFDS builder."""
import numpy as np
import pytest

from zoo_core import data as zoo_data
from zoo_core.data import listops, pipeline

OPTIONS = dict(max_length=64, min_length=8, num_train=64, num_validation=16, num_test=24, seed=3)


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    b = zoo_data.make_builder("lra_listops", str(tmp_path_factory.mktemp("listops")), **OPTIONS)
    b.download_and_prepare()
    return b


def _evaluate(tokens: list[str]) -> int:
    """Independent evaluator of a ListOps token list (prefix operators closed by ']')."""
    stack = []
    for tok in tokens:
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            value = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(np.median(a)),
                     "[SM": lambda a: int(np.sum(a)) % 10}[op](args)
            if not stack:
                return value
            stack[-1].append(value)
        else:
            if not stack:
                return int(tok)
            stack[-1].append(int(tok))
    raise AssertionError(f"unterminated expression {tokens}")


def _records(builder, split):
    src = builder.as_data_source(split)
    return [src[i] for i in range(len(src))]


def test_batches_shapes_dtypes_and_ranges(builder):
    batch = next(pipeline.train_batches(builder.as_data_source("train"), global_batch_size=16, seed=0))
    assert batch["inputs"].shape == (16, OPTIONS["max_length"]) and batch["inputs"].dtype == np.int32
    assert batch["label"].shape == (16,) and batch["label"].dtype == np.int64
    assert batch["inputs"].min() >= 0 and batch["inputs"].max() < listops.VOCAB_SIZE
    assert ((batch["label"] >= 0) & (batch["label"] < 10)).all()
    evals = list(pipeline.eval_batches(builder.as_data_source("test"), global_batch_size=16))
    assert [b["inputs"].shape for b in evals] == [(16, 64)] * 2
    assert evals[-1]["example_mask"].sum() == OPTIONS["num_test"] - 16
    assert builder.info.metadata["vocab_size"] == listops.VOCAB_SIZE == 16


def test_split_sizes_distinct_and_padding_at_the_end(builder):
    seen = set()
    for split in ("train", "validation", "test"):
        records = _records(builder, split)
        assert len(records) == OPTIONS[f"num_{split}"]
        for r in records:
            n = int((r["inputs"] != 0).sum())
            assert OPTIONS["min_length"] < n < OPTIONS["max_length"]
            assert (r["inputs"][n:] == 0).all(), "padding must follow the tokens"
            seen.add(r["inputs"].tobytes())
    assert len(seen) == 64 + 16 + 24, "examples must be distinct across all splits"


def test_labels_equal_direct_evaluation(builder):
    for split in ("train", "validation", "test"):
        for r in _records(builder, split):
            tokens = listops.decode(r["inputs"]).split()
            assert _evaluate(tokens) == r["label"], tokens


def test_same_seed_same_data_other_seed_other_data(builder, tmp_path):
    again = listops.make_builder(str(tmp_path), **OPTIONS)
    again.download_and_prepare()
    for split in ("train", "test"):
        a, b = _records(builder, split), _records(again, split)
        assert all((x["inputs"] == y["inputs"]).all() and x["label"] == y["label"] for x, y in zip(a, b))
    kw = dict(max_length=64, min_length=8, max_depth=10, max_args=10)
    assert listops.generate(20, seed=1, **kw) == listops.generate(20, seed=1, **kw)
    assert listops.generate(20, seed=1, **kw)[0] != listops.generate(20, seed=2, **kw)[0]


def test_small_cpu_setting_lengths_and_classes():
    o = listops.CPU_SMALL_OPTIONS
    seqs, labels = listops.generate(o["num_train"], max_length=o["max_length"], min_length=o["min_length"],
                                    max_depth=10, max_args=10, seed=0)
    lengths = np.array([len(s) for s in seqs])
    assert lengths.min() > o["min_length"] and lengths.max() < o["max_length"]
    assert set(labels) == set(range(10))
    # LRA's generator puts a digit (length 1) at the root with probability 0.75, so every accepted
    # root is an operator: first token an operator, last token ']'.
    assert all(s[0] in listops.OPERATOR_IDS and s[-1] == listops.END_ID for s in seqs)


def test_median_is_floor_of_numpy_median():
    rng = np.random.default_rng(0)
    for n in range(2, 11):
        args = rng.integers(0, 10, size=n).tolist()
        assert listops.apply_operator(listops.MED_ID, args) == int(np.median(args))


@pytest.mark.parametrize("options, match", [
    (dict(max_len=10), "has no option"),
    (dict(max_length=10, min_length=10), "min_length"),
    (dict(max_args=1), "max_args"),
    (dict(num_train=-1), "num_train"),
])
def test_bad_options_raise(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        listops.make_builder(str(tmp_path), **options)


def test_too_few_distinct_expressions_raises(monkeypatch):
    monkeypatch.setattr(listops, "_MAX_STALL", 2000)
    # Length 4 means '[OP d d ]': only 4 * 10 * 10 = 400 distinct expressions exist.
    with pytest.raises(ValueError, match="distinct"):
        listops.generate(500, max_length=5, min_length=3, max_depth=2, max_args=2, seed=0)


# --- LRA's released files (source_dir) --------------------------------------------------------


def _lra_to_string(tokens: list[str]) -> str:
    """Independent port of LRA's serialisation: build the left-nested pair tree, print '( l r )'."""
    def tree(pos):
        tok = tokens[pos]
        if not tok.startswith("["):
            return tok, pos + 1
        t, pos = tok, pos + 1
        while tokens[pos] != "]":
            child, pos = tree(pos)
            t = (t, child)
        return (t, "]"), pos + 1

    def to_string(t):
        return t if isinstance(t, str) else f"( {to_string(t[0])} {to_string(t[1])} )"

    t, end = tree(0)
    assert end == len(tokens)
    return to_string(t)


def test_lra_source_matches_lra_serialisation_and_parses_back():
    assert listops.lra_source([listops.MAX_ID, 3, 10, listops.END_ID]) == "( ( ( [MAX 2 ) 9 ) ] )"
    nested = "[SM 3 [MIN 4 1 ] ]"
    ids = [listops._TOKEN_IDS[t] for t in nested.split()]
    assert listops.lra_source(ids) == "( ( ( [SM 3 ) ( ( ( [MIN 4 ) 1 ) ] ) ) ] )"
    seqs, _ = listops.generate(30, max_length=120, min_length=10, max_depth=10, max_args=10, seed=5)
    for seq in seqs:
        text = listops.lra_source(seq)
        assert text == _lra_to_string(listops.decode(seq).split())
        back = listops.parse_lra_source(text, 120)
        assert back[:len(seq)].tolist() == list(seq) and not back[len(seq):].any()


def _write_release(directory, splits: dict) -> None:
    for split, rows in splits.items():
        lines = ["Source\tTarget"] + [f"{listops.lra_source(s)}\t{y}" for s, y in rows]
        (directory / listops.RELEASED_FILES[split]).write_text("\n".join(lines) + "\n")


def test_builder_reads_released_files_and_truncates_like_lra(tmp_path):
    seqs, labels = listops.generate(12, max_length=60, min_length=30, max_depth=10, max_args=10, seed=2)
    rows = list(zip(seqs, labels))
    src = tmp_path / "listops-1000"
    src.mkdir()
    _write_release(src, {"train": rows[:6], "validation": rows[6:9], "test": rows[9:]})
    b = listops.make_builder(str(tmp_path / "tfds"), source_dir=str(src), max_length=40)
    b.download_and_prepare()
    for split, part in (("train", rows[:6]), ("validation", rows[6:9]), ("test", rows[9:])):
        got = sorted((r["inputs"].tolist(), int(r["label"])) for r in _records(b, split))
        want = sorted((list(seq[:40]) + [0] * (40 - len(seq[:40])), label)  # LRA cuts at max_length
                      for seq, label in part)
        assert got == want   # TFDS stores a split in hashed-key order: compare as multisets
    assert any(len(s) > 40 for s in seqs), "the truncation path must be exercised"


@pytest.mark.parametrize("line, match", [
    ("( ( ( [MAX 2 ) 9 ) ] )\t11", r"basic_test.tsv, line 3: target '11'"),
    ("( ( ( [FOO 2 ) 9 ) ] )\t9", r"basic_test.tsv, line 3: unknown ListOps token '\[FOO'"),
    ("( ( ( [MAX 2 ) 9 ) ] )", r"basic_test.tsv, line 3: expected 'Source<TAB>Target'"),
])
def test_malformed_released_file_names_file_and_line(tmp_path, line, match):
    _write_release(tmp_path, {"train": [((listops.MAX_ID, 3, 10, listops.END_ID), 9)],
                              "validation": [((listops.MIN_ID, 3, 10, listops.END_ID), 2)]})
    good = f"{listops.lra_source((listops.SM_ID, 3, 10, listops.END_ID))}\t1"
    (tmp_path / "basic_test.tsv").write_text(f"Source\tTarget\n{good}\n{line}\n")
    b = listops.make_builder(str(tmp_path / "tfds"), source_dir=str(tmp_path))
    with pytest.raises(ValueError, match=match):
        b.download_and_prepare()


def test_released_files_missing_or_with_generation_options_raise(tmp_path):
    b = listops.make_builder(str(tmp_path / "tfds"), source_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"missing .*basic_train.tsv.*lra_release/listops-1000"):
        b.download_and_prepare()
    with pytest.raises(ValueError, match=r"min_length=20 describe a generated draw"):
        listops.make_builder(str(tmp_path / "tfds"), source_dir=str(tmp_path), min_length=20)
