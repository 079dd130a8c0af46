"""Defaults shared by every config, and `parse_arg` for `--config file.py:key=value,flag` strings.

Every knob of the trainer is here with one comment (the schedule and lookahead fields take their
defaults, and their comments, from zoo_core/optim.py); architecture configs override what they need.

Resuming: a workdir with checkpoints resumes only under the config stored in its config.json. Fields
marked "(safe on resume)" below may change between a run and its resumption (they decide what is
logged, evaluated or kept, not what is trained), and so may total_steps when it grows under a constant
or warmup_rsqrt schedule; any other difference (model, optim, schedule, data, seed, batch_size, ...) is
refused naming the fields unless the run is started with `--allow_config_change`
(`train_and_evaluate(..., allow_config_change=True)`), which logs the differences and replaces
config.json. The list is zoo_core.trainer.SAFE_ON_RESUME.
"""
from __future__ import annotations

from typing import Any

import ml_collections

from zoo_core import optim


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parses 'variant=small,smoke' into typed values using `defaults` for names and types.

    A bare word sets a bool to True ('smoke'); 'key=value' converts value to the default's type.

    Raises:
      ValueError: an unknown key or a value that does not convert.
    """
    out = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; valid: {', '.join(sorted(defaults))}")
        kind = type(defaults[key])
        if not sep:
            if kind is not bool:
                raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
            out[key] = True
        elif kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config argument {key}={value!r} is not a bool")
            out[key] = value.lower() in ("true", "1")
        else:
            try:
                out[key] = kind(value)
            except ValueError:
                raise ValueError(f"config argument {key}={value!r} is not a {kind.__name__}") from None
    return ml_collections.ConfigDict(out)


def base_config() -> ml_collections.ConfigDict:
    """The trainer's full set of fields with defaults (configs override and then lock)."""
    c = ml_collections.ConfigDict()
    c.seed = 0                        # parameter init, dropout and data order all derive from it
    c.total_steps = 1000              # optimiser steps (may grow on resume under a constant/warmup_rsqrt schedule)
    c.batch_size = 32                 # global batch (all devices and processes); divisible by device count
    c.eval_batch_size = 32            # global eval batch; the last batch is padded and masked (safe on resume)
    c.eval_max_examples = 0           # 0 = the whole eval split; >0 caps it (smoke runs) (safe on resume)
    c.log_every_steps = 50            # train metrics to metrics.jsonl / TensorBoard, averaged (safe on resume)
    c.eval_every_steps = 500          # also at total_steps and eval_also_at_step; 0 = no eval at all (safe on resume)
    c.eval_also_at_step = 0           # one more eval (UEA: end of epoch 1, as the reference); 0 = none (safe on resume)
    c.checkpoint_every_steps = 500    # 0 = only at the end (and on SIGTERM) (safe on resume)
    c.progress_bar = True             # tqdm bar with ETA and live loss on process 0 (safe on resume)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.keep = 3             # newest checkpoints kept under workdir/checkpoints (safe on resume)
    c.checkpoint.best_metric = ""     # e.g. 'eval/accuracy': keep the best in workdir/best; '' = off (safe on resume)
    c.checkpoint.best_mode = "max"    # 'max' or 'min' for best_metric (safe on resume)
    c.checkpoint.patience = 0         # > 0: early stopping after this many evals without a new best (safe on resume)

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"            # adamw | adam | radam | lamb | ranger (lookahead(radam))
    c.optim.learning_rate = 1e-3      # peak learning rate
    c.optim.weight_decay = 0.0        # decoupled weight decay (adamw, radam, lamb, ranger)
    c.optim.decay_mask = "no_bias_norm"  # all | no_bias_norm | no_bias_norm_embed
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.grad_clip_norm = 0.0      # global-norm clipping (0 = off)
    c.optim.grad_accum_steps = 1      # micro-batches averaged per optimiser step
    c.optim.update(optim.LOOKAHEAD_DEFAULTS)  # ranger only: lookahead sync period and step size

    c.schedule = ml_collections.ConfigDict()
    c.schedule.name = "constant"      # constant | one_cycle | warmup_linear | warmup_cosine | warmup_rsqrt
    c.schedule.update(optim.SCHEDULE_DEFAULTS)  # each field with its meaning: zoo_core/optim.py

    c.parallel = ml_collections.ConfigDict()
    c.parallel.mode = "jit"           # jit (NamedSharding over a 'data' mesh) | pmap (legacy)

    c.data = ml_collections.ConfigDict()
    c.data.name = ""                  # a key of zoo_core.data.DATASETS
    c.data.data_dir = ""              # '' = $ZOO_DATA_DIR or ~/.cache/linear_attention_zoo (safe on resume)
    c.data.train_split = "train"
    c.data.eval_split = "test"        # (safe on resume)
    c.data.options = ml_collections.ConfigDict()  # the dataset's own options (validated by the dataset)

    c.task = ml_collections.ConfigDict()
    c.task.name = "classification"    # classification | forecast | seq2seq

    c.model = ml_collections.ConfigDict()  # passed as Model(**config.model)
    return c


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrinks a config to a seconds-long run: 2 steps, tiny batches, eval on a few examples."""
    c.total_steps = 2
    c.batch_size = 4
    c.eval_batch_size = 4
    c.eval_max_examples = 8
    c.log_every_steps = 1
    c.eval_every_steps = 2
    c.eval_also_at_step = 0
    c.checkpoint_every_steps = 2
    c.progress_bar = False
    return c
