"""Scaling of HTGN's attention kernels against softmax attention: fwd+bwd time and memory vs length.

Times `jax.grad` of `sum(out)` with respect to every input at batch 1 for N = 1K, 2K, ..., 64K
tokens (htgn.md §5.11, "no N^2 term anywhere"):

* `favor`: non-causal FAVOR+ (`htgn_jax.ops.favor_attention`, positive orthogonal random features,
  m features, key stabiliser 'max'), the encoder self-attention and the cross-attention form;
* `favor_causal`: causal FAVOR+ in the chunked form (`lax.scan` over chunks of C tokens, constant
  key stabiliser), the decoder self-attention;
* `gat`: windowed GATv2 with g global nodes (`htgn_jax.graph_ops.window_graph_attention`: window +-w,
  learned relative bias, globals attending to all nodes; N tokens + g globals), the encoder graph
  convolution, O(N (2w+1+g) H D);
* `gat_causal`: the decoder's causal window GAT (offsets -w..0, no globals);
* `softmax`, `softmax_causal`: `jax.nn.dot_product_attention` (XLA implementation), the vanilla
  Transformer's attention, O(N^2) memory.

Defaults are the spec's base-mt sizes (§5.12): d = 512, H = 8 heads of D = 64, m = 256 features,
w = 8, g = 4, chunk C = 64. The memory guard of `zoo_core.bench.run_scaling` records lengths whose
compiled estimate does not fit as skipped (softmax stops there); `--max_run_s` stops a case once
it gets too slow.

Run from the repo root:

    python -m benchmarks.htgn_scaling
    python -m benchmarks.htgn_scaling --lengths 1024,2048 --cases favor,gat,softmax --repeats 1

Writes benchmarks/results/htgn_scaling.{json,png} (or --out_dir, --name) and prints a table.
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp

from htgn_jax import graph_ops, ops
from zoo_core import bench, checks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CASES = ("favor", "favor_causal", "gat", "gat_causal", "softmax", "softmax_causal")


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.scaling_parser(__doc__.split("\n")[0], CASES, out_dir=RESULTS)
    p.add_argument("--heads", type=checks.positive_int, default=8, help="H (base-mt: 8)")
    p.add_argument("--head_dim", type=checks.positive_int, default=64, help="D per head (base-mt: 512 / 8)")
    p.add_argument("--features", type=checks.positive_int, default=256, help="m random features (base-mt: 256)")
    p.add_argument("--window", type=checks.nonnegative_int, default=8, help="GAT window radius w (base-mt: 8)")
    p.add_argument("--globals", type=checks.nonnegative_int, default=4, help="g global nodes of `gat` (base-mt: 4)")
    p.add_argument("--chunk", type=checks.positive_int, default=64, help="C of the chunked causal FAVOR+")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--name", default="htgn_scaling", help="output file stem")
    return bench.parse_scaling_args(p, CASES, argv)


def make_case(case: str, n: int, args, projection):
    """(fn, arg specs, info) of one record: fn = grad of sum(attention output) w.r.t. all inputs."""
    dtype = jnp.dtype(args.dtype)
    h, d = args.heads, args.head_dim
    seq = jax.ShapeDtypeStruct((1, n, h, d), dtype)
    info = dict(heads=h, head_dim=d)
    if case in ("favor", "favor_causal"):
        causal = case == "favor_causal"

        def loss(q, k, v):
            out = ops.favor_attention(q, k, v, feature_map="softmax", projection=projection,
                                      causal=causal, chunk_size=min(args.chunk, n))
            return jnp.sum(out.astype(jnp.float32))
        info.update(features=args.features, chunk=args.chunk if causal else None)
        return jax.grad(loss, argnums=(0, 1, 2)), (seq, seq, seq), info
    if case in ("gat", "gat_causal"):
        causal = case == "gat_causal"
        g = 0 if causal else args.globals
        nodes = jax.ShapeDtypeStruct((1, g + n, h, d), dtype)
        attn = jax.ShapeDtypeStruct((h, d), dtype)
        k_offsets = len(graph_ops.window_offsets(args.window, causal))
        bias = jax.ShapeDtypeStruct((h, k_offsets), dtype)

        def loss(target, source, attn, rel_bias):
            # GATv2: the source projection is both the score key and the message (htgn.md §3.4).
            out, _ = graph_ops.window_graph_attention(
                target, source, source, attn, window=args.window, num_global=g, causal=causal,
                rel_bias=rel_bias, global_bias=jnp.zeros((h,), dtype) if g else None)
            return jnp.sum(out.astype(jnp.float32))
        info.update(window=args.window, num_global=g)
        return jax.grad(loss, argnums=(0, 1, 2, 3)), (nodes, nodes, attn, bias), info
    if case in ("softmax", "softmax_causal"):
        causal = case == "softmax_causal"

        def loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2)), (seq, seq, seq), info
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)
    projection = ops.draw_projection(jax.random.PRNGKey(0), None, num_features=args.features,
                                     dim=args.head_dim).astype(args.dtype)

    def make_fn(case: str, n: int):
        return make_case(case, n, args, projection)

    meta = dict(benchmark="htgn_scaling", what="forward+backward of one attention layer, batch 1",
                heads=args.heads, head_dim=args.head_dim, features=args.features,
                window=args.window, num_global=args.globals, chunk=args.chunk, dtype=args.dtype)
    title = (f"HTGN kernels vs softmax, fwd+bwd, B=1, H={args.heads}, D={args.head_dim}, "
             f"m={args.features}, w={args.window}, g={args.globals}, {args.dtype}")
    return bench.run_and_report(args, make_fn, name=args.name, meta=meta, title=title)


if __name__ == "__main__":
    main()
