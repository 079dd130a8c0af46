"""Evaluation: `evaluate_params` over a split, `evaluate_checkpoint` (a saved checkpoint on any split, nothing
trained) and `load_params` (a run's model and parameters, for notebooks and decoding).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from absl import logging

from zoo_core.data import pipeline
from zoo_core.run import checkpoint as ckpt_lib
from zoo_core.run import metrics as metrics_lib
from zoo_core.run import sharding
from zoo_core.run.errors import ConfigError
from zoo_core.run.resume import check_eval_config
from zoo_core.run.setup import check_setup, compile_steps
from zoo_core.run.steps import eval_feature_step, feature_step_kwargs


def evaluate_params(params, steps_done: int, *, p_eval, eval_source, config, model, to_device,
                    pmapped: bool = False, evaluators: Iterable[Callable[..., Mapping[str, float]]] = (),
                    host_params=None) -> dict[str, float]:
    """{'eval/<metric>': value} of `params` (after `steps_done` updates) over `eval_source`, plus evaluators.

    `p_eval` is the compiled `eval_step`; under pmap (`pmapped`) `params` are replicated and `host_params`
    is the single copy the host-side evaluators get.
    """
    pindex, pcount = jax.process_index(), jax.process_count()
    index = np.int32(eval_feature_step(steps_done))
    totals: dict[str, list[float]] = {}
    for batch in pipeline.eval_batches(eval_source, global_batch_size=config.eval_batch_size,
                                       process_index=pindex, process_count=pcount,
                                       max_examples=config.eval_max_examples or None):
        sums = jax.device_get(p_eval(params, to_device(batch), index))
        if pmapped:
            sums = sharding.unreplicate(sums)
        for k, (v, n) in sums.items():
            acc = totals.setdefault(k, [0.0, 0.0])
            acc[0] += float(v)
            acc[1] += float(n)
    result = {f"eval/{k}": v / max(n, 1e-12) for k, (v, n) in totals.items()}
    host_params = params if host_params is None else host_params
    for evaluator in evaluators:
        found = evaluator(host_params, model, config, **feature_step_kwargs(model, int(index)))
        result.update({f"eval/{k}": float(v) for k, v in found.items()})
    return result


def evaluate_checkpoint(config, workdir: str, build_model: Callable[..., Any], *, which: str = "best",
                        split: str | None = None,
                        evaluators: Iterable[Callable[..., Mapping[str, float]]] = ()) -> dict[str, float]:
    """Evaluates a saved checkpoint of a run on one split; nothing is trained or changed in the run.

    The same setup and compiled eval step as training: `check_setup(...).prepare()` (the config, the
    model, task and data, each built once and checked as training checks them) and `compile_steps`
    (jit over the 'data' mesh, or pmap under parallel.mode 'pmap'), so the evaluation of a checkpoint
    reproduces the evaluation logged when it was saved.

    Writes the result to `workdir/eval_<which>_<split>.json` (with the checkpoint's step) and returns it;
    where that file cannot be written (a read-only run directory) it logs one warning line and still
    returns it.

    Args:
      config: the run's config (the same model and data options as the training run).
      workdir: the training run's directory.
      build_model: the architecture's `Model` factory.
      which: 'best' (the best checkpoint by config.checkpoint.best_metric) or 'latest'.
      split: the split to evaluate; None = config.data.eval_split. The evaluators must have been made
        for a config with this split (`with_eval_split`).
      evaluators: extra host-side evaluations, as in `train_and_evaluate`.

    Returns:
      {'eval/<metric>': value, ...} and 'step', the checkpoint's step.

    Raises:
      ConfigError: a bad `which`, an unknown split, a model other than the run's (`check_eval_config`)
        or a config problem (one line).
      FileNotFoundError: no such checkpoint in workdir.
    """
    if which not in ("best", "latest"):
        raise ConfigError(f"which must be 'best' or 'latest', got {which!r}")
    if split is not None:
        config = with_eval_split(config, split)
    evaluators = list(evaluators)
    # Before the data is built (minutes for some data sets): an empty or mistyped workdir fails at once.
    folder = "best" if which == "best" else "checkpoints"
    ckpt_lib.require_checkpoints(workdir, folder)
    check_eval_config(json.loads(config.to_json_best_effort()), workdir)
    s = check_setup(config, build_model, has_evaluators=bool(evaluators)).prepare()
    mesh = sharding.make_mesh(config.parallel.get("sequence", 1))
    with sharding.mesh_context(mesh):
        return _evaluate_on(s, mesh, workdir, which, folder, config, evaluators)


def _evaluate_on(s, mesh, workdir, which, folder, config, evaluators):
    replicated = sharding.replicated(mesh)
    steps = compile_steps(s, mesh, replicated)   # only its eval step runs (jit compiles on first call)
    # Restored straight into the global replicated sharding: each process reads its own shards.
    host_params, step = ckpt_lib.restore_params(workdir, which=folder,
                                                target_sharding=None if steps.pmapped else replicated)
    params = sharding.replicate_for_pmap(host_params) if steps.pmapped else host_params
    result = evaluate_params(params, step, p_eval=steps.eval, eval_source=s.eval_source, config=config,
                             model=s.model, to_device=steps.to_device, pmapped=steps.pmapped,
                             evaluators=evaluators, host_params=host_params)
    result["step"] = int(step)
    if jax.process_index() == 0:
        path = os.path.join(workdir, f"eval_{which}_{config.data.eval_split}.json")
        try:
            metrics_lib.write_json(path, result)
        except OSError as e:   # a read-only run directory: the result is still returned (and printed)
            logging.warning("%s could not be written (%s); the result is only returned (--eval_only prints "
                            "it)", path, e.strerror or e)
    logging.info("%s checkpoint (step %d) on %s: %s", which, step, config.data.eval_split,
                 ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.items()) if k != "step"))
    return result


def with_eval_split(config, split: str):
    """A copy of `config` whose data.eval_split is `split`."""
    if not isinstance(split, str) or not split:
        raise ConfigError(f"the evaluation split must be a non-empty name, got {split!r}")
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.data.eval_split = split
    return config


def load_params(workdir: str, build_model: Callable[..., Any], config, *, which: str = "checkpoints",
                target_sharding: jax.sharding.Sharding | None = None):
    """The run's model and the parameters of its newest checkpoint in workdir/<which> (notebooks, decoding).

    The restore itself is `checkpoint.restore_params`.

    The checkpoint may come from any topology (8 accelerators, 2 processes): the state is restored
    against its own stored shapes and dtypes in `target_sharding`, by default this process's first local
    device, so a laptop reads a TPU run's checkpoint.

    Args:
      workdir, build_model, config: the run's directory, `Model` factory and config.
      which: 'checkpoints' (the newest) or 'best'.
      target_sharding: where every array goes (e.g. a replicated `NamedSharding` over all processes);
        None means `jax.local_devices()[0]`.

    Returns:
      (model, params, step).
    """
    model = build_model(**config.model.to_dict())
    params, step = ckpt_lib.restore_params(workdir, which=which, target_sharding=target_sharding)
    return model, params, step
