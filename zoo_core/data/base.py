"""Building blocks shared by the dataset modules: option-keyed builder configs, pipelines helpers."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, TypeVar

import tensorflow_datasets as tfds

C = TypeVar("C", bound=tfds.core.BuilderConfig)


def absolute_path_option(options: dict[str, Any], key: str, *, keep_prefix: str = "") -> dict[str, Any]:
    """`options` with options[key] made an absolute path ('' -> None: configs spell "not given" as '').

    The prepared directory is keyed by the option values, so a relative path would name the same
    directory for different files seen from different working directories. Values starting with
    `keep_prefix` (e.g. 'embedded:') are not paths and stay as they are.
    """
    value = options.get(key)
    if value == "":
        return {**options, key: None}
    if isinstance(value, (str, os.PathLike)) and not (keep_prefix and str(value).startswith(keep_prefix)):
        return {**options, key: os.path.abspath(os.path.expanduser(os.fspath(value)))}
    return options


def config_from_options(config_cls: type[C], options: dict[str, Any], *, dataset: str) -> C:
    """Makes a BuilderConfig from user options, one directory per distinct set of options.

    The config name is a readable prefix plus a short hash of every option value, so two runs with
    different generation settings never share (and never corrupt) one prepared directory.

    Raises:
      ValueError: an option that the dataset does not have (named, with the valid ones).
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    own = [name for name in fields if name not in {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}]
    unknown = sorted(set(options) - set(own))
    if unknown:
        raise ValueError(f"dataset {dataset!r} has no option(s) {', '.join(unknown)}; valid: {', '.join(own)}")
    values = {name: options.get(name, fields[name].default) for name in own}
    key = json.dumps(values, sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return config_cls(name=f"cfg_{digest}", description=key, **values)
