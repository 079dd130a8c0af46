"""AGF on LRA Retrieval: AAN byte pairs, 4000 tokens each, dual encoder (agf.md §3.1).

Filter from the reference's `best_agf.sh`: jacobi, K=5, alpha=2.0, beta=-1.5, gamma = reg = 0.0001.

    python -m agf_jax.train --config configs/agf/lra_retrieval.py --workdir runs/agf_lra_retrieval \
        --config.data.options.source_dir=/path/to/retrieval
    python -m agf_jax.train --config configs/agf/lra_retrieval.py:attention=softmax --workdir runs/sm_lra_retrieval \
        --config.data.options.source_dir=/path/to/retrieval
    python -m agf_jax.train --config configs/agf/lra_retrieval.py:source_dir=/path/to/lra/retrieval --workdir runs/r
    python -m agf_jax.train --config configs/agf/lra_retrieval.py:smoke --workdir /tmp/agf_smoke

Data: DIR/train.tsv, DIR/validation.tsv and DIR/test.tsv, lines 'label<TAB>text1<TAB>text2' or LRA's
new_aan_pairs.{train,eval,test}.tsv renamed (zoo_core.data.lra_files), given as :source_dir=DIR or
--config.data.options.source_dir=DIR. validation.tsv is required (model selection runs on it) and
checked with the others before anything is read. `python -m zoo_core.data.lra_prepare --archive
URL_OR_PATH --out /path/to/lra` writes all three from LRA's lra_release.gz (docs/data.md).
The smoke variant builds without them (tests/configs_test.py) but needs them to run.
Harness: batch 32, 30000 steps (800 warm-up), eval on validation every 300 steps, the best
checkpoint by validation accuracy under workdir/best, reported on test with the
training command plus `--eval_only --eval_split=test`. Expected: AGF's own number is not available
(agf.md §8.1); for context, Primalformer's table: Transformer 79.4.
"""
from zoo_core.configs import common
from zoo_core.configs.agf import common as agf


def get_config(arg=None):
    args = agf.lra_args(arg)
    c = common.base_config()
    agf.set_lra(c, "retrieval", args, order=5, alpha=2.0, beta=-1.5, reg=0.0001)
    return agf.finish(c)
