"""AGF on UEA Heartbeat (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: chebyshev, K=6, no fixI, eta=0.01.

    python -m agf_jax.train --config configs/agf/uea_heartbeat.py \
        --workdir runs/agf_heartbeat --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_heartbeat.py:attention=softmax \
        --workdir runs/sm_heartbeat --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_heartbeat.py:smoke --workdir /tmp/agf_smoke

Data: DIR/Heartbeat/Heartbeat_TRAIN.ts and _TEST.ts from the UEA archive (204 train / 205 test, 61
channels, length 405, 2 classes); the smoke variant trains on the bundled JapaneseVowels instead. 100
epochs of 13 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 100 (as the reference): best =
max over evals of eval/accuracy in workdir/metrics.jsonl (the reference protocol), last = the final
eval. Expected: AGF's own number is not available (agf.md §8.1); for context, Primalformer's table gives
Transformer 76.1, Flowformer 77.6.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "Heartbeat",
                          basis="chebyshev", order=6, fix_i=False, eta=0.01)
