"""Scaling of AGF attention against softmax attention: forward+backward time and peak memory vs N.

AGF (Wi, Choi, Park, IJCAI 2025; spec agf.md §2.6) computes O = (U * g) (V^T Val) per head in
O(N d^2) time and O(N d + d^2) memory; softmax attention materialises the [B, H, N, N] logits. This
script times `jax.grad` of a scalar loss with respect to every input of the attention core (the
projections are identical in both and left out) at batch 1 for N = 1K, 2K, ..., 64K:

  agf             non-causal AGF with its orthogonality regulariser in one pass, as the layer trains
                  (`agf_jax.ops.agf_with_orthogonality`); Jacobi filter K=5, alpha=2, beta=-1
                  (the reference's ListOps setting); inputs Z_U, Z_V, Z_S, Val [1, N, H, d] and theta [K]
  agf_causal      the causal extension, chunked form (`ops.agf_chunked`, --chunk_size, default 16: the
                  intra-chunk work is C * D exponentials per token and head, and at 8 x 64 heads and
                  N = 4K on the 2-core CPU C = 8 / 16 / 32 / 64 took 0.73 / 0.58 / 0.61 / 1.91 s)
  agf_causal_scan the causal extension, associative-scan form (`ops.agf_parallel(causal=True)`),
                  O(N d^2) memory per head
  softmax         `jax.nn.dot_product_attention(q, k, v)`, q, k, v [1, N, H, d]
  softmax_causal  the same with is_causal=True

Head sizes (agf.md §3): --setting lra (default) is the AGF_LRA model, 2 heads x 32; --setting uea is
AGF_UEA's 8 heads x 64. Lengths whose compiled-memory estimate exceeds the guard are recorded as
skipped (zoo_core.bench.run_scaling), so softmax stops where it no longer fits.

Run from the repo root:

    python -m benchmarks.agf_scaling                       # both families, N = 1K ... 64K, LRA heads
    python -m benchmarks.agf_scaling --setting uea --lengths 1024,4096,16384

Writes benchmarks/results/agf_scaling[_uea].{json,png} (or --out_dir / --name) and prints a table.
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from agf_jax import ops
from zoo_core import bench, checks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CASES = ("agf", "agf_causal", "agf_causal_scan", "softmax", "softmax_causal")
SETTINGS = {"lra": (2, 32), "uea": (8, 64)}   # heads, head width (agf.md §3.1, §3.2)
ORDER, ALPHA, BETA = 5, 2.0, -1.0             # the reference's best ListOps filter


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.scaling_parser(__doc__.split("\n")[0], CASES, out_dir=RESULTS, max_run_s=120.0)
    p.add_argument("--setting", default="lra", choices=sorted(SETTINGS),
                   help="head count and width of the AGF_LRA (2 x 32) or AGF_UEA (8 x 64) models")
    p.add_argument("--chunk_size", type=checks.positive_int, default=16, help="chunk length of agf_causal")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the inputs (the filter coefficients stay float32)")
    p.add_argument("--name", default=None, help="output file stem (default agf_scaling[_<setting>])")
    args = bench.parse_scaling_args(p, CASES, argv)
    if args.name is None:
        args.name = "agf_scaling" if args.setting == "lra" else f"agf_scaling_{args.setting}"
    return args


def make_case(case: str, n: int, heads: int, head_dim: int, chunk_size: int, dtype: str = "float32"):
    """(fn, args, info) of one record: the gradient of a scalar loss of the attention core."""
    spec = jax.ShapeDtypeStruct((1, n, heads, head_dim), jnp.dtype(dtype))
    info = dict(heads=heads, head_dim=head_dim)
    if case.startswith("softmax"):
        causal = case == "softmax_causal"

        def softmax_loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(softmax_loss, argnums=(0, 1, 2)), (spec, spec, spec), info

    def agf_loss(zu, zv, zs, val, theta):
        c = ops.filter_coefficients(theta)
        kw = dict(basis="jacobi", alpha=ALPHA, beta=BETA)
        if case == "agf":
            # What the non-causal layer trains with: output and regulariser in one pass.
            out, ortho = ops.agf_with_orthogonality(zu, zv, zs, val, c, **kw)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(ortho.astype(jnp.float32))
        if case == "agf_causal":
            out, _ = ops.agf_chunked(zu, zv, zs, val, c, chunk_size=chunk_size, **kw)
        else:
            out = ops.agf_parallel(zu, zv, zs, val, c, causal=True, **kw)
        # Training adds the orthogonality regulariser (two more O(N d^2) Gram matrices).
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(ops.orthogonality_loss(zu, zv).astype(jnp.float32))

    # A fixed, non-trivial filter (theta is concrete: materialize() passes it through).
    theta = jnp.asarray(np.linspace(-0.8, 0.8, ORDER), jnp.float32)
    info.update(order=ORDER, alpha=ALPHA, beta=BETA)
    if case == "agf_causal":
        info["chunk_size"] = chunk_size
    return jax.grad(agf_loss, argnums=(0, 1, 2, 3, 4)), (spec, spec, spec, spec, theta), info


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)
    heads, head_dim = SETTINGS[args.setting]

    def make_fn(case: str, n: int):
        return make_case(case, n, heads, head_dim, args.chunk_size, args.dtype)

    meta = dict(benchmark="agf_scaling", what="forward+backward of the attention core, batch 1",
                setting=args.setting, heads=heads, head_dim=head_dim, dtype=args.dtype,
                filter=dict(basis="jacobi", order=ORDER, alpha=ALPHA, beta=BETA),
                chunk_size=args.chunk_size)
    title = f"AGF vs softmax attention, fwd+bwd, B=1, H={heads}, d={head_dim}, {args.dtype}"
    return bench.run_and_report(args, make_fn, name=args.name, meta=meta, title=title)


if __name__ == "__main__":
    main()
