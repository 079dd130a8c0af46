"""AGF on UEA PEMS-SF (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=1.5, beta=2.0, K=5, fixI, eta=0.1.

    python -m agf_jax.train --config configs/agf/uea_pems_sf.py \
        --workdir runs/agf_pems_sf --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_pems_sf.py:attention=softmax \
        --workdir runs/sm_pems_sf --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_pems_sf.py:smoke --workdir /tmp/agf_smoke

Data: DIR/PEMS-SF/PEMS-SF_TRAIN.ts and _TEST.ts from the UEA archive (267 train / 173 test, 963
channels, length 144, 7 classes); the smoke variant trains on the bundled JapaneseVowels instead. 400
epochs of 17 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 400 (as the reference): best =
max over evals of eval/accuracy in workdir/metrics.jsonl (the reference protocol), last = the final
eval. Expected: AGF's own number is not available (agf.md §8.1); for context, Primalformer's table gives
Transformer 82.1, Flowformer 83.8.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "PEMS-SF",
                          basis="jacobi", order=5, alpha=1.5, beta=2.0, fix_i=True, eta=0.1, epochs=400)
