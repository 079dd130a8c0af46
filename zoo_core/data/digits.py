"""`digits`: scikit-learn's 8x8 handwritten digits (UCI optdigits test set), offline (platform.md §6.2).

`sklearn.datasets.load_digits()` reads `digits.csv.gz` from the scikit-learn wheel: 1,797 grey images of
8x8 pixels with values 0..16 and 10 classes. No split ships with it, so one is made here: a stratified,
seeded split (each class is shuffled with `seed` and its first round(test_fraction * n_class) images go
to 'test', likewise 'validation' if validation_fraction > 0), so class proportions match across splits.
This is the small image-classification task of the HTGN encoder (htgn.md §5.12, image preset).

Features: 'image' float32 [8, 8, 1] = pixel / 16 in [0, 1]; 'label' int64 in [0, 10);
'index' int64, the row in load_digits (to trace examples). Splits 'train', 'test' (and 'validation').
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import numpy as np
import tensorflow_datasets as tfds

from zoo_core import extras
from zoo_core.data import base

# The extra and the packages of it that building this dataset imports (zoo_core.extras).
EXTRA = ("digits", ("sklearn",))

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)


@dataclasses.dataclass
class DigitsConfig(tfds.core.BuilderConfig):
    test_fraction: float = 0.2
    validation_fraction: float = 0.0
    seed: int = 0


def split_indices(labels: np.ndarray, config: DigitsConfig) -> dict[str, np.ndarray]:
    """Sorted row indices of every split, stratified by label.

    Args:
      labels: int [N] class of every image.
      config: fractions and seed.

    Returns:
      {'train': idx, 'test': idx} plus 'validation' when validation_fraction > 0; disjoint, covering [0, N).
    """
    rng = np.random.default_rng(config.seed)
    parts = {"train": [], "validation": [], "test": []}
    for k in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == k))
        n_test = int(round(config.test_fraction * len(rows)))
        n_val = int(round(config.validation_fraction * len(rows)))
        parts["test"].append(rows[:n_test])
        parts["validation"].append(rows[n_test:n_test + n_val])
        parts["train"].append(rows[n_test + n_val:])
    out = {split: np.sort(np.concatenate(rows)) for split, rows in parts.items()}
    if config.validation_fraction <= 0:
        del out["validation"]
    return out


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images float32 [N, 8, 8, 1] in [0, 1], labels int64 [N]) from scikit-learn's wheel.

    Reads `sklearn/datasets/data/digits.csv.gz` (64 pixels then the label per row, what `load_digits`
    parses) without importing scikit-learn, which takes seconds; falls back to `load_digits`.
    """
    extras.require(EXTRA[0], "data.name='digits'", EXTRA[1])
    spec = importlib.util.find_spec("sklearn")
    path = pathlib.Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        table = np.loadtxt(path, delimiter=",")
        pixels, labels = table[:, :-1], table[:, -1]
    else:  # a future wheel layout
        from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel

        bunch = load_digits()
        pixels, labels = bunch.data, bunch.target
    images = (pixels.astype(np.float32) / 16.0).reshape(-1, *IMAGE_SHAPE)
    return images, labels.astype(np.int64)


class Digits(base.GeneratorBuilder):
    """8x8 digits: 'image' float32 [8, 8, 1] in [0, 1], 'label' int64 in [0, 10)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [DigitsConfig(name="default")]

    def _info(self):
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=IMAGE_SHAPE, dtype=np.float32),
                "label": tfds.features.Scalar(dtype=np.int64),
                "index": tfds.features.Scalar(dtype=np.int64),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        images, labels = load_arrays()
        return {split: self._generate_examples(images, labels, idx)
                for split, idx in split_indices(labels, self.builder_config).items()}

    def _generate_examples(self, images, labels, indices):
        for i in indices:
            yield int(i), {"image": images[i], "label": int(labels[i]), "index": int(i)}


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Builder of `digits`.

    Options: test_fraction (0.2), validation_fraction (0.0: no 'validation' split), seed (0).

    Raises:
      ValueError: an unknown option or fractions outside (0, 1) / summing to >= 1.
    """
    config = base.config_from_options(DigitsConfig, options, dataset="digits")
    if not (0 < config.test_fraction < 1 and 0 <= config.validation_fraction < 1
            and config.test_fraction + config.validation_fraction < 1):
        raise ValueError(f"digits: need 0 < test_fraction, 0 <= validation_fraction and their sum < 1, got "
                         f"{config.test_fraction}, {config.validation_fraction}")
    return Digits(data_dir=data_dir, config=config, file_format="array_record")
