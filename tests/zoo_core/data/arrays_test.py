"""Splits held in memory (`zoo_core.data.arrays`): the batch at every step equals the streaming path's,
bit for bit and dtype for dtype, for each dataset kind of the main configs (their `:smoke` data), also
after a resume offset and per process; eval batches too; the memory bound and its fallback."""
import importlib
import itertools
import threading

import numpy as np
import pytest

from zoo_core import data as data_lib
from zoo_core.data import arrays, pipeline

# The main configs' datasets: AGF ListOps, SAMoVAR Fig. 4, HTGN number_words.
CONFIGS = ("zoo_core.configs.agf.lra_listops", "zoo_core.configs.samovar.synthetic_var", "zoo_core.configs.htgn.number_words")


@pytest.fixture(scope="module", params=CONFIGS)
def prepared(request, tmp_path_factory):
    config = importlib.import_module(request.param).get_config("smoke")
    builder = data_lib.make_builder(config.data.name, str(tmp_path_factory.mktemp("d")),
                                    **config.data.options.to_dict())
    builder.download_and_prepare()
    return builder.as_data_source(config.data.train_split), builder.as_data_source(config.data.eval_split)


def _assert_same_batches(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert (g[k].dtype, g[k].shape) == (w[k].dtype, w[k].shape), k
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


@pytest.mark.parametrize("batch_size,seed", [(8, 0), (12, 2**32 - 1)])
def test_in_memory_batches_equal_the_streamed_ones_at_every_step(prepared, batch_size, seed):
    train, _ = prepared
    steps = 3 * len(train) // batch_size + 2   # three epochs and more; batches straddle epochs at 12
    take = lambda start, count, **kw: list(itertools.islice(pipeline.train_batches(
        train, global_batch_size=batch_size, seed=seed, start_step=start, **kw), count))
    streamed = take(0, steps, in_memory=False)
    _assert_same_batches(take(0, steps), streamed)
    for start in (1, len(train) // batch_size, steps - 3):   # resumed runs
        _assert_same_batches(take(start, steps - start), streamed[start:])


def test_batches_switch_from_streamed_to_held_when_the_split_is_decoded(prepared, monkeypatch):
    train, _ = prepared
    release, real_load, taken = threading.Event(), arrays.load, []
    monkeypatch.setattr(arrays, "load", lambda source, **kw: release.wait(60) and real_load(source, **kw))
    real_take = arrays.ArraySource.take
    monkeypatch.setattr(arrays.ArraySource, "take", lambda self, i: taken.append(len(i)) or real_take(self, i))
    steps = 2 * len(train) // 8
    it = pipeline.train_batches(train, global_batch_size=8, seed=2, start_step=5, prefetch=1)
    got = [next(it) for _ in range(6)]   # streamed: the decode waits
    assert taken == []
    release.set()
    got += [next(it) for _ in range(steps)]
    assert taken, "never switched to the held split"
    _assert_same_batches(got, list(itertools.islice(pipeline.train_batches(
        train, global_batch_size=8, seed=2, start_step=5, in_memory=False), steps + 6)))


def test_process_shards_of_the_in_memory_path(prepared):
    train, _ = prepared
    for p in range(2):
        take = lambda in_memory: list(itertools.islice(pipeline.train_batches(
            train, global_batch_size=8, seed=4, start_step=3, process_index=p, process_count=2,
            in_memory=in_memory), 4))
        _assert_same_batches(take(True), take(False))


def test_eval_batches_and_records_of_a_held_split(prepared):
    _, evaluation = prepared
    held = arrays.load(evaluation)
    assert held is not None and len(held) == len(evaluation)
    _assert_same_batches(list(pipeline.eval_batches(held, global_batch_size=6)),
                         list(pipeline.eval_batches(evaluation, global_batch_size=6)))
    for i in (0, len(held) - 1):
        _assert_same_batches([pipeline.stack_records(held.__getitems__([i, 0]))],
                             [pipeline.stack_records(evaluation.__getitems__([i, 0]))])
        assert {k: type(v) for k, v in held[i].items()} == {k: type(v) for k, v in evaluation[i].items()}
    assert arrays.load(held) is held


def test_eval_batches_decode_a_whole_split_once(prepared, monkeypatch):
    _, evaluation = prepared
    want = list(pipeline.eval_batches(evaluation, global_batch_size=5, max_examples=7))   # a part: streamed
    loads, real_load = [], arrays.load
    monkeypatch.setattr(arrays, "load", lambda source, **kw: loads.append(source) or real_load(source, **kw))
    source = evaluation.__class__(evaluation.dataset_info, evaluation.split)   # not yet held
    for _ in range(3):
        batches = list(pipeline.eval_batches(source, global_batch_size=5))
    assert loads == [source]
    _assert_same_batches(batches, list(pipeline.eval_batches(evaluation, global_batch_size=5)))
    _assert_same_batches(list(pipeline.eval_batches(source, global_batch_size=5, max_examples=7)), want)



def test_the_memory_bound_streams_larger_splits(prepared, monkeypatch):
    train, _ = prepared
    record_bytes = sum(np.asarray(v).nbytes for v in train[0].values())
    assert arrays.load(train, max_bytes=record_bytes * len(train)) is not None
    assert arrays.load(train, max_bytes=record_bytes * len(train) - 1) is None
    monkeypatch.setenv(arrays.ENV_LIMIT, "0")
    assert arrays.memory_limit() == 0 and arrays.load(train) is None
    take = lambda **kw: list(itertools.islice(pipeline.train_batches(train, global_batch_size=4, seed=0, **kw), 3))
    _assert_same_batches(take(in_memory=True), take(in_memory=False))   # too big: streamed
    monkeypatch.setenv(arrays.ENV_LIMIT, "lots")
    with pytest.raises(ValueError, match="ZOO_DATA_IN_MEMORY_BYTES must be a number of bytes"):
        arrays.memory_limit()
    monkeypatch.delenv(arrays.ENV_LIMIT)
    assert 0 < arrays.memory_limit() <= arrays.MAX_DEFAULT_BYTES


class _Records:
    """A data source of given records."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitems__(self, keys):
        return [self.records[k] for k in keys]


def test_records_of_different_shapes_are_streamed():
    ragged = _Records([{"x": np.zeros(3, np.int32)}, {"x": np.zeros(4, np.int32)}] * 4)
    assert arrays.load(ragged) is None
    assert arrays.load(_Records([{"x": np.zeros(3, np.int32)}, {"x": np.zeros(3, np.int64)}] * 4)) is None
    batches = list(itertools.islice(pipeline.train_batches(_Records([{"x": i} for i in range(8)]),
                                                           global_batch_size=4, seed=1), 2))
    assert sorted(np.concatenate([b["x"] for b in batches]).tolist()) == list(range(8))


def test_an_error_in_the_read_ahead_thread_reaches_the_caller():
    held = arrays.ArraySource({"x": np.arange(8)}, {})
    calls = []

    def make(stop):
        for step in range(3):
            calls.append(step)
            if step == 2:
                raise RuntimeError("broken batch")
            yield held.take([step])

    it = pipeline._ReadAhead(make, 2)
    assert [next(it)["x"].tolist() for _ in range(2)] == [[0], [1]]
    for _ in range(2):   # and again: the iterator stays broken
        with pytest.raises(RuntimeError, match="broken batch"):
            next(it)
    assert calls == [0, 1, 2]
    def unmade(stop):
        raise ValueError("no items")

    with pytest.raises(ValueError, match="no items"):
        next(pipeline._ReadAhead(unmade, 2))
    done = pipeline._ReadAhead(lambda stop: iter([1]), 2)
    assert next(done) == 1
    with pytest.raises(StopIteration):
        next(done)
