"""The data of a run: `prepare_data` builds the dataset on first use and returns its train and eval sources.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import numpy as np

from zoo_core import data as data_lib
from zoo_core.data import pipeline


def prepare_data(config, *, builder=None) -> tuple[Any, Any]:
    """Builds the dataset on first use (process 0 first, the others wait), returns (train, eval) sources.

    A run whose dataset another process is preparing (another run, a study's parallel run) waits for it
    under the dataset's lock (`base.preparation_lock`, one log line), then reads what it prepared.

    `builder`: the dataset's builder for `config.data` if one was made already (`data.check_options`).
    """
    d = config.data
    data_dir = pipeline.resolve_data_dir(d.data_dir)
    make_builder = lambda: data_lib.make_builder(d.name, data_dir, **d.options.to_dict())
    builder = make_builder() if builder is None else builder
    failure = None
    if jax.process_index() == 0 and not builder.is_prepared():
        try:
            builder = _prepare(builder, make_builder, data_dir)
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other processes
            failure = e
            if isinstance(e, OSError):   # the data dir cannot be written (e.g. a read-only mount): name it
                failure = ValueError(f"could not prepare {d.name} in data.data_dir {data_dir!r}: "
                                     f"{type(e).__name__}: {e}; give a writable data.data_dir or $ZOO_DATA_DIR")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        # Doubles as the barrier; without it a failure on process 0 would leave the others waiting.
        ok = multihost_utils.process_allgather(np.int32(failure is None))
        if failure is not None:
            raise failure
        if not np.all(ok):
            raise ValueError(f"process 0 could not prepare {d.name} (its log names the problem)")
        # A builder made before process 0 wrote the data has empty info: make it again to read it.
        builder = make_builder()
        builder.download_and_prepare()   # a no-op read of what process 0 wrote
    elif failure is not None:
        raise failure
    roles = [("data.train_split", d.train_split), ("data.eval_split", d.eval_split)]
    if config.get("test_split", ""):
        roles.append(("test_split", config.test_split))
    for role, split in roles:
        name = split.split("[")[0]   # 'train[:90%]' slices a split
        if name not in builder.info.splits:
            raise ValueError(f"{role} {split!r} is not a split of {d.name} "
                             f"(it has: {', '.join(sorted(builder.info.splits))})")
        try:
            selected = builder.info.splits[split].num_examples
        except ValueError as e:   # a slice TFDS cannot parse
            raise ValueError(f"{role} {split!r}: {' '.join(str(e).split()[:40])}") from None
        if selected <= 0:
            raise ValueError(f"{role} {split!r} selects no examples ({name} has "
                             f"{builder.info.splits[name].num_examples})")
    try:
        sources = builder.as_data_source(d.train_split), builder.as_data_source(d.eval_split)
        for source in sources:   # a damaged or missing record file fails here, not steps into training
            source[0], source[len(source) - 1]
    except (RuntimeError, OSError) as e:   # what the record reader raises for a short or missing file
        reason = (str(e).splitlines() or [""])[0][:300]
        raise ValueError(f"the prepared {d.name} in {str(builder.data_dir)!r} cannot be read ({type(e).__name__}: "
                         f"{reason}); delete that folder to prepare it again") from e
    return sources


def _prepare(builder, make_builder, data_dir: str):
    """Prepares `builder`'s dataset under its lock; returns the builder to read it with (made again when
    another process held the lock first: one made before the data was written has empty info). A failure,
    Ctrl-C included, removes the folders made for it; data_dir, when this call made it, only while it
    holds no file (another data set may be prepared there at the same time)."""
    from zoo_core.data import base as data_base
    made_data_dir = not os.path.exists(data_dir)
    try:
        with data_base.preparation_lock(data_base.lock_path(builder), f"{builder.name} in {data_dir}") as waited:
            if waited:
                builder = make_builder()
            data_base.explain_rebuild(builder)
            config_name = builder.builder_config.name if builder.builder_config else ""
            folders = [os.path.join(data_dir, builder.name)]
            if config_name:
                folders.append(os.path.join(folders[0], config_name))
            # Under the lock no other process prepares this configuration: the folders made now are this one's.
            created = [p for p in folders if not os.path.exists(p)]
            try:
                builder.download_and_prepare()
            except BaseException:
                if created:
                    shutil.rmtree(created[-1], ignore_errors=True)
                if len(created) == 2 and set(_entries(created[0])) <= {".config"}:
                    # TFDS's .config/metadata.json of the data set, made for the configuration just removed
                    shutil.rmtree(created[0], ignore_errors=True)
                raise
    except BaseException:
        if made_data_dir:
            _remove_if_no_file(data_dir)
        raise
    return builder


def _entries(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _remove_if_no_file(folder: str) -> None:
    """Removes `folder` if it holds no file: its empty sub-folders, innermost first, then itself."""
    for root, _, _ in sorted(os.walk(folder), key=lambda w: -len(w[0])):
        try:
            os.rmdir(root)
        except OSError:   # not empty: kept
            pass
