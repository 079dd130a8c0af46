"""Context parallelism: per-device memory, bytes between devices and time against shards P and length.

For each mechanism, length T and shard count P, the forward + backward (`jax.grad` of a sum) of the
sequence split over a `sequence` mesh axis of P host devices, compiled from shapes only
(`jax.ShapeDtypeStruct`, nothing allocated), so lengths up to 1M tokens fit this machine:

* `memory`: XLA's memory analysis of the compiled SPMD program (`zoo_core.costs.memory_of`): the bytes
  of one device's arguments, outputs and temporaries, what one device of a pod would hold;
* `moved`: the bytes of the results of every collective in the compiled program
  (`zoo_core.testing.collective_bytes`), what one call sends between devices;
* `time`: measured only for T <= --time_up_to (host devices share this machine's cores, so the time
  shows the overhead of the collectives, not a pod's speed-up).

Mechanisms (docs/specs/context_parallel.md):

* `linear`: causal linear attention (`zoo_core.ops.context_parallel.causal`, LASP-2's all-gather of the
  shards' states and a local fold), with elu+1 features on raw inputs;
* `linear_global`: the non-causal global form (a psum of the states);
* `linear_packed`: `linear` over packed documents of 1,000 tokens (`segment_ids`);
* `favor`, `favor_global`: HTGN's FAVOR+ (softmax features, M = D random features), causal (the same
  fold on the features) and global (a psum, and one pmax for the key stabiliser);
  `htgn_jax.context_parallel.favor`;
* `var_chain`: SAMoVAR's VAR chain of 3 layers (one all-gather of `[B, H, D, D]` states per layer);
  `samovar_jax.context_parallel.var_chain`;
* `agf`, `agf_global`: AGF (order 4, Jacobi), causal (one all-gather of the shards' max-aware (m, z, N)
  summaries) and global with its orthogonality regulariser (pmax and psums); `agf_jax.context_parallel`;
* `window_graph`: HTGN's window graph (radius 8, 4 global nodes) by a halo exchange (`ppermute`) of the
  boundary nodes; `htgn_jax.graph_context_parallel.window_graph_attention`;
* `softmax`: causal softmax attention by an all-gather of K and V, the baseline (its memory and bytes
  grow with T: run it at short lengths); `agf_jax.softmax.softmax_context_parallel`;
* `auto`: the single-device `linear_attention.causal_chunked` with its inputs sharded along T and
  jit's automatic partitioning deciding the collectives, the baseline.

Run from the repo root (the script gives itself 8 host devices):

    python -m benchmarks.context_parallel
    python -m benchmarks.context_parallel --lengths 8192,32768 --shards 1,4 --cases linear,auto

Writes benchmarks/results/context_parallel.json (or --out) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

if "jax" not in __import__("sys").modules:   # host devices must be set before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from agf_jax import context_parallel as agf_cp  # noqa: E402
from agf_jax import softmax
from htgn_jax import context_parallel as favor_cp  # noqa: E402
from htgn_jax import graph_context_parallel as graph_cp
from htgn_jax import ops as favor_ops
from samovar_jax import context_parallel as var_cp  # noqa: E402
from zoo_core import bench, checks  # noqa: E402
from zoo_core.ops import context_parallel, linear_attention  # noqa: E402
from zoo_core.testing import collective_bytes  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CASES = ("linear", "linear_global", "linear_packed", "agf", "agf_global", "favor", "favor_global", "var_chain",
         "window_graph", "softmax", "auto")
VAR_LAYERS = 3
DOCUMENT = 1000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--lengths", type=checks.positive_ints, default=[8192, 32768, 131072, 1048576])
    p.add_argument("--shards", type=checks.positive_ints, default=[1, 2, 4, 8])
    p.add_argument("--heads", type=checks.positive_int, default=8)
    p.add_argument("--head_dim", type=checks.positive_int, default=64)
    p.add_argument("--chunk", type=checks.positive_int, default=64)
    p.add_argument("--time_up_to", type=int, default=32768, help="time the calls up to this length (0: none)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "context_parallel.json")
    args = p.parse_args(argv)
    args.cases = checks.choice_list(p, "--cases", args.cases, CASES)
    args.error = p.error
    return args


def loss_fn(case: str, mesh, chunk: int):
    """(q, k, v, segment_ids) -> scalar for `case`; q, k, v `[1, T, H, D]` (features: elu + 1),
    segment_ids `[1, T]` (read by `linear_packed` only)."""
    feature = lambda x: jax.nn.elu(x) + 1

    def loss(q, k, v, ids):
        if case.startswith("favor"):
            omega = favor_ops.gaussian_orthogonal_random_matrix(jax.random.PRNGKey(0), q.shape[-1], q.shape[-1])
            out = favor_cp.favor(q, k, v, omega, axis_name="sequence", feature_map="softmax",
                                 causal=case == "favor", chunk_size=chunk, eps=1e-4, mesh=mesh)
            return jnp.sum(out)
        if case.startswith("agf"):
            coeffs = jnp.asarray([1.0, 0.5, 0.25, 0.125, 0.0625])
            if case == "agf":
                return jnp.sum(agf_cp.causal(q, k, v, v, coeffs, chunk_size=chunk, mesh=mesh))
            out, reg = agf_cp.noncausal(q, k, v, v, coeffs, mesh=mesh)
            return jnp.sum(out) + jnp.sum(reg)
        if case == "window_graph":
            out, _ = graph_cp.window_graph_attention(q, k, v, None, axis_name="sequence", window=8, num_global=4,
                                                     mesh=mesh)
            return jnp.sum(out)
        if case == "softmax":
            return jnp.sum(softmax.softmax_context_parallel(q, k, v, causal=True, mesh=mesh))
        if case == "var_chain":
            # x0 and the layers' queries from the three inputs; values: the chain's own (v = x0 per layer)
            x0 = jax.nn.tanh(v)
            qs = jnp.stack([feature(q) * (i + 1) / VAR_LAYERS for i in range(VAR_LAYERS)])
            vs = jnp.stack([feature(k)] * VAR_LAYERS)
            return jnp.sum(var_cp.var_chain(x0, qs, vs, chunk_size=chunk, mesh=mesh)[-1])
        q, k = feature(q), feature(k)
        if case == "auto":
            out = linear_attention.causal_chunked(q, k, v, chunk_size=chunk)[0]
        elif case == "linear_global":
            out = context_parallel.noncausal(q, k, v, mesh=mesh)[0]
        else:
            out = context_parallel.causal(q, k, v, chunk_size=chunk, mesh=mesh,
                                          segment_ids=ids if case == "linear_packed" else None)[0]
        return jnp.sum(out)

    return loss


def measure(case: str, t: int, shards: int, args) -> dict:
    mesh = jax.make_mesh((shards,), ("sequence",), devices=jax.devices()[:shards],
                         axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P(None, "sequence"))
    shape = jax.ShapeDtypeStruct((1, t, args.heads, args.head_dim), jnp.float32, sharding=sharding)
    ids_shape = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sharding)
    fn = jax.jit(jax.grad(loss_fn(case, mesh, args.chunk), argnums=(0, 1, 2)))
    start = time.perf_counter()
    compiled = fn.lower(shape, shape, shape, ids_shape).compile()
    row = dict(case=case, length=t, shards=shards, compile_s=round(time.perf_counter() - start, 2),
               memory=bench.memory_of(compiled), moved_bytes=collective_bytes(compiled.as_text()))
    if t <= args.time_up_to:
        xs = [jax.device_put(jax.random.normal(jax.random.PRNGKey(i), shape.shape), sharding) for i in range(3)]
        ids = jax.device_put(jnp.asarray(np.arange(t)[None] // DOCUMENT + 1, jnp.int32), sharding)
        row["time"] = bench.time_jitted(fn, *xs, ids, warmup=1, repeats=3)
    return row


def table(rows: list[dict], key: str = "case", extra: tuple[str, ...] = ()) -> str:
    """The markdown table of `rows` (this benchmark's and `context_parallel_models`'): one line per row,
    named by its `key` field, T, P and its `extra` fields; memory against the P = 1 row of the same key
    and length."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"
    names = [key, "T", "P", *extra, "memory / device (MiB)", "vs P=1", "moved (MiB)", "median s"]
    out = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    base = {(r[key], r["length"]): r["memory"]["total_bytes"] for r in rows if r["shards"] == 1}
    for r in rows:
        total = r["memory"]["total_bytes"]
        ratio = base.get((r[key], r["length"]))
        ratio = f"{total / ratio:.3f}" if ratio else "-"
        timed = f"{r['time']['median_s']:.3f}" if "time" in r else "-"
        cells = [r[key], f"{r['length']:,}", r["shards"], *(r[f] for f in extra), mib(total), ratio,
                 f"{r['moved_bytes'] / 2**20:,.3f}", timed]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if max(args.shards) > jax.device_count():   # here, not in parse_args: a caller that imported jax has its own count
        args.error(f"--shards up to {max(args.shards)} needs that many devices; this process has {jax.device_count()}")
    rows = []
    for case in args.cases:
        for t in args.lengths:
            for shards in args.shards:
                if t % shards:
                    continue
                rows.append(measure(case, t, shards, args))
                print(f"{case} T={t} P={shards}: {rows[-1]['memory']['total_bytes'] / 2**20:,.1f} MiB/device, "
                      f"moved {rows[-1]['moved_bytes'] / 2**20:,.2f} MiB", flush=True)
                bench.write_records(args.out, rows, meta=dict(benchmark="context_parallel", heads=args.heads,
                                                           head_dim=args.head_dim, chunk=args.chunk,
                                                           loadavg=os.getloadavg()))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
