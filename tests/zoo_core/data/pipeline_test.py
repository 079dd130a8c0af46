"""grain pipeline: deterministic, resumable order; process shards compose the global batch; eval padding."""
import numpy as np
import pytest

from zoo_core import data as data_lib
from zoo_core.data import pipeline


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    builder = data_lib.make_builder("synthetic_linear", str(tmp_path_factory.mktemp("d")), num_train=40, num_test=10)
    builder.download_and_prepare()
    return builder.as_data_source("train"), builder.as_data_source("test")


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_order_is_deterministic_and_resumes(source):
    train, _ = source
    a = _take(pipeline.train_batches(train, global_batch_size=8, seed=3), 12)
    b = _take(pipeline.train_batches(train, global_batch_size=8, seed=3), 12)
    resumed = _take(pipeline.train_batches(train, global_batch_size=8, seed=3, start_step=7), 5)
    other = _take(pipeline.train_batches(train, global_batch_size=8, seed=4), 1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    for x, y in zip(a[7:], resumed):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert not np.array_equal(a[0]["inputs"], other[0]["inputs"])


def test_each_epoch_sees_every_example_once_and_is_reshuffled(source):
    train, _ = source
    batches = _take(pipeline.train_batches(train, global_batch_size=8, seed=0), 10)   # 2 epochs of 40
    epoch1 = np.concatenate([b["inputs"] for b in batches[:5]])
    epoch2 = np.concatenate([b["inputs"] for b in batches[5:]])
    all_rows = np.stack([train[i]["inputs"] for i in range(len(train))])
    for epoch in (epoch1, epoch2):
        assert sorted(map(tuple, epoch.round(6))) == sorted(map(tuple, all_rows.round(6)))
    assert not np.array_equal(epoch1, epoch2)


def test_process_shards_compose_the_global_batch(source):
    train, _ = source
    whole = _take(pipeline.train_batches(train, global_batch_size=8, seed=1), 3)
    parts = [_take(pipeline.train_batches(train, global_batch_size=8, seed=1, process_index=p, process_count=2), 3)
             for p in range(2)]
    for step in range(3):
        np.testing.assert_array_equal(np.concatenate([parts[0][step]["inputs"], parts[1][step]["inputs"]]),
                                      whole[step]["inputs"])


def test_eval_batches_pad_and_mask_the_last_batch(source):
    _, test = source
    batches = list(pipeline.eval_batches(test, global_batch_size=4))
    assert [b["inputs"].shape[0] for b in batches] == [4, 4, 4]
    np.testing.assert_array_equal(np.concatenate([b["example_mask"] for b in batches]), [1] * 10 + [0] * 2)
    assert sum(b["example_mask"].sum() for b in batches) == len(test)


def test_bad_sizes_raise(source):
    train, _ = source
    with pytest.raises(ValueError, match="exceeds"):
        pipeline.train_batches(train, global_batch_size=64, seed=0)
    with pytest.raises(ValueError, match="divisible by the process count"):
        pipeline.train_batches(train, global_batch_size=7, seed=0, process_count=2)
    with pytest.raises(ValueError, match="no option"):
        data_lib.make_builder("synthetic_linear", "/tmp", num_rows=3)
