"""Prepares the file-based Long Range Arena tasks from the official archives, in one command, without TensorFlow.

    python -m zoo_core.data.lra_prepare --out DIR [--archive PATH_OR_URL] [--imdb PATH_OR_URL] \
        [--cifar PATH_OR_URL] [--tasks listops,retrieval,pathfinder,text,image]

writes one folder per task under DIR, each what `--config.data.options.source_dir` (or the configs'
`:source_dir=`) of that task reads:

  DIR/listops/basic_{train,val,test}.tsv     <- lra_release/listops-1000/ (copied as they are)
  DIR/retrieval/{train,validation,test}.tsv  <- lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv
  DIR/pathfinder/{train,validation,test}.npz <- lra_release/pathfinder32/curv_contour_length_14/
  DIR/text/{train,test}.tsv                  <- IMDB (aclImdb_v1.tar.gz), not in LRA's archive
  DIR/image/{train,validation,test}.npz      <- CIFAR-10 (cifar-10-binary.tar.gz), not in LRA's archive

Sources (a local file, or a URL fetched into `<data dir>/downloads/lra/` by `zoo_core.data.fetch`):
  * `--archive`: LRA's release, https://storage.googleapis.com/long-range-arena/lra_release.gz (a
    gzipped tar, about 7.7 GB; LRA's `dataset_setup.sh`). Its members sit under `lra_release/` or
    `lra_release/lra_release/` (both are accepted: members are matched by their path after the
    `listops-1000/`, `tsv_data/` or `pathfinder<R>/` folder). Read in one streaming pass.
  * `--imdb`: https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz; aclImdb/{train,test}/
    {pos,neg}/*.txt -> 'label<TAB>text' lines, pos = 1, line breaks inside a review become spaces.
    LRA Text is IMDB (TFDS imdb_reviews) with test as its validation set, so there is no validation.tsv.
  * `--cifar`: https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz (the file TFDS's cifar10
    reads; no pickle); RGB [N, 32, 32, 3] uint8, converted to grayscale by the builder as
    tf.image.rgb_to_grayscale. LRA uses TFDS's train[:90%] / train[90%:] / test; here train and
    validation are the first 45,000 / last 5,000 images in the archive's order (TFDS's own order is a
    hash of its keys, which this does not reproduce).

Pathfinder (`--pathfinder_resolution` 32 | 64 | 128 | 256, `--pathfinder_difficulty`
curv_baseline | curv_contour_length_9 | curv_contour_length_14): each metadata/<i>.npy is text, one image
per line `<folder> <file> <...> <label> ...`, the PNG at <difficulty>/<folder>/<file> (LRA's
`lra_benchmarks/data/pathfinder.py`). LRA cuts TFDS's hash-ordered split 80/10/10; here the examples,
in metadata order, are permuted with numpy's default_rng(0) and cut 80/10/10. PNGs are decoded with
Pillow. The builder's `resolution` option must match (configs: --config.data.options.resolution=R).

Each task's folder is written under a temporary name and renamed when complete, so an interrupted run
leaves no half-written task; a task whose folder exists is skipped (delete it to make it again).
Splits of any size prepare without TensorFlow (`base.GeneratorBuilder`).
"""
from __future__ import annotations

import argparse
import bz2
import functools
import gzip
import io
import lzma
import os
import re
import shutil
import sys
import tarfile
import tempfile
import zlib
from typing import Callable, Iterator, Optional

import numpy as np

from zoo_core import checks, extras
from zoo_core.data import fetch

LRA_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
TASKS = ("listops", "retrieval", "pathfinder", "text", "image")
ARCHIVE_TASKS = ("listops", "retrieval", "pathfinder")
DIFFICULTIES = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
RESOLUTIONS = (32, 64, 128, 256)
LISTOPS_FILES = ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv")
AAN_FILES = {"new_aan_pairs.train.tsv": "train.tsv", "new_aan_pairs.eval.tsv": "validation.tsv",
             "new_aan_pairs.test.tsv": "test.tsv"}
CIFAR_RECORD = 1 + 32 * 32 * 3   # label byte, then 1024 red, 1024 green, 1024 blue bytes


class PrepareError(ValueError):
    """A source that lacks what a task needs; one line."""


class UnreadableArchive(PrepareError):
    """A source that is not a readable (compressed) tar archive, e.g. a truncated download; `path` is it."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def local_source(source: str, *, what: str, data_dir: Optional[str] = None, fetched: Optional[set] = None) -> str:
    """`source` if it is a local file, else (a URL) the fetched file in `<data dir>/downloads/lra/`, which
    is then added to `fetched` (a cached download that `main` drops when it cannot be read).

    Raises:
      PrepareError / fetch.FetchError: one line naming the file or URL.
    """
    if re.match(r"^(https?|file)://", source):
        folder = os.path.join(fetch.downloads_dir(data_dir), "lra")
        path = fetch.fetch(source, folder, put=f"put {what} in {folder} or pass its path", timeout=fetch.TIMEOUT_S)
        if fetched is not None:
            fetched.add(path)
        return path
    path = os.path.expanduser(source)
    if not os.path.isfile(path):
        raise PrepareError(f"{what} {source!r} is not a file (give its path or URL)")
    return path


# The compressions a source may have (by its first bytes), each read by a module that raises EOFError
# when the stream ends early and checks the stream's checksum at its end.
_COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))


def _open_decompressed(path: str) -> io.BufferedIOBase:
    with open(path, "rb") as f:
        head = f.read(6)
    opener = next((o for magic, o in _COMPRESSED if head.startswith(magic)), None)
    return opener(path, "rb") if opener is not None else open(path, "rb")  # noqa: SIM115 - the caller closes it


_UNREADABLE = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)


def _unreadable(path: str, e: BaseException) -> UnreadableArchive:
    return UnreadableArchive(f"{path}: not a readable tar archive ({fetch.one_line(e)})", path)


class _MemberReader:
    """A member's file of `_tar_members`: a read that meets the archive's cut or damage raises
    `UnreadableArchive`, as the iteration does (the reads happen in the caller's code)."""

    def __init__(self, f: io.BufferedIOBase, path: str):
        self._f, self._path = f, path

    def read(self, size: int = -1) -> bytes:
        try:
            return self._f.read(size)
        except _UNREADABLE as e:
            raise _unreadable(self._path, e) from None


def _tar_members(path: str) -> Iterator[tuple[tarfile.TarInfo, Callable[[], _MemberReader]]]:
    """(member, open) for every regular file of the (compressed) tar `path`, in one streaming pass:
    `open()` gives the member's bytes as a file, readable until the next member.

    Raises:
      UnreadableArchive: not a tar archive, damaged, or cut short. tarfile alone ends quietly at a cut
        between members; the stream is therefore read to its end, where a cut raises.
    """
    try:
        with _open_decompressed(path) as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
            for member in tar:
                if member.isfile():
                    yield member, lambda m=member, t=tar: _MemberReader(t.extractfile(m), path)
            while raw.read(1 << 20):   # the end-of-archive blocks and, compressed, the checksum
                pass
    except _UNREADABLE as e:
        raise _unreadable(path, e) from None


class _Task:
    """A task folder written under a temporary name in `out` and renamed to `out/<name>` at `commit`."""

    def __init__(self, out: str, name: str):
        self.final = os.path.join(out, name)
        os.makedirs(out, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".part", dir=out)

    def path(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def commit(self) -> str:
        os.rename(self.tmp, self.final)
        return self.final

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def _after(name: str, folder: str) -> Optional[str]:
    """The part of member path `name` after its component `folder` ('a/b/folder/x/y' -> 'x/y')."""
    parts = name.split("/")
    return "/".join(parts[parts.index(folder) + 1:]) if folder in parts[:-1] else None


def _decode_png(data: bytes, side: int, where: str) -> np.ndarray:
    from PIL import Image  # pylint: disable=import-outside-toplevel
    try:
        image = np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 - Pillow raises several types for a bad image
        raise PrepareError(f"{where}: not a readable PNG ({fetch.one_line(e)})") from None
    if image.shape != (side, side):
        raise PrepareError(f"{where}: a {image.shape[0]}x{image.shape[1]} image, expected {side}x{side}")
    return image


def _pathfinder_examples(metadata: dict[str, bytes], images: dict[str, np.ndarray], where: str):
    """(images uint8 [N, R, R], labels int64 [N]) in metadata order (files by number, lines in order)."""
    xs, ys = [], []
    for name in sorted(metadata, key=lambda n: (int(re.sub(r"\D", "", n) or 0), n)):
        for line_no, line in enumerate(metadata[name].decode("utf-8", "replace").splitlines(), 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4:
                raise PrepareError(f"{where}/metadata/{name}, line {line_no}: expected '<folder> <file> <.> <label> "
                                   f"...', got {line[:60]!r}")
            key = f"{fields[0]}/{fields[1]}"
            if key not in images:
                raise PrepareError(f"{where}/metadata/{name}, line {line_no}: no image {key} in the archive")
            xs.append(images[key])
            ys.append(int(fields[3]))
    if not xs:
        raise PrepareError(f"{where}: no metadata/*.npy lines in the archive")
    return np.stack(xs), np.asarray(ys, np.int64)


def split_80_10_10(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Indices of train / validation / test: a permutation of [0, n) by default_rng(seed), cut 80/10/10."""
    order = np.random.default_rng(seed).permutation(n)
    a, b = int(0.8 * n), int(0.9 * n)
    return {"train": order[:a], "validation": order[a:b], "test": order[b:]}


def prepare_archive(archive: str, out: str, tasks=ARCHIVE_TASKS, *, resolution: int = 32,
                    difficulty: str = "curv_contour_length_14", log=print) -> list[str]:
    """Writes the listops / retrieval / pathfinder folders of `tasks` from LRA's release archive.

    Returns:
      The folders written (tasks already there are skipped and not listed).

    Raises:
      PrepareError: the archive lacks a file a task needs (named), before any task folder is renamed.
    """
    todo = [t for t in tasks if t in ARCHIVE_TASKS and not os.path.isdir(os.path.join(out, t))]
    for t in sorted(set(tasks) & set(ARCHIVE_TASKS) - set(todo)):
        log(f"lra_prepare: {os.path.join(out, t)} exists; skipped (delete it to prepare it again)")
    if not todo:
        return []
    pf_folder = f"pathfinder{resolution}"
    metadata: dict[str, bytes] = {}
    images: dict[str, np.ndarray] = {}
    # The text files are copied as they stream by (Retrieval's train file is 1.2 GB).
    folders = {task: _Task(out, task) for task in todo}
    copied: dict[str, set[str]] = {"listops": set(), "retrieval": set()}
    written = []
    try:
        log(f"lra_prepare: reading {archive} (one pass)")
        for member, open_member in _tar_members(archive):
            name = member.name
            base = os.path.basename(name)
            if "listops" in todo and _after(name, "listops-1000") in LISTOPS_FILES:
                task, target = "listops", base
            elif "retrieval" in todo and _after(name, "tsv_data") in AAN_FILES:
                task, target = "retrieval", AAN_FILES[base]
            else:
                rest = _after(name, pf_folder) if "pathfinder" in todo else None
                if rest and rest.startswith(difficulty + "/"):
                    rest = rest[len(difficulty) + 1:]
                    if rest.startswith("metadata/") and rest.endswith(".npy"):
                        metadata[rest[len("metadata/"):]] = open_member().read()
                    elif rest.endswith(".png"):
                        images[rest] = _decode_png(open_member().read(), resolution, f"{archive}:{name}")
                continue
            with open(folders[task].path(target), "wb") as f:
                shutil.copyfileobj(open_member(), f, 1 << 20)
            copied[task].add(target)
        for task, needed in (("listops", LISTOPS_FILES), ("retrieval", tuple(AAN_FILES))):
            targets = LISTOPS_FILES if task == "listops" else tuple(AAN_FILES.values())
            if task in todo and set(targets) - copied[task]:
                raise PrepareError(f"{archive}: no {', '.join(needed)} under a listops-1000/ or tsv_data/ folder "
                                   f"(the {task} task; is it LRA's lra_release.gz? --tasks chooses the tasks)")
        if "pathfinder" in todo:
            x, y = _pathfinder_examples(metadata, images, f"{archive}:{pf_folder}/{difficulty}")
            images.clear()
            for split, idx in split_80_10_10(len(y)).items():
                np.savez(folders["pathfinder"].path(f"{split}.npz"), inputs=x[idx], label=y[idx])
        for task in todo:
            written.append(folders.pop(task).commit())
            log(f"lra_prepare: wrote {written[-1]}")
    finally:
        for folder in folders.values():   # the tasks not renamed into place
            folder.abort()
    return written


def prepare_imdb(archive: str, out: str, log=print) -> Optional[str]:
    """DIR/text/{train,test}.tsv from aclImdb_v1.tar.gz ('label<TAB>text', pos = 1, neg = 0)."""
    if os.path.isdir(os.path.join(out, "text")):
        log(f"lra_prepare: {os.path.join(out, 'text')} exists; skipped (delete it to prepare it again)")
        return None
    lines: dict[str, list[bytes]] = {"train": [], "test": []}
    for member, read in _tar_members(archive):
        parts = member.name.split("/")
        if len(parts) >= 4 and parts[-4] == "aclImdb" and parts[-3] in lines and parts[-2] in ("pos", "neg") \
                and parts[-1].endswith(".txt"):
            text = b" ".join(read().read().replace(b"\r", b"\n").split(b"\n")).strip()
            lines[parts[-3]].append(b"%d\t%s\n" % (parts[-2] == "pos", text))
    empty = [s for s, v in lines.items() if not v]
    if empty:
        raise PrepareError(f"{archive}: no aclImdb/{empty[0]}/{{pos,neg}}/*.txt (is it aclImdb_v1.tar.gz?)")
    folder = _Task(out, "text")
    try:
        for split, rows in lines.items():
            with open(folder.path(f"{split}.tsv"), "wb") as f:
                f.writelines(rows)
        path = folder.commit()
    except BaseException:
        folder.abort()
        raise
    log(f"lra_prepare: wrote {path} ({len(lines['train'])} train, {len(lines['test'])} test reviews)")
    return path


def prepare_cifar(archive: str, out: str, log=print) -> Optional[str]:
    """DIR/image/{train,validation,test}.npz from cifar-10-binary.tar.gz (RGB [N, 32, 32, 3] uint8)."""
    if os.path.isdir(os.path.join(out, "image")):
        log(f"lra_prepare: {os.path.join(out, 'image')} exists; skipped (delete it to prepare it again)")
        return None
    batches: dict[str, bytes] = {}
    for member, read in _tar_members(archive):
        base = os.path.basename(member.name)
        if re.fullmatch(r"(data_batch_[1-5]|test_batch)\.bin", base):
            batches[base] = read().read()
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    missing = [n for n in names if n not in batches]
    if missing:
        raise PrepareError(f"{archive}: no {', '.join(missing)} (is it cifar-10-binary.tar.gz?)")

    def decode(data: bytes, name: str):
        if len(data) % CIFAR_RECORD:
            raise PrepareError(f"{archive}:{name}: {len(data)} bytes is not a whole number of {CIFAR_RECORD}-byte "
                               "records")
        records = np.frombuffer(data, np.uint8).reshape(-1, CIFAR_RECORD)
        return records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), records[:, 0].astype(np.int64)

    train = [decode(batches[n], n) for n in names[:5]]
    x, y = np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train])
    cut = int(0.9 * len(y))
    splits = {"train": (x[:cut], y[:cut]), "validation": (x[cut:], y[cut:]),
              "test": decode(batches[names[5]], names[5])}
    folder = _Task(out, "image")
    try:
        for split, (xs, ys) in splits.items():
            np.savez(folder.path(f"{split}.npz"), inputs=xs, label=ys)
        path = folder.commit()
    except BaseException:
        folder.abort()
        raise
    log(f"lra_prepare: wrote {path} ({cut} train, {len(y) - cut} validation, {len(splits['test'][1])} test)")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (argv without the program name; None = sys.argv)."""
    parser = checks.ArgumentParser(prog="python -m zoo_core.data.lra_prepare",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder that gets one sub-folder per task")
    parser.add_argument("--archive", default="", help=f"LRA's lra_release.gz, a path or URL ({LRA_URL})")
    parser.add_argument("--imdb", default="", help=f"aclImdb_v1.tar.gz, a path or URL ({IMDB_URL})")
    parser.add_argument("--cifar", default="", help=f"cifar-10-binary.tar.gz, a path or URL ({CIFAR_URL})")
    parser.add_argument("--tasks", default="", help=f"comma-separated subset of {','.join(TASKS)} "
                                                    "(default: those whose source is given)")
    parser.add_argument("--pathfinder_resolution", type=int, default=32, choices=RESOLUTIONS)
    parser.add_argument("--pathfinder_difficulty", default="curv_contour_length_14", choices=DIFFICULTIES)
    parser.add_argument("--data_dir", default=None, help="where URLs are downloaded to (<data dir>/downloads/lra)")
    args = parser.parse_args(argv)
    # A file (or a path under one, or '') as a folder: one line now, not a traceback when it is written.
    checks.check_output_paths(parser, args, dirs=["out", "data_dir"])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    given = {"archive": args.archive, "imdb": args.imdb, "cifar": args.cifar}
    source_of = {"listops": "archive", "retrieval": "archive", "pathfinder": "archive", "text": "imdb",
                 "image": "cifar"}
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] or [t for t in TASKS if given[source_of[t]]]
    fetched: set[str] = set()   # the sources downloaded from a URL into the cache
    try:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise PrepareError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if not tasks:
            raise PrepareError("nothing to prepare: give --archive (listops, retrieval, pathfinder), --imdb (text) "
                               "and/or --cifar (image)")
        lacking = sorted({source_of[t] for t in tasks if not given[source_of[t]]})
        if lacking:
            raise PrepareError(f"--tasks {','.join(tasks)} needs --{' --'.join(lacking)}")
        if "pathfinder" in tasks:
            extras.require("lra", "pathfinder (its PNG images)", ("PIL",))
        data_dir = args.data_dir
        archive_tasks = [t for t in tasks if t in ARCHIVE_TASKS]
        source = functools.partial(local_source, data_dir=data_dir, fetched=fetched)
        if archive_tasks:
            prepare_archive(source(args.archive, what="lra_release.gz"), args.out, archive_tasks,
                            resolution=args.pathfinder_resolution, difficulty=args.pathfinder_difficulty)
        if "text" in tasks:
            prepare_imdb(source(args.imdb, what="aclImdb_v1.tar.gz"), args.out)
        if "image" in tasks:
            prepare_cifar(source(args.cifar, what="cifar-10-binary.tar.gz"), args.out)
    except ValueError as e:
        message = fetch.one_line(e, 400)
        if isinstance(e, UnreadableArchive) and e.path in fetched:
            # A download that arrived whole but is no archive (cut short at the source): every run
            # would read it from the cache again.
            os.remove(e.path)
            message += "; removed it from the download cache (the next run fetches it again)"
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2
    for task in tasks:
        print(f"{task}: --config.data.options.source_dir={os.path.join(os.path.abspath(args.out), task)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
