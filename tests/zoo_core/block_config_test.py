"""How a model passes its fields down (zoo_core/ops/block_config.py): a frozen config class of its fields."""
import dataclasses

import flax.linen as nn

from zoo_core.ops.block_config import config_class


def test_a_config_class_has_the_models_fields_once():
    class Fields(nn.Module, kw_only=True):
        width: int
        rate: float = 0.1

    config_cls = config_class(Fields, "Config", "Doc.", extra=(("act", str, "gelu"),))
    assert [f.name for f in dataclasses.fields(config_cls)] == ["width", "rate", "act"]
    module = Fields(width=4)
    config = config_cls.from_module(module, rate=0.5)
    assert (config.width, config.rate, config.act) == (4, 0.5, "gelu") and hash(config) == hash(config_cls(width=4, rate=0.5))
    assert config_cls.__doc__ == "Doc." and config_cls.__module__ == __name__
