"""grain input pipelines over prepared TFDS array_record datasets (no TensorFlow anywhere).

Ordering is defined *globally*: one seeded shuffle of example indices per epoch, cut into global batches
of `global_batch_size`; process p of P reads only rows [p*b, (p+1)*b) of each global batch, b = G / P.
Hence
  * the order is a pure function of (seed, step), so a resumed run continues exactly where it stopped
    (`start_step`), and
  * the global batch at every step is the same whatever the number of processes or devices, which is what
    makes single-process, multi-device and multi-process runs comparable parameter for parameter.
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import grain
import numpy as np

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


def train_batches(source, *, global_batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1, start_step: int = 0, prefetch: int = 4) -> Iterator[dict[str, np.ndarray]]:
    """Endless iterator of this process's share of every global training batch, from `start_step` on.

    Args:
      source: a random-access data source (`builder.as_data_source(split)`).
      global_batch_size: examples per optimiser step over all processes.
      seed: shuffle seed; each epoch is reshuffled deterministically.
      process_index, process_count: this process's slot (jax.process_index(), jax.process_count()).
      start_step: the first step to produce (the restored step when resuming).
      prefetch: batches read ahead by grain's threads.

    Returns:
      Iterator of dicts of numpy arrays with leading dimension global_batch_size / process_count.
    """
    n = len(source)
    if n < global_batch_size:
        raise ValueError(f"batch_size {global_batch_size} exceeds the {n} training examples")
    rows = _local_rows(global_batch_size, process_index, process_count)
    batches = (grain.MapDataset.range(n).shuffle(seed=seed).repeat()
               .batch(global_batch_size, drop_remainder=True)
               .map(lambda idx: stack_records(source.__getitems__([int(i) for i in idx[rows]]))))
    read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=prefetch)
    return iter(batches[start_step:].to_iter_dataset(read))


def eval_batches(source, *, global_batch_size: int, process_index: int = 0, process_count: int = 1,
                 max_examples: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """One ordered pass over `source` in fixed-size batches; the last one is padded.

    Every batch carries 'example_mask' (float32 [b]): 1 for real examples, 0 for padding, so metrics
    weighted by it are exact over the split, and every batch has one shape (one compile).
    """
    n = len(source) if max_examples is None else min(max_examples, len(source))
    rows = _local_rows(global_batch_size, process_index, process_count)
    for start in range(0, n, global_batch_size):
        idx = np.arange(start, start + global_batch_size)[rows]
        valid = idx < n
        batch = stack_records(source.__getitems__([int(i) if v else 0 for i, v in zip(idx, valid)]))
        batch["example_mask"] = valid.astype(np.float32)
        yield batch
