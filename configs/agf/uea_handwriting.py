"""AGF on UEA Handwriting (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=1.0, beta=0.2, K=3, no fixI, eta=0.01.

    python -m agf_jax.train --config configs/agf/uea_handwriting.py \
        --workdir runs/agf_handwriting --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_handwriting.py:attention=softmax \
        --workdir runs/sm_handwriting --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_handwriting.py:smoke --workdir /tmp/agf_smoke

Data: DIR/Handwriting/Handwriting_TRAIN.ts and _TEST.ts from the UEA archive (150 train / 850 test, 3
channels, length 152, 26 classes); the smoke variant trains on the bundled JapaneseVowels instead.
alpha/beta are the reference defaults (the script passes none). 100 epochs of 10 steps (batch 16), test
accuracy after epochs 1, 2, 4, ..., 100 (as the reference): best = max over evals of eval/accuracy in
workdir/metrics.jsonl (the reference protocol), last = the final eval. Expected: AGF's own number is not
available (agf.md §8.1); for context, Primalformer's table gives Transformer 32.0, Flowformer 33.8.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "Handwriting",
                          basis="jacobi", order=3, alpha=1.0, beta=0.2, fix_i=False, eta=0.01)
