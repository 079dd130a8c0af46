"""`synthetic_linear`: the small synthetic classification task the core's own tests train on.

Each example is a Gaussian vector x [F] with label argmax(W x) for a fixed random W [K, F] drawn from
`seed`: learnable to ~100% accuracy by a linear model, so trainer tests can check that loss falls.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base


@dataclasses.dataclass
class SyntheticLinearConfig(tfds.core.BuilderConfig):
    num_features: int = 8
    num_classes: int = 4
    num_train: int = 512
    num_test: int = 128
    seed: int = 0


class SyntheticLinear(base.GeneratorBuilder):
    """Linear-teacher classification: 'inputs' float32 [F], 'label' int64 in [0, K)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [SyntheticLinearConfig(name="default")]

    def _info(self):
        c = self.builder_config
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "inputs": tfds.features.Tensor(shape=(c.num_features,), dtype=np.float32),
                "label": tfds.features.Scalar(dtype=np.int64),
            }),
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        teacher = np.random.default_rng(c.seed).normal(size=(c.num_classes, c.num_features))
        return {
            "train": self._generate_examples(teacher, c.num_train, c.seed + 1),
            "test": self._generate_examples(teacher, c.num_test, c.seed + 2),
        }

    def _generate_examples(self, teacher, n, seed):
        x = np.random.default_rng(seed).normal(size=(n, teacher.shape[1])).astype(np.float32)
        labels = np.argmax(x @ teacher.T, axis=-1)
        for i in range(n):
            yield i, {"inputs": x[i], "label": int(labels[i])}


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    config = base.config_from_options(SyntheticLinearConfig, options, dataset="synthetic_linear")
    for name, minimum in (("num_features", 1), ("num_classes", 2), ("num_train", 1), ("num_test", 1), ("seed", 0)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"synthetic_linear: {name} must be an integer >= {minimum}, got {value!r}")
    return SyntheticLinear(data_dir=data_dir, config=config, file_format="array_record")
