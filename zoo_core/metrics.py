"""Metric writers: JSON lines in the workdir plus TensorBoard event files (tensorboardX, no TensorFlow)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np


class MetricWriter:
    """Appends `{"step": s, name: value, ...}` lines to workdir/metrics.jsonl and TensorBoard scalars.

    Only the process with `enabled=True` (process 0) writes; the others get a writer that does nothing, so
    the trainer does not branch on the process index at every call.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
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


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl file back (used by tests and notebooks)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
