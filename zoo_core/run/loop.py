"""The training loop: `train_and_evaluate` and the hooks of `Loop` after every step (log, eval with the best
checkpoint and early stopping, checkpoint, signal), and the run's closing summary line (`closing_summary`).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable, Mapping

import jax
from absl import logging

from zoo_core import tasks
from zoo_core.data import pipeline
from zoo_core.run import checkpoint as ckpt_lib
from zoo_core.run import metrics as metrics_lib
from zoo_core.run import sharding
from zoo_core.run.errors import ConfigError, NonFiniteError
from zoo_core.run.evaluation import evaluate_params
from zoo_core.run.guard import Terminate, lock_workdir
from zoo_core.run.log import log_run, log_through_tqdm, mean_metrics
from zoo_core.run.output import PipeSafe, ignore_sigpipe, write_line
from zoo_core.run.resume import check_resume
from zoo_core.run.setup import RunSetup, Steps, check_setup, compile_steps, restore_or_init, step_flops
from zoo_core.run.setup_checks import check_workdir


def evals_between(config, after: int, upto: int) -> int:
    """How many evaluations the loop makes after the steps after+1 .. upto (`is_eval_step`'s count)."""
    every = config.eval_every_steps
    if not every:
        return 0
    extra = {int(config.total_steps), int(config.eval_also_at_step)}
    return upto // every - after // every + sum(1 for s in extra if after < s <= upto and s % every)


def is_eval_step(config, step: int) -> bool:
    """Whether the loop evaluates after `step`: every eval_every_steps, at the end, at eval_also_at_step."""
    return evals_between(config, step - 1, step) > 0


class Loop:
    """The training loop's hooks, called after every step in this order: `log`, `eval` (with the best
    checkpoint and early stopping), `checkpoint`, `signal`. `eval` and `signal` return True to stop."""

    def __init__(self, s: RunSetup, steps: Steps, checkpoints: ckpt_lib.Checkpoints, writer, workdir: str,
                 start: int, evaluators, progress=None):
        self.s, self.steps, self.checkpoints, self.writer = s, steps, checkpoints, writer
        self.config, self.workdir, self.start = s.config, workdir, start
        self.evaluators, self.progress = evaluators, progress
        self.history: list[dict[str, jax.Array]] = []
        self.last_eval: dict[str, float] = {}
        self.t0, self.steps_since = time.time(), 0
        self.flops: float | None = None   # of one train step, once the first one has run
        # The sequence features whose tokens and padding are counted (a task that can pack), and the counts
        # since the last log: train/tokens_per_second and train/padding.
        self.token_keys = tasks.PACKED_FEATURES.get(s.config.task.name, ())
        self.tokens = self.slots = 0
        self.step = start                 # the last step taken

    def patience_spent(self, step: int) -> bool:
        """Early stopping: checkpoint.patience evaluations in a row without a new best."""
        ck = self.config.checkpoint
        best = self.checkpoints.best_step
        if best is None or best > step:
            # No usable best (none yet, its metric unreadable or changed, or left by a run whose
            # checkpoints are gone): count from where this run started.
            best = self.start
        return bool(ck.patience) and evals_between(self.config, best, step) >= ck.patience

    def check_finite(self, state) -> None:
        bad = int(jax.device_get(self.steps.host_state(state).bad_step))
        if bad >= 0:
            last = self.checkpoints.last.latest_step()
            kept = (f"the last good checkpoint (step {last}) in {self.workdir} is kept" if last is not None
                    else f"no checkpoint had been saved in {self.workdir} yet")
            raise NonFiniteError(f"non-finite loss or gradient at step {bad + 1} (also what a label outside "
                                 f"the model's classes gives): stopping; {kept}")

    def save(self, state, step: int, *, force: bool = False) -> None:
        self.check_finite(state)
        self.checkpoints.save(step, self.steps.host_state(state), self.s.config_dict, force=force)

    def after_step(self, metrics) -> None:
        self.history.append(metrics if not self.steps.pmapped else sharding.unreplicate(metrics))
        self.steps_since += 1
        if self.progress is not None:
            self.progress.update(1)

    def log(self, state, step: int) -> None:
        """Train metrics averaged since the last log, every log_every_steps and at the end."""
        if not (step % self.config.log_every_steps == 0 or step == self.config.total_steps):
            return
        self.check_finite(state)
        summary = mean_metrics(self.history)
        summary["train/steps_per_second"] = self.steps_since / max(time.time() - self.t0, 1e-9)
        if self.flops is not None:   # achieved, all devices (the step's FLOPs as XLA counts them)
            summary["train/gflops_per_second"] = self.flops * summary["train/steps_per_second"] / 1e9
        if self.slots:   # this process's rows, times the processes: the global batch's tokens
            elapsed = self.steps_since / summary["train/steps_per_second"]
            summary["train/tokens_per_second"] = self.tokens * jax.process_count() / max(elapsed, 1e-9)
            summary["train/padding"] = 1.0 - self.tokens / self.slots
        self.history, self.t0, self.steps_since = [], time.time(), 0
        self.tokens = self.slots = 0
        self.writer.write(step, summary)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{summary['train/total_loss']:.4g}")

    def eval(self, state, step: int) -> bool:
        """Evaluation at `is_eval_step`, the best checkpoint, and early stopping (True: stop)."""
        if not is_eval_step(self.config, step):
            return False
        self.check_finite(state)
        host = self.steps.host_state(state)
        result = evaluate_params(state.params, step, p_eval=self.steps.eval, eval_source=self.s.eval_source,
                                 config=self.config, model=self.s.model, to_device=self.steps.to_device,
                                 pmapped=self.steps.pmapped, evaluators=self.evaluators,
                                 host_params=host.params)
        self.writer.write(step, result)
        logging.info("step %d eval: %s", step, ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.items())))
        self.last_eval = result
        self.checkpoints.maybe_save_best(step, self.steps.host_state(state), self.s.config_dict, result)
        if not self.patience_spent(step):
            return False
        self.save(state, step, force=True)
        ck = self.config.checkpoint
        logging.info("early stop at step %d: no new best %s in %d evaluations (best: step %s)", step,
                     ck.best_metric, ck.patience, self.checkpoints.best_step)
        return True

    def checkpoint(self, state, step: int) -> None:
        """A checkpoint every checkpoint_every_steps and at the end."""
        every = self.config.checkpoint_every_steps
        if (every and step % every == 0) or step == self.config.total_steps:
            self.save(state, step)

    def signal(self, state, step: int, term: "Terminate") -> bool:
        """SIGTERM or Ctrl-C (on any process): a checkpoint now, then stop (True)."""
        if not term.any_requested():
            return False
        self.save(state, step, force=True)
        logging.warning("saved the checkpoint at step %d after %s; exiting", step,
                        term.requested or "SIGTERM or Ctrl-C on another process")
        return True


def train_loop(loop: Loop, state, train_iter) -> None:
    """Steps start+1 .. total_steps, each followed by the hooks; at most one step in flight."""
    steps = loop.steps
    in_flight = None  # the metrics of the step still computing
    with Terminate() as term:
        for step in range(loop.start + 1, loop.config.total_steps + 1):
            host = next(train_iter)
            if loop.token_keys:
                tokens, slots = pipeline.token_count(host, loop.token_keys, int(loop.config.task.get("pad_id", 0)))
                loop.tokens, loop.slots = loop.tokens + tokens, loop.slots + slots
            batch = steps.to_device(host)  # host work overlaps the step in flight
            if in_flight is not None:
                # Without this wait, async dispatch lets the loop queue steps up to the next blocking
                # log or eval, so a SIGTERM would be answered only after all of them had run (minutes
                # in a long-sequence run, past a preemption's grace period) and the progress bar would
                # run ahead of the work.
                jax.block_until_ready(in_flight)
            state, metrics = steps.train(state, batch)
            if step == loop.start + 1:
                loop.flops = step_flops(steps, state, batch)
            in_flight = metrics
            loop.step = step
            loop.after_step(metrics)
            loop.log(state, step)
            if loop.eval(state, step):
                break
            loop.checkpoint(state, step)
            if loop.signal(state, step, term):
                break


def train_and_evaluate(config, workdir: str, build_model: Callable[..., Any], *,
                       evaluators: Iterable[Callable[..., Mapping[str, float]]] = (),
                       allow_config_change: bool = False, print_summary: bool = False,
                       setup: RunSetup | None = None) -> dict[str, float]:
    """Trains `build_model(**config.model)` on `config.data` and evaluates it; resumes from `workdir`.

    Args:
      config: the resolved ml_collections config (see configs/common.py for every field).
      workdir: where checkpoints, metrics.jsonl, TensorBoard files and config.json go.
      build_model: the architecture's `Model` factory.
      evaluators: extra host-side evaluations `fn(params, model, config, **feature_step_kwargs(model, i))`
        -> {name: value} (i = `eval_feature_step`; no `feature_step=` for a model without
        `uses_feature_step`) run with every eval (e.g. decoding + BLEU); their results are logged under 'eval/'.
      allow_config_change: resume a run in `workdir` whose stored config.json differs from `config` in
        fields that change what is trained (see `check_resume`); the differences are logged and
        config.json is replaced. Without it such a resume is refused (`SAFE_ON_RESUME` fields, and a
        longer total_steps under a step-free schedule, are always allowed).
      print_summary: print the run's closing summary line (`closing_summary`) on stdout instead of
        logging it (process 0; the others log it), so that a terminal shows it once.
      setup: `check_setup(config, build_model, has_evaluators=bool(evaluators))` when the caller made it
        already (the command line checks the setup before anything else); None: made here.

    Returns:
      The last eval metrics ({} when there was nothing left to train: the run had reached
      total_steps, or had stopped early, before this call).

    Raises:
      ConfigError: a configuration problem (or a refused resume), before anything is compiled or written.
      NonFiniteError: the loss or gradient became non-finite (the message names the step).
    """
    evaluators = list(evaluators)
    if setup is None:
        setup = check_setup(config, build_model, has_evaluators=bool(evaluators))
    elif setup.config is not config or setup.has_evaluators != bool(evaluators):
        raise ValueError("setup must be check_setup(config, build_model, has_evaluators=bool(evaluators)) "
                         "of this config and these evaluators")
    s = setup
    check_workdir(workdir)
    changes = check_resume(s.config_dict, workdir, allow_config_change=allow_config_change)
    s.prepare()   # the data: minutes for some data sets, so after the cheap checks above
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:   # e.g. under /proc, which os.access calls writable
        raise ConfigError(f"workdir {workdir!r} cannot be made: {e.strerror}") from None
    lock = lock_workdir(workdir)
    # Ctrl-C on `... | tee log` ends tee too: writing to the closed pipe must not stop the run before
    # its checkpoint is saved, nor end it in a traceback after.
    with ignore_sigpipe():
        try:
            result, summary = _train_in(s, workdir, changes, evaluators, allow_config_change=allow_config_change)
        finally:
            if lock is not None:
                lock.close()   # releases the lock (so does the process ending, however it ends)
        if print_summary and jax.process_index() == 0:
            write_line(summary)   # not logged too: on the command line the log is the same terminal
        else:
            logging.info("%s", summary)
    return result


def closing_summary(config, steps_done: int, checkpoints: ckpt_lib.Checkpoints) -> str:
    """The run's closing line: the steps done, the best checkpoint's metric where one is kept, and where
    the checkpoints are."""
    parts = [f"end of run: {steps_done} of {config.total_steps} steps"]
    metric, best = config.checkpoint.best_metric, checkpoints.best_step
    if metric and best is not None:
        parts.append(f"best {metric}={checkpoints.best_value:.6g} at step {best} in "
                     f"{os.path.join(checkpoints.workdir, 'best')}")
    last = checkpoints.last.latest_step()
    parts.append(f"latest checkpoint (step {last}) in {os.path.join(checkpoints.workdir, 'checkpoints')}"
                 if last is not None else f"no checkpoint in {checkpoints.workdir}")
    return "; ".join(parts)


def _train_in(s: RunSetup, workdir: str, changes: list[str], evaluators, *,
              allow_config_change: bool) -> tuple[dict, str]:
    """`train_and_evaluate` once the workdir is checked, made and locked: (last eval metrics, summary line)."""
    config = s.config
    log_run(s, workdir, changes, allow_config_change=allow_config_change)
    mesh = sharding.make_mesh(config.parallel.get("sequence", 1))
    with sharding.mesh_context(mesh):
        return _train_on(s, workdir, mesh, evaluators)


def _train_on(s: RunSetup, workdir: str, mesh, evaluators) -> tuple[dict, str]:
    """`_train_in` on `mesh` (under `sharding.mesh_context`)."""
    config = s.config
    replicated = sharding.replicated(mesh)
    checkpoints, state, start = restore_or_init(s, workdir, replicated)
    if start >= config.total_steps:   # its last evaluation came before its last checkpoint
        logging.info("the run in %s has reached total_steps=%d: nothing to train (a larger "
                     "--config.total_steps trains on; --eval_only scores a checkpoint)", workdir, config.total_steps)
        summary = closing_summary(config, start, checkpoints)
        checkpoints.close()
        return {}, summary
    steps = compile_steps(s, mesh, replicated)
    if steps.pmapped:
        state = sharding.replicate_for_pmap(jax.device_get(state))

    is_main = jax.process_index() == 0
    loop = Loop(s, steps, checkpoints, None, workdir, start, evaluators)
    if loop.patience_spent(start):
        logging.info("the run stopped early at step %d (no new best %s in %d evaluations): nothing to do",
                     start, config.checkpoint.best_metric, config.checkpoint.patience)
        summary = closing_summary(config, start, checkpoints)
        checkpoints.close()
        return {}, summary
    loop.writer = metrics_lib.MetricWriter(workdir, enabled=is_main, resume_step=start)
    if start == 0:
        loop.writer.write_text("config", f"```\n{config}\n```")
    if s.packer is not None and is_main:
        logging.info("%s", s.packer.stats().line())
    train_iter = s.train_batches(start)
    restore_logging = lambda: None
    if is_main and config.progress_bar:
        from tqdm.auto import tqdm
        loop.progress = tqdm(total=config.total_steps, initial=start, desc="train", unit="step",
                             dynamic_ncols=True, file=PipeSafe(sys.stderr))
        restore_logging = log_through_tqdm()
    try:
        train_loop(loop, state, train_iter)
        summary = closing_summary(config, loop.step, checkpoints)
    finally:
        if loop.progress is not None:
            restore_logging()
            loop.progress.close()
        loop.writer.flush()
        loop.writer.close()
        checkpoints.close()
    return loop.last_eval, summary
