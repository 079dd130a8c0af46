"""Scaling of every registered attention: forward+backward time and peak memory against length.

Registry-driven: one case per mechanism of `zoo_core.attention.names('self')` (`<name>`, non-causal
self-attention) and per mechanism of `names('causal')` (`<name>_causal`), so a mechanism added to
the registry is measured without touching this script. Each case times `jax.grad` of `sum(y)` with
respect to the parameters and the input of the drop-in module (`attention.make`, projections
included) at batch 1, x `[1, N, H * D]`, and records XLA's compiled-memory estimate
(`memory_analysis`: arguments, outputs and temporaries) beside the time (`zoo_core.bench.run_scaling`,
whose guard skips lengths whose estimate does not fit and stops a case once it gets too slow).

Options: each mechanism's defaults, except its `attention.length_option` set to N in the non-causal
case (Linformer's `max_length`: its sequence projections span the input), and `--chunk_size` on
the causal cases whose layer has a `chunk_size` field (the chunked form, which trains at long N).

Run from the repo root:

    python -m benchmarks.attention_scaling --lengths 1024,4096,16384 --budget_s 600
    python -m benchmarks.attention_scaling --cases linformer,nystromformer,softmax --lengths 1024,2048

Writes benchmarks/results/attention_scaling.{json,png} (or --out_dir / --name) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import pathlib

import jax
import jax.numpy as jnp

from zoo_core import attention, bench, checks

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def cases() -> tuple[str, ...]:
    """`<name>` for every non-causal self-attention, `<name>_causal` for every causal one."""
    return tuple(attention.names("self")) + tuple(f"{n}_causal" for n in attention.names("causal"))


def parse_args(argv=None) -> argparse.Namespace:
    all_cases = cases()
    p = bench.scaling_parser(__doc__.split("\n")[0], all_cases, out_dir=RESULTS, max_run_s=30.0)
    p.add_argument("--heads", type=checks.positive_int, default=4)
    p.add_argument("--head_dim", type=checks.positive_int, default=32)
    p.add_argument("--chunk_size", type=checks.positive_int, default=64,
                   help="chunk length of the causal cases whose layer has a chunked form")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--name", default="attention_scaling", help="output file stem")
    return bench.parse_scaling_args(p, all_cases, argv)


def case_module(case: str, n: int, heads: int, head_dim: int, chunk_size: int, dtype: str):
    """(mechanism, causal, the `make` options, the drop-in module) of one case at length n."""
    causal = case.endswith("_causal")
    name = case[:-len("_causal")] if causal else case
    own = attention.options(name)
    options = {}
    if attention.length_option(name) and not causal:
        options[attention.length_option(name)] = n
    if causal and "chunk_size" in own:
        options["chunk_size"] = chunk_size
    module = attention.make(name, num_heads=heads, qkv_features=heads * head_dim, causal=causal,
                            dtype=jnp.dtype(dtype), **options)
    return name, causal, options, module


def make_case(case: str, n: int, heads: int, head_dim: int, chunk_size: int, dtype: str = "float32"):
    """(fn, args, info) of one record: the gradient of sum(y) for parameters and input."""
    name, causal, options, module = case_module(case, n, heads, head_dim, chunk_size, dtype)
    width = heads * head_dim
    # Parameters from the module's own init (on a few tokens: no shape depends on N beyond
    # max_length), so every mechanism runs on the values it trains from.
    params = jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, min(n, 8), width)))

    def loss(params, x):
        y = module.apply(params, x, mutable=["losses"])[0]
        return jnp.sum(y.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((1, n, width), jnp.dtype(dtype))
    info = dict(mechanism=name, causal=causal, heads=heads, head_dim=head_dim, options=options)
    return jax.grad(loss, argnums=(0, 1)), (params, x), info


def main(argv=None) -> list[bench.Result]:
    args = parse_args(argv)

    def make_fn(case: str, n: int):
        return make_case(case, n, args.heads, args.head_dim, args.chunk_size, args.dtype)

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average before: {load}")
    meta = dict(benchmark="attention_scaling", what="forward+backward of the drop-in attention, batch 1",
                heads=args.heads, head_dim=args.head_dim, chunk_size=args.chunk_size, dtype=args.dtype,
                load_before=load)
    title = f"every attention, fwd+bwd, B=1, H={args.heads}, D={args.head_dim}, {args.dtype}"
    records = bench.run_and_report(args, make_fn, name=args.name, meta=meta, title=title)
    print(f"load average after: {os.getloadavg() if hasattr(os, 'getloadavg') else None}")
    return records


if __name__ == "__main__":
    main()
