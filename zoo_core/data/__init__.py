"""Datasets of the zoo: TFDS builders stored as array_record, read through grain without TensorFlow.

Every dataset is a module of this package exposing `make_builder(data_dir, **options)`, which returns an
unprepared `tfds.core.DatasetBuilder`. `DATASETS` maps the names used in `config.data.name` to those
modules; it is a plain dict (not a decorator registry) so that every dataset is one grep away.
"""
import glob
import importlib
import json
import os

from absl import logging

from zoo_core import extras

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


def require_extra(name: str) -> None:
    """Raises `extras.MissingExtra` (one line) when dataset `name` needs an extra that is not installed:
    its module's `EXTRA`, (extra, the import names its building needs)."""
    need = getattr(importlib.import_module(DATASETS[name]), "EXTRA", None)
    if need is not None:
        extras.require(need[0], f"data.name={name!r}", need[1])


def make_builder(name: str, data_dir: str, **options):
    """Returns the (unprepared) TFDS builder of dataset `name` configured with `options`.

    Its preparation logs one line instead of printing TFDS's download banner (TFDS downloads nothing:
    every dataset here is generated or read from local files; the files fetched on first use, UEA's
    and ETT's, are fetched by `zoo_core.data.fetch` before preparation, docs/data.md).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    require_extra(name)
    module = importlib.import_module(DATASETS[name])
    # Modules serving several names (the LRA file readers) take the name as their first option.
    if getattr(module, "MULTI_DATASET", False):
        builder = module.make_builder(name, data_dir, **options)
    else:
        builder = module.make_builder(data_dir, **options)
    builder._log_download_bytes = lambda: logging.info("preparing %s in %s", name, builder.data_dir)
    builder._log_download_done = lambda: logging.info("prepared %s in %s", name, builder.data_dir)
    return builder


def _check_prepared_infos(name: str, folder: str) -> None:
    """Raises naming the first prepared copy under `folder` (<data dir>/<dataset>/[<config>/]<version>/)
    whose dataset_info.json is not readable JSON."""
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*", "dataset_info.json"))
                       + glob.glob(os.path.join(glob.escape(folder), "*", "*", "dataset_info.json"))):
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"the prepared {name} in {os.path.dirname(path)!r} is damaged: its "
                             f"dataset_info.json is not readable JSON ({type(e).__name__}); delete that folder "
                             "to prepare it again") from e


def _path_kind(key: str) -> str | None:
    """'dir' or 'file' for an option that names a path, by its name; None for other options."""
    if key.endswith("_dir"):
        return "dir"
    if key == "source" or key.endswith(("_file", "_path")):
        return "file"
    return None


def check_options(name: str, data_dir: str, options: dict):
    """Checks `config.data` without preparing anything or writing a file.

    The dataset name, the data directory (a file there is an error), every path option (a file where
    a directory is expected and the reverse, a missing file) and the options themselves (the dataset's
    `make_builder`, which also reads small sources such as UEA's .ts files). A dataset module with a
    `check_sources(builder)` function reads its unprepared sources here too (a forecasting CSV); one
    with `fetch_missing(data_dir, options)` fetches a missing source first (an ETT CSV).

    Returns:
      The (unprepared) builder.

    Raises:
      ValueError: one line naming the field or file and what is expected.
    """
    from zoo_core.data import pipeline
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (data.name); known datasets: {', '.join(sorted(DATASETS))}")
    require_extra(name)
    resolved = pipeline.resolve_data_dir(data_dir)
    where = "data.data_dir" if data_dir else ("$ZOO_DATA_DIR" if os.environ.get("ZOO_DATA_DIR") else "the data dir")
    parent = os.path.abspath(resolved)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        what = "is a file" if parent == os.path.abspath(resolved) else f"is under the file {parent!r}"
        raise ValueError(f"{where} {resolved!r} {what}; expected a directory (prepared datasets go there)")
    module = importlib.import_module(DATASETS[name])
    fetch_missing = getattr(module, "fetch_missing", None)
    if fetch_missing is not None:   # a source fetched on first use exists before it is checked
        fetch_missing(resolved, options)
    for key, value in options.items():
        kind = _path_kind(key)
        if kind is None or not isinstance(value, str) or not value or value.startswith("embedded:"):
            continue
        path = os.path.expanduser(value)
        if kind == "dir" and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"data.options.{key} {value!r} is a file; expected a directory")
        if kind == "file" and os.path.isdir(path):
            raise ValueError(f"data.options.{key} {value!r} is a directory; expected a file")
        if kind == "file" and not os.path.exists(path):
            raise ValueError(f"data.options.{key} {value!r} does not exist; expected a file")
    try:
        builder = make_builder(name, resolved, **options)
    except Exception:
        # TFDS reads a prepared copy's dataset_info.json when it makes the builder: a damaged one (a run
        # killed while writing it, an edit) ends in a protobuf traceback. Name it if that is the cause.
        _check_prepared_infos(name, os.path.join(resolved, name))
        raise
    check_sources = getattr(module, "check_sources", None)
    if check_sources is not None and not builder.is_prepared():
        check_sources(builder)
    return builder
