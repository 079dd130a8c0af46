"""AGF on UEA SpokenArabicDigits (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=1.0, beta=0.0, K=4, fixI, eta=0.5.

    python -m agf_jax.train --config configs/agf/uea_spoken_arabic_digits.py \
        --workdir runs/agf_spoken_arabic_digits --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_spoken_arabic_digits.py:attention=softmax \
        --workdir runs/sm_spoken_arabic_digits --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_spoken_arabic_digits.py:smoke --workdir /tmp/agf_smoke

Data: DIR/SpokenArabicDigits/SpokenArabicDigits_TRAIN.ts and _TEST.ts from the UEA archive (6599 train /
2199 test, 13 channels, length 93, 10 classes); the smoke variant trains on the bundled JapaneseVowels
instead. Adam instead of RAdam, as in the reference script. 100 epochs of 413 steps (batch 16), test
accuracy after epochs 1, 2, 4, ..., 100 (as the reference): best = max over evals of eval/accuracy in
workdir/metrics.jsonl (the reference protocol), last = the final eval. Expected: AGF's own number is not
available (agf.md §8.1); for context, Primalformer's table gives Transformer 98.4, Flowformer 98.8.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "SpokenArabicDigits",
                          basis="jacobi", order=4, alpha=1.0, beta=0.0, fix_i=True, eta=0.5,
                          optimizer="adam")
