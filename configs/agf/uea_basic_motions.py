"""AGF on UEA BasicMotions (not in the paper's ten; the reference has no tuned setting for it).

    python -m agf_jax.train --config configs/agf/uea_basic_motions.py --workdir runs/agf_bm
    python -m agf_jax.train --config configs/agf/uea_basic_motions.py:attention=softmax --workdir runs/sm_bm
    python -m agf_jax.train --config configs/agf/uea_basic_motions.py:smoke --workdir /tmp/agf_bm_smoke

The data ship with sktime (40 train / 40 test, 6 channels, length 100, 4 classes). Filter: the reference
defaults (jacobi, alpha 1.0, beta 0.2) with K=3, fixI and eta=0.1 (the CLI default). 100 epochs of 3
steps, test accuracy after epochs 1, 2, 4, ..., 100 (as the reference): best = max over evals of
eval/accuracy in workdir/metrics.jsonl, last = the final eval. Expected: 1.0 (the dataset is easy).
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "BasicMotions", basis="jacobi", order=3, alpha=1.0, beta=0.2,
                          fix_i=True, eta=0.1)
