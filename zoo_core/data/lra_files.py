"""Long Range Arena tasks read from prepared files (Tay et al., ICLR 2021): `lra_text`, `lra_retrieval`,
`lra_image`, `lra_pathfinder`.

These tasks need data that cannot be generated or shipped (IMDB, the ACL Anthology Network pairs,
CIFAR-10, Pathfinder), so each builder reads files that the user puts in the directory option
`source_dir`. Splits: 'train' and 'test' are required, 'validation' is built when its file exists
(LRA uses IMDB's test split as its text validation set; image and pathfinder carve one out of train),
except for retrieval, whose 'validation' is required: LRA's release ships it (new_aan_pairs.eval.tsv)
and the retrieval configs select checkpoints on it, so a missing one is reported with the others
before any file is read, not after the other splits are prepared.

Files and features (tokenisation as `lra_benchmarks/*/input_pipeline.py`, htgn.md §4.2):

* `lra_text`: {train,validation,test}.tsv, one example per line `label<TAB>text`, label 0/1, the text
  up to the end of the line (raw UTF-8 bytes, no newline inside). Byte-level ids as LRA's
  ByteTextEncoder: byte b -> b + 1, 0 = padding, TEXT_VOCAB_SIZE = 257; truncated/padded to
  max_length (default 4000; AGF's config uses 1024, LRA's code 1000).
  Features 'inputs' int32 [max_length], 'label' int64 in {0, 1}.
* `lra_retrieval`: {train,validation,test}.tsv, one pair per line `label<TAB>text1<TAB>text2`, or LRA's
  own AAN lines `label<TAB>id1<TAB>id2<TAB>text1<TAB>text2` (lra_release's new_aan_pairs.{train,eval,
  test}.tsv renamed; labels may be written '0.0'/'1.0'). Bytes as for text, max_length 4000 each.
  Features 'inputs1', 'inputs2' int32 [max_length], 'label' int64 in {0, 1}.
* `lra_image`: {train,validation,test}.npz with arrays 'inputs' (uint8 CIFAR-10 images [N, 32, 32]
  grayscale, or [N, 32, 32, 3] RGB converted as tf.image.rgb_to_grayscale, or already flat
  [N, 1024]) and 'label' (int [N] in 0..9). LRA: train = CIFAR-10 train[:90%], validation =
  train[90%:], test = test. Features 'inputs' int32 [1024] pixel values 0..255 (PIXEL_VOCAB_SIZE = 256;
  0 is a black pixel, not padding), 'label' int64.
* `lra_pathfinder`: {train,validation,test}.npz as for image with [N, R, R] grayscale images
  (R = the `resolution` option, default 32 -> 1024 tokens; 128 is Path-X) and labels 0/1 (1 = the
  two markers are connected). LRA splits each difficulty 80/10/10; the usual one is
  curv_contour_length_14. Features 'inputs' int32 [R*R], 'label' int64.

Every builder raises a one-line ValueError naming the missing files and their format when
`source_dir` is not given or lacks train/test files, and a ValueError naming file and line (or
array) for a malformed entry.
"""
from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base

MULTI_DATASET = True

TEXT_VOCAB_SIZE = 257   # 0 = padding, byte b -> b + 1
PIXEL_VOCAB_SIZE = 256  # pixel values 0..255 are the tokens
SPLITS = ("train", "validation", "test")


@dataclasses.dataclass
class LraTextConfig(tfds.core.BuilderConfig):
    source_dir: Any = None
    max_length: int = 4000


@dataclasses.dataclass
class LraRetrievalConfig(tfds.core.BuilderConfig):
    source_dir: Any = None
    max_length: int = 4000


@dataclasses.dataclass
class LraImageConfig(tfds.core.BuilderConfig):
    source_dir: Any = None


@dataclasses.dataclass
class LraPathfinderConfig(tfds.core.BuilderConfig):
    source_dir: Any = None
    resolution: int = 32


# ----------------------------------------------------------------------------------------------
# readers


def encode_bytes(text: bytes, max_length: int) -> np.ndarray:
    """LRA byte-level ids: byte b -> b + 1, truncated and zero-padded to int32 [max_length]."""
    ids = np.zeros((max_length,), np.int32)
    raw = np.frombuffer(text[:max_length], np.uint8)
    ids[:len(raw)] = raw.astype(np.int32) + 1
    return ids


def _label(field: bytes, path: str, line_no: int, num_classes: int) -> int:
    try:
        value = float(field)
    except ValueError:
        raise ValueError(f"{path}, line {line_no}: label {field[:20]!r} is not a number") from None
    if value != int(value) or not 0 <= value < num_classes:
        raise ValueError(f"{path}, line {line_no}: label {field[:20]!r} is not an integer in [0, {num_classes})")
    return int(value)


def read_tsv(path: str, num_texts: int, max_length: int, num_classes: int = 2):
    """Yields (label, [ids int32 [max_length]] * num_texts) from an LRA text/retrieval TSV file.

    Lines are `label<TAB>text` (num_texts=1; the text may contain tabs) or
    `label<TAB>text1<TAB>text2` / `label<TAB>id1<TAB>id2<TAB>text1<TAB>text2` (num_texts=2).
    """
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            if num_texts == 1:
                fields = line.split(b"\t", 1)
                if len(fields) != 2:
                    raise ValueError(f"{path}, line {line_no}: expected 'label<TAB>text', found no tab")
                texts = fields[1:]
            else:
                fields = line.split(b"\t")
                if len(fields) == 3:
                    texts = fields[1:]
                elif len(fields) == 5:  # LRA's AAN files: label, id1, id2, text1, text2
                    texts = fields[3:]
                else:
                    raise ValueError(f"{path}, line {line_no}: expected 'label<TAB>text1<TAB>text2' or LRA's "
                                     f"'label<TAB>id1<TAB>id2<TAB>text1<TAB>text2', got {len(fields)} fields")
            yield _label(fields[0], path, line_no, num_classes), [encode_bytes(t, max_length) for t in texts]


def rgb_to_grayscale(images: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] -> uint8 [...] as tf.image.rgb_to_grayscale on uint8 images (up to float32 rounding)."""
    flt = images.astype(np.float32) * np.float32(1.0 / 255.0)
    gray = flt @ np.array([0.2989, 0.5870, 0.1140], np.float32)
    # convert_image_dtype float -> uint8 scales by 255.5 and saturate-casts (truncates).
    return np.clip(gray * np.float32(255.5), 0, 255).astype(np.uint8)


def read_npz(path: str, side: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Loads LRA image/pathfinder arrays: (tokens int32 [N, side*side], labels int64 [N])."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz file ({e})") from None
    missing = [k for k in ("inputs", "label") if k not in arrays]
    if missing:
        raise ValueError(f"{path}: missing array(s) {missing}; found {sorted(arrays)}")
    images, labels = arrays["inputs"], arrays["label"]
    if images.ndim < 2:
        raise ValueError(f"{path}: 'inputs' must be [N, {side}, {side}] or [N, {side * side}], "
                         f"got {list(images.shape)}")
    n = len(images)
    if images.ndim == 4 and images.shape[1:] == (side, side, 3):
        if images.dtype != np.uint8:
            raise ValueError(f"{path}: RGB 'inputs' must be uint8, got {images.dtype}")
        images = rgb_to_grayscale(images)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if images.shape[1:] not in ((side, side), (side * side,)):
        raise ValueError(f"{path}: 'inputs' must be [N, {side}, {side}] (optionally with a trailing 1 or 3 "
                         f"channels) or [N, {side * side}], got {list(images.shape)}")
    if not np.issubdtype(images.dtype, np.integer):
        raise ValueError(f"{path}: 'inputs' must hold integer pixel values 0..255, got dtype {images.dtype}")
    if n and (images.min() < 0 or images.max() > 255):
        raise ValueError(f"{path}: 'inputs' values must be in 0..255, got {images.min()}..{images.max()}")
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: 'label' must be an integer array [N={n}], got {labels.dtype} {list(labels.shape)}")
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        raise ValueError(f"{path}: 'label'[{bad[0]}] = {labels[bad[0]]} is not in [0, {num_classes})")
    return images.reshape(n, side * side).astype(np.int32), labels.astype(np.int64)


# ----------------------------------------------------------------------------------------------
# builders


class _LraFiles(base.GeneratorBuilder, skip_registration=True):
    """Shared split discovery; subclasses set EXT, FORMAT and the features."""

    VERSION = tfds.core.Version("1.0.0")
    EXT = ""
    FORMAT = ""
    NUM_CLASSES = 2
    REQUIRED = ("train", "test")   # the splits whose files must exist; the others are built when present
    RELEASE = ""   # where LRA's release has these files, for the missing-files message

    def _split_generators(self, dl_manager):
        paths = check_files(self.name, self.builder_config.source_dir)
        return {split: self._generate_examples(path) for split, path in paths.items()}

    def _info_with(self, features: dict, **metadata):
        return base.DatasetInfo(
            builder=self, description=__doc__, features=tfds.features.FeaturesDict(features),
            metadata=tfds.core.MetadataDict(num_classes=self.NUM_CLASSES, **metadata))


class LraText(_LraFiles):
    """LRA Text (IMDB bytes): 'inputs' int32 [max_length] (0 = pad), 'label' int64 in {0, 1}."""

    BUILDER_CONFIGS = [LraTextConfig(name="default")]
    EXT = ".tsv"
    FORMAT = "one example per line 'label<TAB>text', label 0/1, raw UTF-8 text without newlines"

    def _info(self):
        c = self.builder_config
        return self._info_with({"inputs": tfds.features.Tensor(shape=(c.max_length,), dtype=np.int32),
                                "label": tfds.features.Scalar(dtype=np.int64)}, vocab_size=TEXT_VOCAB_SIZE)

    def _generate_examples(self, path):
        for i, (label, (ids,)) in enumerate(read_tsv(path, 1, self.builder_config.max_length)):
            yield i, {"inputs": ids, "label": label}


class LraRetrieval(_LraFiles):
    """LRA Retrieval (AAN byte pairs): 'inputs1', 'inputs2' int32 [max_length], 'label' int64 in {0, 1}."""

    BUILDER_CONFIGS = [LraRetrievalConfig(name="default")]
    EXT = ".tsv"
    FORMAT = ("one pair per line 'label<TAB>text1<TAB>text2' or LRA's AAN "
              "'label<TAB>id1<TAB>id2<TAB>text1<TAB>text2', label 0/1")
    REQUIRED = ("train", "validation", "test")
    RELEASE = "lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv, renamed"

    def _info(self):
        c = self.builder_config
        tokens = tfds.features.Tensor(shape=(c.max_length,), dtype=np.int32)
        return self._info_with({"inputs1": tokens, "inputs2": tokens,
                                "label": tfds.features.Scalar(dtype=np.int64)}, vocab_size=TEXT_VOCAB_SIZE)

    def _generate_examples(self, path):
        for i, (label, (ids1, ids2)) in enumerate(read_tsv(path, 2, self.builder_config.max_length)):
            yield i, {"inputs1": ids1, "inputs2": ids2, "label": label}


class LraImage(_LraFiles):
    """LRA Image (grayscale CIFAR-10): 'inputs' int32 [1024] pixels 0..255, 'label' int64 in [0, 10)."""

    BUILDER_CONFIGS = [LraImageConfig(name="default")]
    EXT = ".npz"
    FORMAT = ("arrays 'inputs' uint8 [N, 32, 32] (grayscale; [N, 32, 32, 3] RGB or [N, 1024] also accepted) "
              "and 'label' int [N] in 0..9")
    NUM_CLASSES = 10
    SIDE = 32

    def _side(self) -> int:
        return self.SIDE

    def _info(self):
        side = self._side()
        return self._info_with({"inputs": tfds.features.Tensor(shape=(side * side,), dtype=np.int32),
                                "label": tfds.features.Scalar(dtype=np.int64)},
                               vocab_size=PIXEL_VOCAB_SIZE, image_shape=[side, side])

    def _generate_examples(self, path):
        tokens, labels = read_npz(path, self._side(), self.NUM_CLASSES)
        for i in range(len(labels)):
            yield i, {"inputs": tokens[i], "label": int(labels[i])}


class LraPathfinder(LraImage):
    """LRA Pathfinder: 'inputs' int32 [R*R] pixels 0..255, 'label' int64 in {0, 1}."""

    BUILDER_CONFIGS = [LraPathfinderConfig(name="default")]
    FORMAT = ("arrays 'inputs' uint8 [N, R, R] grayscale (R = resolution option; [N, R*R] also accepted) "
              "and 'label' int [N] in 0..1")
    NUM_CLASSES = 2

    def _side(self) -> int:
        return self.builder_config.resolution


BUILDERS = {"lra_text": LraText, "lra_retrieval": LraRetrieval, "lra_image": LraImage,
            "lra_pathfinder": LraPathfinder}
_CONFIGS = {"lra_text": LraTextConfig, "lra_retrieval": LraRetrievalConfig, "lra_image": LraImageConfig,
            "lra_pathfinder": LraPathfinderConfig}


def check_files(name: str, source_dir: str | None) -> dict[str, str]:
    """{split: path} of the files of dataset `name` in `source_dir`: its required splits (`REQUIRED`),
    and the others that are present. Reads no file.

    Raises:
      ValueError: one line naming every missing required file, which files to put where, and their format.
    """
    cls = BUILDERS[name]
    files = [f"DIR/{split}{cls.EXT}" for split in cls.REQUIRED]
    wanted = ", ".join(files[:-1]) + f" and {files[-1]}"
    optional = [f"DIR/{split}{cls.EXT}" for split in SPLITS if split not in cls.REQUIRED]
    if optional:
        wanted += f" (optional {', '.join(optional)})"
    if cls.RELEASE:
        wanted += f" (LRA: {cls.RELEASE})"
    if source_dir is None:
        raise ValueError(f"{name} reads prepared files: pass source_dir=DIR with {wanted}, {cls.FORMAT}")
    paths = {split: os.path.join(source_dir, split + cls.EXT) for split in SPLITS}
    missing = [paths[s] for s in cls.REQUIRED if not os.path.isfile(paths[s])]
    if missing:
        raise ValueError(f"{name}: missing {', '.join(missing)}; put {wanted} there (source_dir={source_dir!r}), "
                         f"{cls.FORMAT}")
    return {s: p for s, p in paths.items() if os.path.isfile(p)}


def _check(name: str, c) -> None:
    if c.source_dir is not None and not isinstance(c.source_dir, str):
        raise ValueError(f"source_dir must be a directory path, got {c.source_dir!r}")
    for field in ("max_length", "resolution"):
        value = getattr(c, field, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {field} must be a positive int, got {value!r}")


def make_builder(name: str, data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Returns the (unprepared) builder of LRA task `name` reading `source_dir`.

    Options: source_dir (required unless already prepared); lra_text / lra_retrieval: max_length
    (4000); lra_pathfinder: resolution (32).

    Raises:
      ValueError: unknown dataset or option, bad option value, or missing source files (one line
        saying which files to put where) when the dataset is not prepared yet.
    """
    if name not in BUILDERS:
        raise ValueError(f"lra_files serves {', '.join(BUILDERS)}, not {name!r}")
    options = base.absolute_path_option(options, "source_dir")
    config = base.config_from_options(_CONFIGS[name], options, dataset=name)
    _check(name, config)
    if config.source_dir:
        try:
            found = check_files(name, config.source_dir)
        except ValueError:
            found = None   # reported below unless prepared data for these options already exists
        if found:
            # Keyed by the files' contents too: edited or replaced files are prepared again.
            config = base.config_from_options(_CONFIGS[name], options, dataset=name,
                                              sources=[found[s] for s in sorted(found)])
        else:
            config = base.find_prepared(data_dir, BUILDERS[name].name, config) or config
    builder = BUILDERS[name](data_dir=data_dir, config=config, file_format="array_record")
    if not builder.is_prepared():
        check_files(name, config.source_dir)
    return builder
