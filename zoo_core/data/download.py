"""Fetches data sets ahead of the runs that use them (e.g. on a machine with network, for nodes without).

    python -m zoo_core.data.download uea                       # the ten UEA data sets of AGF Table 1
    python -m zoo_core.data.download uea Heartbeat PEMS-SF     # some of them (any archive name works)
    python -m zoo_core.data.download ett                       # ETTh1, ETTh2, ETTm1, ETTm2

The training commands fetch the same files on first use, into the same places, so this is never
required: UEA into `<data dir>/downloads/uea/<Name>/` (`uea.fetch_dataset`), ETT into `--csv_dir`
(default `<data dir>/ETT-small`, where configs/samovar/ett.py looks). The data dir is `--data_dir`,
else $ZOO_DATA_DIR, else ~/.cache/linear_attention_zoo. Files already there are not fetched again.
Every data set is tried; each failure is one `error:` line, and the exit status is 2 if any failed.
LRA's archives are prepared by `python -m zoo_core.data.lra_prepare` (docs/data.md).
"""
from __future__ import annotations

import argparse
import os
import sys

from zoo_core import checks
from zoo_core.data import fetch, forecasting, pipeline, uea


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (argv without the program name; None = sys.argv); a mistake is one `error:` line
    and exit status 2."""
    parser = checks.ArgumentParser(prog="python -m zoo_core.data.download",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("source", choices=("uea", "ett"))
    # default=[]: without one, argparse counts a '*' positional as required in its missing-arguments message.
    parser.add_argument("names", nargs="*", default=[],
                        help="data sets (default: UEA's AGF Table 1, or the four ETT files)")
    parser.add_argument("--data_dir", default=None,
                        help="default: $ZOO_DATA_DIR, else ~/.cache/linear_attention_zoo")
    parser.add_argument("--base_url", default="", help=f"default: {uea.BASE_URL} (uea), "
                                                       f"{forecasting.ETT_BASE_URL} (ett)")
    parser.add_argument("--csv_dir", default=None, help="ett: where the CSVs go (default: <data dir>/ETT-small)")
    args = parser.parse_args(argv)
    # A file given as a folder: one line now, not a fetch error per data set advising a folder under it.
    checks.check_output_paths(parser, args, dirs=["data_dir", "csv_dir"])
    if args.data_dir is None and os.environ.get("ZOO_DATA_DIR"):
        problem = checks.output_path_problem(pipeline.resolve_data_dir(None), directory=True)
        if problem:
            parser.error(f"$ZOO_DATA_DIR {os.environ['ZOO_DATA_DIR']!r} {problem}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    data_dir = pipeline.resolve_data_dir(args.data_dir or None)
    failed = 0
    if args.source == "uea":
        for name in args.names or uea.TABLE1:
            if name in uea.shipped_datasets():
                print(f"{name}: shipped in the package, nothing to fetch")
                continue
            try:
                train, _ = uea.fetch_dataset(name, data_dir, args.base_url or uea.BASE_URL)
            except ValueError as e:
                print(f"error: {name}: {fetch.one_line(e, 400)}", file=sys.stderr, flush=True)
                failed += 1
            else:
                print(f"{name}: {os.path.dirname(train)}")
    else:
        csv_dir = os.path.expanduser(args.csv_dir) if args.csv_dir else os.path.join(data_dir, "ETT-small")
        for name in args.names or [f[:-len(".csv")] for f in forecasting.ETT_FILES]:
            if f"{name}.csv" not in forecasting.ETT_FILES:
                print(f"error: {name}: not an ETT file; choose from "
                      f"{', '.join(f[:-4] for f in forecasting.ETT_FILES)}", file=sys.stderr, flush=True)
                failed += 1
                continue
            path = os.path.join(csv_dir, f"{name}.csv")
            try:
                forecasting.fetch_missing(data_dir, {"source": path,
                                                     "base_url": args.base_url or forecasting.ETT_BASE_URL})
            except ValueError as e:
                print(f"error: {name}: {fetch.one_line(e, 400)}", file=sys.stderr, flush=True)
                failed += 1
            else:
                print(f"{name}: {path}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
