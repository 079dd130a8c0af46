"""Packing of sequence examples into rows, as flax's wmt input pipeline packs (`pack_dataset`).

Semantics (flax examples/wmt/input_pipeline.py, `pack_dataset` / `_pack_with_tf_ops`, read, not copied):
  * each example's sequence features are cut at their last non-pad token (an example's length) and at the
    row width;
  * examples are taken in order and appended to one open row while every feature still fits its width;
    when one would not, the row is closed (padded) and a new one opened (greedy, one open row);
  * each packed feature `k` gets `k_segmentation` int32 `[R, W]` (1, 2, ... per example of the row, 0 at
    padding) and `k_position` int32 `[R, W]` (0, 1, ... restarting at each example, 0 at padding);
    the zoo's layers read them as `segment_ids` and `positions` (docs/specs/context_parallel.md).
The training order stays a pure function of (seed, step): epoch e's shuffled order (`shuffle.Order`) is
packed into rows, the epochs' rows are concatenated, and step s takes rows [s B, (s + 1) B). A resumed run
packs the epochs before its step again (lengths only, a fraction of a second per 50k examples) and
continues with the same rows.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from zoo_core.data import shuffle

SEGMENTATION, POSITION = "_segmentation", "_position"


def lengths(x: np.ndarray, pad_id: int = 0) -> np.ndarray:
    """int64 `[n]`: the length of each row of `x` `[n, W]`, up to and including its last non-pad token."""
    x = np.asarray(x)
    nonpad = x != pad_id
    last = x.shape[1] - np.argmax(nonpad[:, ::-1], axis=1)
    return np.where(nonpad.any(axis=1), last, 0).astype(np.int64)


def assign_rows(lens: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """int64 `[R + 1]`: the first example of each row (and n), greedy as flax packs.

    Args:
      lens: int `[n, K]`, each example's length in each of the K packed features (already cut at widths).
      widths: the K row widths.
    """
    lens = np.asarray(lens, np.int64)
    n, k = lens.shape
    assert len(widths) == k, (lens.shape, widths)
    starts = [0]
    used = [0] * k
    rows = lens.tolist()
    for i, example in enumerate(rows):
        if any(u + e > w for u, e, w in zip(used, example, widths)):
            starts.append(i)
            used = list(example)
        else:
            used = [u + e for u, e in zip(used, example)]
    if n:
        starts.append(n)
    return np.asarray(starts, np.int64)


def pack_rows(examples: dict[str, np.ndarray], lens: np.ndarray, starts: np.ndarray,
              widths: Sequence[int], keys: Sequence[str], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Packs consecutive examples into rows (vectorised: one scatter per feature).

    Args:
      examples: {k: `[n, w_k]`} for k in `keys`, in packing order.
      lens: int `[n, K]` their lengths (cut at `widths`).
      starts: int `[R + 1]` the first example of each row relative to `examples` (`assign_rows`).
      widths: the row width of each key.
      keys: the packed features.
    Returns:
      {k, k_segmentation, k_position: `[R, W_k]`}.
    """
    n = lens.shape[0]
    counts = np.diff(starts)
    row = np.repeat(np.arange(len(counts)), counts)                       # [n]
    segment = np.arange(n) - np.repeat(starts[:-1], counts) + 1            # [n], 1-based in its row
    out = {}
    for j, (key, width) in enumerate(zip(keys, widths)):
        x = np.asarray(examples[key])
        ln = lens[:, j]
        # the offset of each example in its row: the lengths before it in the same row
        cum = np.cumsum(ln) - ln
        offset = cum - np.repeat(cum[starts[:-1]], counts)
        cols = np.arange(x.shape[1])
        keep = cols[None, :] < ln[:, None]                                   # [n, w]
        ex, col = np.nonzero(keep)
        flat = row[ex] * width + offset[ex] + col
        values = np.full(len(counts) * width, pad_id, x.dtype)
        values[flat] = x[ex, col]
        seg = np.zeros(len(counts) * width, np.int32)
        seg[flat] = segment[ex]
        pos = np.zeros(len(counts) * width, np.int32)
        pos[flat] = col
        shape = (len(counts), width)
        out[key] = values.reshape(shape)
        out[key + SEGMENTATION] = seg.reshape(shape)
        out[key + POSITION] = pos.reshape(shape)
    return out


@dataclasses.dataclass
class PackStats:
    """Padding shares of one epoch: unpacked (the examples as stored) and packed (the rows)."""
    examples: int
    rows: int
    tokens: int
    unpacked_slots: int
    packed_slots: int

    @property
    def padding_unpacked(self) -> float:
        return 1.0 - self.tokens / max(self.unpacked_slots, 1)

    @property
    def padding_packed(self) -> float:
        return 1.0 - self.tokens / max(self.packed_slots, 1)

    def line(self) -> str:
        return (f"packing: {self.padding_unpacked:.0%} padding unpacked -> {self.padding_packed:.0%} packed, "
                f"{self.examples / max(self.rows, 1):.1f} examples per row")


class Packer:
    """The packed training stream of a source: rows of epoch e from its shuffled order, steps of B rows.

    Args:
      take: indices -> {feature: `[len, ...]`} (the source's examples, e.g. `ArraySource.take`).
      n: the number of examples.
      keys: the features to pack (e.g. ('inputs', 'targets')); the others are dropped (per-example values
        have no place in a packed row).
      widths: the row width of each key.
      seed: the shuffle seed (the same order as the unpacked pipeline's).
      pad_id: the pad token (lengths end at the last other token).
    """

    def __init__(self, take: Callable[[np.ndarray], dict], n: int, keys: Sequence[str], widths: Sequence[int],
                 seed: int, pad_id: int = 0, chunk: int = 8192):
        self.take, self.n, self.keys, self.widths, self.pad_id = take, n, tuple(keys), tuple(widths), pad_id
        self.order = shuffle.Order(n, seed)
        self.stored_widths = None
        parts = []
        for first in range(0, n, chunk):
            batch = take(np.arange(first, min(first + chunk, n)))
            self.stored_widths = tuple(int(batch[k].shape[1]) for k in self.keys)
            parts.append(np.stack([np.minimum(lengths(batch[k], pad_id), w)
                                   for k, w in zip(self.keys, self.widths)], axis=1))
        self.lens = np.concatenate(parts) if parts else np.zeros((0, len(self.keys)), np.int64)   # [n, K]
        self._epochs: dict[int, np.ndarray] = {}
        self._first_row = [0]   # the first global row of each epoch computed so far (and the next)

    def _starts(self, e: int) -> np.ndarray:
        """`assign_rows` of epoch e's order (the last two kept)."""
        if e not in self._epochs:
            if len(self._epochs) >= 2:
                del self._epochs[min(self._epochs)]
            perm = self.order.positions(e * self.n, (e + 1) * self.n)
            self._epochs[e] = assign_rows(self.lens[perm], self.widths)
        return self._epochs[e]

    def _epoch_of_row(self, r: int) -> int:
        while self._first_row[-1] <= r:
            e = len(self._first_row) - 1
            self._first_row.append(self._first_row[-1] + len(self._starts(e)) - 1)
        return int(np.searchsorted(self._first_row, r, side="right")) - 1

    def stats(self) -> PackStats:
        """The padding shares of epoch 0."""
        rows = len(self._starts(0)) - 1
        return PackStats(examples=self.n, rows=rows, tokens=int(self.lens.sum()),
                         unpacked_slots=self.n * sum(self.stored_widths or self.widths),
                         packed_slots=rows * sum(self.widths))

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Global packed rows [start, stop) of the stream (they may span epochs)."""
        parts = []
        while start < stop:
            e = self._epoch_of_row(start)
            starts = self._starts(e)
            r0 = start - self._first_row[e]
            r1 = min(stop - self._first_row[e], len(starts) - 1)
            first, last = starts[r0], starts[r1]
            perm = self.order.positions(e * self.n + first, e * self.n + last)
            examples = self.take(perm)
            parts.append(pack_rows(examples, self.lens[perm], starts[r0:r1 + 1] - first, self.widths, self.keys,
                                   self.pad_id))
            start += r1 - r0
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

