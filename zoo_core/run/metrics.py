"""Metric writers: JSON lines in the workdir plus TensorBoard event files (tensorboardX, no TensorFlow)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping, Optional

import numpy as np


class MetricWriter:
    """Appends `{"step": s, name: value, ...}` lines to workdir/metrics.jsonl and TensorBoard scalars.

    Only the process with `enabled=True` (process 0) writes; the others get a writer that does nothing, so
    the trainer does not branch on the process index at every call.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None):
        """`resume_step`: the step the run restarts from; records after it (written by the interrupted
        run, and about to be written again) are dropped from metrics.jsonl, so each step appears once."""
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "metrics.jsonl")
        if resume_step is not None and os.path.exists(path):
            _drop_records_after(path, resume_step)
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: only the writing process needs it
            self._tb = SummaryWriter(logdir=os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = {k: float(np.asarray(v)) for k, v in metrics.items()}
        record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, int(step))

    def write_text(self, name: str, text: str) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(name, text, 0)

    def flush(self) -> None:
        if self.enabled:
            self._jsonl.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


def _drop_records_after(path: str, step: int) -> None:
    """Rewrites metrics.jsonl (atomically) without the records of steps > `step` or a torn last line."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:   # a line cut short by a kill
                continue
            if record.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    _replace(path, "".join(kept))


def write_json(path: str | os.PathLike, obj: Any, *,
               default: Optional[Callable[[Any], Any]] = None) -> None:
    """Writes `obj` as indented JSON to `path` atomically (config.json is what a resume reads).

    `default`: `json.dumps`'s converter of values JSON has no type for (None: such a value raises).
    """
    _replace(path, json.dumps(obj, indent=2, sort_keys=True, default=default) + "\n")


def _replace(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename: a kill mid-write leaves the old
    file or the new one, never a torn one."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl file back (used by tests and notebooks)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
