"""AGF on UEA EthanolConcentration (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=1.5, beta=-1.5, K=6, fixI, eta=0.1.

    python -m agf_jax.train --config configs/agf/uea_ethanol_concentration.py \
        --workdir runs/agf_ethanol_concentration --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_ethanol_concentration.py:attention=softmax \
        --workdir runs/sm_ethanol_concentration --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_ethanol_concentration.py:smoke --workdir /tmp/agf_smoke

Data: DIR/EthanolConcentration/EthanolConcentration_TRAIN.ts and _TEST.ts from the UEA archive (261
train / 263 test, 3 channels, length 1751, 4 classes); the smoke variant trains on the bundled
JapaneseVowels instead. 100 epochs of 17 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 100
(as the reference): best = max over evals of eval/accuracy in workdir/metrics.jsonl (the reference
protocol), last = the final eval. Expected: AGF's own number is not available (agf.md §8.1); for
context, Primalformer's table gives Transformer 32.7, Flowformer 33.8.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "EthanolConcentration",
                          basis="jacobi", order=6, alpha=1.5, beta=-1.5, fix_i=True, eta=0.1)
