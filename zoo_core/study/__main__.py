"""The study command: `python -m zoo_core.study configs/studies/<name>.py[:args] --workdir DIR`.

Flags: --workdir DIR (default runs/study_<name>[_<args>]; the study's runs, results.md, results.csv and
figure go there), --parallel N (runs at a time, each its own process), --dry_run (list the runs and
their commands; nothing runs), --only REGEX (run only the cells whose label matches; the results
still cover every cell), --set field=value (repeatable: `--config.field=value` for every training
run, e.g. --set total_steps=200). Mistakes (a study file that does not exist or does not load, a bad
:args, a --set field that no cell's config has or a value not of its type there) end the command with
one `error:` line and exit status 2, before any run;
a run that fails is recorded in the results with its one-line error and the others go on (exit status 1
when any failed).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import sys

from zoo_core import checks, configs, extras
from zoo_core.study import Study, report, runner

STUDIES = configs.ROOT / "studies"


def _fail(message: str) -> None:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_study(spec: str) -> Study:
    """The `Study` of 'path/to/study.py[:args]' (raises ValueError with one line when it cannot be had)."""
    path, _, arg = configs.resolve(spec).partition(":")
    if not os.path.isfile(path) or not path.endswith(".py"):
        known = sorted(p.stem for p in STUDIES.glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"unknown study {spec.partition(':')[0]!r}: not a study file; known: "
                         f"{', '.join(f'configs/studies/{k}.py' for k in known)}")
    try:
        module = _load_module(path, f"_study_{os.path.basename(path)[:-3]}")
    except Exception as e:   # a broken study file: name it and the exception
        raise ValueError(f"study file {path} does not load: {type(e).__name__}: {e}") from None
    if not hasattr(module, "get_study"):
        raise ValueError(f"study file {path} defines no get_study(arg)")
    study = module.get_study(arg or None)
    if not isinstance(study, Study):
        raise ValueError(f"get_study of {path} returned {type(study).__name__}, not a zoo_core.study.Study")
    study.check()
    return study


def _set_flags(values: list[str]) -> list[str]:
    out = []
    for v in values:
        field, sep, value = v.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][\w.]*$", field):
            raise ValueError(f"--set {v!r}: give field=value, e.g. --set total_steps=200")
        out.append(f"--config.{field}={value}")
    return out


def check_set_fields(study: Study, flags: list[str]) -> None:
    """Each --set field must exist in every training cell's config (loaded here, as the trainer would),
    and its value must parse as that field's type there (as the trainer parses `--config.<field>=value`),
    so that a mistake stops the study before its first run instead of failing every run."""
    if not flags:
        return
    specs = {c.config or study.config for c in study.cells if not c.is_benchmark}
    if not specs:
        raise ValueError("--set: this study has no training runs (its cells are benchmarks)")
    for spec in sorted(specs):
        path, _, arg = configs.resolve(spec).partition(":")
        try:
            config = _load_module(path, "study_config").get_config(arg or None)
        except Exception as e:
            raise ValueError(f"config {spec} does not load: {type(e).__name__}: {e}") from None
        for flag in flags:
            field = flag[len("--config."):].partition("=")[0]
            node = config
            for part in field.split("."):
                if not hasattr(node, "keys") or part not in node.keys():
                    raise ValueError(f"--set {field}: {spec} has no field {field!r}")
                node = node[part]
        problem = _override_problem(config, flags)
        if problem:
            raise ValueError(f"--set {problem} (in {spec})")


def _override_problem(config, flags: list[str]) -> str | None:
    """'<field>=<value>: <why>' for the first of `flags` (`--config.<field>=value`) whose value does not
    parse as its field of `config` (ml_collections' own parsing, as on the training command), or None."""
    from absl import flags as absl_flags
    from ml_collections import config_flags

    from zoo_core.run import flag_errors
    argv = ["study", *flags]
    values = absl_flags.FlagValues()
    try:
        config_flags.DEFINE_config_dict("config", config, flag_values=values, lock_config=True, sys_argv=argv)
        values(argv)
    except Exception as e:  # noqa: BLE001 - absl's and ml_collections' parse errors have several types
        message = flag_errors.last_line(str(e))
        return re.sub(r"^flag --config\.", "", message)
    return None


def _shown(cmd: list[str]) -> str:
    """The command as a user would type it ('python' for this interpreter)."""
    return shlex.join(["python" if cmd[0] == sys.executable else cmd[0], *cmd[1:]])


def default_workdir(spec: str) -> str:
    path, _, arg = spec.partition(":")
    name = "study_" + os.path.splitext(os.path.basename(path))[0]
    if arg:
        name += "_" + re.sub(r"[^A-Za-z0-9.=-]+", "_", arg).replace("=", "-").strip("_")
    return os.path.join("runs", name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line above (`--help` lists it)."""
    p = checks.ArgumentParser(prog="python -m zoo_core.study", description=__doc__.split("\n")[0])
    p.add_argument("study", help="configs/studies/<name>.py[:args], e.g. configs/studies/agf_order.py:smoke")
    p.add_argument("--workdir", default=None, help="the study's folder (default runs/study_<name>[_<args>])")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time, each its own process")
    p.add_argument("--dry_run", action="store_true", help="list the runs and their commands; run nothing")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="run only the cells whose label matches (re.search), e.g. --only JapaneseVowels")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="--config.FIELD=VALUE for every training run (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parallel < 1:
        _fail(f"--parallel must be >= 1, got {args.parallel}")
    if args.workdir is not None and not args.workdir.strip():
        _fail("--workdir is empty (an unset shell variable?); give a directory")
    try:
        study = load_study(args.study)
        extra = _set_flags(args.set)
        check_set_fields(study, extra)
    except ValueError as e:
        _fail(f"{args.study}: {e}" if not str(e).startswith(("unknown study", "study file")) else e)
    if args.only is not None:
        try:
            chosen = [c for c in study.cells if re.search(args.only, c.label)]
        except re.error as e:
            _fail(f"--only {args.only!r} is not a regular expression: {e}")
        if not chosen:
            _fail(f"--only {args.only!r} matches no cell; cells: {', '.join(c.label for c in study.cells)}")
    else:
        chosen = list(study.cells)
    root = os.path.abspath(os.path.expanduser(args.workdir or default_workdir(args.study)))
    runs = [r for r in study.runs() if r.cell in chosen]
    if args.dry_run:
        print(f"{study.name}: {study.title}\n{len(runs)} runs under {root}:")
        for i, run in enumerate(runs, 1):
            run_dir = os.path.join(root, run.folder)
            state = " (done)" if runner.is_done(run_dir) else ""
            print(f"[{i}/{len(runs)}] {run.folder}{state}: {_shown(runner.train_command(study, run, run_dir, extra))}")
            evaluation = runner.eval_command(study, run, run_dir, extra)
            if evaluation:
                print(f"    then: {_shown(evaluation)}")
        return 0
    if study.plot is not None:
        extras.require_or_exit("plots", f"the {study.name} study's figure", ("matplotlib",))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        _fail(f"--workdir {root!r} cannot be made: {e.strerror}")
    print(f"{study.name}: {len(runs)} runs under {root}, {args.parallel} at a time", flush=True)
    try:
        done, failed = runner.run_study(study, root, runs=runs, extra=extra, parallel=args.parallel,
                                        after_run=lambda: report.write(study, root))
    except runner.Stopped:
        report.write(study, root)
        print("error: interrupted: the running runs were stopped and keep their last checkpoint; the same "
              "command skips the finished runs and resumes the others", file=sys.stderr, flush=True)
        return 130
    paths = report.write(study, root)
    print(f"{study.name}: {done} run(s) done, {failed} failed this time; results: {', '.join(paths)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
