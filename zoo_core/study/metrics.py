"""What a study reads from each finished run folder: the metric rows of `zoo_core.study.report`.

A metric's `rows(run_dir)` returns a list of rows, each `{name: value}` plus the row's own keys (a
benchmark record's 'case' and 'n'); a training run gives one row. The trainer writes
`run_dir/metrics.jsonl` (one `{"step": s, name: value, ...}` line per log or eval; a resumed run's
lines after its checkpoint are dropped, so each step appears once) and `--eval_only` writes
`run_dir/eval_<checkpoint>_<split>.json`; the scaling benchmarks write `{"meta", "records"}` JSON
(`zoo_core.bench.run_scaling`).
"""
from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
from typing import Any


def read_jsonl(run_dir: str) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` ([] when there is none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(run_dir: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every finite `key` in metrics.jsonl, in step order."""
    out = [(int(r["step"]), float(r[key])) for r in read_jsonl(run_dir)
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sorted(out)


def last_step(run_dir: str) -> int | None:
    """The last step metrics.jsonl records (None: no record)."""
    steps = [int(r["step"]) for r in read_jsonl(run_dir)]
    return max(steps) if steps else None


class Metric(abc.ABC):
    """A column of the study's table (`name`); `rows(run_dir)` reads it from a finished run."""
    name: str

    @abc.abstractmethod
    def rows(self, run_dir: str) -> list[dict[str, Any]]:
        """The metric's rows in the run folder ([] when the run wrote none)."""


def _pick(values: list[tuple[int, float]], mode: str) -> tuple[int, float] | None:
    if not values:
        return None
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    sign = 1.0 if mode == "max" else -1.0
    return max(values, key=lambda sv: (sign * sv[1], -sv[0]))   # the first step reaching the best


@dataclasses.dataclass(frozen=True)
class Best(Metric):
    """The best value of `key` over the run's evaluations (`mode` 'max' or 'min'), e.g. the UEA protocol's
    best test accuracy over epochs."""
    key: str
    mode: str = "max"
    label: str | None = None

    @property
    def name(self) -> str:
        return self.label or f"{self.mode} {self.key}"

    def rows(self, run_dir):
        best = _pick(series(run_dir, self.key), self.mode)
        return [] if best is None else [{self.name: best[1]}]


@dataclasses.dataclass(frozen=True)
class Last(Metric):
    """The value of `key` at the run's last evaluation."""
    key: str
    label: str | None = None

    @property
    def name(self) -> str:
        return self.label or f"last {self.key}"

    def rows(self, run_dir):
        values = series(run_dir, self.key)
        return [{self.name: values[-1][1]}] if values else []


@dataclasses.dataclass(frozen=True)
class AtBest(Metric):
    """`key` at the step where `by` is best (`mode`), e.g. the test MSE at the lowest validation MSE."""
    key: str
    by: str
    mode: str = "min"
    label: str | None = None

    @property
    def name(self) -> str:
        return self.label or f"{self.key} at {self.mode} {self.by}"

    def rows(self, run_dir):
        best = _pick(series(run_dir, self.by), self.mode)
        if best is None:
            return []
        at = dict(series(run_dir, self.key))
        return [{self.name: at[best[0]]}] if best[0] in at else []


@dataclasses.dataclass(frozen=True)
class EvalFile(Metric):
    """`key` of a JSON file the run's evaluation command wrote (`Study.evaluate`), e.g.
    'eval_best_test.json' of `--eval_only --eval_split=test`: the test score of the best checkpoint."""
    file: str
    key: str
    label: str | None = None

    @property
    def name(self) -> str:
        return self.label or f"{self.key} ({self.file})"

    def rows(self, run_dir):
        path = os.path.join(run_dir, self.file)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            value = json.load(f).get(self.key)
        return [{self.name: float(value)}] if isinstance(value, (int, float)) else []


@dataclasses.dataclass(frozen=True)
class BenchRecords(Metric):
    """One row per measured record of a scaling benchmark's JSON (`run_dir/<file>`): its `keys` ('case',
    'n') and `field` (a dotted path into the record, e.g. 'median_s' or 'memory.total_bytes') times
    `scale`. Records the benchmark skipped (memory guard, time limit) are left out."""
    field: str
    label: str
    scale: float = 1.0
    file: str = "bench.json"
    keys: tuple[str, ...] = ("case", "n")

    @property
    def name(self) -> str:
        return self.label

    def rows(self, run_dir):
        path = os.path.join(run_dir, self.file)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            records = json.load(f).get("records", [])
        out = []
        for r in records:
            value: Any = r
            for part in self.field.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if r.get("status") == "ok" and isinstance(value, (int, float)):
                out.append({**{k: r.get(k) for k in self.keys}, self.name: float(value) * self.scale})
        return out
