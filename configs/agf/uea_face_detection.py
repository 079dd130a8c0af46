"""AGF on UEA FaceDetection (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=2.0, beta=0.5, K=9, fixI, eta=0.1.

    python -m agf_jax.train --config configs/agf/uea_face_detection.py \
        --workdir runs/agf_face_detection --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_face_detection.py:attention=softmax \
        --workdir runs/sm_face_detection --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_face_detection.py:smoke --workdir /tmp/agf_smoke

Data: DIR/FaceDetection/FaceDetection_TRAIN.ts and _TEST.ts from the UEA archive (5890 train / 3524
test, 144 channels, length 62, 2 classes); the smoke variant trains on the bundled JapaneseVowels
instead. 100 epochs of 369 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 100 (as the
reference): best = max over evals of eval/accuracy in workdir/metrics.jsonl (the reference protocol),
last = the final eval. Expected: AGF's own number is not available (agf.md §8.1); for context,
Primalformer's table gives Transformer 67.3, Flowformer 67.6.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "FaceDetection",
                          basis="jacobi", order=9, alpha=2.0, beta=0.5, fix_i=True, eta=0.1)
