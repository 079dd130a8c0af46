"""Scaling of softmax attention: forward+backward time and peak memory against sequence length.

Times `jax.grad` of `sum(jax.nn.dot_product_attention(q, k, v))` with respect to q, k and v at
batch 1 for N = 1K, 2K, ..., 64K. Softmax attention materialises the [B, H, N, N] logits, so its
memory grows as N^2: lengths whose compiled-memory estimate exceeds the guard are recorded as
skipped instead of being run. This is the template for the architecture scaling scripts: they
replace `make_fn` and the flags.

Run from the repo root:

    python -m benchmarks.softmax_attention --lengths 1024,2048,4096

Writes benchmarks/results/softmax_attention.{json,png} (or --out_dir) and prints a table.
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp

from zoo_core import bench

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DEFAULT_LENGTHS = ",".join(str(1024 * 2**i) for i in range(7))  # 1024 ... 65536
CASES = {"full": False, "causal": True}  # case name -> is_causal


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated sequence lengths N")
    p.add_argument("--cases", default="full", help=f"comma-separated subset of {sorted(CASES)}")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max_gib", type=float, default=None,
                   help="memory guard in GiB (default: 80%% of available RAM / device memory)")
    p.add_argument("--max_run_s", type=float, default=120.0,
                   help="stop a case once its median time exceeds this")
    p.add_argument("--ref_n", type=int, default=2048, help="reference matmul size (GPU: 8192)")
    p.add_argument("--out_dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.cases = args.cases.split(",")
    unknown = set(args.cases) - set(CASES)
    if unknown:
        p.error(f"unknown --cases {sorted(unknown)}; choose from {sorted(CASES)}")
    return args


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)

    def make_fn(case: str, n: int):
        def loss(q, k, v):  # q, k, v: [B, N, H, D]
            out = jax.nn.dot_product_attention(q, k, v, is_causal=CASES[case])
            return jnp.sum(out.astype(jnp.float32))

        spec = jax.ShapeDtypeStruct((1, n, args.heads, args.head_dim), dtype)
        return jax.grad(loss, argnums=(0, 1, 2)), (spec, spec, spec)

    max_bytes = int(args.max_gib * 2**30) if args.max_gib else bench.default_max_bytes()
    records = bench.run_scaling(args.cases, args.lengths, make_fn, repeats=args.repeats,
                                max_bytes=max_bytes, max_run_s=args.max_run_s, ref_n=args.ref_n,
                                log=print)
    meta = dict(benchmark="softmax_attention", what="forward+backward, batch 1", heads=args.heads,
                head_dim=args.head_dim, dtype=args.dtype, max_bytes=max_bytes)
    out = pathlib.Path(args.out_dir)
    bench.write_json(out / "softmax_attention.json", records, meta)
    title = f"softmax attention fwd+bwd, B=1, H={args.heads}, D={args.head_dim}, {args.dtype}"
    bench.plot(records, out / "softmax_attention.png", max_bytes=max_bytes, title=title)
    print(bench.format_table(records))
    print(f"wrote {out}/softmax_attention.{{json,png}}")
    return records


if __name__ == "__main__":
    main()
