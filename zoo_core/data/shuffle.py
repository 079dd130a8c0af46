"""The training order of `pipeline.train_batches` as numpy arrays: grain's index shuffle, vectorised.

`grain.MapDataset.range(n).shuffle(seed).repeat()` puts example `index_shuffle(i, n - 1, seed + e, 4)` at
position i of epoch e. Grain computes it one Python call per example (a few microseconds each, and up to
~100 us when n is far below 2**16: each call walks ~2**16 / n encryptions). This module computes a whole
epoch at once with the same cipher (grain's `index_shuffle.cc`: a Simon block cipher on
B = max(16, ceil(log2(max_index))) rounded-up-even bits, keyed by `std::seed_seq{seed}`, cycle-walked into
[0, max_index]), in one of two ways:
  * n > 2**16 (2**B < 4n): encrypt [0, n) and re-encrypt the few values outside [0, n) (`index_shuffle`);
  * n <= 2**16 (B = 16, so 2**B may be thousands of times n): the cipher as a table over all 2**16 blocks,
    then each start's first value in [0, n) along its cycle by pointer doubling (`_table_walk`): about
    log2(2**16 / n) whole-table gathers and a few [n] ones, not one Python step per encryption.
`tests/zoo_core/data/shuffle_test.py` checks both equal to grain's function element by element and to
grain's dataset order. Grain's quirk is copied too: for n = 2**k + 1 with k even and >= 16, index 2**k does
not fit the k-bit block, so its "permutation" repeats one example and leaves one out.
"""
from __future__ import annotations

import math

import numpy as np

ROUNDS = 4   # what grain's ShuffleMapDataset uses
_M32 = 0xFFFFFFFF
_TABLE_BITS = 16   # grain's smallest block: every n <= 2**16 shuffles in it


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


def _simon_f8(x: np.ndarray) -> np.ndarray:
    """Simon's round function on 8-bit halves (rotl 1 & rotl 8 ^ rotl 2; rotl 8 is the identity)."""
    return (((x << 1) | (x >> 7)) & x) ^ ((x << 2) | (x >> 6))


_BYTE = np.arange(256, dtype=np.uint8)
_WORD = np.arange(1 << _TABLE_BITS, dtype=np.uint16)
# The two half-rounds of a 16-bit block v = left << 8 | right without their key, as tables over v:
# `left ^= f(right)` and `right ^= f(left)` (the round key is xored in after the lookup).
_LEFT_ROUND = _WORD ^ (_simon_f8(_BYTE)[_WORD & 0xFF].astype(np.uint16) << 8)
_RIGHT_ROUND = _WORD ^ _simon_f8(_BYTE)[_WORD >> 8].astype(np.uint16)


def _cipher_table(seed: int, rounds: int = ROUNDS) -> np.ndarray:
    """uint16 [2**16]: grain's 16-bit block cipher (`index_shuffle`'s one encryption) of every block."""
    keys = [k & 0xFF for k in seed_seq_keys(seed, rounds)]
    table = _LEFT_ROUND ^ np.uint16(keys[0] << 8)
    for i in range(0, rounds, 2):
        if i:
            table = np.take(_LEFT_ROUND, table) ^ np.uint16(keys[i] << 8)
        table = np.take(_RIGHT_ROUND, table) ^ np.uint16(keys[i + 1])
    return table


def _table_walk(table: np.ndarray, n: int) -> np.ndarray:
    """int64 [n]: for each start s in [0, n), the first of table[s], table[table[s]], ... in [0, n).

    Cycle walking by pointer doubling: in `jump` the nodes of [0, n) stay put and any other node x goes to
    table[x]; squaring it (`jump[jump]`) doubles the steps a node takes, stopping in [0, n). After k
    squarings, when 2**k is the mean walk N / n, the walks from table[s] end in a few more jumps.
    """
    size = len(table)
    jump = table.astype(np.intp)
    jump[:n] = np.arange(n)
    spare = np.empty_like(jump)
    for _ in range(max(0, math.ceil(math.log2(size / n)))):
        np.take(jump, jump, out=spare, mode="clip")   # "clip": unbuffered; every index is in range
        jump, spare = spare, jump
    walk = table[:n].astype(np.intp)
    for _ in range(size):   # a walk from [0, n) ends within N steps: `table` is a permutation
        if walk.max() < n:
            return walk.astype(np.int64)
        walk = np.take(jump, walk)
    raise AssertionError(f"the cipher table of {size} blocks is not a permutation")


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """int64 [n]: the example at each position of `epoch` in `range(n).shuffle(seed).repeat()`."""
    seed = (seed + epoch) % 2**32
    if 1 < n <= 1 << _TABLE_BITS:
        return _table_walk(_cipher_table(seed), n)
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
