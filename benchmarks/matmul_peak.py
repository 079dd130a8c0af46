"""Matmul throughput of this machine (GFLOP/s) for a few sizes and dtypes.

The measured peak is what every scaling benchmark's `frac_peak` is relative to (platform.md §7:
about 200 GFLOP/s float32 on an idle 2-core CPU, half that under load).

Run from the repo root:

    python -m benchmarks.matmul_peak            # or: python benchmarks/matmul_peak.py

Writes benchmarks/results/matmul_peak.json (or --out_dir) and prints a table.
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp

from zoo_core import bench, checks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=checks.positive_ints, default=[512, 1024, 2048, 4096],
                   help="comma-separated square sizes n")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--repeats", type=checks.positive_int, default=5)
    p.add_argument("--out_dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.sizes = sorted(args.sizes)
    args.dtypes = args.dtypes.split(",")
    for name in args.dtypes:
        if name not in ("float32", "bfloat16", "float16"):
            p.error(f"unsupported --dtypes entry {name!r}")
    checks.check_output_paths(p, args, dirs=["out_dir"])
    return args


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)

    def make_fn(case: str, n: int):
        spec = jax.ShapeDtypeStruct((n, n), jnp.dtype(case.removeprefix("matmul_")))
        return jnp.matmul, (spec, spec), dict(flops=2.0 * n**3)

    cases = [f"matmul_{d}" for d in args.dtypes]
    records = bench.run_scaling(cases, args.sizes, make_fn, repeats=args.repeats, log=None)
    path = bench.write_records(pathlib.Path(args.out_dir) / "matmul_peak.json", records,
                            dict(benchmark="matmul_peak"))
    print(bench.format_table(records))
    for case in cases:
        best = max((2.0 * r.n**3 / r.min_s / 1e9, r.n) for r in records
                   if r.case == case and r.status == bench.OK)
        print(f"{case}: best {best[0]:.1f} GFLOP/s (n={best[1]}, best of {args.repeats})")
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
