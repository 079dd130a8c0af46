"""grain input pipelines over prepared TFDS array_record datasets (no TensorFlow anywhere).

Ordering is defined *globally*: one seeded shuffle of example indices per epoch, cut into global batches
of `global_batch_size`; process p of P reads only rows [p*b, (p+1)*b) of each global batch, b = G / P.
Hence
  * the order is a pure function of (seed, step), so a resumed run continues exactly where it stopped
    (`start_step`), and
  * the global batch at every step is the same whatever the number of processes or devices, which is what
    makes single-process, multi-device and multi-process runs comparable parameter for parameter.

Two ways to read the same order: a split within the in-memory bound (`arrays`) is decoded once into
arrays and each batch is one gather per feature, its indices from `shuffle.Order` (grain's shuffle,
vectorised); a larger split is read record by record through grain's threads. They give equal batches.
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np
from absl import logging

from zoo_core.data import arrays as arrays_lib
from zoo_core.data import packing as packing_lib
from zoo_core.data import shuffle

DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "linear_attention_zoo")


def resolve_data_dir(data_dir: str | None) -> str:
    """`data_dir` if given, else $ZOO_DATA_DIR, else ~/.cache/linear_attention_zoo; a leading '~' is the
    home folder (the shell leaves it as is in `--config.data.data_dir=~/data`)."""
    return os.path.expanduser(data_dir or os.environ.get("ZOO_DATA_DIR") or DEFAULT_DATA_DIR)


def stack_records(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """[{'x': [...]}, ...] -> {'x': [n, ...]}."""
    return {k: np.stack([np.asarray(r[k]) for r in records]) for k in records[0]}


def _local_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
    if global_batch_size % process_count:
        raise ValueError(f"batch_size {global_batch_size} is not divisible by the process count {process_count}")
    local = global_batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def read_threads() -> int:
    """grain's reader threads for a streamed split: one per core, at least 2, at most 16."""
    return min(16, max(2, os.cpu_count() or 2))


def train_batches(source, *, global_batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1, start_step: int = 0, prefetch: int = 4,
                  in_memory: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Endless iterator of this process's share of every global training batch, from `start_step` on.

    With `in_memory`, a split within the bound (`arrays.memory_limit()`) is decoded once into arrays in a
    background thread and then batched by index (`arrays.ArraySource.take`, the order from
    `shuffle.Order`); until it is decoded, and for a larger split, batches are read record by record
    through grain. Both give the same batch at every step, bit for bit, so the switch changes nothing.

    Args:
      source: a random-access data source (`builder.as_data_source(split)`), or an `arrays.ArraySource`.
      global_batch_size: examples per optimiser step over all processes.
      seed: shuffle seed; each epoch is reshuffled deterministically.
      process_index, process_count: this process's slot (jax.process_index(), jax.process_count()).
      start_step: the first step to produce (the restored step when resuming).
      prefetch: batches read ahead (by grain's threads, or by one thread over the arrays).
      in_memory: hold the split in memory if it is within the bound; False streams it always.

    Returns:
      Iterator of dicts of numpy arrays with leading dimension global_batch_size / process_count.
    """
    n = len(source)
    if n < global_batch_size:
        raise ValueError(f"batch_size {global_batch_size} exceeds the {n} training examples")
    rows = _local_rows(global_batch_size, process_index, process_count)
    streamed = lambda first: _streamed_batches(source, global_batch_size=global_batch_size, seed=seed, rows=rows,
                                               start_step=first, prefetch=prefetch)
    if not in_memory:
        return streamed(start_step)

    def batches(stop: threading.Event):
        # Runs in the read-ahead thread. Until the split is decoded (by one more thread) the batches are
        # streamed, so the first comes at once; the same step's batch is equal either way.
        decoded: dict[str, Any] = {}
        done = _start(lambda: decoded.update(held=arrays_lib.load(source, stop=stop.is_set)), stop)
        step, stream = start_step, None
        while not done.is_set():
            if stream is None:
                stream = streamed(step)
            yield next(stream)
            step += 1
        if stop.is_set():
            return
        held = decoded.get("held")   # absent when the decode failed (its error is logged)
        if held is None:
            yield from streamed(step) if stream is None else stream
            return
        del stream
        order = shuffle.Order(n, seed)
        for i in itertools.count(step):
            yield held.take(order.positions(i * global_batch_size, (i + 1) * global_batch_size)[rows])

    return _ReadAhead(batches, prefetch)


def make_packer(source, *, keys, seed: int, pad_id: int = 0, factor: int = 1) -> packing_lib.Packer:
    """The `packing.Packer` of a training split: its sequence features `keys` packed into rows `factor` times
    their stored width, in the order of seed `seed`. The split is decoded into memory when it is within
    the bound (`arrays.load`), else read record by record (its lengths once, then each step's examples)."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"data.packing_factor must be an int >= 1, got {factor!r}")
    first = source.__getitems__([0])[0]
    for k in keys:
        if k not in first or np.ndim(first[k]) != 1:
            raise ValueError(f"data.packing packs 1-D sequence features; the examples' {k!r} is "
                             f"{'missing' if k not in first else np.shape(first[k])}")
    widths = [factor * int(np.shape(first[k])[0]) for k in keys]
    held = arrays_lib.load(source)
    if held is not None:
        take = lambda idx: held.take(idx)
    else:
        take = lambda idx: stack_records(source.__getitems__([int(i) for i in idx]))
    return packing_lib.Packer(take, len(source), keys, widths, seed=seed, pad_id=pad_id)


def packed_train_batches(packer: packing_lib.Packer, *, global_batch_size: int, process_index: int = 0,
                         process_count: int = 1, start_step: int = 0,
                         prefetch: int = 4) -> Iterator[dict[str, np.ndarray]]:
    """Endless iterator of this process's rows of every global batch of packed rows (`make_packer`), from
    `start_step` on: step s is rows [s G, (s + 1) G) of the packed stream, a pure function of (seed, step),
    so a resumed run continues with the rows it would have had. Batches: {k, k_segmentation, k_position}
    `[G / process_count, W_k]` for each packed feature k."""
    rows = _local_rows(global_batch_size, process_index, process_count)

    def batches(stop: threading.Event):
        for step in itertools.count(start_step):
            if stop.is_set():
                return
            first = step * global_batch_size
            yield packer.rows(first + rows.start, first + rows.stop)

    return _ReadAhead(batches, prefetch)


def token_count(batch: dict[str, np.ndarray], keys: Sequence[str], pad_id: int = 0) -> tuple[int, int]:
    """(tokens, slots) of `keys` in a batch, packed (by `k_segmentation`) or not (by `pad_id`)."""
    tokens = slots = 0
    for k in keys:
        if k not in batch:
            continue
        seg = batch.get(k + packing_lib.SEGMENTATION)
        real = (np.asarray(seg) > 0) if seg is not None else (np.asarray(batch[k]) != pad_id)
        tokens += int(real.sum())
        slots += real.size
    return tokens, slots


def _streamed_batches(source, *, global_batch_size, seed, rows, start_step, prefetch):
    batches = (grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat()
               .batch(global_batch_size, drop_remainder=True)
               .map(lambda idx: stack_records(source.__getitems__([int(i) for i in idx[rows]]))))
    read = grain.ReadOptions(num_threads=read_threads(), prefetch_buffer_size=prefetch)
    return iter(batches[start_step:].to_iter_dataset(read))


class _ReadAhead:
    """Iterator over the items of `make(stop)`, taken by one daemon thread up to `depth` ahead.

    The thread stops when the iterator is closed or garbage-collected (it holds no reference to it), and
    at interpreter exit, which waits for it (a thread still inside the record reader's C++ code when the
    interpreter finalises aborts the process); `make` should end soon after the event `stop` is set.
    An exception of the items is raised by the `next` that reaches it.
    """

    def __init__(self, make: Callable[[threading.Event], Iterator[Any]], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        queue_, stop = self._queue, self._stop   # the thread must not hold `self`
        _start(lambda: _fill(make, queue_, stop), stop)

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        kind, value = self._queue.get()
        if kind == "error":
            self._error = value
            self.close()
            raise value
        return value

    def close(self):
        self._stop.set()
        try:   # free a slot so a producer blocked on a full queue sees the stop
            self._queue.get_nowait()
        except queue.Empty:
            pass

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the queue module may be gone
            pass


_LIVE: set[tuple[threading.Thread, threading.Event]] = set()


@atexit.register
def _stop_threads(timeout_s: float = 60.0):
    for _, stop in list(_LIVE):
        stop.set()
    for thread, _ in list(_LIVE):
        thread.join(timeout_s)


def _start(target: Callable[[], Any], stop: threading.Event) -> threading.Event:
    """Runs `target` in a daemon thread that exit stops (`stop`) and waits for; returns the event set
    when it returns. An exception is logged."""
    done = threading.Event()

    def run():
        try:
            target()
        except Exception:  # noqa: BLE001 - logged; the caller sees that nothing was made
            logging.exception("the data reading thread failed")
        finally:
            _LIVE.discard((threading.current_thread(), stop))
            done.set()

    thread = threading.Thread(target=run, daemon=True, name="zoo-data")
    _LIVE.add((thread, stop))
    thread.start()
    return done


def _fill(make, out: queue.Queue, stop: threading.Event):
    items = None
    try:
        try:
            items = make(stop)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            items = _raising(e)
        _fill_until_stopped(items, out, stop)
    finally:
        if hasattr(items, "close"):   # a generator: ends what it reads from (grain's iterator) here
            items.close()


def _raising(error: Exception) -> Iterator[Any]:
    yield from ()
    raise error


def _fill_until_stopped(items: Iterator[Any], out: queue.Queue, stop: threading.Event):
    while not stop.is_set():
        try:
            item = ("batch", next(items))
        except StopIteration:
            item = ("error", StopIteration())
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            item = ("error", e)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if item[0] == "error":
            return


def eval_batches(source, *, global_batch_size: int, process_index: int = 0, process_count: int = 1,
                 max_examples: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """One ordered pass over `source` in fixed-size batches; the last one is padded.

    Every batch carries 'example_mask' (float32 [b]): 1 for real examples, 0 for padding, so metrics
    weighted by it are exact over the split, and every batch has one shape (one compile). A whole split
    within the in-memory bound is decoded at the first call and kept while `source` lives (`arrays.held`).
    """
    n = len(source) if max_examples is None else min(max_examples, len(source))
    rows = _local_rows(global_batch_size, process_index, process_count)
    if n == len(source):   # a whole pass: decoded at the first, gathered from at the others
        source = arrays_lib.held(source) or source
    for start in range(0, n, global_batch_size):
        idx = np.arange(start, start + global_batch_size)[rows]
        valid = idx < n
        picked = np.where(valid, idx, 0)
        if isinstance(source, arrays_lib.ArraySource):
            batch = source.take(picked)
        else:
            batch = stack_records(source.__getitems__([int(i) for i in picked]))
        batch["example_mask"] = valid.astype(np.float32)
        yield batch
