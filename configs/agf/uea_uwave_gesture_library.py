"""AGF on UEA UWaveGestureLibrary (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=2.0, beta=1.5, K=10, fixI, eta=0.1.

    python -m agf_jax.train --config configs/agf/uea_uwave_gesture_library.py \
        --workdir runs/agf_uwave_gesture_library --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_uwave_gesture_library.py:attention=softmax \
        --workdir runs/sm_uwave_gesture_library --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_uwave_gesture_library.py:smoke --workdir /tmp/agf_smoke

Data: DIR/UWaveGestureLibrary/UWaveGestureLibrary_TRAIN.ts and _TEST.ts from the UEA archive (120 train
/ 320 test, 3 channels, length 315, 8 classes); the smoke variant trains on the bundled JapaneseVowels
instead. 100 epochs of 8 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 100 (as the
reference): best = max over evals of eval/accuracy in workdir/metrics.jsonl (the reference protocol),
last = the final eval. Expected: AGF's own number is not available (agf.md §8.1); for context,
Primalformer's table gives Transformer 85.6, Flowformer 86.6.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "UWaveGestureLibrary",
                          basis="jacobi", order=10, alpha=2.0, beta=1.5, fix_i=True, eta=0.1)
