"""Orbax checkpoints of the trainer: the last N steps plus the best one, with the resolved config.

Layout of a workdir:
    checkpoints/<step>/   the newest `keep` checkpoints (state + config.json), saved every k steps and at the end
    best/<step>/          the single best checkpoint by the configured eval metric
    damaged/<step>-<n>/   checkpoints that failed to restore, moved aside (never deleted)

Restores always go against an abstract state (`jax.ShapeDtypeStruct`s carrying shardings), so the
state is never allocated twice and comes back sharded as the run wants it.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

from absl import logging
import orbax.checkpoint as ocp


class Checkpoints:
    """Saves and restores the train state under `workdir` (see the module docstring)."""

    def __init__(self, workdir: str, *, keep: int, best_metric: str | None = None, best_mode: str = "max"):
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"checkpoint.best_mode must be 'max' or 'min', got {best_mode!r}")
        self.workdir = os.path.abspath(workdir)
        self.best_metric, self.best_mode = best_metric, best_mode
        self._keep = keep
        self.last = self._manager("checkpoints", keep)
        self.best = self._manager("best", 1) if best_metric else None
        self.best_value: float | None = None

    def _manager(self, sub: str, keep: int) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            os.path.join(self.workdir, sub),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False))

    def save(self, step: int, state: Any, config: dict, *, force: bool = False) -> None:
        if self.last.latest_step() == step:
            return
        self.last.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      config=ocp.args.JsonSave(config)), force=force)
        self.last.wait_until_finished()

    def maybe_save_best(self, step: int, state: Any, config: dict, metrics: dict[str, float]) -> bool:
        """Saves `state` into best/ if metrics[best_metric] beats the best so far; returns whether it did."""
        if self.best is None:
            return False
        if self.best_metric not in metrics:
            raise ValueError(f"checkpoint.best_metric {self.best_metric!r} is not among the eval metrics "
                             f"{sorted(metrics)}")
        value = float(metrics[self.best_metric])
        if self.best_value is not None and not (
                value > self.best_value if self.best_mode == "max" else value < self.best_value):
            return False
        self.best_value = value
        if self.best.latest_step() != step:
            self.best.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                config=ocp.args.JsonSave({**config, "_best": {self.best_metric: value}})), force=True)
            self.best.wait_until_finished()
        return True

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any] | None:
        """Restores the newest checkpoint that reads back; damaged ones are moved aside with a warning.

        Returns:
          (step, state), or None when there is no usable checkpoint.
        """
        self._restore_best_value()
        for step in sorted(self.last.all_steps(), reverse=True):
            try:
                restored = self.last.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state)))
                return step, restored.state
            except Exception as e:  # noqa: BLE001 - any read failure means this checkpoint is unusable
                logging.warning("checkpoint at step %d is damaged (%s: %s); falling back to an older one",
                                step, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self._move_aside(step)
        return None

    def _restore_best_value(self) -> None:
        if self.best is None or self.best.latest_step() is None:
            return
        try:
            meta = self.best.restore(self.best.latest_step(), args=ocp.args.Composite(config=ocp.args.JsonRestore()))
            self.best_value = meta.config["_best"][self.best_metric]
        except Exception as e:  # noqa: BLE001
            logging.warning("could not read the best checkpoint's metric (%s); best tracking restarts", e)

    def _move_aside(self, step: int) -> None:
        import jax
        if jax.process_index() == 0:   # one mover on a shared filesystem; the others wait for it
            src = os.path.join(self.workdir, "checkpoints", str(step))
            n = 0
            while os.path.exists(dst := os.path.join(self.workdir, "damaged", f"{step}-{n}")):
                n += 1
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"zoo_checkpoint_moved_{step}")
        # The manager caches its step list: rebuild it so the moved step is forgotten.
        self.last.close()
        self.last = self._manager("checkpoints", self._keep)

    def close(self) -> None:
        self.last.close()
        if self.best is not None:
            self.best.close()
