"""Datasets of the zoo: TFDS builders stored as array_record, read through grain without TensorFlow.

Every dataset is a module of this package exposing `make_builder(data_dir, **options)`, which returns an
unprepared `tfds.core.DatasetBuilder`. `DATASETS` maps the names used in `config.data.name` to those
modules; it is a plain dict (not a decorator registry) so that every dataset is one grep away.
"""
import importlib

DATASETS = {
    "synthetic_linear": "zoo_core.data.synthetic",
    "lra_listops": "zoo_core.data.listops",
    "lra_text": "zoo_core.data.lra_files",
    "lra_retrieval": "zoo_core.data.lra_files",
    "lra_image": "zoo_core.data.lra_files",
    "lra_pathfinder": "zoo_core.data.lra_files",
    "uea": "zoo_core.data.uea",
    "synthetic_var": "zoo_core.data.synthetic_var",
    "forecasting": "zoo_core.data.forecasting",
    "number_words": "zoo_core.data.number_words",
    "digits": "zoo_core.data.digits",
    "wmt14_en_de": "zoo_core.data.wmt",
}


def make_builder(name: str, data_dir: str, **options):
    """Returns the (unprepared) TFDS builder of dataset `name` configured with `options`."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    module = importlib.import_module(DATASETS[name])
    # Modules serving several names (the LRA file readers) take the name as their first option.
    if getattr(module, "MULTI_DATASET", False):
        return module.make_builder(name, data_dir, **options)
    return module.make_builder(data_dir, **options)
