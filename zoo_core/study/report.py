"""A study's outputs, rewritten after every run: DIR/results.md, DIR/results.csv, DIR/<name>.png and, for
training curves, DIR/curves.csv (the figure's points).

Rows: one per cell (and per benchmark record key, e.g. case and length, for a benchmark cell). Each metric
is the mean ± sample standard deviation over the seeds whose run finished ('n' of them); failed runs are
listed with their one-line errors; 'steps' is the last step in the runs' metrics.jsonl, 'wall' the mean
wall time of a run (training plus its evaluation command) in seconds.
"""
from __future__ import annotations

import csv
import io
import math
import os
from typing import Any

from zoo_core.study import Curve, StepCurves, Study, runner, slug
from zoo_core.study import metrics as metrics_lib


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _order(value: Any) -> tuple:
    """Sort key of a row key's value: numbers by value (length 64 before 128), then the rest as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def collect(study: Study, root: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(table rows, failed runs) from the run folders under `root`.

    Each table row: 'cell', the cell's params, the row keys of its metrics (benchmark 'case', 'n'), per
    metric '<name>' = (mean, std, n), 'steps', 'wall_s', 'runs' (done/total), 'folder'.
    """
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for cell in study.cells:
        runs = [r for r in study.runs() if r.cell is cell]
        groups: dict[tuple, dict[str, Any]] = {}
        steps, walls, n_done = [], [], 0
        for run in runs:
            run_dir = os.path.join(root, run.folder)
            marker = runner.read_marker(run_dir)
            if marker is None:
                continue
            if marker["status"] != "done":
                failed.append({"cell": cell.label, "seed": run.seed, "folder": run.folder, "error": marker["error"]})
                continue
            n_done += 1
            walls.append(marker["wall_s"])
            step = metrics_lib.last_step(run_dir)
            if step is not None:
                steps.append(step)
            for metric in study.metrics:
                for row in metric.rows(run_dir):
                    keys = tuple(sorted((k, v) for k, v in row.items() if k != metric.name))
                    group = groups.setdefault(keys, {})
                    group.setdefault(metric.name, []).append(row[metric.name])
        base = {"cell": cell.label, **cell.params}
        common = {"steps": (f"{min(steps)}" if len(set(steps)) == 1 else f"{min(steps)}-{max(steps)}") if steps else "",
                  "wall_s": sum(walls) / len(walls) if walls else float("nan"),
                  "runs": f"{n_done}/{len(runs)}", "folder": slug(cell.label)}
        if not groups:
            rows.append({**base, **common})
        for keys, values in sorted(groups.items(), key=lambda kv: [(k, *_order(v)) for k, v in kv[0]]):
            row = {**base, **dict(keys), **common}
            for name, vals in values.items():
                row[name] = (*_mean_std(vals), len(vals))
            rows.append(row)
    return rows, failed


def _columns(study: Study, rows: list[dict[str, Any]]) -> list[str]:
    """The cell parameters and row keys, in first-seen order."""
    names = [m.name for m in study.metrics]
    fixed = {"cell", "steps", "wall_s", "runs", "folder", *names}
    out: list[str] = []
    for row in rows:
        out.extend(k for k in row if k not in fixed and k not in out)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        mean, std, n = value
        return f"{mean:.4g}" + ("" if math.isnan(std) else f" ± {std:.2g}") + f" (n={n})"
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def markdown(study: Study, rows: list[dict[str, Any]], failed: list[dict[str, Any]]) -> str:
    params = _columns(study, rows)
    names = [m.name for m in study.metrics]
    head = ["cell", *params, *names, "steps", "wall (s)", "runs done", "folder"]
    lines = [f"# {study.name}: {study.title}", ""]
    lines += [f"{note}" for note in study.notes] + ([""] if study.notes else [])
    seeds = ", ".join(map(str, study.seeds)) or "the config's own"
    if any(not c.is_benchmark for c in study.cells):
        lines += [f"Base: `python -m {study.module} --config {study.config}`; seeds: {seeds}."]
    lines += ["Metrics: mean ± sample std over the seeds whose run finished (n); a benchmark cell runs once, "
              "one row per case and length.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["cell"], *[row.get(p) for p in params], *[row.get(n) for n in names],
                 row["steps"], row["wall_s"], row["runs"], f"`{row['folder']}`"]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    if failed:
        lines += ["", "Failed runs (rerun the study command to try them again):", ""]
        lines += [f"- {f['cell']}" + ("" if f["seed"] is None else f" seed {f['seed']}") +
                  f" (`{f['folder']}`): {f['error']}" for f in failed]
    return "\n".join(lines) + "\n"


def csv_text(study: Study, rows: list[dict[str, Any]], failed: list[dict[str, Any]]) -> str:
    params = _columns(study, rows)
    names = [m.name for m in study.metrics]
    head = ["cell", *params]
    for n in names:
        head += [f"{n} mean", f"{n} std", f"{n} n"]
    head += ["steps", "wall_s", "runs_done", "failed", "folder"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for row in rows:
        out = [row["cell"], *[row.get(p, "") for p in params]]
        for n in names:
            mean, std, count = row.get(n, (float("nan"), float("nan"), 0))
            out += [f"{mean:.6g}", f"{std:.6g}", count]
        errors = "; ".join(f["error"] for f in failed if f["cell"] == row["cell"])
        out += [row["steps"], f"{row['wall_s']:.2f}", row["runs"], errors, row["folder"]]
        w.writerow(out)
    return buf.getvalue()


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def step_curves(study: Study, root: str) -> dict[str, list[tuple[int, float, float, int]]]:
    """A `StepCurves` study's curves: per cell label, (step, mean, sample std, n) over the seeds' runs."""
    curves = {}
    runs = study.runs()
    for cell in study.cells:
        per_step: dict[int, list[float]] = {}
        for run in (r for r in runs if r.cell is cell):
            for step, value in metrics_lib.series(os.path.join(root, run.folder), study.plot.metric):
                per_step.setdefault(step, []).append(value)
        if per_step:
            curves[cell.label] = [(step, *_mean_std(per_step[step]), len(per_step[step])) for step in sorted(per_step)]
    return curves


def curves_csv(study: Study, curves: dict[str, list[tuple[int, float, float, int]]]) -> str:
    """curves.csv of a `StepCurves` study from its `step_curves`: the figure's points, one row per (cell, step)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    metric = study.plot.metric
    writer.writerow(["cell", "step", f"{metric} mean", f"{metric} std", "n"])
    for label, points in curves.items():
        writer.writerows([label, step, mean, std, n] for step, mean, std, n in points)
    return out.getvalue()


# matplotlib's colour cycle has 10 colours: the next 10 lines are dashed, the 10 after dotted
_STYLES = ("-", "--", ":")


def plot(study: Study, rows: list[dict[str, Any]], path: str,
         curves: dict[str, list[tuple[int, float, float, int]]] | None = None) -> bool:
    """Draws the study's figure into `path` (matplotlib, Agg): a `Curve` from `rows`, `StepCurves` from
    `curves` (`step_curves`); False when there is nothing to draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    if isinstance(study.plot, StepCurves):
        for i, (label, points) in enumerate((curves or {}).items()):
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label,
                    linestyle=_STYLES[i // 10 % 3])
            drawn = True
        ax.set_xlabel("step")
        ax.set_ylabel(f"{study.plot.metric} (mean over seeds)")
        log_x, log_y = False, study.plot.log_y
    else:
        curve: Curve = study.plot
        name = study.metrics[0].name
        lines: dict[Any, list[tuple[float, float, float]]] = {}
        for row in rows:
            x, value = row.get(curve.x), row.get(name)
            if not isinstance(x, (int, float)) or isinstance(x, bool) or value is None:
                continue
            series_key = row.get(curve.series) if curve.series else name
            lines.setdefault(series_key, []).append((float(x), value[0], 0.0 if math.isnan(value[1]) else value[1]))
        for i, (label, points) in enumerate(lines.items()):
            points.sort()
            ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                        marker="o", capsize=3, label=str(label), linestyle=_STYLES[i // 10 % 3])
            drawn = True
        ax.set_xlabel(curve.x)
        ax.set_ylabel(name)
        log_x, log_y = curve.log_x, curve.log_y
    if drawn:
        if log_x:
            ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(f"{study.name}: {study.title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path + ".tmp.png", dpi=120)
        os.replace(path + ".tmp.png", path)
    plt.close(fig)
    return drawn


def write(study: Study, root: str) -> list[str]:
    """Rewrites the study's outputs under `root`; returns the paths written."""
    rows, failed = collect(study, root)
    paths = [os.path.join(root, "results.md"), os.path.join(root, "results.csv")]
    _write(paths[0], markdown(study, rows, failed))
    _write(paths[1], csv_text(study, rows, failed))
    curves = step_curves(study, root) if isinstance(study.plot, StepCurves) else None   # read once: CSV and figure
    if curves is not None:
        paths.append(os.path.join(root, "curves.csv"))
        _write(paths[-1], curves_csv(study, curves))
    if study.plot is not None:
        png = os.path.join(root, f"{study.name}.png")
        if plot(study, rows, png, curves):
            paths.append(png)
    return paths
