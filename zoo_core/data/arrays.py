"""A split held in memory as one numpy array per feature, read once and batched by index.

`load` decodes every record of a TFDS data source in one ordered pass into arrays `[n, ...]`; `ArraySource`
then serves any list of indices as a batch with one gather per feature (`take`), and behaves as a data
source (`len`, `[i]`, `__getitems__`) for code that reads records. A batch from `take` equals
`pipeline.stack_records(source.__getitems__(indices))` bit for bit, dtypes included: scalars stack as
int64/float64, text as bytes `S<w>` with w the longest text of that batch.

Memory bound: a split is held when its decoded size (the first record's bytes times the number of
records) is at most `memory_limit()`: $ZOO_DATA_IN_MEMORY_BYTES if set (0 = never), else a quarter of
the machine's physical memory, at most 8 GiB. Larger splits, and splits whose records differ in shape
or dtype, are streamed from disk as before.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np
from absl import logging

ENV_LIMIT = "ZOO_DATA_IN_MEMORY_BYTES"
MAX_DEFAULT_BYTES = 8 << 30
_CHUNK = 4096   # records decoded per read


def memory_limit() -> int:
    """Bytes of decoded data a split may take to be held in memory (see the module docstring)."""
    value = os.environ.get(ENV_LIMIT, "").strip()
    if value:
        try:
            limit = int(float(value))
        except ValueError:
            raise ValueError(f"${ENV_LIMIT} must be a number of bytes, got {value!r}") from None
        if limit < 0:
            raise ValueError(f"${ENV_LIMIT} must be >= 0 bytes, got {value!r}")
        return limit
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):   # no sysconf (not POSIX): the cap alone
        return MAX_DEFAULT_BYTES
    return min(MAX_DEFAULT_BYTES, physical // 4)


def _record_bytes(record: dict[str, Any]) -> int:
    return sum(np.asarray(v).nbytes for v in record.values())


class ArraySource:
    """A decoded split: `arrays[k]` is feature k of every record, `[n, ...]`.

    `widths[k]` is set for text features (dtype kind 'S'/'U'): each record's own itemsize, so that a
    batch is cast to the width `np.stack` would give it. `plain` names the features the decoder gives
    as Python objects (int, bytes), which a record (`[i]`) gives the same way.
    """

    def __init__(self, arrays: dict[str, np.ndarray], widths: dict[str, np.ndarray], plain=()):
        lengths = {len(a) for a in arrays.values()}
        assert len(lengths) == 1, lengths
        self.arrays, self.widths, self.plain = arrays, widths, frozenset(plain)
        self._n = lengths.pop()

    def __len__(self) -> int:
        return self._n

    def take(self, indices) -> dict[str, np.ndarray]:
        """{k: [len(indices), ...]} for int indices in [0, n): a new array per feature."""
        indices = np.asarray(indices, dtype=np.int64)
        batch = {}
        for k, a in self.arrays.items():
            rows = a[indices]
            if k in self.widths:
                width = int(self.widths[k][indices].max()) if len(indices) else 1
                rows = rows.astype(f"{a.dtype.kind}{width // np.dtype(a.dtype.kind + '1').itemsize}")
            batch[k] = rows
        return batch

    def __getitems__(self, indices) -> list[dict[str, Any]]:
        return [self[i] for i in indices]

    def __getitem__(self, i) -> dict[str, Any]:
        i = int(i)
        if not -self._n <= i < self._n:
            raise IndexError(f"record {i} of a split of {self._n}")
        return {k: a[i].item() if k in self.plain else a[i] for k, a in self.arrays.items()}


def load(source, *, max_bytes: int | None = None, stop=lambda: False) -> ArraySource | None:
    """`source` (a TFDS data source, or anything with len and `__getitems__`) decoded into memory, or
    None when it would take more than `max_bytes` (default `memory_limit()`) or its records differ in
    shape or dtype (then stream it), or when `stop()` turns true between two reads."""
    if isinstance(source, ArraySource):
        return source
    n = len(source)
    if n == 0:
        return None
    limit = memory_limit() if max_bytes is None else max_bytes
    first = source.__getitems__([0])[0]
    estimate = _record_bytes(first) * n
    if estimate > limit:
        logging.info("streaming a split of %d records (about %.0f MB decoded > the in-memory limit %.0f MB)",
                     n, estimate / 1e6, limit / 1e6)
        return None
    texts = {k for k, v in first.items() if np.asarray(v).dtype.kind in "SU"}
    arrays: dict[str, Any] = {}
    for k, v in first.items():
        v = np.asarray(v)
        arrays[k] = [None] * n if k in texts else np.empty((n, *v.shape), v.dtype)
    for start in range(0, n, _CHUNK):
        if stop():
            return None
        records = source.__getitems__(list(range(start, min(start + _CHUNK, n))))
        for k, a in arrays.items():
            if k in texts:
                a[start:start + len(records)] = [np.asarray(r[k]) for r in records]
                continue
            for j, r in enumerate(records, start):
                v = np.asarray(r[k])
                if v.shape != a.shape[1:] or v.dtype != a.dtype:
                    logging.info("streaming: feature %r of record %d is %s %s, record 0's %s %s", k, j,
                                 v.dtype, v.shape, a.dtype, a.shape[1:])
                    return None
                a[j] = v
    widths = {}
    for k in texts:
        values = arrays[k]
        kinds = {v.dtype.kind for v in values}
        if len(kinds) != 1 or any(v.shape != () for v in values):
            return None
        widths[k] = np.array([v.dtype.itemsize for v in values], np.int64)
        arrays[k] = np.stack(values)
    return ArraySource(arrays, widths, plain=[k for k, v in first.items() if not isinstance(v, np.ndarray)])


_HELD: dict[int, tuple[Any, ArraySource | None]] = {}
_HELD_LOCK = threading.Lock()


def held(source) -> ArraySource | None:
    """`load(source)` once per source object, kept while that object lives (None, too big, included):
    what a split read again and again (every evaluation) is served from."""
    if isinstance(source, ArraySource):
        return source
    key = id(source)
    with _HELD_LOCK:
        entry = _HELD.get(key)
        if entry is not None and entry[0]() is source:
            return entry[1]
        try:
            ref = weakref.ref(source, lambda _, key=key: _HELD.pop(key, None))
        except TypeError:   # an object without weak references: not kept
            return load(source)
        value = load(source)
        _HELD[key] = (ref, value)
        return value
