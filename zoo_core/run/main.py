"""The command line shared by every `python -m <package>.train` entry point.

    python -m agf_jax.train --config configs/agf/lra_listops.py:smoke --workdir /tmp/run \
        --config.model.num_layers=3

Flags: --config (ml_collections file[:args], with --config.a.b=value overrides), --workdir (default
runs/<config name>[_<args>]), and for
multi-host runs --coordinator_address / --num_processes / --process_id (or the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); `--help` lists them. Configuration mistakes
(an error in the config file itself, an empty --workdir, a config of another architecture included) end
the run with one line on stderr and exit status 2, before anything is compiled.

A training run ends with one summary line on stdout (printed once, not logged again on stderr): the
steps done, the best checkpoint's metric and value (with checkpoint.best_metric) and where the
checkpoints are. A progress bar still shown when a run fails is closed before its `error:` line.

Evaluation only (nothing is trained): `--eval_only --eval_split=test [--checkpoint=best|latest]` evaluates
a finished run's best (or newest) checkpoint on a split, e.g. the LRA protocol "select on validation,
report test"; the result is printed as one JSON line and written to workdir/eval_<checkpoint>_<split>.json
(where that file cannot be written, e.g. a read-only run directory, one warning line says so and the
command still exits 0: the printed line is the result).

Resuming: a --workdir holding checkpoints is resumed only with the config it was trained with (its
config.json); a difference in what is trained (model, optimiser, schedule, data, seed, batch) is refused
naming the fields, unless `--allow_config_change` is given. Logging, evaluation and checkpoint cadence,
the progress bar, the CPU device count and a longer total_steps (under a constant or warmup_rsqrt
schedule) may always change.

CPU devices: JAX's CPU backend starts with `config.parallel.cpu_devices` devices (0: one per core;
`zoo_core.run.sharding.cpu_device_count`), before anything else touches JAX.
"""
from __future__ import annotations

__all__ = ["run"]

import functools
import json
import os
import pathlib
import re
import signal
import sys
from typing import Any, Callable, Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from zoo_core import configs
from zoo_core.run import flag_errors, output
from zoo_core.run.errors import ConfigError, NonFiniteError

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file, optionally with ':args'",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints and metrics (resumes from it)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host runs)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "number of processes (multi-host runs)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's id in [0, num_processes)")
_EVAL_ONLY = flags.DEFINE_bool("eval_only", False, "evaluate a saved checkpoint of --workdir instead of training")
_EVAL_SPLIT = flags.DEFINE_string("eval_split", None, "split for --eval_only (default: config.data.eval_split)")
_CHECKPOINT = flags.DEFINE_enum("checkpoint", None, ["best", "latest"],
                                "which checkpoint --eval_only reads (default: best)")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False,
    "resume the run in --workdir although the config differs from its stored config.json in fields that "
    "change what is trained (model, optim, schedule, data, seed, batch_size, ...); without it such a resume "
    "is refused naming the fields. The differences are logged and config.json is replaced. Fields that only "
    "change logging, evaluation or checkpointing (and a longer total_steps under a constant or "
    "warmup_rsqrt schedule) may always change: zoo_core.run.resume.SAFE_ON_RESUME")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache_dir",
    os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zoo_jax", "xla")),
    "JAX's persistent compilation cache: a rerun of the same config loads the compiled steps instead "
    "of compiling them. Default: $JAX_COMPILATION_CACHE_DIR "
    "if set, else ~/.cache/zoo_jax/xla. Empty: no cache")


def configure_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` ('' leaves it off).

    Raises:
      ValueError: `path` is a file, or under one, or not writable. JAX itself would only warn, once
        per compiled program, and run without the cache.
    """
    if not path:
        return
    path = os.path.expanduser(path)
    from zoo_core import checks
    problem = checks.output_path_problem(path, directory=True)
    if problem:
        raise ValueError(f"--compilation_cache_dir {path!r} {problem}; give a directory, or '' for no cache")
    import jax
    jax.config.update("jax_compilation_cache_dir", path)


def maybe_initialize_distributed() -> None:
    """Calls jax.distributed.initialize when a coordinator is given by flag or environment."""
    address = _COORDINATOR.value or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        if _NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None:
            raise ValueError("--num_processes and --process_id need --coordinator_address host:port (or "
                             "JAX_COORDINATOR_ADDRESS); without it this would be a single-process run")
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator_address must be host:port with a port in 1..65535, got {address!r}")
    num = _NUM_PROCESSES.value if _NUM_PROCESSES.value is not None else os.environ.get("JAX_NUM_PROCESSES")
    pid = _PROCESS_ID.value if _PROCESS_ID.value is not None else os.environ.get("JAX_PROCESS_ID")
    if num is None or pid is None:
        raise ValueError("a coordinator address needs --num_processes and --process_id "
                         "(or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    import jax
    jax.distributed.initialize(coordinator_address=address, num_processes=int(num), process_id=int(pid),
                               initialization_timeout=120)


class _QuietLibraries:
    """Drops INFO records from orbax and the grain/tfds internals (dozens of lines per checkpoint), and
    two TFDS warnings that every run here would print: that the dataset uses a custom configuration
    (they all do, by design), and that a data folder not yet prepared has no dataset_info.json (it is
    about to be prepared, or the options are refused first)."""

    _NOISY = ("/orbax/", "/grain/", "/tensorflow_datasets/", "/etils/", "/jax/_src/xla_bridge.py")
    _TFDS_NOTES = ("Using custom data conf", "Variant folder ")

    def filter(self, record) -> bool:
        if "/tensorflow_datasets/" in record.pathname and str(record.msg).startswith(self._TFDS_NOTES):
            return False
        return record.levelno >= 30 or not any(n in record.pathname for n in self._NOISY)


def _main(argv, *, build_model: Callable[..., Any], evaluators_fn: Callable[[Any], list] | None) -> None:
    if len(argv) > 1:
        _fail(f"unexpected positional argument(s) {' '.join(argv[1:])!r}: every option is a flag, e.g. "
              "--workdir DIR or --config.optim.learning_rate=3e-4")
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _QuietLibraries) for f in handler.filters):
        handler.addFilter(_QuietLibraries())
    # Imported here, not at the top: --help and a flag mistake answer without loading JAX.
    from zoo_core.run import evaluation, loop, setup, sharding
    config = _CONFIG.value
    if config is None:
        _fail("--config is required, e.g. --config configs/core/synthetic.py:smoke")
    mismatch = _command_for_config(flags.FLAGS["config"].config_filename, build_model)
    if mismatch:
        _fail(mismatch)
    if _WORKDIR.value is not None and not _WORKDIR.value.strip():
        # `--workdir=$RUN` with RUN unset: the default folder might hold (and resume) another run.
        _fail("--workdir is empty (an unset shell variable?); give a directory, or leave the flag out for "
              "the default runs/<config name>")
    # expanduser: the shell leaves '~' as is in `--workdir=~/runs/x` (it would make a folder named '~').
    workdir = os.path.expanduser(_WORKDIR.value or default_workdir(flags.FLAGS["config"].config_filename))
    if _ALLOW_CONFIG_CHANGE.value and _EVAL_ONLY.value:
        _fail("--allow_config_change applies to training runs, not to --eval_only")
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    if previous_sigterm is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        try:
            configure_compilation_cache(_COMPILATION_CACHE.value)
            sharding.configure_cpu_devices(config)
            maybe_initialize_distributed()
        except ValueError as e:
            _fail(str(e))
        if _EVAL_ONLY.value:
            if _EVAL_SPLIT.value is not None:
                config = evaluation.with_eval_split(config, _EVAL_SPLIT.value)
            evaluators = _evaluators(evaluators_fn, config)
            try:
                result = evaluation.evaluate_checkpoint(config, workdir, build_model,
                                                        which=_CHECKPOINT.value or "best", evaluators=evaluators)
            except ConfigError as e:
                # The split came from the flag: name it, not the config field it was written into.
                if _EVAL_SPLIT.value is None or not str(e).startswith("data.eval_split "):
                    raise
                raise ConfigError("--eval_split" + str(e)[len("data.eval_split"):]) from None
            output.write_line(json.dumps(result, sort_keys=True))
            return
        if _EVAL_SPLIT.value is not None or _CHECKPOINT.value is not None:
            _fail("--eval_split and --checkpoint are only used with --eval_only (training evaluates "
                  "config.data.eval_split)")
        # The evaluators only check their options here (they build their data and programs at the
        # first evaluation), so their mistakes come before the data is built; they may add metric
        # names (eval/bleu), which the setup check allows.
        evaluators = _evaluators(evaluators_fn, config)
        checked = setup.check_setup(config, build_model, has_evaluators=bool(evaluators))
        # Then the workdir and the resume, before the data is built or anything is written; prints the
        # run's closing summary line at its end.
        loop.train_and_evaluate(config, workdir, build_model, evaluators=evaluators,
                                allow_config_change=_ALLOW_CONFIG_CHANGE.value, print_summary=True,
                                setup=checked)
    except ConfigError as e:
        _fail(e.command_line)
    except FileNotFoundError as e:
        if not _EVAL_ONLY.value:
            raise
        _fail(str(e).splitlines()[0])
    except NonFiniteError as e:
        _fail(str(e), status=3)
    except KeyboardInterrupt as e:
        # Ctrl-C or SIGTERM in the training loop saves and exits cleanly (run.guard.Terminate); this is one
        # outside it (preparing data, compiling) or a second Ctrl-C inside it. Nothing is half-written
        # either way: checkpoints are written atomically and a dataset being prepared is removed.
        name = getattr(e, "signal_name", "Ctrl-C")
        _fail(f"interrupted ({name}): stopped at once; the last saved checkpoint, if any, is kept and a "
              "rerun of the same command resumes from it", status=143 if name == "SIGTERM" else 130)
    finally:
        if previous_sigterm is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _SigtermStop(KeyboardInterrupt):
    """SIGTERM outside the training loop (whose own handler saves a checkpoint), raised so that the
    cleanup a Ctrl-C gets runs too (a dataset being prepared is removed) instead of a silent kill."""
    signal_name = "SIGTERM"


def _stop_on_sigterm(signum, frame):
    raise _SigtermStop


def _evaluators(evaluators_fn: Callable[[Any], list] | None, config) -> Sequence[Any]:
    """The architecture's extra evaluators. Building one only reads and checks its config options
    (the data and programs come at the first evaluation), so its ValueError is a config mistake."""
    try:
        evaluators = evaluators_fn(config) if evaluators_fn is not None else ()
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    # `test_split` is read by an evaluator that reports a split (its `split` attribute), never by the
    # trainer itself: where no evaluator reads it, it would be silently ignored.
    split = config.get("test_split", "")
    if split and not any(getattr(e, "split", None) == split for e in evaluators):
        raise ConfigError(f"test_split={split!r} is not reported by this architecture's evaluators "
                          f"(SAMoVAR's are); score the split after training with --eval_only "
                          f"--eval_split={split}")
    return evaluators


# configs/<folder>/ -> the package whose train command runs the configs there.
CONFIG_FOLDERS = {"agf": "agf_jax", "samovar": "samovar_jax", "htgn": "htgn_jax", "core": "zoo_core"}


def _command_for_config(config_arg: str, build_model: Callable[..., Any]) -> str | None:
    """The error when a config of a `configs/<architecture>/` folder is given to another architecture's
    train command, naming the right one; None otherwise (also for configs kept elsewhere). Its model
    fields may fit the wrong `Model` well enough to fail late or in a misleading way (an HTGN config
    under agf_jax.train was refused for its `kind`)."""
    given = config_arg.partition(":")[0]
    path = pathlib.Path(os.path.abspath(given))
    want = CONFIG_FOLDERS.get(path.parent.name) if path.parent.parent.name == "configs" else None
    have = build_model.__module__.split(".")[0]
    if want is None or want == have:
        return None
    return f"{given} is a config for {want}: run it with python -m {want}.train (this is {have}.train)"


def default_workdir(config_arg: str) -> str:
    """runs/<config file name>[_<its :args>], e.g. 'configs/agf/lra_listops.py:smoke' ->
    'runs/lra_listops_smoke', so that variants of one config never resume each other's runs."""
    path, _, args = config_arg.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    if args:
        name += "_" + re.sub(r"[^A-Za-z0-9.=-]+", "_", args).replace("=", "-").strip("_")
    return os.path.join("runs", name)


def _fail(message: str, status: int = 2) -> None:
    """Prints the one line `error: <message>` on stderr (not also through logging) and exits; a progress
    bar still shown is closed first, so that the line starts a line of its own."""
    message = " ".join(str(message).split())
    _close_progress_bars()
    output.write_line(f"error: {message}", sys.stderr)
    sys.exit(status)


def _close_progress_bars() -> None:
    """Closes every tqdm bar still shown (a data set being prepared when an error came: TFDS shows nested
    ones), innermost first, the outermost left at its last state on a line that ends, so that what is
    printed next (an `error:` line) starts a line of its own instead of following a bar's text or its
    cursor-up codes."""
    if "tqdm" not in sys.modules:   # no bar was ever made
        return
    from tqdm import tqdm
    # tqdm keeps its live bars in the class's `_instances` (there is no public list).
    bars = sorted(list(getattr(tqdm, "_instances", ())), key=lambda bar: -abs(getattr(bar, "pos", 0)))
    for i, bar in enumerate(bars):
        bar.leave = i == len(bars) - 1
        try:
            bar.close()
        except BrokenPipeError:   # its reader is gone (Ctrl-C on `| tee`): nothing to tidy
            pass


_HELP = ("--help", "-help", "-h", "-?", "--helpshort")


def _print_help() -> None:
    """The entry point's docstring and every flag of this command line (absl's own --help lists only
    flags defined in the __main__ module, which defines none here, and exits with status 1)."""
    doc = (sys.modules["__main__"].__doc__ or "").strip()
    ours = flags.FLAGS.module_help(__name__).strip().split("\n", 1)[1]    # without its "zoo_core.run.main:"
    lines = [doc, ""] if doc else []
    lines += ["flags (--helpfull lists absl's and JAX's too):", ours,
              "  --config.<field>=<value>: overrides any field of the config, e.g. --config.model.num_layers=3"]
    print("\n".join(lines))


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config mistakes (unknown key, bad value, broken file) reduced to one line."""
    if any(arg in _HELP for arg in argv[1:]):
        _print_help()
        sys.exit(0)
    argv = with_shipped_config(argv)
    problem = flag_errors.config_path_problem(argv)
    if problem:
        _fail(problem)
    try:
        rest = flags.FLAGS(argv)
    except Exception as e:
        message = flag_errors.flag_error(e, argv)
        if message is None:
            raise
        _fail(message)
    # A config file that cannot be loaded (e.g. a wrong path) is not a parse error for ml_collections:
    # the flag holds a placeholder that raises OSError on first use. Surface it here as one line.
    if _CONFIG.value is not None:
        try:
            _CONFIG.value.get("seed")
        except OSError as e:
            _fail(f"bad flag: --config {flag_errors.config_argument(argv)}: {flag_errors.last_line(str(e))}")
    return rest


def with_shipped_config(argv: Sequence[str]) -> list[str]:
    """`argv` with its --config value passed through `zoo_core.configs.resolve`: the README's
    `--config configs/<arch>/<task>.py` names the shipped file from any folder where no such file exists."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-config") and i + 1 < len(out):
            out[i + 1] = configs.resolve(out[i + 1])
        elif arg.startswith(("--config=", "-config=")):
            flag, _, value = arg.partition("=")
            out[i] = f"{flag}={configs.resolve(value)}"
    return out


def run(build_model: Callable[..., Any], evaluators_fn: Callable[[Any], list] | None = None) -> None:
    """Parses flags and runs the shared trainer with the architecture's `Model` factory."""
    app.run(functools.partial(_main, build_model=build_model, evaluators_fn=evaluators_fn),
            flags_parser=_parse_flags)
