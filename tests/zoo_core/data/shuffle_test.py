"""`zoo_core.data.shuffle`: the vectorised index shuffle equals grain's, element by element, and `Order`
gives the example order of `grain.MapDataset.range(n).shuffle(seed).repeat()` across epoch boundaries."""
import grain
import numpy as np
import pytest
from grain.experimental import index_shuffle as grain_index_shuffle

from zoo_core.data import shuffle


# Block sizes 16 (the minimum) to 20, each side of a power of two, and the seed's extremes.
@pytest.mark.parametrize("n", [2, 3, 40, 255, 8191, 8193, 20000, 65536, 65537, 96000])
@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_index_shuffle_equals_grains(n, seed):
    index = np.arange(n) if n <= 20000 else np.random.default_rng(n).integers(0, n, 4000)
    want = [grain_index_shuffle(int(i), max_index=n - 1, seed=seed, rounds=4) for i in index]
    np.testing.assert_array_equal(shuffle.index_shuffle(index, n - 1, seed), want)
    if n <= 20000:   # the whole epoch, through either of epoch_permutation's two ways
        np.testing.assert_array_equal(shuffle.epoch_permutation(n, seed, 0), want)


def test_epoch_permutation_is_a_permutation_and_changes_with_the_epoch():
    a, b = shuffle.epoch_permutation(30000, 5, 0), shuffle.epoch_permutation(30000, 5, 1)
    np.testing.assert_array_equal(np.sort(a), np.arange(30000))
    np.testing.assert_array_equal(np.sort(b), np.arange(30000))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(shuffle.epoch_permutation(1, 5, 3), [0])


@pytest.mark.parametrize("n,seed", [(37, 3), (9000, 2**32 - 2)])
def test_order_is_grains_repeated_shuffle(n, seed):
    stream = grain.MapDataset.range(n).shuffle(seed=seed).repeat()
    order = shuffle.Order(n, seed)
    for start, stop in [(0, 5), (n - 3, n + 4), (3 * n - 1, 5 * n + 2), (2, 3)]:   # epoch boundaries, 2+ epochs
        np.testing.assert_array_equal(order.positions(start, stop), [stream[i] for i in range(start, stop)])


# Fixed random sizes: two in the 16-bit block (the table walk), one above it (index_shuffle's walk).
_RANDOM_N = [int(x) for x in np.random.default_rng(43).integers([6, 6, 2**16 + 1], [2**16, 2**16, 2**18])]


@pytest.mark.parametrize("n,seed", list(zip([1, 2, 3, 5, 17, 270, 1000, 4096, 4097, 20000] + _RANDOM_N,
                                            [0, 7, 2**32 - 1, 1, 2**31, 2**32 - 1, 0, 12345, 7, 2**32 - 1, 3, 99, 0])))
def test_epoch_permutation_is_grains_shuffled_dataset(n, seed):
    # Against grain's own dataset (not its index function): epochs 0 and 1 (seed + 1, wrapping at 2**32).
    stream = grain.MapDataset.range(n).shuffle(seed=seed).repeat()
    rng = np.random.default_rng(n)
    positions = np.arange(n) if n <= 5000 else np.unique(np.r_[0, n - 1, rng.integers(0, n, 1500)])
    for epoch in (0, 1):
        got = shuffle.epoch_permutation(n, seed, epoch)
        assert got.dtype == np.int64 and got.shape == (n,)
        np.testing.assert_array_equal(got[positions], [stream[epoch * n + int(i)] for i in positions])
