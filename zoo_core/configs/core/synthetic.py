"""The core's self-test: an MLP on the synthetic linear-teacher task (seconds on a CPU).

    python -m zoo_core.train --config configs/core/synthetic.py --workdir /tmp/core
    python -m zoo_core.train --config configs/core/synthetic.py:smoke --workdir /tmp/core_smoke

Expected: eval/accuracy above 0.9 after the default 200 steps.
"""
from zoo_core import mlp_classifier
from zoo_core.configs import common


def get_config(arg=None):
    args = common.parse_arg(arg, smoke=False)
    c = common.base_config()
    c.total_steps = 200
    c.batch_size = 16
    c.eval_batch_size = 16
    c.log_every_steps = 20
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 50
    c.checkpoint.best_metric = "eval/accuracy"
    c.optim.learning_rate = 3e-3
    c.data.name = "synthetic_linear"
    c.data.options.num_features = 8
    c.data.options.num_classes = 4
    c.data.options.num_train = 512
    c.data.options.num_test = 128
    c.model.hidden = 32
    c.model.num_classes = 4
    if args.smoke:
        common.smoke(c)
    return common.finish(c, build=mlp_classifier.Model)
