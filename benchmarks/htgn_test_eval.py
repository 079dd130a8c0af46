"""Test-set BLEU / chrF / exact match of a finished HTGN translation run.

The shared trainer evaluates `data.eval_split` (number-words: 'validation') during training, and
resuming a run whose `total_steps` is reached trains and evaluates nothing. This script restores
the run's newest checkpoint and decodes another split with the run's own decoding options
(`htgn_jax.analysis.evaluate_translation`).

Run from the repo root, with the config (and args) the run was trained with:

    python -m benchmarks.htgn_test_eval --workdir /work/runs/htgn_nw_htgn \
        --config configs/htgn/number_words.py --out /work/runs/htgn_nw_htgn/test_metrics.json
    python -m benchmarks.htgn_test_eval --workdir runs/nw_softmax \
        --config configs/htgn/number_words.py:attention=softmax --split test

Prints one JSON line (and writes it to --out if given).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib


def load_config(spec: str):
    """'path/to/config.py[:args]' -> the locked ConfigDict of `get_config(args)`."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} not found")
    module_spec = importlib.util.spec_from_file_location("_htgn_eval_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="the finished run's workdir")
    p.add_argument("--config", required=True, help="config file[:args] the run was trained with")
    p.add_argument("--split", default="test")
    p.add_argument("--which", default="checkpoints", choices=["checkpoints", "best"])
    p.add_argument("--max_examples", type=int, default=0, help="0 = the whole split")
    p.add_argument("--out", default=None, help="write the metrics JSON here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from htgn_jax import analysis   # pylint: disable=import-outside-toplevel

    config = load_config(args.config)
    metrics = analysis.evaluate_translation(args.workdir, config, split=args.split,
                                            which=args.which, max_examples=args.max_examples)
    record = dict(workdir=os.path.abspath(args.workdir), config=args.config, split=args.split,
                  which=args.which, **metrics)
    line = json.dumps(record, sort_keys=True)
    print(line)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
