"""Host-side evaluators of the SAMoVAR configs, for the shared trainer's `evaluators` hook.

A config with a non-empty `test_split` field (the forecasting configs) also evaluates that split at
every eval, logged as eval/<split>_mse and eval/<split>_mae, so the test metrics at the best
validation step (the reference's early-stopping protocol, samovar.md §9) can be read from
workdir/metrics.jsonl.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core import data as data_lib
from zoo_core import tasks
from zoo_core.data import pipeline


def split_evaluator(split: str):
    """Host-side evaluator `fn(params, model, config) -> {'<split>_mse', '<split>_mae'}` over `split`.

    Covers the whole split, or its first `config.eval_max_examples` windows when that is > 0 (smoke runs).
    The source and the jitted forward are built on first use and reused by later evals.
    """
    cache = {}

    def evaluate(params, net, config):
        if "source" not in cache:
            d = config.data
            builder = data_lib.make_builder(d.name, pipeline.resolve_data_dir(d.data_dir), **d.options.to_dict())
            cache["source"] = builder.as_data_source(split)
            metrics = tasks.forecast()   # the training task's MSE/MAE (and its shape check)

            def sums(p, batch):
                outputs = net.apply({"params": p}, batch, train=False)[0]
                reduced = tasks.reduce_metrics(metrics(outputs, batch), batch["example_mask"])
                return jnp.stack([reduced["mse"][0], reduced["mae"][0], reduced["mse"][1]])
            cache["sums"] = jax.jit(sums)
        total = np.zeros(3)
        for batch in pipeline.eval_batches(cache["source"], global_batch_size=config.eval_batch_size,
                                           max_examples=config.eval_max_examples or None):
            total += np.asarray(cache["sums"](params, batch))
        return {f"{split}_mse": total[0] / total[2], f"{split}_mae": total[1] / total[2]}

    evaluate.split = split   # the split it reports: `config.test_split` is read (zoo_core.run.main checks)
    return evaluate


def evaluators_for(config) -> list:
    """The evaluators a config declares: `split_evaluator(config.test_split)` if it has one."""
    split = config.get("test_split", "")
    return [split_evaluator(split)] if split else []
