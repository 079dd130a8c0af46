"""A config for the command-line tests: the core's synthetic smoke run, or the same trainer fields with
a UEA or forecasting data block whose path options exist (so that `--config.data.options.<path>=` can
be overridden). `:data=uea|forecasting`.
"""
from zoo_core.configs import common
from zoo_core.configs.core import synthetic


def get_config(arg=None):
    args = common.parse_arg(arg, data="synthetic")
    c = synthetic.get_config("smoke")
    c.unlock()
    if args.data == "uea":
        c.data.name = "uea"
        c.data.options = common.ml_collections.ConfigDict(
            dict(dataset="Toy", source_dir="", normalization="standardization"))
    elif args.data == "forecasting":
        c.data.name = "forecasting"
        c.data.train_split, c.data.eval_split = "train", "validation"
        c.data.options = common.ml_collections.ConfigDict(dict(source="", input_length=4, horizon=2))
        c.task.name = "forecast"
    elif args.data != "synthetic":
        raise ValueError(f"data must be synthetic, uea or forecasting, got {args.data!r}")
    c.lock()
    return c
