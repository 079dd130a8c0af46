"""bfloat16 compute and per-block remat, measured: memory and step time of the three main training steps.

    python -m benchmarks.memory_options                          # the main configs, 4 variants each
    python -m benchmarks.memory_options --tiny --configs samovar_fig4 --variants f32,f32+remat

For each config (the main configs of `benchmarks.device_check`: AGF LRA ListOps, SAMoVAR Fig. 4,
HTGN number_words) and each variant (`f32`, `f32+remat`, `bf16`, `bf16+remat`: `model.dtype` =
bfloat16 and/or `model.remat` = True on the config), the shared trainer's jitted train step
(`bench.train_step_setup`) is compiled and XLA's memory analysis of the executable is recorded
(`temp_bytes`: the activations and other temporaries, what remat shrinks; `total_bytes`: the peak
estimate, parameters and optimiser state included), then the step is timed on a fixed batch
(median of `--steps` after `--warmup`). A 2048^2 float32 matmul is timed before every record
(`ref_s`, `time_over_ref` in the JSON) to show whether the load changed between rows; the table's
time ratio is of the raw medians (measure on a quiet machine).

On a CPU neither option pays (README, Design decisions, "bfloat16 and remat"): bfloat16 steps are
slower (XLA's CPU backend converts around each bfloat16 matmul) and remat saves no memory, because
XLA's CPU scheduler runs every block's recomputation as soon as its input exists, not when the
backward pass reaches the block. They are the memory options for accelerators.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from zoo_core import checks  # noqa: E402 - after the path above

VARIANTS = ("f32", "f32+remat", "bf16", "bf16+remat")


def _apply_variant(config, variant: str):
    with config.unlocked():
        config.model.dtype = "bfloat16" if variant.startswith("bf16") else None
        config.model.remat = variant.endswith("+remat")
    return config


def measure(name: str, variant: str, *, tiny: bool, steps: int, warmup: int) -> dict[str, Any]:
    """One record: compiled memory and step time of config `name` under `variant`."""
    from benchmarks import device_check
    from zoo_core import bench

    config = _apply_variant(device_check._config(name, tiny), variant)
    setup = bench.train_step_setup(config, device_check._factory(device_check.MAIN_CONFIGS[name][3]))
    memory = bench.memory_of(setup["compiled"])
    ref_s = 2.0 * 2048**3 / (bench.reference_matmul(2048) * 1e9)
    timing, _ = bench.time_state_step(setup["step"], setup["state"], setup["batch"], warmup=warmup,
                                      repeats=steps)
    return dict(config=name, variant=variant, batch={k: list(v.shape) for k, v in setup["batch"].items()},
                compile_s=setup["compile_s"], temp_bytes=memory["temp_bytes"],
                total_bytes=memory["total_bytes"], memory=memory, median_s=timing["median_s"],
                min_s=timing["min_s"], ref_s=ref_s, time_over_ref=timing["median_s"] / ref_s)


def table(records: list[dict[str, Any]]) -> str:
    """Markdown rows: per config, each variant's temp/total GiB, s/step and ratios to its f32 row."""
    lines = ["| config | variant | temp GiB | total GiB | temp / f32 | s/step | time / f32 |",
             "|---|---|---|---|---|---|---|"]
    base = {r["config"]: r for r in records if r["variant"] == "f32"}
    for r in records:
        b = base.get(r["config"])
        gib = lambda v: "n/a" if v is None else f"{v / 2**30:.3f}"  # noqa: E731
        t_ratio = f"{r['median_s'] / b['median_s']:.2f}" if b else "n/a"
        m_ratio = (f"{r['temp_bytes'] / b['temp_bytes']:.2f}" if b and r["temp_bytes"] and b["temp_bytes"]
                   else "n/a")
        lines.append(f"| {r['config']} | {r['variant']} | {gib(r['temp_bytes'])} | {gib(r['total_bytes'])} "
                     f"| {m_ratio} | {r['median_s']:.3f} | {t_ratio} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks import device_check

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(k for k in device_check.MAIN_CONFIGS if "softmax" not in k),
                   help=f"subset of {list(device_check.MAIN_CONFIGS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {list(VARIANTS)}")
    p.add_argument("--tiny", action="store_true", help="the configs' smoke variants (CPU test)")
    p.add_argument("--steps", type=checks.positive_int, default=None, help="timed steps (default 5; --tiny 1)")
    p.add_argument("--warmup", type=checks.nonnegative_int, default=1)
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = p.parse_args(argv)
    args.configs = checks.choice_list(p, "--configs", args.configs, device_check.MAIN_CONFIGS)
    args.variants = checks.choice_list(p, "--variants", args.variants, VARIANTS)
    checks.check_output_paths(p, args, files=["out"])
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    configs, variants = args.configs, args.variants
    steps = args.steps or (1 if args.tiny else 5)
    import jax
    meta = dict(backend=jax.default_backend(), devices=jax.device_count(), load_avg=os.getloadavg(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"), tiny=args.tiny, steps=steps, warmup=args.warmup)
    records = []
    for name in configs:
        for variant in variants:
            records.append(measure(name, variant, tiny=args.tiny, steps=steps, warmup=args.warmup))
            print(json.dumps({k: records[-1][k] for k in ("config", "variant", "temp_bytes", "median_s")}),
                  flush=True)
    meta["load_avg_end"] = os.getloadavg()
    summary = dict(meta=meta, records=records)
    print(table(records))
    print(f"load average {meta['load_avg']} -> {meta['load_avg_end']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
