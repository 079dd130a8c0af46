"""Context parallelism of the zoo's own models: their compiled training step with the sequence split over P devices.

For each model, length T (tokens of the model's sequence) and mode, the trainer's `train_step` (forward,
backward and the trainer's default AdamW update, `zoo_core.run.steps.train_step`) is compiled from shapes only for a
('data', 'sequence') mesh of [1, P] host devices, as the trainer builds it with `--config.parallel.sequence=P`
(the state replicated, the sequence features split along T), and measured as `benchmarks.context_parallel`
measures one mechanism:

* `moved`: the bytes of the results of every collective of the compiled step (`zoo_core.testing.collective_bytes`);
* `memory`: XLA's memory analysis of one device's program (`zoo_core.costs.memory_of`), against P = 1;
* `time`: the median step for T <= --time_up_to (host devices share this machine's cores).

Modes: `cp` = the model built with `sequence_axis='sequence'` (its layers' context-parallel forms, what the
trainer builds with parallel.sequence > 1); `auto` = the model without it, its step partitioned by XLA
(what the trainer did before the models had the field). P = 1 rows are the one-device step.

Models (batch 1, the sizes of their smoke and LRA presets, so that 32K tokens compile on this machine):

* `samovar`: SAMoVAR (width 32, 2 heads, 3 layers, chunks of 64), one channel, patch length 1: T/2 input steps,
  T ARX tokens through the VAR chain;
* `lintrans`: the LinTrans baseline of the same size (causal linear attention blocks);
* `agf_lra`: AGF's LRA classifier (the 'lra' preset: width 64, 2 heads x 32, 2 layers, order 3), T tokens;
* `agf_uea`: AGF's UEA classifier at the LRA preset's width (flatten head over T x 64), T steps of 3 channels;
* `htgn`: HTGN's encoder-decoder (the 'tiny' preset), T source and T target tokens.

    python -m benchmarks.context_parallel_models --lengths 8192,32768 --shards 1,4 --time_up_to 8192

Writes benchmarks/results/context_parallel_models.json (or --out) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import functools
import os
import pathlib
import time

if "jax" not in __import__("sys").modules:   # host devices must be set before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from benchmarks import context_parallel  # noqa: E402
from zoo_core import bench, checks, tasks  # noqa: E402
from zoo_core.configs import common  # noqa: E402
from zoo_core.run import optim, sharding  # noqa: E402
from zoo_core.run.steps import init_state, train_step  # noqa: E402
from zoo_core.testing import collective_bytes  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODELS = ("samovar", "lintrans", "agf_lra", "agf_uea", "htgn")
MODES = ("cp", "auto")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES} (P > 1 rows)")
    p.add_argument("--lengths", type=checks.positive_ints, default=[8192, 32768])
    p.add_argument("--shards", type=checks.positive_ints, default=[1, 4])
    p.add_argument("--time_up_to", type=int, default=8192, help="time the steps up to this length (0: none)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "context_parallel_models.json")
    args = p.parse_args(argv)
    args.models = checks.choice_list(p, "--models", args.models, MODELS)
    args.modes = checks.choice_list(p, "--modes", args.modes, MODES)
    args.error = p.error
    return args


def build(name: str, t: int, sequence_axis):
    """(model, task, batch of numpy arrays) of model `name` at T = t tokens."""
    rng = np.random.default_rng(0)
    cp = {"sequence_axis": sequence_axis}
    if name in ("samovar", "lintrans"):
        from samovar_jax import model as samovar
        m = samovar.Model(kind=name, variant="synthetic", num_channels=1, input_len=t // 2, patch_len=1,
                          dropout=0.0, chunk_size=64, **cp)
        return m, tasks.forecast(), {"inputs": rng.normal(size=(1, t // 2, 1)).astype(np.float32),
                                     "target": rng.normal(size=(1, 1, 1)).astype(np.float32)}
    if name.startswith("agf"):
        from agf_jax import model as agf
        if name == "agf_lra":
            m = agf.Model(kind="lra_classifier", variant="lra", vocab_size=256, max_len=t, num_classes=10, **cp)
            inputs = rng.integers(1, 256, (1, t)).astype(np.int32)
        else:
            m = agf.Model(kind="uea_classifier", variant="lra", feat_dim=3, max_len=t, num_classes=4, **cp)
            inputs = rng.normal(size=(1, t, 3)).astype(np.float32)
        return m, tasks.classification(), {"inputs": inputs, "label": np.zeros((1,), np.int32)}
    from htgn_jax import model as htgn
    m = htgn.Model(kind="seq2seq", variant="tiny", source_vocab_size=64, target_vocab_size=64, max_source_len=t,
                   max_target_len=t, dropout_rate=0.0, **cp)
    ids = lambda: rng.integers(3, 64, (1, t)).astype(np.int32)   # noqa: E731
    return m, tasks.seq2seq(), {"inputs": ids(), "targets": ids()}


def measure(name: str, t: int, shards: int, mode: str, args) -> dict:
    mesh = jax.make_mesh((1, shards), (sharding.DATA_AXIS, sharding.SEQUENCE_AXIS), devices=jax.devices()[:shards],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, task, host = build(name, t, sharding.SEQUENCE_AXIS if mode == "cp" and shards > 1 else None)
    tx, schedule = optim.make_optimizer(common.base_config())   # the trainer's default AdamW, as a vector
    step = jax.jit(functools.partial(train_step, model=model, tx=tx, task=task, schedule=schedule))
    shape = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    with jax.set_mesh(mesh):
        batch = {k: shape(v, sharding.feature_sharding(mesh, k, v.ndim).spec) for k, v in host.items()}
        abstract = jax.eval_shape(functools.partial(init_state, model=model, tx=tx), jax.random.PRNGKey(0), host)
        state = jax.tree_util.tree_map(lambda a: shape(a, P()), abstract)
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        row = dict(model=name, length=t, shards=shards, mode=mode if shards > 1 else "one",
                   compile_s=round(time.perf_counter() - start, 2), memory=bench.memory_of(compiled),
                   moved_bytes=collective_bytes(compiled.as_text()))
        if t <= args.time_up_to:
            live = jax.jit(functools.partial(init_state, model=model, tx=tx), out_shardings=NamedSharding(mesh, P()))(
                jax.random.PRNGKey(0), host)
            placed = sharding.global_batch(host, mesh)
            row["time"] = bench.time_jitted(step, live, placed, warmup=1, repeats=3)
    return row


def table(rows: list[dict]) -> str:
    return context_parallel.table(rows, key="model", extra=("mode",))


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if max(args.shards) > jax.device_count():
        args.error(f"--shards up to {max(args.shards)} needs that many devices; this process has {jax.device_count()}")
    rows = []
    for name in args.models:
        for t in args.lengths:
            for shards in args.shards:
                for mode in (args.modes if shards > 1 else ("one",)):
                    rows.append(measure(name, t, shards, mode, args))
                    r = rows[-1]
                    print(f"{name} T={t} P={shards} {r['mode']}: {r['memory']['total_bytes'] / 2**20:,.1f} MiB/device, "
                          f"moved {r['moved_bytes'] / 2**20:,.3f} MiB"
                          + (f", {r['time']['median_s']:.3f} s" if "time" in r else ""), flush=True)
                    bench.write_records(args.out, rows, meta=dict(benchmark="context_parallel_models",
                                                               loadavg=os.getloadavg()))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
