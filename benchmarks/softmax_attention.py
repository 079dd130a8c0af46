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

from zoo_core import bench, checks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CASES = {"full": False, "causal": True}  # case name -> is_causal


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.scaling_parser(__doc__.split("\n")[0], tuple(CASES), out_dir=RESULTS, max_run_s=120.0,
                             default_cases="full")
    p.add_argument("--heads", type=checks.positive_int, default=4)
    p.add_argument("--head_dim", type=checks.positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return bench.parse_scaling_args(p, tuple(CASES), argv)


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)

    def make_fn(case: str, n: int):
        def loss(q, k, v):  # q, k, v: [B, N, H, D]
            out = jax.nn.dot_product_attention(q, k, v, is_causal=CASES[case])
            return jnp.sum(out.astype(jnp.float32))

        spec = jax.ShapeDtypeStruct((1, n, args.heads, args.head_dim), dtype)
        return jax.grad(loss, argnums=(0, 1, 2)), (spec, spec, spec)

    meta = dict(benchmark="softmax_attention", what="forward+backward, batch 1", heads=args.heads,
                head_dim=args.head_dim, dtype=args.dtype)
    title = f"softmax attention fwd+bwd, B=1, H={args.heads}, D={args.head_dim}, {args.dtype}"
    return bench.run_and_report(args, make_fn, name="softmax_attention", meta=meta, title=title)


if __name__ == "__main__":
    main()
