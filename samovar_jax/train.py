"""Training entry point for SAMoVAR (Lu & Yang, ICML 2025) and its baselines on the shared zoo trainer.

    python -m samovar_jax.train --config configs/samovar/synthetic_var.py --workdir runs/samovar_var
    python -m samovar_jax.train --config configs/samovar/forecasting.py:kind=dlinear --workdir runs/dlinear_vic

`config.model.kind` selects the model: 'samovar' | 'lintrans' | 'fixedvar' (`samovar_jax.model.Model`)
or 'dlinear' (`samovar_jax.baselines.DLinear`). A config with a `test_split` field (the forecasting
configs) also evaluates that split at every eval, logged as eval/test_mse and
eval/test_mae, so the test metrics at the best validation step (the reference's early-stopping
protocol, samovar.md §9) can be read from workdir/metrics.jsonl. See zoo_core.main for the flags.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from samovar_jax import baselines, model
from zoo_core import data as data_lib
from zoo_core import main, tasks
from zoo_core.data import pipeline


def build_model(kind: str = "samovar", **fields):
    """`Model(kind=kind, **fields)`, or `DLinear(**fields)` for kind='dlinear'."""
    if kind == "dlinear":
        return baselines.DLinear(**fields)
    return model.Model(kind=kind, **fields)


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

    return evaluate


def evaluators(config) -> list:
    split = config.get("test_split", "")
    return [split_evaluator(split)] if split else []


if __name__ == "__main__":
    main.run(build_model, evaluators)
