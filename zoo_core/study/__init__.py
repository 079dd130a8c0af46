"""Studies: a grid of training (or benchmark) runs turned into a paper's table and figure.

    python -m zoo_core.study configs/studies/agf_order.py --workdir studies/agf_order
    python -m zoo_core.study configs/studies/samovar_fig4.py:smoke --workdir /tmp/fig4 --parallel 2
    python -m zoo_core.study configs/studies/agf_uea.py --workdir studies/agf_uea --dry_run

A study file (configs/studies/<name>.py) defines `get_study(arg)` returning a `Study`: a base training
command (`module`, `config`), a list of `Cell`s (each a label, its parameters for the table and the plot,
and `--config.<field>=value` overrides, or a benchmark command instead of a training run) and the seeds.
Each (cell, seed) is one run, an ordinary `python -m <module>` training run in its own folder
`DIR/<cell>/seed_<s>` started in a subprocess (`zoo_core.study.runner`), so a crash in one cell cannot
take the study down. After every run `DIR/results.md`, `DIR/results.csv` and, for a curve, `DIR/<name>.png`
are rewritten (`zoo_core.study.report`): per cell, each of the study's metrics (`zoo_core.study.metrics`)
as mean ± std over the seeds that finished, the steps, the wall time and the run folders.

Resuming: a finished run leaves `study_run.json` with status 'done' in its folder and is skipped by a rerun
of the same command; a run killed mid-way has no such file and reruns its command, which resumes from the
run's last checkpoint (the trainer resumes from its workdir). A failed run is recorded with its one-line
error (the trainer's `error: ...` line) and is tried again by the next rerun.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from zoo_core.study.metrics import AtBest, BenchRecords, Best, EvalFile, Last, Metric

__all__ = ["AtBest", "Best", "BenchRecords", "Cell", "Curve", "EvalFile", "Last", "Metric", "Run", "Study",
           "StepCurves", "slug"]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of a study's grid.

    label: the cell's name in the table ('K=4'); its folder is `slug(label)`.
    params: the cell's coordinates, {column: value} (the table's columns and the plot's x and series).
    overrides: extra `--config.<field>=value` flags of a training cell.
    config: the cell's config file[:args] where it differs from the study's.
    module: the cell's training entry point where it differs from the study's (e.g. 'htgn_jax.train').
    command: a benchmark cell: the argv after `python` (e.g. ['-m', 'benchmarks.agf_scaling', ...]),
      '{run_dir}' replaced by the run's folder; it is run instead of a training command, once (no seeds).
    """
    label: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    overrides: Sequence[str] = ()
    config: str | None = None
    module: str | None = None
    command: Sequence[str] | None = None

    @property
    def is_benchmark(self) -> bool:
        return self.command is not None


@dataclasses.dataclass(frozen=True)
class Curve:
    """The figure of a study whose cells lie on a curve: the first metric (mean ± std over seeds) against
    the cell parameter `x`, one line per value of `series` (a cell parameter, or a benchmark record's
    field such as 'case'); `log_x` for lengths."""
    x: str
    series: str | None = None
    log_x: bool = False
    log_y: bool = False


@dataclasses.dataclass(frozen=True)
class StepCurves:
    """The figure of a study of training curves: `metric` against the step from each run's metrics.jsonl,
    the mean over seeds per cell (e.g. SAMoVAR Fig. 4's validation MSE)."""
    metric: str
    log_y: bool = False


@dataclasses.dataclass(frozen=True)
class Study:
    """A grid of runs (see the module docstring).

    name: the study's name (its figure is `<name>.png`).
    title: one line for results.md (which table or figure of which paper).
    module: the training entry point, e.g. 'agf_jax.train'.
    config: the base config file[:args], relative to the repository root.
    cells: the grid.
    seeds: each training cell runs once per seed (`--config.seed=<s>`); empty: the config's own seed.
    metrics: what results.md reports per cell; the first is the headline (and the plot's y).
    plot: a `Curve`, `StepCurves` or None (a table only).
    overrides: `--config.<field>=value` flags of every training cell (before the cell's own).
    evaluate: flags of a second command run after each training run, with its config and overrides, e.g.
      ('--eval_only', '--eval_split=test'): the test score of the best checkpoint (`EvalFile` reads it).
    notes: lines for results.md (the protocol, the budget, what needs data or an accelerator).
    """
    name: str
    title: str
    module: str
    config: str
    cells: Sequence[Cell]
    seeds: Sequence[int] = ()
    metrics: Sequence[Metric] = ()
    plot: Curve | StepCurves | None = None
    overrides: Sequence[str] = ()
    evaluate: Sequence[str] = ()
    notes: Sequence[str] = ()

    def runs(self) -> list["Run"]:
        """Every (cell, seed) of the grid in order; a benchmark cell is one run."""
        out = []
        for cell in self.cells:
            seeds = [None] if cell.is_benchmark or not self.seeds else list(self.seeds)
            out.extend(Run(cell, seed) for seed in seeds)
        return out

    def check(self) -> None:
        """Raises ValueError naming the problem: no cells, two cells of one folder, no metric."""
        if not self.cells:
            raise ValueError(f"study {self.name!r} has no cells")
        if not self.metrics:
            raise ValueError(f"study {self.name!r} names no metric")
        folders = [slug(c.label) for c in self.cells]
        twice = sorted({f for f in folders if folders.count(f) > 1})
        if twice:
            raise ValueError(f"study {self.name!r}: cells share the folder name(s) {', '.join(twice)}")
        for owner, overrides in [("the study", self.overrides)] + [(f"cell {c.label!r}", c.overrides) for c in self.cells]:
            bad = [o for o in overrides if not re.match(r"^--config\.[A-Za-z_][\w.]*=", o)]
            if bad:
                raise ValueError(f"{owner}: overrides must be --config.<field>=<value>, got {bad[0]!r}")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a study: a cell and a seed (None: the config's own seed, or a benchmark)."""
    cell: Cell
    seed: int | None

    @property
    def folder(self) -> str:
        """The run's folder under the study's workdir."""
        name = slug(self.cell.label)
        return name if self.seed is None else f"{name}/seed_{self.seed}"


def slug(label: str) -> str:
    """A folder name for a cell label: 'K=4, gamma=0.1' -> 'K-4_gamma-0.1'."""
    s = re.sub(r"[^A-Za-z0-9.+-]+", "_", label.replace("=", "-")).strip("_")
    return s or "cell"
