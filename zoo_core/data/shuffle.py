"""The training order of `pipeline.train_batches` as numpy arrays: grain's index shuffle, vectorised.

`grain.MapDataset.range(n).shuffle(seed).repeat()` puts example `index_shuffle(i, n - 1, seed + e, 4)` at
position i of epoch e. Grain computes it one Python call per example (a few microseconds each: the
limit of a 256-example batch). This module computes a whole epoch at once with the same cipher
(grain's `index_shuffle.cc`: a Simon block cipher on B = max(16, ceil(log2(max_index))) rounded-up-even
bits, keyed by `std::seed_seq{seed}`, cycle-walked into [0, max_index]); `tests/zoo_core/data/
shuffle_test.py` checks it equal to grain's function element by element.
"""
from __future__ import annotations

import math

from grain.experimental import index_shuffle as grain_index_shuffle
import numpy as np

_WALK_LIMIT = 8   # above this many encryptions per example on average, the scalar C++ function
ROUNDS = 4   # what grain's ShuffleMapDataset uses
_M32 = 0xFFFFFFFF


def seed_seq_keys(seed: int, count: int) -> list[int]:
    """`std::seed_seq{seed}.generate(count words)`: grain's round keys of a seed (C++ [rand.util.seedseq])."""
    v = [seed & _M32]
    s, n = len(v), count
    b = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)
    mix = lambda x: x ^ (x >> 27)
    for k in range(m):
        r1 = (1664525 * mix(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n])) & _M32
        r2 = (r1 + (s if k == 0 else (k % n + v[k - 1]) if k <= s else k % n)) & _M32
        b[(k + p) % n] = (b[(k + p) % n] + r1) & _M32
        b[(k + q) % n] = (b[(k + q) % n] + r2) & _M32
        b[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * mix((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & _M32)) & _M32
        r4 = (r3 - k % n) & _M32
        b[(k + p) % n] ^= r3
        b[(k + q) % n] ^= r4
        b[k % n] = r4
    return b


def _block_bits(max_index: int) -> int:
    bits = math.ceil(math.log2(max_index))
    return min(max(bits + bits % 2, 16), 64)


def index_shuffle(index: np.ndarray, max_index: int, seed: int, rounds: int = ROUNDS) -> np.ndarray:
    """grain's `index_shuffle` applied to every element of `index` (ints in [0, max_index]): int64, same shape."""
    index = np.asarray(index, dtype=np.uint64)
    if max_index == 0:
        return np.zeros(index.shape, np.int64)
    w = _block_bits(max_index) // 2
    mask = np.uint64((1 << w) - 1)
    keys = [np.uint64(k & ((1 << w) - 1)) for k in seed_seq_keys(seed, rounds)]
    sw, one, two, eight = np.uint64(w), np.uint64(1), np.uint64(2), np.uint64(8)
    rotl = lambda x, r: ((x << r) | (x >> (sw - r))) & mask

    def simon_f(x):
        return (rotl(x, one) & rotl(x, eight)) ^ rotl(x, two)

    def encrypt(value):
        left, right = (value >> sw) & mask, value & mask
        for i in range(0, rounds, 2):
            left = left ^ simon_f(right) ^ keys[i]
            right = right ^ simon_f(left) ^ keys[i + 1]
        return (left << sw) | right

    out = encrypt(index)
    outside = np.flatnonzero(out > np.uint64(max_index))
    while outside.size:   # cycle walking: encrypt again until the value lands in [0, max_index]
        out[outside] = encrypt(out[outside])
        outside = outside[out[outside] > np.uint64(max_index)]
    return out.astype(np.int64)


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """int64 [n]: the example at each position of `epoch` in `range(n).shuffle(seed).repeat()`."""
    seed = (seed + epoch) % 2**32
    if n > 1 and (1 << _block_bits(n - 1)) > _WALK_LIMIT * n:
        # Cycle walking takes 2**B / n encryptions per example: grain's C++ loop is cheaper there.
        return np.array([grain_index_shuffle(i, max_index=n - 1, seed=seed, rounds=ROUNDS) for i in range(n)],
                        np.int64)
    return index_shuffle(np.arange(n), n - 1, seed)


class Order:
    """The example indices of global positions [start, stop) of the shuffled, repeated stream, with the
    permutation of the last epochs used kept (a batch spans at most two epochs)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            if len(self._epochs) >= 2:
                del self._epochs[min(self._epochs)]
            self._epochs[e] = epoch_permutation(self.n, self.seed, e)
        return self._epochs[e]

    def positions(self, start: int, stop: int) -> np.ndarray:
        """int64 [stop - start]: the example index at each global position."""
        parts = []
        while start < stop:
            e, i = divmod(start, self.n)
            take = min(stop - start, self.n - i)
            parts.append(self._epoch(e)[i:i + take])
            start += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
