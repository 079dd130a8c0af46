"""UEA multivariate classification: dataset facts and the data/task part of a config.

The AGF/Flowformer/Primalformer UEA harness (mvts_transformer lineage, agf.md §3.2) validates on the
TEST split and reports the best test accuracy over epochs; `zoo_core.data.uea` reproduces its
preprocessing (per-channel standardisation with TRAIN statistics, zero padding, 'mask').

Sizes are those of the UEA 2018 archive (Bagnall et al. 2018). `length` is the padded length the
harness uses, the longest TRAIN series (mvts `max_seq_len`); it is given explicitly as the data option
`max_length` so that the model's flatten head (`max_len * d_model` inputs) and the data always agree.
BasicMotions and JapaneseVowels ship inside the package (`zoo_core.data.uea.SHIPPED_DIR`); the other
datasets are fetched on first use, or read from the archive's `.ts` files with
`--config.data.options.source_dir=DIR` (DIR/<Name>/<Name>_TRAIN.ts and _TEST.ts).
"""
from __future__ import annotations

import math

import ml_collections

# name -> channels, padded length (longest TRAIN series), classes, train size, test size.
DATASETS = {
    "BasicMotions": dict(channels=6, length=100, classes=4, num_train=40, num_test=40),
    "EthanolConcentration": dict(channels=3, length=1751, classes=4, num_train=261, num_test=263),
    "FaceDetection": dict(channels=144, length=62, classes=2, num_train=5890, num_test=3524),
    "Handwriting": dict(channels=3, length=152, classes=26, num_train=150, num_test=850),
    "Heartbeat": dict(channels=61, length=405, classes=2, num_train=204, num_test=205),
    # Variable length 7..29; the TRAIN series are at most 26 long (test series are cut to 26, as in
    # the harness).
    "JapaneseVowels": dict(channels=12, length=26, classes=9, num_train=270, num_test=370),
    "PEMS-SF": dict(channels=963, length=144, classes=7, num_train=267, num_test=173),
    "SelfRegulationSCP1": dict(channels=6, length=896, classes=2, num_train=268, num_test=293),
    "SelfRegulationSCP2": dict(channels=7, length=1152, classes=2, num_train=200, num_test=180),
    # Variable length 4..93 (archive maximum 93; a shorter TRAIN maximum only adds zero padding).
    "SpokenArabicDigits": dict(channels=13, length=93, classes=10, num_train=6599, num_test=2199),
    "UWaveGestureLibrary": dict(channels=3, length=315, classes=8, num_train=120, num_test=320),
}
# Shipped inside the package (zoo_core.data.uea reads them without a source_dir).
SHIPPED = ("BasicMotions", "JapaneseVowels")


def steps_per_epoch(dataset: str, batch_size: int) -> int:
    """Optimiser steps of one epoch (PyTorch DataLoader without drop_last: ceil(N / batch))."""
    return math.ceil(DATASETS[dataset]["num_train"] / batch_size)


def set_data(c: ml_collections.ConfigDict, dataset: str, *, source_dir: str = "") -> dict:
    """Fills c.data and c.task for UEA `dataset` (train on TRAIN, evaluate on TEST).

    Args:
      c: a config from `common.base_config()`.
      dataset: a key of DATASETS.
      source_dir: directory with the archive's .ts files; '' = the shipped copy for the shipped
        datasets, and for the others the download cache or a fetch (an empty option to override with
        --config.data.options.source_dir=DIR).

    Returns:
      The dataset's facts (channels, length, classes, num_train, num_test) for the model fields.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown UEA dataset {dataset!r}; known: {', '.join(sorted(DATASETS))}")
    facts = DATASETS[dataset]
    c.data.name = "uea"
    c.data.train_split = "train"
    c.data.eval_split = "test"   # the harness's validation set is the TEST split
    c.data.options.dataset = dataset
    c.data.options.max_length = facts["length"]
    c.data.options.normalization = "standardization"
    if source_dir or dataset not in SHIPPED:
        c.data.options.source_dir = source_dir
    c.task.name = "classification"
    return facts
