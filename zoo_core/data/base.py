"""Building blocks shared by the dataset modules: option-keyed builder configs, the builder base class
that prepares any size without TensorFlow, pipelines helpers."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import socket
import struct
import threading
import time
from typing import Any, Iterator, TypeVar

import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core import shuffle as tfds_shuffle

C = TypeVar("C", bound=tfds.core.BuilderConfig)


class DatasetInfo(tfds.core.DatasetInfo):
    """`tfds.core.DatasetInfo` for a dataset made here (generated or read from local files).

    A builder of an unprepared dataset asks its info to `initialize_from_bucket`, which makes a
    `tmp*tfds` folder in the system temp folder before it looks for the dataset on TFDS's bucket and
    never removes it. Nothing made here is on the bucket, so there is nothing to look for.
    """

    def initialize_from_bucket(self) -> None:
        return None


class _FileBucket(tfds_shuffle._Bucket):   # pylint: disable=protected-access
    """TFDS's shuffler bucket (a temporary file of `key | size | record` entries) written and read with
    Python's own file functions. TFDS's uses `tf.io.gfile`, which needs TensorFlow: once a split's
    records pass `MAX_MEM_BUFFER_SIZE` (1 GB), TFDS spills them into 1000 such buckets by key hash, and
    without TensorFlow preparing it failed. The file format, and so the record order, is TFDS's."""

    def add(self, key, data: bytes):
        if not self._fobj:
            os.makedirs(os.path.dirname(os.fspath(self._path)), exist_ok=True)
            try:
                self._fobj = open(self._path, "wb")  # noqa: SIM115 - closed by flush()
            except OSError as e:
                if e.errno != errno.EMFILE:
                    raise
                tfds_shuffle._increase_open_files_limit()   # pylint: disable=protected-access
                self._fobj = open(self._path, "wb")  # noqa: SIM115
        self._fobj.write(tfds_shuffle._hkey_to_bytes(key))   # pylint: disable=protected-access
        self._fobj.write(struct.pack("=Q", len(data)))
        self._fobj.write(data)
        self._length += 1
        self._size += len(data)

    def read_values(self):
        self.flush()
        if not os.path.exists(self._path):   # a bucket that no key hashed to
            return
        size_bytes = tfds_shuffle.HKEY_SIZE_BYTES
        with open(self._path, "rb") as f:
            while True:
                head = f.read(size_bytes)
                if not head:
                    break
                hkey = tfds_shuffle._read_hkey(head)   # pylint: disable=protected-access
                (size,) = struct.unpack("=Q", f.read(8))
                yield hkey, f.read(size)

    def del_file(self):
        if os.path.exists(self._path):
            os.remove(self._path)


_BUCKETS_LOCK = threading.RLock()


@contextlib.contextmanager
def file_buckets():
    """TFDS's shuffler spills through `_FileBucket` (plain files) inside this block."""
    with _BUCKETS_LOCK:
        previous = tfds_shuffle._Bucket   # pylint: disable=protected-access
        tfds_shuffle._Bucket = _FileBucket   # pylint: disable=protected-access
        try:
            yield
        finally:
            tfds_shuffle._Bucket = previous   # pylint: disable=protected-access


class GeneratorBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """The zoo's TFDS builder base: prepares a split of any size with no TensorFlow installed.

    TFDS writes the records through its shuffler, which holds up to 1 GB in memory and spills larger
    splits to temporary files through `tf.io.gfile`; here they go through Python's files
    (`file_buckets`), so the prepared array_record files, their record order included, are the ones
    TFDS would write, at every size.
    """

    def _download_and_prepare(self, *args, **kwargs):
        with file_buckets():
            return super()._download_and_prepare(*args, **kwargs)


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


def file_digest(path: str) -> str:
    """SHA-1 of a file's bytes (hex), memoised per (path, size, mtime, inode) within the process."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:
        h = hashlib.sha1()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple, str] = {}


def sources_digest(paths) -> str:
    """A short hash of the contents of `paths` (files), in the given order."""
    h = hashlib.sha1()
    for path in paths:
        h.update(file_digest(path).encode())
    return h.hexdigest()[:8]


def config_from_options(config_cls: type[C], options: dict[str, Any], *, dataset: str, sources=()) -> C:
    """Makes a BuilderConfig from user options, one directory per distinct set of options and sources.

    The config name is a readable prefix plus a short hash of every option value, so two runs with
    different generation settings never share (and never corrupt) one prepared directory; with
    `sources` (the files the data is read from) a hash of their contents follows, 'cfg_<options>_<files>',
    so an edited or replaced source file is prepared again (`explain_rebuild` says why).

    Raises:
      ValueError: an option that the dataset does not have (named, with the valid ones), or a seed
        (an option named `seed` or `*_seed_offset`) that is not an int in [0, 2**32): NumPy refuses
        others, and Python's `random` would seed -s like s (two draws, one data set).
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    own = [name for name in fields if name not in {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}]
    unknown = sorted(set(options) - set(own))
    if unknown:
        raise ValueError(f"dataset {dataset!r} has no option(s) {', '.join(unknown)}; valid: {', '.join(own)}")
    values = {name: options.get(name, fields[name].default) for name in own}
    for name, value in values.items():
        if (name == "seed" or name.endswith("_seed_offset")) and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32):
            raise ValueError(f"{dataset}: {name} must be an int in [0, 2**32), got {value!r}")
    key = json.dumps(values, sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    sources = [os.fspath(p) for p in sources]
    name = f"cfg_{digest}_{sources_digest(sources)}" if sources else f"cfg_{digest}"
    return config_cls(name=name, description=key, **values)


def find_prepared(data_dir: str, builder_name: str, config: tfds.core.BuilderConfig) -> C | None:
    """`config` renamed to the newest prepared directory made from the same options with any source
    contents ('cfg_<options>_<files>'), for when the source files are gone; None if there is none."""
    root = os.path.join(os.fspath(data_dir), builder_name)
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        if not name.startswith(config.name + "_"):
            continue
        for version in os.listdir(os.path.join(root, name)):
            info = os.path.join(root, name, version, "dataset_info.json")
            if os.path.isfile(info):
                found.append((os.path.getmtime(info), name))
    if not found:
        return None
    name = max(found)[1]
    logging.info("%s: the source files are not there; using the data prepared from them as %s", builder_name, name)
    return dataclasses.replace(config, name=name)


def explain_rebuild(builder: tfds.core.DatasetBuilder) -> str | None:
    """Why an unprepared builder is prepared again: another content hash of its sources was prepared
    with the same options. Returns that sentence (also logged), or None."""
    name = builder.builder_config.name if builder.builder_config else ""
    prefix, sep, _ = name.rpartition("_")
    if not sep or not prefix.startswith("cfg_") or builder.is_prepared():
        return None
    root = os.path.join(os.fspath(builder.data_dir_root), builder.name)
    others = sorted(n for n in (os.listdir(root) if os.path.isdir(root) else ())
                    if n.startswith(prefix + "_") and n != name)
    if not others:
        return None
    message = (f"{builder.name}: the source files changed since they were prepared as {', '.join(others)} "
               f"(content hash {name.rsplit('_', 1)[1]} now): preparing {name}")
    logging.info("%s", message)
    return message


def lock_path(builder: tfds.core.DatasetBuilder) -> str:
    """The preparation lock of `builder`'s folder <data dir>/<name>/<config>/<version>: the file
    <data dir>/.<name>-<config>-<version>.lock, outside the folders a failed preparation removes."""
    name = builder.builder_config.name if builder.builder_config else ""
    key = "-".join(p for p in (builder.name, name, str(builder.version)) if p)
    return os.path.join(os.fspath(builder.data_dir_root), f".{key}.lock")


@contextlib.contextmanager
def preparation_lock(path: str, what: str) -> Iterator[bool]:
    """Holds an exclusive lock on the file `path` (made, with its folder, if missing) while `what` is
    prepared: two runs that share an unprepared data set prepare it once, the second waiting for the
    first (one log line says so) instead of building it beside it and failing at the rename. Yields
    whether another process held it first (then the data may be prepared now). The lock goes with its
    process (a killed holder leaves none) and its file is removed on release; one that cannot be made
    (a read-only data dir; a system without fcntl) is not taken.
    """
    try:
        import fcntl
    except ImportError:   # Windows: no advisory locks
        yield False
        return
    waited = False
    while True:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:   # cannot be written: preparing there fails with its own message
            yield waited
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                    logging.info("waiting for %s to finish preparing %s (lock %s)", holder, what, path)
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if not same:   # its holder removed the file on release: lock the one now at `path`
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
            try:
                yield waited
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)   # while still held: a waiter then finds the file gone and retries
            return
        finally:
            os.close(fd)
