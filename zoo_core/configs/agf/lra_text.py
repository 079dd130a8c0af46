"""AGF on LRA Text: IMDB bytes, 1024 tokens (agf.md §3.1).

AGF's lra_config.py uses 1024 bytes; the usual LRA Text setting is 4K.

Filter from the reference's `best_agf.sh`: jacobi, K=5, alpha=2.0, beta=-2.0, gamma = reg = 0.01.

    python -m agf_jax.train --config configs/agf/lra_text.py --workdir runs/agf_lra_text \
        --config.data.options.source_dir=/path/to/text
    python -m agf_jax.train --config configs/agf/lra_text.py:attention=softmax --workdir runs/sm_lra_text \
        --config.data.options.source_dir=/path/to/text
    python -m agf_jax.train --config configs/agf/lra_text.py:source_dir=/path/to/lra/text --workdir runs/agf_lra_text
    python -m agf_jax.train --config configs/agf/lra_text.py:smoke --workdir /tmp/agf_smoke

Data: DIR/train.tsv and DIR/test.tsv (optional validation.tsv), one review per line
'label<TAB>text' (zoo_core.data.lra_files), given as :source_dir=DIR or
--config.data.options.source_dir=DIR. `python -m zoo_core.data.lra_prepare --imdb URL_OR_PATH --out
/path/to/lra` writes them from IMDB's aclImdb_v1.tar.gz (docs/data.md).
The smoke variant builds without them (tests/configs_test.py) but needs them to run.
Harness: batch 32, 20000 steps (8000 warm-up), eval on test every 500 steps (LRA's text task has no
dev split: IMDB test serves as both), the best checkpoint by eval/accuracy under workdir/best.
Expected: AGF's own number is not available (agf.md §8.1); for context, Primalformer's table (4K):
Transformer 65.0.
"""
from zoo_core.configs import common
from zoo_core.configs.agf import common as agf


def get_config(arg=None):
    args = agf.lra_args(arg)
    c = common.base_config()
    agf.set_lra(c, "text", args, order=5, alpha=2.0, beta=-2.0, reg=0.01)
    return agf.finish(c)
