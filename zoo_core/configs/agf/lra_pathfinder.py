"""AGF on LRA Pathfinder: Pathfinder32 curv_contour_length_14, 1024 pixels (agf.md §3.1).

Filter from the reference's `best_agf.sh`: jacobi, K=4, alpha=1.5, beta=-1.0, gamma = reg = 0.0001.

    python -m agf_jax.train --config configs/agf/lra_pathfinder.py --workdir runs/agf_lra_pathfinder \
        --config.data.options.source_dir=/path/to/pathfinder
    python -m agf_jax.train --config configs/agf/lra_pathfinder.py:attention=softmax --workdir runs/sm_lra_pathfinder \
        --config.data.options.source_dir=/path/to/pathfinder
    python -m agf_jax.train --config configs/agf/lra_pathfinder.py:source_dir=/path/to/lra/pathfinder --workdir runs/p
    python -m agf_jax.train --config configs/agf/lra_pathfinder.py:smoke --workdir /tmp/agf_smoke

Data: DIR/train.npz, DIR/validation.npz and DIR/test.npz (LRA's 80/10/10 split) with 'inputs' uint8
[N, 32, 32] and 'label' [N] in {0, 1} (zoo_core.data.lra_files), given as :source_dir=DIR or
--config.data.options.source_dir=DIR.
`python -m zoo_core.data.lra_prepare --archive URL_OR_PATH --out /path/to/lra` writes them from
LRA's lra_release.gz (pathfinder32/curv_contour_length_14, a seeded 80/10/10 split; docs/data.md).
The smoke variant builds without them (tests/configs_test.py) but needs them to run.
Harness: batch 256, 62400 steps (312 warm-up), eval on validation every 312 steps, the best
checkpoint by validation accuracy under workdir/best, reported on test with the
training command plus `--eval_only --eval_split=test`. Expected: AGF's own number is not available
(agf.md §8.1); for context, Primalformer's table: Transformer 74.2.
"""
from zoo_core.configs import common
from zoo_core.configs.agf import common as agf


def get_config(arg=None):
    args = agf.lra_args(arg)
    c = common.base_config()
    agf.set_lra(c, "pathfinder", args, order=4, alpha=1.5, beta=-1.0, reg=0.0001)
    return agf.finish(c)
