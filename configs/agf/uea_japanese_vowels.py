"""AGF on UEA JapaneseVowels (agf.md §3.2; `run_agf_best.sh`: legendre, K=4, no fixI, eta=0.01).

    python -m agf_jax.train --config configs/agf/uea_japanese_vowels.py --workdir runs/agf_jv
    python -m agf_jax.train --config configs/agf/uea_japanese_vowels.py:attention=softmax --workdir runs/sm_jv
    python -m agf_jax.train --config configs/agf/uea_japanese_vowels.py:smoke --workdir /tmp/agf_jv_smoke

The data ship with sktime. 100 epochs of 17 steps (batch 16), test accuracy after epochs 1, 2, 4, ...,
100 (as the reference): best = max over evals of eval/accuracy in workdir/metrics.jsonl (the reference
protocol), last = the final eval. Expected: best test accuracy >= 0.989 (Primalformer's table:
Transformer 98.7, Flowformer 98.9; AGF's own number is not available, agf.md §8.1). Measured here
(README): best 0.9838 with seed 666; over seeds 666 and 1-4: 0.9838-0.9892, mean 0.9860, the target
reached by seed 1 (seed 4 reaches it only at epoch 93, which the reference does not evaluate); softmax
baseline 0.9892.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "JapaneseVowels", basis="legendre", order=4, fix_i=False, eta=0.01)
