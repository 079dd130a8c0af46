"""AGF on LRA Image: grayscale CIFAR-10, 1024 pixels (agf.md §3.1).

Filter from the reference's `best_agf.sh`: jacobi, K=6, alpha=1.5, beta=2.0, gamma = reg = 0.1.

    python -m agf_jax.train --config configs/agf/lra_image.py --workdir runs/agf_lra_image \
        --config.data.options.source_dir=/path/to/image
    python -m agf_jax.train --config configs/agf/lra_image.py:attention=softmax --workdir runs/sm_lra_image \
        --config.data.options.source_dir=/path/to/image
    python -m agf_jax.train --config configs/agf/lra_image.py:source_dir=/path/to/lra/image --workdir runs/agf_image
    python -m agf_jax.train --config configs/agf/lra_image.py:smoke --workdir /tmp/agf_smoke

Data: DIR/train.npz, DIR/validation.npz and DIR/test.npz (LRA: CIFAR-10 train[:90%], train[90%:],
test) with 'inputs' uint8 [N, 32, 32] (or RGB [N, 32, 32, 3]) and 'label' [N] in 0..9
(zoo_core.data.lra_files), given as :source_dir=DIR or --config.data.options.source_dir=DIR.
`python -m zoo_core.data.lra_prepare --cifar URL_OR_PATH --out /path/to/lra` writes them from
cifar-10-binary.tar.gz (train/validation = the first 45,000 / last 5,000 in the archive's order;
docs/data.md).
The smoke variant builds without them (tests/configs_test.py) but needs them to run.
Harness: batch 256, 35000 steps (175 warm-up), eval on validation every 175 steps, the best
checkpoint by validation accuracy under workdir/best, reported on test with the
training command plus `--eval_only --eval_split=test`. Expected: AGF's own number is not available
(agf.md §8.1); for context, Primalformer's table: Transformer 38.2.
"""
from zoo_core.configs import common
from zoo_core.configs.agf import common as agf


def get_config(arg=None):
    args = agf.lra_args(arg)
    c = common.base_config()
    agf.set_lra(c, "image", args, order=6, alpha=1.5, beta=2.0, reg=0.1)
    return agf.finish(c)
