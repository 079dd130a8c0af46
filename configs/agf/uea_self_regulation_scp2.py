"""AGF on UEA SelfRegulationSCP2 (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=2.0, beta=1.5, K=7, fixI, eta=0.1.

    python -m agf_jax.train --config configs/agf/uea_self_regulation_scp2.py \
        --workdir runs/agf_self_regulation_scp2 --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_self_regulation_scp2.py:attention=softmax \
        --workdir runs/sm_self_regulation_scp2 --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_self_regulation_scp2.py:smoke --workdir /tmp/agf_smoke

Data: DIR/SelfRegulationSCP2/SelfRegulationSCP2_TRAIN.ts and _TEST.ts from the UEA archive (200 train /
180 test, 7 channels, length 1152, 2 classes); the smoke variant trains on the bundled JapaneseVowels
instead. 100 epochs of 13 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 100 (as the
reference): best = max over evals of eval/accuracy in workdir/metrics.jsonl (the reference protocol),
last = the final eval. Expected: AGF's own number is not available (agf.md §8.1); for context,
Primalformer's table gives Transformer 53.9, Flowformer 56.1.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "SelfRegulationSCP2",
                          basis="jacobi", order=7, alpha=2.0, beta=1.5, fix_i=True, eta=0.1)
