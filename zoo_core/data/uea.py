"""`uea`: UEA multivariate time-series classification archive (Bagnall et al. 2018) from `.ts` files.

The AGF UEA harness (agf.md §3.2) is mvts_transformer's (Zerveas et al., KDD 2021) data pipeline,
which this module reproduces:
  * missing values ('?') are filled per series and dimension by linear interpolation, the ends by the
    nearest observed value (pandas `interpolate(method='linear', limit_direction='both')`);
  * `normalization='standardization'` (the harness default): per channel, the mean and standard
    deviation (ddof=1) over every time step of every TRAIN series, x -> (x - mean) / (std + eps),
    applied to both splits; 'minmax' is (x - min) / (max - min + eps) with TRAIN statistics; 'none';
  * class ids are the sorted class names (pandas categorical codes);
  * series are zero-padded after normalisation to a common length; 'mask' marks the real steps. The
    harness uses the longest TRAIN series and truncates longer TEST series (`max_length='train'`);
    the default here (`max_length=None`) pads to the longest series of both splits, so nothing is cut.
The validation split of the harness is the TEST split (agf.md §3.2), so the splits are 'train', 'test'.

Sources:
  * `source_dir=None`: the `.ts` files shipped in this package (`SHIPPED_DIR`, the UEA archive's files
    as sktime's wheel ships them): BasicMotions (40/40, 6 dims, length 100, 4 classes) and
    JapaneseVowels (270/370, 12 dims, length 7-29, 9 classes). Univariate sets work the same way (C = 1).
  * `source_dir=DIR`: the archive layout DIR/<Name>/<Name>_TRAIN.ts and DIR/<Name>/<Name>_TEST.ts
    (as unzipped from timeseriesclassification.com's Multivariate2018_ts.zip; DIR/<Name>_TRAIN.ts works
    too).
  * otherwise (no `source_dir`, not shipped): fetched on first use from `<base_url>/<Name>.zip` (the
    option `base_url`, default `BASE_URL`, the archive's per-data-set zips that aeon and sktime download)
    into `<data dir>/downloads/uea/<Name>.zip`, checked (every CRC, <Name>_TRAIN.ts and <Name>_TEST.ts at
    the zip's root or in a <Name>/ folder, both loading) and unpacked to `<data dir>/downloads/uea/<Name>/`
    (`zoo_core.data.fetch`). The archive publishes no checksums, so the check is by structure; the
    prepared data are keyed by the files' contents as for any source. `base_url=''` turns fetching off.
    Offline the error is one line naming the URL and the folder to put the files in.

Features: 'inputs' float32 [T, C] (0 beyond the series), 'mask' bool [T] (True = real step),
'label' int64. `info.metadata` holds class_names, num_channels, max_length, train_max_length and the
normalisation statistics; `class_names(builder)` returns the id -> name list.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base, fetch

BASE_URL = "https://timeseriesclassification.com/aeon-toolkit"
# AGF Table 1 (agf.md §3.2): the ten data sets of the paper, fetched when not shipped.
TABLE1 = ("EthanolConcentration", "FaceDetection", "Handwriting", "Heartbeat", "JapaneseVowels", "PEMS-SF",
          "SelfRegulationSCP1", "SelfRegulationSCP2", "SpokenArabicDigits", "UWaveGestureLibrary")
# The two small sets the main job and the tests use ship inside the package (attribution: its README.md).
SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "uea_files"
NORMALIZATIONS = ("standardization", "minmax", "none")
_EPS = np.finfo(float).eps  # mvts_transformer's Normalizer epsilon (float64)


@dataclasses.dataclass
class UeaConfig(tfds.core.BuilderConfig):
    dataset: str = "JapaneseVowels"
    source_dir: Any = None
    max_length: Any = None
    normalization: Any = "standardization"


# ----------------------------------------------------------------------------------------------
# .ts parsing


@dataclasses.dataclass
class TsFile:
    """A parsed .ts file: `series[i]` float64 [T_i, C] (NaN where missing), `labels[i]` a class name."""
    path: str
    series: list[np.ndarray]
    labels: list[str]
    class_names: list[str] | None  # as declared by '@classLabel true ...' (None when not declared)
    header: dict[str, str]


def _fail(path: str, line_no: int, what: str) -> ValueError:
    return ValueError(f"{path}, line {line_no}: {what}")


def parse_ts(path: str) -> TsFile:
    """Parses a classification `.ts` file (sktime/aeon format).

    Layout: '#' comment lines, '@key value' header lines up to '@data', then one case per line:
    dimensions separated by ':', values inside a dimension by ',', '?' (or 'NaN') for a missing value,
    and the class label as the last ':' field. A leading byte-order mark is ignored.

    Raises:
      ValueError: naming the file and line, for a malformed header or case line, a case whose
        dimensions differ in count or length, an infinite value, an undeclared label, or an unsupported variant
        (timestamps, regression targets).
    """
    header: dict[str, str] = {}
    series: list[np.ndarray] = []
    labels: list[str] = []
    class_names = None
    num_dims = None
    in_data = False
    # utf-8-sig: a byte-order mark (files saved by some Windows editors) is not part of the first line.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line_no, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if not in_data:
                if not line.startswith("@"):
                    raise _fail(path, line_no, f"expected an '@' header line or '@data' before the cases, "
                                               f"got {line[:40]!r}")
                key, _, value = line[1:].partition(" ")
                key, value = key.lower(), value.strip()
                if key == "data":
                    in_data = True
                    if header.get("timestamps", "false").lower() == "true":
                        raise _fail(path, line_no, "'@timeStamps true' files are not supported")
                    if header.get("classlabel", "").split()[:1] != ["true"]:
                        raise _fail(path, line_no, "not a classification file ('@classLabel true <names>' "
                                                   "is missing before '@data')")
                    if "dimensions" in header:
                        num_dims = int(header["dimensions"])
                elif key == "classlabel":
                    parts = value.split()
                    if not parts or parts[0].lower() not in ("true", "false"):
                        raise _fail(path, line_no, f"'@classLabel' must be 'true <names...>' or 'false', "
                                                   f"got {value!r}")
                    parts[0] = parts[0].lower()
                    if parts[0] == "true":
                        if len(parts) < 2:
                            raise _fail(path, line_no, "'@classLabel true' declares no class names")
                        class_names = parts[1:]
                    header[key] = " ".join(parts)
                elif key == "dimensions" and not value.isdigit():
                    raise _fail(path, line_no, f"'@dimensions' must be an integer, got {value!r}")
                else:
                    header[key] = value
                continue
            fields = line.split(":")
            if len(fields) < 2:
                raise _fail(path, line_no, "a case needs at least one dimension and a label separated by ':'")
            label = fields[-1].strip()
            dims = fields[:-1]
            if num_dims is None:
                num_dims = len(dims)
            if len(dims) != num_dims:
                raise _fail(path, line_no, f"{len(dims)} dimensions, expected {num_dims}")
            if class_names is not None and label not in class_names:
                raise _fail(path, line_no, f"label {label!r} is not among the declared classes {class_names}")
            try:
                values = [np.array(d.replace("?", "nan").split(","), dtype=np.float64) for d in dims]
            except ValueError as e:
                raise _fail(path, line_no, f"bad value ({e})") from None
            if any(np.isinf(v).any() for v in values):
                # float() reads 'inf'; it would reach the normalisation and make every loss NaN.
                raise _fail(path, line_no, "an infinite value (a missing value is written '?')")
            lengths = {len(v) for v in values}
            if len(lengths) != 1:
                raise _fail(path, line_no, f"dimensions of one case differ in length: {[len(v) for v in values]}")
            series.append(np.stack(values, axis=-1))
            labels.append(label)
    if not in_data:
        raise ValueError(f"{path}: no '@data' line")
    if not series:
        raise ValueError(f"{path}: no cases after '@data'")
    return TsFile(path=path, series=series, labels=labels, class_names=class_names, header=header)


def fill_missing(x: np.ndarray, *, where: str = "") -> np.ndarray:
    """Linear interpolation of NaNs over time per channel, ends held (mvts `interpolate_missing`).

    Args:
      x: float [T, C].
      where: names the series in the error message.

    Raises:
      ValueError: a channel with no observed value at all.
    """
    if not np.isnan(x).any():
        return x
    x = x.copy()
    t = np.arange(x.shape[0])
    for c in range(x.shape[1]):
        bad = np.isnan(x[:, c])
        if bad.all():
            raise ValueError(f"{where}: dimension {c} has no observed value (all '?')")
        if bad.any():
            x[bad, c] = np.interp(t[bad], t[~bad], x[~bad, c])
    return x


# ----------------------------------------------------------------------------------------------
# locating files


def shipped_datasets() -> list[str]:
    """Names of the datasets shipped inside this package (`SHIPPED_DIR`, with both TRAIN and TEST)."""
    return sorted(d.name for d in SHIPPED_DIR.iterdir()
                  if (d / f"{d.name}_TRAIN.ts").is_file() and (d / f"{d.name}_TEST.ts").is_file())


def _zip_members(dataset: str, names: list[str]) -> dict[str, str]:
    """{member: file name} of <dataset>_TRAIN.ts and _TEST.ts in a zip, at its root or in <dataset>/.

    Raises:
      ValueError: a file is in neither place.
    """
    found = {}
    for wanted in (f"{dataset}_TRAIN.ts", f"{dataset}_TEST.ts"):
        member = next((m for m in (wanted, f"{dataset}/{wanted}") if m in names), None)
        if member is None:
            raise ValueError(f"the archive holds no {wanted} at its root or in {dataset}/")
        found[member] = wanted
    return found


def _check_archive(dataset: str, path: str) -> None:
    """Raises ValueError (one line) unless the zip `path` holds <dataset>_TRAIN.ts and _TEST.ts that load
    (`_load`: parsed, consistent), so that a download that would fail every run never reaches the cache."""
    import tempfile  # pylint: disable=import-outside-toplevel
    members = _zip_members(dataset, fetch.check_zip(path))
    with tempfile.TemporaryDirectory(prefix=".check.", dir=os.path.dirname(path)) as tmp:
        fetch.extract(path, os.path.join(tmp, dataset), members)
        files = [os.path.join(tmp, dataset, f"{dataset}_{split}.ts") for split in ("TRAIN", "TEST")]
        try:
            _load.__wrapped__(*map(_file_key, files), None, "none")
        except ValueError as e:   # it names the unpacked file: name it as the archive's member
            raise ValueError(str(e).replace(os.path.join(tmp, dataset) + os.sep, "")) from None


def cached_dir(data_dir: str) -> str:
    """Where fetched UEA data sets are unpacked: `<data dir>/downloads/uea` (a `source_dir` layout)."""
    return os.path.join(fetch.downloads_dir(data_dir), "uea")


def fetch_dataset(dataset: str, data_dir: str, base_url: str = BASE_URL) -> tuple[str, str]:
    """Paths of <dataset>_TRAIN.ts and _TEST.ts under `cached_dir(data_dir)`/<dataset>/, fetched from
    `<base_url>/<dataset>.zip` and unpacked there if they are not there yet.

    Raises:
      fetch.FetchError: one line naming the URL, the reason and where to put the files instead.
    """
    folder = cached_dir(data_dir)
    names = (f"{dataset}_TRAIN.ts", f"{dataset}_TEST.ts")
    paths = tuple(os.path.join(folder, dataset, n) for n in names)
    if all(os.path.isfile(p) for p in paths):
        return paths
    put = f"put {dataset}/{names[0]} and {dataset}/{names[1]} in {folder} (or pass source_dir=DIR)"
    archive = fetch.fetch(f"{base_url.rstrip('/')}/{dataset}.zip", folder, put=put,
                          expect=lambda path: _check_archive(dataset, path))
    fetch.extract(archive, os.path.join(folder, dataset), _zip_members(dataset, fetch.check_zip(archive)))
    if not all(os.path.isfile(p) for p in paths):   # a folder of that name made by hand, without them
        raise fetch.FetchError(f"{os.path.join(folder, dataset)} exists but lacks {names[0]} or {names[1]}; "
                               f"delete it to fetch {dataset} again")
    return paths


def locate(dataset: str, source_dir: str | None, *, data_dir: str | None = None,
           base_url: str | None = None) -> tuple[str, str]:
    """Paths of <dataset>_TRAIN.ts and <dataset>_TEST.ts: from `source_dir`, else the copy shipped in this
    package, else (with `data_dir`) from the download cache, else (with `base_url` too) fetched
    (`fetch_dataset`).

    Raises:
      ValueError: (one line) where the files were looked for and where to put them.
    """
    names = (f"{dataset}_TRAIN.ts", f"{dataset}_TEST.ts")
    if source_dir is not None:
        for folder in (os.path.join(source_dir, dataset), source_dir):
            paths = tuple(os.path.join(folder, n) for n in names)
            if all(os.path.isfile(p) for p in paths):
                return paths
        raise ValueError(f"uea: dataset {dataset!r} not found: put {dataset}/{names[0]} and {dataset}/{names[1]} "
                         f"(UEA .ts format, the archive's Multivariate_ts layout) under "
                         f"source_dir={source_dir!r}")
    shipped = SHIPPED_DIR / dataset
    if all((shipped / n).is_file() for n in names):
        return str(shipped / names[0]), str(shipped / names[1])
    if data_dir is not None:
        paths = tuple(os.path.join(cached_dir(data_dir), dataset, n) for n in names)
        if all(os.path.isfile(p) for p in paths):
            return paths
    not_shipped = f"uea: {dataset} is not shipped (only {', '.join(shipped_datasets())} are)"
    if data_dir is not None and base_url:
        try:
            return fetch_dataset(dataset, data_dir, base_url)
        except fetch.FetchError as e:
            raise ValueError(f"{not_shipped} and {e}") from None
    raise ValueError(f"{not_shipped}; pass source_dir=DIR holding "
                     f"DIR/{dataset}/{names[0]} and DIR/{dataset}/{names[1]} from the UEA archive")


# ----------------------------------------------------------------------------------------------
# loading


@dataclasses.dataclass
class Prepared:
    """Both splits after filling, normalisation and padding."""
    inputs: dict[str, np.ndarray]   # split -> float32 [N, T, C]
    mask: dict[str, np.ndarray]     # split -> bool [N, T]
    labels: dict[str, np.ndarray]   # split -> int64 [N]
    metadata: dict[str, Any]


def _file_key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns


def load(dataset: str = "JapaneseVowels", source_dir: str | None = None, max_length: Any = None,
         normalization: Any = "standardization") -> Prepared:
    """Reads, fills, normalises and pads both splits of a UEA dataset (see the module docstring)."""
    train_path, test_path = locate(dataset, source_dir)
    return _load(_file_key(train_path), _file_key(test_path), max_length, normalization)


@functools.lru_cache(maxsize=4)
def _load(train_key, test_key, max_length, normalization) -> Prepared:
    files = {"train": parse_ts(train_key[0]), "test": parse_ts(test_key[0])}
    num_channels = {f.series[0].shape[1] for f in files.values()}
    if len(num_channels) != 1:
        raise ValueError(f"{train_key[0]} and {test_key[0]} have different numbers of dimensions: "
                         f"{sorted(num_channels)}")
    (num_channels,) = num_channels
    declared = [f.class_names for f in files.values() if f.class_names is not None]
    names = sorted(set(declared[0])) if declared else sorted(set(files["train"].labels + files["test"].labels))
    for f in files.values():
        unknown = sorted(set(f.labels) - set(names))
        if unknown:
            raise ValueError(f"{f.path}: labels {unknown} are not among the classes {names} of the TRAIN file")
    class_id = {n: i for i, n in enumerate(names)}

    series = {split: [fill_missing(x, where=f"{f.path}, case {i}") for i, x in enumerate(f.series)]
              for split, f in files.items()}
    lengths = {split: np.array([len(x) for x in xs]) for split, xs in series.items()}
    train_max = int(lengths["train"].max())
    if max_length is None:
        length = max(train_max, int(lengths["test"].max()))
    elif max_length == "train":
        length = train_max
    else:
        length = int(max_length)

    stats: dict[str, list[float]] = {}
    if normalization in ("standardization", "minmax"):
        steps = np.concatenate(series["train"], axis=0)  # every TRAIN time step: [sum T_i, C]
        if normalization == "standardization":
            shift, scale = steps.mean(0), steps.std(0, ddof=1) + _EPS
            stats = {"mean": steps.mean(0).tolist(), "std": steps.std(0, ddof=1).tolist()}
        else:
            shift, scale = steps.min(0), steps.max(0) - steps.min(0) + _EPS
            stats = {"min": steps.min(0).tolist(), "max": steps.max(0).tolist()}
        series = {split: [(x - shift) / scale for x in xs] for split, xs in series.items()}

    inputs, mask, labels = {}, {}, {}
    for split, xs in series.items():
        n = len(xs)
        inputs[split] = np.zeros((n, length, num_channels), np.float32)
        mask[split] = np.zeros((n, length), bool)
        for i, x in enumerate(xs):
            t = min(len(x), length)
            inputs[split][i, :t] = x[:t]
            mask[split][i, :t] = True
        labels[split] = np.array([class_id[y] for y in files[split].labels], np.int64)

    metadata = {
        "class_names": names,
        "num_classes": len(names),
        "num_channels": int(num_channels),
        "max_length": int(length),
        "train_max_length": train_max,
        "test_max_length": int(lengths["test"].max()),
        "normalization": normalization,
        "normalization_stats": stats,
        "files": [train_key[0], test_key[0]],
    }
    return Prepared(inputs=inputs, mask=mask, labels=labels, metadata=metadata)


# ----------------------------------------------------------------------------------------------
# builder


class Uea(base.GeneratorBuilder):
    """UEA classification: 'inputs' float32 [T, C], 'mask' bool [T], 'label' int64."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [UeaConfig(name="default")]

    def _prepared_metadata(self) -> dict[str, Any] | None:
        path = os.path.join(os.fspath(self._data_dir), "metadata.json")
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        return None

    def _load(self) -> Prepared:
        c = self.builder_config
        paths = locate(c.dataset, c.source_dir, data_dir=os.fspath(self.data_dir_root))
        return _load(*map(_file_key, paths), c.max_length, c.normalization)

    def _info(self):
        # Shapes come from the data: from the prepared directory's metadata when it exists (the
        # source files are then not needed), else from the files themselves.
        metadata = self._prepared_metadata() or self._load().metadata
        length, channels = metadata["max_length"], metadata["num_channels"]
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "inputs": tfds.features.Tensor(shape=(length, channels), dtype=np.float32),
                "mask": tfds.features.Tensor(shape=(length,), dtype=np.bool_),
                "label": tfds.features.Scalar(dtype=np.int64),
            }),
            supervised_keys=("inputs", "label"),
            metadata=tfds.core.MetadataDict(metadata),
        )

    def _split_generators(self, dl_manager):
        data = self._load()
        return {split: self._generate_examples(data, split) for split in ("train", "test")}

    def _generate_examples(self, data: Prepared, split: str):
        for i in range(len(data.labels[split])):
            yield i, {"inputs": data.inputs[split][i], "mask": data.mask[split][i],
                      "label": int(data.labels[split][i])}


def class_names(builder: tfds.core.DatasetBuilder) -> list[str]:
    """The class name of every label id of a `uea` builder."""
    return list(builder.info.metadata["class_names"])


def _check(c: UeaConfig) -> None:
    if not isinstance(c.dataset, str) or not c.dataset or os.sep in c.dataset:
        raise ValueError(f"dataset must be a UEA dataset name such as 'JapaneseVowels', got {c.dataset!r}")
    if c.source_dir is not None and not isinstance(c.source_dir, str):
        raise ValueError(f"source_dir must be a directory path or None, got {c.source_dir!r}")
    if not (c.max_length is None or c.max_length == "train"
            or (isinstance(c.max_length, int) and not isinstance(c.max_length, bool) and c.max_length > 0)):
        raise ValueError(f"max_length must be None (longest series of both splits), 'train' (longest TRAIN "
                         f"series, as the AGF/mvts harness) or a positive int, got {c.max_length!r}")
    if c.normalization not in NORMALIZATIONS + (None,):
        raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {c.normalization!r}")


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Returns the (unprepared) builder of one UEA dataset.

    Options: dataset ('JapaneseVowels'), source_dir (None: the files shipped in this package, else
    the download cache, else fetched), max_length (None: longest of both splits; 'train': longest TRAIN
    series; or an int), normalization ('standardization' | 'minmax' | 'none'), base_url (`BASE_URL`;
    '' or None: never fetch). base_url does not key the prepared data (the files' contents do).

    Raises:
      ValueError: unknown or invalid option, or missing files (saying where to put them).
    """
    if options.get("normalization", "") is None:
        options = {**options, "normalization": "none"}
    options = dict(options)
    base_url = options.pop("base_url", BASE_URL)
    if base_url is not None and not (isinstance(base_url, str) and (
            base_url == "" or base_url.startswith(("http://", "https://", "file://")))):
        raise ValueError(f"uea: base_url must be an http(s):// or file:// URL, or '' (never fetch), got {base_url!r}")
    options = base.absolute_path_option(options, "source_dir")
    config = base.config_from_options(UeaConfig, options, dataset="uea")
    _check(config)
    # Keyed by the files' contents too: an edited or replaced .ts file is prepared again. Without the
    # files, data prepared from them with these options is still usable.
    sources: tuple[str, ...] = ()
    try:
        sources = locate(config.dataset, config.source_dir, data_dir=os.fspath(data_dir), base_url=base_url)
    except ValueError:
        prepared = base.find_prepared(data_dir, "uea", config)
        if prepared is None:
            raise
        config = prepared
    else:
        config = base.config_from_options(UeaConfig, options, dataset="uea", sources=sources)
    try:
        return Uea(data_dir=data_dir, config=config, file_format="array_record")   # reads the files
    except ValueError as e:
        folder = os.path.join(cached_dir(data_dir), config.dataset)
        if not any(os.path.dirname(p) == folder for p in sources):
            raise
        # Files fetched before downloads were checked (or put there by hand) stay until deleted: say which.
        raise ValueError(f"{e}; {folder} is in the download cache: delete it and {folder}.zip to fetch "
                         f"{config.dataset} again") from None
