"""Defaults shared by every config, and `parse_arg` for `--config file.py:key=value,flag` strings.

Every knob of the trainer is here with one comment (the schedule and lookahead fields take their
defaults, and their comments, from zoo_core/run/optim.py); architecture configs override what they need.

One composition style for every config file: `get_config(arg)` parses its `:args` with `parse_arg`,
starts from `base_config()`, lets the shared helpers of its folder write their part into it
(`set_*(c, ...)`; e.g. configs/agf/common.py, configs/htgn/common.py), applies `smoke(c)` for `:smoke`,
and ends with `finish(c, VARIANTS, build=Model)`, which writes the model's size preset into explicit
fields (`decode_variant`), then every other constructor field of the model (`complete_model_fields`), and
locks the config. Every model and data option is then a field of the config, so
`--config.model.<field>=...` and `--config.data.options.<option>=...` reach it.

Resuming: a workdir with checkpoints resumes only under the config stored in its config.json. Fields
marked "(safe on resume)" below may change between a run and its resumption (they decide what is
logged, evaluated or kept, not what is trained), and so may total_steps when it grows under a constant
or warmup_rsqrt schedule; any other difference (model, optim, schedule, data, seed, batch_size, ...) is
refused naming the fields unless the run is started with `--allow_config_change`
(`train_and_evaluate(..., allow_config_change=True)`), which logs the differences and replaces
config.json. The list is zoo_core.trainer.SAFE_ON_RESUME.
"""
from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any, Callable, Iterable, Mapping

import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from zoo_core.run import optim


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parses 'variant=small,smoke' into typed values using `defaults` for names and types.

    A bare word sets a bool to True ('smoke'); 'key=value' converts value to the default's type.

    Raises:
      ValueError: an unknown key, a key given twice or a value that does not convert.
    """
    out = dict(defaults)
    given = set()
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; valid: {', '.join(sorted(defaults))}")
        if key in given:   # the last would silently win
            raise ValueError(f"config argument {key!r} is given twice in {arg!r}")
        given.add(key)
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
    c.eval_also_at_step = 0           # one more eval (UEA: end of epoch 1, as the reference); 0 or past
                                      # total_steps = none in this run (safe on resume)
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
    c.optim.grad_accum_steps = 1      # micro-batches per optimiser step (same update as the whole batch)
    c.optim.update(optim.LOOKAHEAD_DEFAULTS)  # ranger only: lookahead sync period and step size

    c.schedule = ml_collections.ConfigDict()
    c.schedule.name = "constant"      # constant | one_cycle | warmup_linear | warmup_cosine | warmup_rsqrt
    c.schedule.update(optim.SCHEDULE_DEFAULTS)  # each field with its meaning: zoo_core/run/optim.py

    c.parallel = ml_collections.ConfigDict()
    c.parallel.mode = "jit"           # jit (NamedSharding over a 'data' mesh) | pmap (legacy)
    # The CPU devices the training command starts JAX with (0: one per core that divides the batch):
    # data parallelism over the cores, worth it where the step is mostly elementwise work
    # (zoo_core.run.sharding.cpu_device_count says why). No effect on accelerators.
    c.parallel.cpu_devices = 1        # (safe on resume)
    # Context parallelism: the mesh becomes data x sequence with this many devices on 'sequence'; sequence
    # inputs are split along their length, parameters replicated. Models whose layers have a
    # `sequence_axis` field get it set to 'sequence' (zoo_core.run.sharding.sequence_model_fields).
    c.parallel.sequence = 1           # (safe on resume: the same numbers within float32 rounding)

    c.data = ml_collections.ConfigDict()
    c.data.name = ""                  # a key of zoo_core.data.DATASETS
    c.data.data_dir = ""              # '' = $ZOO_DATA_DIR or ~/.cache/linear_attention_zoo (safe on resume)
    c.data.train_split = "train"
    c.data.eval_split = "test"        # (safe on resume)
    c.data.options = ml_collections.ConfigDict()  # the dataset's own options (validated by the dataset)
    # Pack several training examples into each row, as flax's wmt pipeline does (zoo_core/data/packing.py):
    # seq2seq only; batches gain '<feature>_segmentation' and '<feature>_position'; eval stays unpacked.
    c.data.packing = False
    c.data.packing_factor = 1         # packed rows are this many times each sequence feature's stored width

    c.task = ml_collections.ConfigDict()
    c.task.name = "classification"    # classification | forecast | seq2seq

    c.model = ml_collections.ConfigDict()  # passed as Model(**config.model); every field explicit (finish)

    # Read by the architectures' host-side evaluators (the `evaluators_fn` of their train.py), which run
    # with every eval; declared here so that every config has them and a typo fails as an unknown key.
    c.test_split = ""                 # SAMoVAR: scored at every eval ('' = off; refused elsewhere) (safe on resume)
    c.decode = ml_collections.ConfigDict()  # htgn_jax.decoding: seq2seq decoding for eval/bleu (safe on resume)
    c.decode.beam_size = 1            # 1 = greedy
    c.decode.length_penalty = 0.0     # GNMT length penalty alpha >= 0, beam search only (0 = none)
    c.decode.max_examples = 0         # 0 = eval_max_examples, else the whole eval split
    c.decode.max_len = 0              # 0 = the targets' width
    c.decode.use_cache = "auto"       # auto | cache | recompute
    return c


# The options class of each dataset (zoo_core.data.DATASETS), whose fields and defaults `data_options`
# writes into a config.
DATA_OPTIONS = {
    "synthetic_linear": "zoo_core.data.synthetic:SyntheticLinearConfig",
    "lra_listops": "zoo_core.data.listops:ListOpsConfig",
    "lra_text": "zoo_core.data.lra_files:LraTextConfig",
    "lra_retrieval": "zoo_core.data.lra_files:LraRetrievalConfig",
    "lra_image": "zoo_core.data.lra_files:LraImageConfig",
    "lra_pathfinder": "zoo_core.data.lra_files:LraPathfinderConfig",
    "uea": "zoo_core.data.uea:UeaConfig",
    "synthetic_var": "zoo_core.data.synthetic_var:SyntheticVarConfig",
    "forecasting": "zoo_core.data.forecasting:ForecastingConfig",
    "number_words": "zoo_core.data.number_words:NumberWordsConfig",
    "digits": "zoo_core.data.digits:DigitsConfig",
    "wmt14_en_de": "zoo_core.data.wmt:WmtConfig",
}


def data_option_defaults(name: str) -> dict[str, Any]:
    """{option: default} of dataset `name` (the fields of its BuilderConfig beyond TFDS's own)."""
    import tensorflow_datasets as tfds
    if name not in DATA_OPTIONS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(sorted(DATA_OPTIONS))}")
    module, _, cls = DATA_OPTIONS[name].partition(":")
    fields = dataclasses.fields(getattr(importlib.import_module(module), cls))
    own = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
    return {f.name: f.default for f in fields if f.name not in own}


def data_options(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Writes every option of dataset c.data.name that c.data.options lacks, with its default.

    The prepared-data key hashes every option value with the defaults filled in, so this names the
    same prepared directory. A path option whose default is None is written as '' (the datasets read
    '' as "not given"); any other None default is a typed placeholder (None until overridden).
    """
    for key, value in data_option_defaults(c.data.name).items():
        if key in c.data.options:
            continue
        if value is None:
            value = "" if key.endswith("_dir") or key == "source" else config_dict.placeholder(object)
        c.data.options[key] = value
    return c


def decode_variant(model: ml_collections.ConfigDict, variants: Mapping[str, Mapping[str, Any]], *,
                   allowed: Iterable[str] | None = None,
                   derived: Iterable[str] = ()) -> ml_collections.ConfigDict:
    """Replaces model.variant by the preset's fields, written explicitly (big_vision's decode_variant).

    Fields already set win over the preset, as in `Model(variant=..., **fields)`, so the model built
    is the same; afterwards `--config.model.num_layers=3` overrides a size like any other field.

    Args:
      model: the config's model part; its `variant` key is removed.
      variants: the architecture's VARIANTS table.
      allowed: the fields the model's kind takes (preset keys outside it are skipped, as the
        factories do); None = all.
      derived: preset fields the model derives from others unless given (AGF's UEA head_dim); they
        become int placeholders (None until overridden) instead of the preset's value.
    """
    variant = model.get("variant")
    if variant is None:
        return model
    if variant not in variants:
        raise ValueError(f"unknown model variant {variant!r}; known: {', '.join(variants)}")
    del model["variant"]
    allowed = None if allowed is None else set(allowed)
    for key, value in variants[variant].items():
        if key in model or (allowed is not None and key not in allowed):
            continue
        model[key] = config_dict.placeholder(type(value)) if key in derived else value
    return model


def _placeholder_type(hint: Any) -> type:
    """The type a placeholder of annotation `hint` holds (Optional[int] -> int; Any -> object)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    return hint if hint in (bool, int, float, str) else object


def complete_model_fields(model: ml_collections.ConfigDict, build: Callable[..., Any]) -> ml_collections.ConfigDict:
    """Writes every constructor field of the model `build(**model)` makes that `model` lacks.

    A field is written with the value the model takes anyway (its default, or the kind's, e.g. the
    softmax baseline's use_graph_conv=False), so the model built afterwards is the same. A field
    the factory would refuse when given (a part that is switched off, e.g. AGF's filter fields with
    attention='softmax') and one the model derives (None by default) become typed placeholders:
    None, read by the factories as unset, until `--config.model.<field>=...` sets them. Dtypes are
    written by name ('float32').
    """
    given = model.to_dict()
    module = build(**given)
    hints = typing.get_type_hints(type(module))
    for field in dataclasses.fields(module):
        if field.name in ("parent", "name") or field.name in model:
            continue
        value = getattr(module, field.name)
        if field.name in ("dtype", "param_dtype"):
            value = None if value is None else jnp.dtype(value).name
            hint = str
        else:
            hint = _placeholder_type(hints[field.name])
        if value is not None:
            try:
                build(**given, **{field.name: value})
            except ValueError:   # refused when given: it belongs to a part that is switched off
                value = None
        model[field.name] = value if value is not None else config_dict.placeholder(hint)
    return model


def finish(c: ml_collections.ConfigDict, variants: Mapping[str, Mapping[str, Any]] | None = None, *,
           build: Callable[..., Any] | None = None, **decode_kwargs) -> ml_collections.ConfigDict:
    """The last step of every get_config: explicit model and data fields, then lock.

    Args:
      c: the config.
      variants: the architecture's VARIANTS table (c.model.variant is decoded with it).
      build: the architecture's `Model` factory; every other field of the model it builds is then
        written too (`complete_model_fields`), so that each is a config field.
      **decode_kwargs: for `decode_variant`.
    """
    if variants is not None:
        decode_variant(c.model, variants, **decode_kwargs)
    if build is not None:
        complete_model_fields(c.model, build)
    if c.data.name:
        data_options(c)
    c.lock()
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
