"""Orbax checkpoints of the trainer: the last N steps plus the best one, with the resolved config.

Layout of a workdir:
    checkpoints/<step>/   the newest `keep` checkpoints (state + config.json), saved every k steps and at the end
    best/<step>/          the single best checkpoint by the configured eval metric
    damaged/<step>-<n>/   checkpoints that failed to restore, moved aside (never deleted)

A checkpoint that reads back but holds a different parameter tree (the workdir belongs to another
model or config) is not damage: restoring raises `CheckpointMismatch` and moves nothing.

Restores always go against an abstract state (`jax.ShapeDtypeStruct`s carrying shardings), so the
state is never allocated twice and comes back sharded as the run wants it.
"""
from __future__ import annotations

import math
import os
import shutil
from typing import Any

import orbax.checkpoint as ocp
from absl import logging


class CheckpointMismatch(ValueError):
    """The checkpoints in a workdir hold another state tree than the one being restored."""


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{'params/encoder/kernel': shape} of every array leaf of a state or of Orbax's tree metadata."""
    import jax
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in flat}


def stored_tree(manager: ocp.CheckpointManager, step: int) -> Any:
    """The tree of array metadata (shape, dtype) of the 'state' item saved at `step`, read without
    restoring it (the manager needs a named 'state' handler)."""
    meta = manager.item_metadata(step)["state"]
    return getattr(meta, "tree", meta)   # Orbax versions differ: a metadata object or the tree


def _first_difference(stored: dict, wanted: dict) -> str:
    for name in sorted(set(stored) | set(wanted), key=lambda n: (not n.startswith("params"), n)):
        if name not in stored:
            return f"{name} is not in the checkpoint"
        if name not in wanted:
            return f"the checkpoint has {name}, which this model does not"
        if stored[name] != wanted[name]:
            return f"{name} is {stored[name]} in the checkpoint, {wanted[name]} now"
    return ""


def _per_parameter_optimiser_state(stored: dict, wanted: dict) -> bool:
    """Whether `stored` is `wanted`'s model with the optimiser state of one array per parameter: the
    same parameters, and optimiser arrays of rank >= 2 (the vector layout holds `[n]` and scalars)."""
    params = lambda shapes: {k: v for k, v in shapes.items() if k.startswith("params/")}
    return params(stored) == params(wanted) and any(
        k.startswith("opt_state/") and len(v) >= 2 for k, v in stored.items())


def require_checkpoints(workdir: str, which: str = "checkpoints") -> str:
    """workdir/<which> as an absolute path; FileNotFoundError('no checkpoint under ...') if it is not a
    directory (a cheap check, e.g. before building the data an evaluation needs)."""
    path = os.path.join(os.path.abspath(workdir), which)
    if not os.path.isdir(path):
        hint = ""
        if which == "best" and os.path.isdir(os.path.join(os.path.abspath(workdir), "checkpoints")):
            hint = ("; this run keeps no best checkpoint (checkpoint.best_metric is empty, or it was not "
                    "evaluated yet): --checkpoint=latest reads its newest one")
        raise FileNotFoundError(f"no checkpoint under {os.path.join(workdir, which)}{hint}")
    return path


def restore_params(workdir: str, *, which: str = "checkpoints", target_sharding: Any = None) -> tuple[Any, int]:
    """The parameters of the newest checkpoint in workdir/<which> ('checkpoints' or 'best'), and its step.

    Only the parameters are read (a partial restore), not the optimiser moments, which would double or
    triple the memory. They are restored against their own stored shapes and dtypes into
    `target_sharding` (default: this process's first local device), so a checkpoint of any topology
    (8 accelerators, 2 processes) reads back on a laptop.

    Raises:
      FileNotFoundError: no checkpoint there (nothing is created).
    """
    import jax
    path = require_checkpoints(workdir, which)   # checked first: a manager would create the directory
    missing = FileNotFoundError(f"no checkpoint under {os.path.join(workdir, which)}")
    # The PyTree handler reads the Standard handler's checkpoints and can restore a subtree.
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False),
                                 item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                                "config": ocp.JsonCheckpointHandler()})
    try:
        step = mngr.latest_step()
        if step is None:
            raise missing
        where = target_sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {"params": jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=where), stored_tree(mngr, step)["params"])}
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)))
    finally:
        mngr.close()
    return restored.state["params"], step


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
        # The folders this instance creates, removed again by close(discard_created=True) when a run is
        # refused (e.g. on a CheckpointMismatch), so that a refused run leaves nothing behind.
        self._created = [sub for sub in ("checkpoints", "best") if (sub == "checkpoints" or best_metric)
                         and not os.path.exists(os.path.join(self.workdir, sub))]
        self.last = self._manager("checkpoints", keep)
        self.best = self._manager("best", 1) if best_metric else None
        self.best_value: float | None = None

    def _manager(self, sub: str, keep: int) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            os.path.join(self.workdir, sub),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False),
            # Named handlers let item_metadata read the state's tree (shapes) without restoring it.
            item_handlers={"state": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state: Any, config: dict, *, force: bool = False) -> None:
        if self.last.latest_step() == step:
            return
        self.last.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      config=ocp.args.JsonSave(config)), force=force)
        self.last.wait_until_finished()

    @property
    def best_step(self) -> int | None:
        """Step of the best checkpoint so far (None: no best metric, no finite eval yet, or a best
        whose metric could not be read back, so tracking restarted)."""
        if self.best is None or self.best_value is None:
            return None
        return self.best.latest_step()

    def maybe_save_best(self, step: int, state: Any, config: dict, metrics: dict[str, float]) -> bool:
        """Saves `state` into best/ if metrics[best_metric] beats the best so far; returns whether it did."""
        if self.best is None:
            return False
        if self.best_metric not in metrics:
            raise ValueError(f"checkpoint.best_metric {self.best_metric!r} is not among the eval metrics "
                             f"{sorted(metrics)}")
        value = float(metrics[self.best_metric])
        if not math.isfinite(value):   # a NaN best would make every later comparison False
            logging.warning("eval %s = %s at step %d: not a candidate for the best checkpoint",
                            self.best_metric, value, step)
            return False
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

    def _made_by_another_config(self, step: int, config: dict | None) -> bool:
        """Whether the config saved with `step` is readable and differs from `config`.

        A state tree that differs although the saved config is the same (or unreadable) is damage.
        """
        if config is None:
            return False
        try:
            saved = self.last.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
        except Exception:  # noqa: BLE001 - unreadable: damage, handled by the caller
            return False
        return saved != config

    def restore_latest(self, abstract_state: Any, config: dict | None = None) -> tuple[int, Any] | None:
        """Restores the newest checkpoint that reads back; damaged ones are moved aside with a warning.

        Args:
          abstract_state: the state to restore into (shapes, dtypes, shardings).
          config: the run's config as saved with each checkpoint; when a checkpoint holds another
            state tree *and* was saved with another config, `CheckpointMismatch` is raised instead
            of treating the checkpoint as damaged.

        Returns:
          (step, state), or None when there is no usable checkpoint.
        """
        self._restore_best_value()
        wanted = leaf_shapes(abstract_state)
        for step in sorted(self.last.all_steps(), reverse=True):
            try:
                stored = leaf_shapes(stored_tree(self.last, step))
            except Exception:  # noqa: BLE001 - unreadable metadata: the restore below reports the damage
                stored = None
            if stored is not None and stored != wanted:
                if _per_parameter_optimiser_state(stored, wanted):
                    # Written by a zoo_core whose optimiser kept one state array per parameter (the state
                    # is one vector now, zoo_core.run.optim). Not damage: nothing is moved.
                    raise CheckpointMismatch(
                        f"the checkpoint at step {step} in {self.workdir} keeps its optimiser state in another "
                        "layout (one array per parameter): it was written by an older zoo_core; resume it with "
                        "that version, or load its parameters (trainer.load_params)")
                if self._made_by_another_config(step, config):
                    raise CheckpointMismatch(
                        f"the checkpoint at step {step} in {self.workdir} was made by another model or config "
                        f"({_first_difference(stored, wanted)}); use a new --workdir or the run's own config")
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

    def close(self, *, discard_created: bool = False) -> None:
        """Closes the managers; with `discard_created`, removes the folders this instance made if they
        are still empty."""
        self.last.close()
        if self.best is not None:
            self.best.close()
        if discard_created:
            import jax
            if jax.process_index() == 0:
                for sub in self._created:
                    path = os.path.join(self.workdir, sub)
                    if os.path.isdir(path) and not os.listdir(path):
                        os.rmdir(path)
