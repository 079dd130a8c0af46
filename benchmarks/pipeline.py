"""The input pipeline alone: training batches per second of `pipeline.train_batches` over a config's data.

    python -m benchmarks.pipeline --data_dir /tmp/zoo_data          # the three main configs
    python -m benchmarks.pipeline --data_dir /tmp/zoo_data --config configs/agf/lra_listops.py \
        --config configs/samovar/synthetic_var.py:kind=lintrans --seconds 10 --paths memory,stream
    python -m benchmarks.pipeline --tiny                               # smoke configs, a temp data dir
    python -m benchmarks.pipeline --synthetic 270,4096,20000 --batch_size 16 --seconds 5   # the order alone

Each `--config` (a config file with its optional ':args', as the training commands take it) has its
data prepared into `--data_dir` by the trainer's `prepare_data` (a first run generates it), then the
training split is read as training reads it, from the batch size and seed of the config. For each
path (`memory`: decoded once into arrays and batched by index; `stream`: read record by record through
grain, the path for splits over the in-memory bound and for the first batches while a split decodes)
the decode time (memory) and the time to the first batch are recorded, then `--warmup` batches are
taken and the batches of `--seconds` are counted, the paths interleaved in `--rounds` rounds. The load
average is printed and recorded before and after each config: the rates fall with the load, so compare
rows measured under the same load.

`--synthetic SIZES` times the memory path alone over synthetic in-memory splits of those sizes (float32
inputs [n, 64], int32 targets [n]; no data is prepared): the cost of the training order itself
(`shuffle.epoch_permutation`, one per epoch) against the batch gather, as batches/s and as batches per
CPU-second of this process (what an idle core would give), written to
benchmarks/results/pipeline_synthetic.json unless --out names another file.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from zoo_core import checks, configs  # noqa: E402  (after the path above)

MAIN_CONFIGS = ("configs/agf/lra_listops.py", "configs/samovar/synthetic_var.py", "configs/htgn/number_words.py")
PATHS = ("memory", "stream")


def load_config(spec: str, *, tiny: bool):
    """The config of 'configs/x/y.py[:args]' (the smoke variant with `tiny`), the file found as the
    training command finds it (`zoo_core.configs.resolve`)."""
    path, _, arg = configs.resolve(spec).partition(":")
    if not os.path.isfile(path):
        raise ValueError(f"--config {spec!r}: no such config file")
    if tiny:
        arg = ",".join(filter(None, [arg, "smoke"]))
    loader = importlib.util.spec_from_file_location(f"_bench_config_{len(arg)}", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.get_config(arg or None)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def time_path(source, config, path: str, *, warmup: int, seconds: float) -> dict[str, Any]:
    """Batches/s of one path: the decode (memory), the time to the first batch, then `warmup` batches,
    then `seconds` of batches. The memory path is timed on the decoded split (training streams the
    batches of the first seconds while it decodes)."""
    from zoo_core.data import arrays, pipeline

    t0 = time.perf_counter()
    if path == "memory":
        source = arrays.load(source)
        if source is None:
            raise ValueError(f"{config.data.name}'s split is over the in-memory bound ({arrays.memory_limit()} "
                             f"bytes, ${arrays.ENV_LIMIT})")
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    it = pipeline.train_batches(source, global_batch_size=config.batch_size, seed=config.seed,
                                in_memory=path == "memory")
    next(it)
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        next(it)
    count, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - t0) < seconds:
        next(it)
        count += 1
    cpu_s = time.process_time() - cpu0   # this process's CPU time, its read-ahead threads included
    if hasattr(it, "close"):
        it.close()
    return dict(decode_s=round(decode_s, 4), first_batch_s=round(first_s, 4), batches=count, seconds=round(elapsed, 4),
                batches_per_s=round(count / elapsed, 2), cpu_s=round(cpu_s, 4))


def synthetic_source(n: int):
    """An in-memory split of n examples: float32 'inputs' [n, 64] and int32 'targets' [n]."""
    import numpy as np

    from zoo_core.data import arrays

    rng = np.random.default_rng(n)
    return arrays.ArraySource({"inputs": rng.standard_normal((n, 64), np.float32),
                               "targets": np.arange(n, dtype=np.int32)}, widths={})


def measure_synthetic(n: int, *, batch_size: int, warmup: int, seconds: float, rounds: int) -> dict:
    """One synthetic split's record: the memory path's rate over `rounds` runs of `seconds / rounds`."""
    from types import SimpleNamespace

    record = dict(config=f"synthetic:{n}", dataset="synthetic", examples=n, batch_size=batch_size,
                  batches_per_epoch=round(n / batch_size, 2), cpu_count=os.cpu_count(), load_before=_load())
    config = SimpleNamespace(batch_size=batch_size, seed=0)
    runs = [time_path(synthetic_source(n), config, "memory", warmup=warmup, seconds=seconds / rounds)
            for _ in range(rounds)]
    batches, secs = sum(r["batches"] for r in runs), sum(r["seconds"] for r in runs)
    cpu = sum(r["cpu_s"] for r in runs)
    # Batches per CPU-second: what one idle core would give; on a shared machine batches/s falls with the load.
    record["paths"] = dict(memory=dict(batches_per_s=round(batches / secs, 2), batches=batches, seconds=round(secs, 3),
                                       batches_per_cpu_s=round(batches / max(cpu, 1e-9), 2), cpu_s=round(cpu, 3),
                                       round_batches_per_s=[r["batches_per_s"] for r in runs]))
    record["load_after"] = _load()
    return record


def measure(spec: str, *, data_dir: str, paths, warmup: int, seconds: float, rounds: int, tiny: bool) -> dict:
    """One config's record: its batch, split size, and each path's rates (interleaved over rounds)."""
    from zoo_core import trainer

    config = load_config(spec, tiny=tiny)
    with config.unlocked():
        config.data.data_dir = data_dir
    t0 = time.perf_counter()
    train_source, _ = trainer.prepare_data(config)
    prepare_s = time.perf_counter() - t0
    record = dict(config=spec, tiny=tiny, dataset=config.data.name, split=config.data.train_split,
                  examples=len(train_source), batch_size=config.batch_size, prepare_s=round(prepare_s, 2),
                  cpu_count=os.cpu_count(), load_before=_load(), paths={})
    runs: dict[str, list] = {p: [] for p in paths}
    for _ in range(rounds):
        for path in paths:
            runs[path].append(time_path(train_source, config, path, warmup=warmup, seconds=seconds / rounds))
    for path, rs in runs.items():
        batches, secs = sum(r["batches"] for r in rs), sum(r["seconds"] for r in rs)
        record["paths"][path] = dict(batches_per_s=round(batches / secs, 2), batches=batches, seconds=round(secs, 3),
                                     decode_s=[r["decode_s"] for r in rs],
                                     first_batch_s=[r["first_batch_s"] for r in rs],
                                     round_batches_per_s=[r["batches_per_s"] for r in rs])
    record["load_after"] = _load()
    return record


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", default=None,
                   help="config file with optional ':args' (repeatable; default: the three main configs)")
    p.add_argument("--data_dir", default=None, help="where the data is prepared (default: a temp folder with "
                   "--tiny, else $ZOO_DATA_DIR or ~/.cache/linear_attention_zoo)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"subset of {list(PATHS)}")
    p.add_argument("--seconds", type=checks.positive_float, default=None, help="timed seconds per path "
                   "(default 10; --tiny 0.2)")
    p.add_argument("--warmup", type=checks.nonnegative_int, default=5, help="batches before the timing")
    p.add_argument("--rounds", type=checks.positive_int, default=None, help="interleaved rounds (default 2; "
                   "--tiny 1)")
    p.add_argument("--synthetic", type=checks.positive_ints, default=None, metavar="SIZES",
                   help="comma-separated split sizes: time the memory path over synthetic in-memory splits "
                   "instead of configs (e.g. 270,4096,20000)")
    p.add_argument("--batch_size", type=checks.positive_int, default=16, help="batch of --synthetic (default 16)")
    p.add_argument("--tiny", action="store_true", help="the configs' smoke variants, a second (CPU test)")
    p.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/pipeline.json, "
                   "none with --tiny)")
    args = p.parse_args(argv)
    paths = [x for x in args.paths.split(",") if x]
    bad = [x for x in paths if x not in PATHS]
    if bad or not paths:
        p.error(f"--paths: {', '.join(bad) or 'none given'}; expected a subset of {', '.join(PATHS)}")
    args.paths = paths
    if args.synthetic:
        if args.config:
            p.error("--synthetic times synthetic splits: give it or --config, not both")
        small = [n for n in args.synthetic if n < args.batch_size]
        if small:
            p.error(f"--synthetic: {', '.join(map(str, small))} examples < --batch_size {args.batch_size}")
    checks.check_output_paths(p, args, dirs=["data_dir"], files=["out"])
    args.config = [] if args.synthetic else args.config or list(MAIN_CONFIGS)
    args.seconds = args.seconds or (0.2 if args.tiny else 10.0)
    args.rounds = args.rounds or (1 if args.tiny else 2)
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    from zoo_core.data import arrays, pipeline

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or (tmp if args.tiny else pipeline.resolve_data_dir(None))
        records = []
        for n in args.synthetic or ():
            record = measure_synthetic(n, batch_size=args.batch_size, warmup=args.warmup, seconds=args.seconds,
                                       rounds=args.rounds)
            records.append(record)
            rate = record["paths"]["memory"]
            print(f"{record['config']}: {n} examples, batch {args.batch_size}: memory {rate['batches_per_s']:.0f} "
                  f"batches/s ({rate['batches_per_cpu_s']:.0f} per CPU-second); load average "
                  f"{record['load_before']} -> {record['load_after']}", flush=True)
        for spec in args.config:
            record = measure(spec, data_dir=data_dir, paths=args.paths, warmup=args.warmup, seconds=args.seconds,
                             rounds=args.rounds, tiny=args.tiny)
            records.append(record)
            rates = ", ".join(f"{p} {r['batches_per_s']:.0f} batches/s" + (
                f" (decoded in {max(r['decode_s']):.2f} s)" if p == "memory" else "")
                for p, r in record["paths"].items())
            print(f"{spec}: {record['examples']} examples, batch {record['batch_size']}: {rates}; "
                  f"load average {record['load_before']} -> {record['load_after']}", flush=True)
    result = dict(meta=dict(argv=sys.argv[1:] if argv is None else list(argv), cpu_count=os.cpu_count(),
                            memory_limit_bytes=arrays.memory_limit(), read_threads=pipeline.read_threads(),
                            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                  records=records)
    name = "pipeline_synthetic.json" if args.synthetic else "pipeline.json"
    out = args.out or (None if args.tiny else str(REPO / "benchmarks" / "results" / name))
    if out:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
