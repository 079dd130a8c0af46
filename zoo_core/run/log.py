"""What a run logs: the run's description (`log_run`), the parameter table, the train metrics averaged
between logs (`mean_metrics`), and log lines routed around the progress bar (`log_through_tqdm`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from zoo_core.run.steps import WEIGHT_PREFIX


def parameter_overview(params) -> str:
    """A table of parameter paths, shapes and sizes, with the total."""
    rows = [(jax.tree_util.keystr(p), tuple(x.shape), int(np.prod(x.shape)))
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    width = max([len(r[0]) for r in rows] + [4])
    lines = [f"{'name':<{width}}  {'shape':<20} {'size':>10}"]
    lines += [f"{n:<{width}}  {str(s):<20} {c:>10,}" for n, s, c in rows]
    lines.append(f"{'total':<{width}}  {'':<20} {sum(r[2] for r in rows):>10,}")
    return "\n".join(lines)


def mean_metrics(history: list[dict[str, jax.Array]]) -> dict[str, float]:
    """The average of the steps' metrics since the last log; a metric with a `weight/<name>` entry (a task
    metric: examples or tokens) is weighted by it, and the weights themselves are not logged."""
    fetched = jax.device_get(history)
    out = {}
    for key in fetched[0]:
        if key.startswith(WEIGHT_PREFIX):
            continue
        values = np.array([np.asarray(m[key]) for m in fetched], np.float64)
        if WEIGHT_PREFIX + key in fetched[0]:
            weights = np.array([np.asarray(m[WEIGHT_PREFIX + key]) for m in fetched], np.float64)
            out[key] = float(np.sum(values * weights) / max(np.sum(weights), 1e-12))
        else:
            out[key] = float(np.mean(values))
    return out


class _TqdmStream:
    """A text stream that writes through `tqdm.write`, so that a log line clears the progress bar,
    is printed on its own line, and the bar is redrawn below it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> None:
        from tqdm.auto import tqdm
        if text:
            tqdm.write(text, file=self._stream, end="")

    def flush(self) -> None:
        self._stream.flush()


def log_through_tqdm() -> Callable[[], None]:
    """Routes absl's stderr log lines (and Python logging's console handlers) through tqdm.write while
    a progress bar is shown; returns the function that undoes it."""
    import logging as py_logging
    import sys
    targets = []
    absl_handler = logging.get_absl_handler().python_handler
    handlers = [absl_handler] + [h for h in py_logging.getLogger().handlers
                                 if isinstance(h, py_logging.StreamHandler) and h is not absl_handler]
    for h in handlers:
        stream = getattr(h, "stream", None)
        if stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__):
            targets.append((h, stream))
            h.stream = _TqdmStream(stream)

    def restore():
        for h, stream in targets:
            h.stream = stream
    return restore


def log_run(s: Any, workdir: str, changes: list[str], *, allow_config_change: bool) -> None:
    logging.info("config:\n%s", s.config)
    logging.info("devices: %d total, %d local, process %d/%d: %s", jax.device_count(), jax.local_device_count(),
                 jax.process_index(), jax.process_count(), jax.devices())
    if changes:
        logging.warning("resuming %s with a changed config (%s): %s", workdir,
                        "allowed by allow_config_change" if allow_config_change else "fields safe to change",
                        "; ".join(changes))
    also, total = int(s.config.eval_also_at_step), int(s.config.total_steps)
    if also > total:
        logging.info("eval_also_at_step=%d is after total_steps=%d: no extra evaluation in this run", also, total)
    logging.info("parameters:\n%s", parameter_overview(s.abstract.params))
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(s.abstract.params))
    logging.info("parameter count: %s", f"{num_params:,}")
