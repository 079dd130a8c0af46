"""SAMoVAR / LinTrans / DLinear on an ETT dataset (ETTh1, ETTh2, ETTm1, ETTm2; samovar.md §9, §11).

    python -m samovar_jax.train --config configs/samovar/ett.py:dataset=ETTh1 --workdir runs/samovar_etth1 \
        --config.data.options.source=/data/ETT-small/ETTh1.csv
    python -m samovar_jax.train --config configs/samovar/ett.py:dataset=ETTm1,horizon=336,kind=lintrans \
        --workdir runs/lintrans_ettm1_336
    python -m samovar_jax.train --config configs/samovar/ett.py:smoke --workdir /tmp/ett_smoke

The CSVs are not shipped with any package (§12): on first use <dataset>.csv is fetched from ETDataset's
ETT-small folder (the data option base_url, default zoo_core.data.forecasting.ETT_BASE_URL =
https://raw.githubusercontent.com/zhouhaoyi/ETDataset/main/ETT-small) into `csv_dir` (default:
$ZOO_DATA_DIR/ETT-small, else ~/.cache/linear_attention_zoo/ETT-small), checked (ETT header, whole
last line, the 20 months the split uses) and then used from there. A file already in `csv_dir`, or
--config.data.options.source=PATH, is used as it is; --config.data.options.base_url='' turns fetching
off. Offline, the run stops before compiling with one line, exit 2: "forecasting: source file <path>
does not exist and could not fetch <URL> (<reason>); put <dataset>.csv (ETDataset's ETT-small) in
<csv_dir> (or pass --config.data.options.source=PATH)".

Protocol: 12/4/4-month split (x4 rows for ETTm), StandardScaler fit on train, mode M (7 channels), the
paper's (L_I, P) pairs (1024, 96), (2048, 192), (2048, 336), (4096, 720), AdamW lr 6e-4 (DLinear 1e-4),
batch 32, clipping 1; see configs/samovar/forecasting.py for the shared settings. `steps` sets the budget
(default 3,000; ETTh1 has 8,640 - 1,024 - 96 + 1 = 7,521 train windows at L_I = 1024, P = 96, so 100
epochs of batch 32 would be about 23.5k steps).

Metrics: eval/mse, eval/mae (validation), eval/test_mse, eval/test_mae at every eval. Expected (poster
Table 1, test MSE averaged over the four horizons): SAMoVAR ETTh1 0.401, ETTh2 0.324, ETTm1 0.339,
ETTm2 0.240; DLinear 0.422 / 0.426 / 0.347 / 0.252 (with the full 100-epoch protocol).
"""
from __future__ import annotations

import os

from zoo_core.configs import common
from zoo_core.configs.samovar import forecasting
from zoo_core.data import forecasting as forecasting_data
from zoo_core.data import pipeline

DATASETS = ("ETTh1", "ETTh2", "ETTm1", "ETTm2")
CHANNELS = 7   # HUFL, HULL, MUFL, MULL, LUFL, LULL, OT


def get_config(arg=None):
    args = common.parse_arg(arg, dataset="ETTh1", kind="samovar", horizon=96, input_length=0, csv_dir="",
                            steps=forecasting.DEFAULT_STEPS, smoke=False)
    if args.dataset not in DATASETS:
        raise ValueError(f"config argument dataset must be one of {DATASETS}, got {args.dataset!r}")
    csv_dir = args.csv_dir or os.path.join(pipeline.resolve_data_dir(""), "ETT-small")
    c = common.base_config()
    forecasting.set_forecast(c, kind=args.kind, source=os.path.join(csv_dir, f"{args.dataset}.csv"),
                             channels=CHANNELS, horizon=args.horizon, input_length=args.input_length,
                             steps=args.steps, smoke=args.smoke)
    c.data.options.base_url = forecasting_data.ETT_BASE_URL   # a missing <dataset>.csv is fetched from there
    return forecasting.finish(c)
