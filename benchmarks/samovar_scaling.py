"""Scaling of SAMoVAR's VAR attention chain against softmax attention: fwd+bwd time and memory vs length.

Times `jax.grad` of `sum(o)` with respect to (x0, q, v) at batch 1 for N = 1K, 2K, ..., 64K tokens, where
`o` [L, B, N, H, D] are the outputs of an L-layer chain whose layer m attends with query q^(m), value
v^(m) and key = the previous layer's output (x0 for m = 1), samovar.md §2.6 / §4:

* `var_masked`: `samovar_jax.ops.var_chain_parallel` (quadratic, materialises [B, H, N, N] per layer);
  all three VAR cases run on the shared kernels of `zoo_core.ops.linear_attention`;
* `var_chunked`: `ops.var_chain_chunked` (intra-chunk masked + inter-chunk state, `--chunk` tokens);
* `var_scan`: `ops.var_chain_scan` (a token `lax.scan` per layer carrying a D x D state per head);
* `softmax`: the same chain with causal softmax attention, `jax.nn.dot_product_attention`
  (`is_causal=True`, XLA implementation), i.e. what a softmax transformer of the same shape pays.

Defaults are the paper's benchmark head sizes on ETT (samovar.sh: d = 32 floor(sqrt(7)) = 64, 8 heads,
so D = 8; 3 layers). The memory guard of `zoo_core.bench.run_scaling` skips lengths whose compiled
estimate does not fit (softmax and the masked chain stop growing there); `--max_run_s` stops a case
once it gets too slow.

Run from the repo root:

    python -m benchmarks.samovar_scaling
    python -m benchmarks.samovar_scaling --lengths 1024,2048 --cases var_chunked,softmax --repeats 1

Writes benchmarks/results/samovar_scaling.{json,png} (or --out_dir, --name) and prints a table.
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp

from samovar_jax import ops
from zoo_core import bench, checks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CASES = ("var_masked", "var_chunked", "var_scan", "softmax")


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.scaling_parser(__doc__.split("\n")[0], CASES, out_dir=RESULTS)
    p.add_argument("--layers", type=checks.positive_int, default=3, help="L, attention layers in the chain")
    p.add_argument("--heads", type=checks.positive_int, default=8)
    p.add_argument("--head_dim", type=checks.positive_int, default=8)
    p.add_argument("--chunk", type=checks.positive_int, default=64, help="chunk length of var_chunked")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--name", default="samovar_scaling", help="output file stem")
    return bench.parse_scaling_args(p, CASES, argv)


def softmax_chain(x0, q, v):
    """The VAR chain's wiring with causal softmax attention: x0 [B, N, H, D], q, v [L, B, N, H, D]."""
    k, outs = x0, []
    for m in range(q.shape[0]):
        o = jax.nn.dot_product_attention(q[m], k, v[m], is_causal=True)
        outs.append(o)
        k = o
    return jnp.stack(outs)


def chain_fn(case: str, chunk: int):
    """(x0, q, v) -> o [L, B, N, H, D] for `case`."""
    if case == "var_masked":
        return ops.var_chain_parallel
    if case == "var_chunked":
        return lambda x0, q, v: ops.var_chain_chunked(x0, q, v, chunk)[0]
    if case == "var_scan":
        return lambda x0, q, v: ops.var_chain_scan(x0, q, v)[0]
    if case == "softmax":
        return softmax_chain
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)

    def make_fn(case: str, n: int):
        chain = chain_fn(case, args.chunk)

        def loss(x0, q, v):
            return jnp.sum(chain(x0, q, v).astype(jnp.float32))

        x0 = jax.ShapeDtypeStruct((1, n, args.heads, args.head_dim), dtype)
        qv = jax.ShapeDtypeStruct((args.layers, 1, n, args.heads, args.head_dim), dtype)
        info = dict(layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                    chunk=args.chunk if case == "var_chunked" else None)
        return jax.grad(loss, argnums=(0, 1, 2)), (x0, qv, qv), info

    meta = dict(benchmark="samovar_scaling", what="forward+backward of an L-layer attention chain, batch 1",
                layers=args.layers, heads=args.heads, head_dim=args.head_dim, chunk=args.chunk,
                dtype=args.dtype)
    title = (f"VAR chain vs softmax, fwd+bwd, B=1, L={args.layers}, H={args.heads}, D={args.head_dim}, "
             f"{args.dtype}")
    return bench.run_and_report(args, make_fn, name=args.name, meta=meta, title=title)


if __name__ == "__main__":
    main()
