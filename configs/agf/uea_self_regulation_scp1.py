"""AGF on UEA SelfRegulationSCP1 (agf.md §3.2).

Filter from the reference's `run_agf_best.sh`: jacobi, alpha=1.5, beta=1.0, K=9, fixI, eta=0.1.

    python -m agf_jax.train --config configs/agf/uea_self_regulation_scp1.py \
        --workdir runs/agf_self_regulation_scp1 --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_self_regulation_scp1.py:attention=softmax \
        --workdir runs/sm_self_regulation_scp1 --config.data.options.source_dir=/path/to/Multivariate_ts
    python -m agf_jax.train --config configs/agf/uea_self_regulation_scp1.py:smoke --workdir /tmp/agf_smoke

Data: DIR/SelfRegulationSCP1/SelfRegulationSCP1_TRAIN.ts and _TEST.ts from the UEA archive (268 train /
293 test, 6 channels, length 896, 2 classes); the smoke variant trains on the bundled JapaneseVowels
instead. 100 epochs of 17 steps (batch 16), test accuracy after epochs 1, 2, 4, ..., 100 (as the
reference): best = max over evals of eval/accuracy in workdir/metrics.jsonl (the reference protocol),
last = the final eval. Expected: AGF's own number is not available (agf.md §8.1); for context,
Primalformer's table gives Transformer 92.2, Flowformer 92.5.
"""
from configs.tasks import agf


def get_config(arg=None):
    return agf.uea_config(arg, "SelfRegulationSCP1",
                          basis="jacobi", order=9, alpha=1.5, beta=1.0, fix_i=True, eta=0.1)
