"""Every command line printed in a config docstring or in README.md works as printed.

The commands are read from the docstrings of configs/<folder>/<file>.py and from README.md (its
```bash blocks and inline `python -m <package>.train ...` spans), so a new one is covered without
editing this file. A README command's optional parts `[A | B]` are expanded into each variant (none,
A, B); `kind=K` becomes each SAMoVAR kind the config takes; a command still holding a placeholder (`<...>`, `ARGS`) is
the generic form and is left out. Each runs in-process through `zoo_core.run.main` (a subprocess costs 5-10 s)
with its --workdir moved under a temporary folder:

  * as printed, up to the training call: flags, config arguments and overrides, `check_setup` and the
    workdir checks. A command whose data the user provides (placeholder paths such as
    /path/to/..., an ETT CSV or WMT text that is not shipped) may stop there with the one-line error
    about that data; anything else (an invalid override, a bad config argument) fails the test.
  * the `:smoke` command of each config file trains for real (2 steps), unless its data must be
    provided by the user (then the same one-line data error is accepted). In the default suite only
    the core's (seconds); the others take 30-60 s each on a 2-core CPU and run with `-m slow` (the
    packages' own train tests run their smoke configs too).
"""
import importlib
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.environment import run_entry_in_process
from zoo_core.run import loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(p for p in (ROOT / "configs").glob("*/*.py") if "def get_config(" in p.read_text())
# A one-line error about data the user must provide (not shipped, or a placeholder path).
DATA_ERROR = re.compile(r"source|does not exist|not found|no such|missing|files?\b|\.csv|\.ts|\.npz|\.tsv",
                        re.IGNORECASE)


def _commands(path: pathlib.Path) -> list[str]:
    """The `python -m ...` lines of the docstring of `path`, continuation lines joined."""
    module = importlib.import_module(f"zoo_core.configs.{path.parent.name}.{path.stem}")
    text = (module.__doc__ or "").replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip().startswith("python -m ")]


COMMANDS = [(f"{p.parent.name}/{p.stem}", cmd) for p in CONFIG_FILES for cmd in _commands(p)]


def _variants(command: str) -> list[str]:
    """A printed command with its first `[A | B]` group expanded (recursively): none, A, B."""
    group = re.search(r"\[([^\[\]]*)\]", command)
    if group is None:
        return [command]
    options = [""] + [o.strip() for o in group.group(1).split("|")]
    return [v for o in options
            for v in _variants(" ".join((command[:group.start()] + (" " if o.startswith("--") else "") + o
                                         + command[group.end():]).split()))]


KINDS = ("samovar", "lintrans", "fixedvar", "dlinear")


def _config_accepts(command: str) -> bool:
    """Whether the command's `--config FILE:ARG` argument is one its config file takes."""
    spec = shlex.split(command)[shlex.split(command).index("--config") + 1]
    path, _, arg = spec.partition(":")
    module = importlib.import_module(path[:-len(".py")].replace("/", "."))
    try:
        module.get_config(arg or None)
    except ValueError:
        return False
    return True


def _readme_lines(inline: str) -> list[str]:
    """README.md's command lines, whitespace-normalised: each line of its ```bash blocks (continuations
    joined, a trailing `# comment` and anything before the last `&&` dropped), then the inline spans
    that match the regex `inline`."""
    text = (ROOT / "README.md").read_text()
    lines = [line.split(" #")[0].split("&&")[-1] for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(inline, text)
    return [" ".join(line.split()) for line in lines]


def _readme_commands() -> list[str]:
    out = []
    for line in _readme_lines(r"`(python -m [a-z_]+\.train [^`]*)`"):
        if not (line.startswith("python -m ") and ".train " in line):
            continue
        for v in _variants(line):
            for kind in (KINDS if "kind=K" in v else (None,)):
                v_kind = v.replace("kind=K", f"kind={kind}") if kind else v
                if kind and not _config_accepts(v_kind):
                    continue   # K stands for the kinds of that config's table
                if "<" not in v_kind and "ARGS" not in v_kind and v_kind not in out:
                    out.append(v_kind)
    return out


README_COMMANDS = _readme_commands()


def _entry(module: str):
    """(build_model, evaluators_fn) of a `python -m <module>` training entry point."""
    package = module.split(".")[0]
    if package == "zoo_core":
        from zoo_core import mlp_classifier
        return mlp_classifier.Model, None
    if package == "agf_jax":
        from agf_jax import model
        return model.Model, None
    if package == "samovar_jax":
        from samovar_jax import evaluation, model
        return model.Model, evaluation.evaluators_for
    if package == "htgn_jax":
        from htgn_jax import decoding, model
        return model.Model, decoding.evaluators_for
    raise AssertionError(f"unknown entry point {module}")


def _argv(command: str, workdir) -> tuple[str, list[str]]:
    """(entry module, flags) of a printed command, its --workdir replaced by `workdir`."""
    tokens = shlex.split(command)
    assert tokens[:2] == ["python", "-m"] and tokens[2].endswith(".train"), command
    argv, rest = [], iter(tokens[3:])
    for token in rest:
        if token == "--workdir":
            next(rest)
        elif token.startswith("--workdir="):
            pass
        else:
            argv.append(token)
    return tokens[2], argv + ["--workdir", str(workdir)]


def _run(module: str, argv: list[str], capfd, monkeypatch, *, train: bool):
    """Runs the entry point in this process; returns (exit status, stderr)."""
    build_model, evaluators_fn = _entry(module)
    if not train:   # the evaluators are built (that checks their options); they read data only when run
        monkeypatch.setattr(loop, "train_and_evaluate", lambda *a, **k: {})
    status, _, err = run_entry_in_process(module, build_model, argv, capfd, evaluators_fn=evaluators_fn)
    return status, err


def _assert_ran(status, err, command):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err, err[-3000:]
    if status == 0:
        return
    assert status == 2 and len(errors) == 1, (command, status, err[-3000:])
    assert "invalid config override" not in errors[0] and "config argument" not in errors[0], (command, errors[0])
    if errors[0].startswith("error: bad flag"):   # only a config that reads a data file it is given
        assert "does not exist" in errors[0], (command, errors[0])
    assert DATA_ERROR.search(errors[0]), f"{command}: {errors[0]}"


def test_every_config_prints_commands():
    assert {name for name, _ in COMMANDS} == {f"{p.parent.name}/{p.stem}" for p in CONFIG_FILES}


@pytest.mark.parametrize("command", [c for _, c in COMMANDS], ids=[f"{n}-{i}" for i, (n, _) in enumerate(COMMANDS)])
def test_a_printed_command_passes_every_check(command, tmp_path, capfd, monkeypatch):
    module, argv = _argv(command, tmp_path / "run")
    status, err = _run(module, argv, capfd, monkeypatch, train=False)
    _assert_ran(status, err, command)


def test_the_readme_prints_training_commands():
    assert len(README_COMMANDS) >= 10, README_COMMANDS


@pytest.mark.parametrize("command", README_COMMANDS, ids=[f"readme-{i}" for i in range(len(README_COMMANDS))])
def test_a_readme_command_passes_every_check(command, tmp_path, capfd, monkeypatch):
    """Up to the training call; an --eval_only command is run against an empty workdir, so it must
    stop at the one-line error that there is no checkpoint yet (and nothing else)."""
    module, argv = _argv(command, tmp_path / "run")
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "data"))
    status, err = _run(module, argv, capfd, monkeypatch, train=False)
    if "--eval_only" in argv:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1 and "no checkpoint under" in errors[0], (command, err[-2000:])
        return
    _assert_ran(status, err, command)


def test_the_main_docstring_example_overrides_a_model_size(tmp_path, capfd, monkeypatch):
    """zoo_core.run.main's (and the README's) example: a model size from the command line."""
    seen = {}
    monkeypatch.setattr(loop, "train_and_evaluate", lambda config, *a, **k: seen.setdefault("c", config))
    status, err = _run("agf_jax.train", ["--config", "configs/agf/lra_listops.py", "--config.model.num_layers=3",
                                         "--workdir", str(tmp_path / "listops")], capfd, monkeypatch, train=True)
    assert status == 0, err[-2000:]
    assert seen["c"].model.num_layers == 3


SMOKE = {}
for _name, _command in COMMANDS:
    if re.search(r"\.py:(\S*,)?smoke\b", _command):
        SMOKE.setdefault(_name, _command)


DEFAULT_SMOKE = ("core/synthetic",)


@pytest.mark.parametrize("command", [pytest.param(c, id=n, marks=() if n in DEFAULT_SMOKE else pytest.mark.slow)
                                     for n, c in SMOKE.items()])
def test_the_smoke_command_of_each_config_trains(command, tmp_path, capfd, monkeypatch):
    module, argv = _argv(command, tmp_path / "run")
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "data"))   # nothing written to the user's cache
    status, err = _run(module, argv, capfd, monkeypatch, train=True)
    _assert_ran(status, err, command)
    if status == 0:
        assert (tmp_path / "run" / "checkpoints").is_dir(), err[-2000:]


# ---------------------------------------------------------------------------------------------
# README.md's other commands parse as printed, with their globs and braces expanded as a shell
# would: the converters' golden checks (every golden they name is run by the packages'
# reference_test.py, file by file), the benchmark and notebook scripts (they run for minutes to
# hours, or need the official sources: benchmarks_test and notebooks_test run them at --tiny / smoke
# size); a `pytest PATH ...` line must select tests. The bare `pytest -n 2` is CI's own command.
# Nothing a command names may lie outside the repository (CI runs with an empty HOME).
# ---------------------------------------------------------------------------------------------

def _braces(command: str) -> list[str]:
    """Shell brace expansion of `{a,b,c}` groups (recursively)."""
    group = re.search(r"\{([^{}]*,[^{}]*)\}", command)
    if group is None:
        return [command]
    return [v for option in group.group(1).split(",")
            for v in _braces(command[:group.start()] + option + command[group.end():])]


def _readme_other_commands() -> list[str]:
    out = []
    for line in _readme_lines(r"`((?:python|pytest) [^`]*)`"):
        if not line.startswith(("python ", "pytest ")) or ".train" in line or "<" in line:
            continue
        if line.startswith("pytest") and not any(t.startswith("tests/") for t in line.split()):
            continue   # the whole suite: CI's own command
        out += [c for c in _braces(line) if c not in out]
    return out


README_OTHER_COMMANDS = _readme_other_commands()


def _script_module(tokens: list[str]) -> tuple[str, list[str]]:
    """(importable module name, argv) of `python -m M ...` or `python path/to/file.py ...`."""
    if tokens[1] == "-m":   # a package runs as its __main__ module
        is_package = importlib.util.find_spec(tokens[2]).submodule_search_locations is not None
        return tokens[2] + (".__main__" if is_package else ""), tokens[3:]
    assert tokens[1].endswith(".py") and (ROOT / tokens[1]).is_file(), tokens
    return tokens[1][:-len(".py")].replace("/", "."), tokens[2:]


def _globbed(argv: list[str]) -> list[str]:
    out = []
    for token in argv:
        if "*" in token:
            matches = sorted(str(p) for p in ROOT.glob(token))
            assert matches, f"{token} matches no file"
            out += matches
        else:
            out.append(token)
    return out


def test_the_readme_prints_other_commands():
    programs = {c.split()[0] + " " + c.split()[1 + (c.split()[1] == "-m")] for c in README_OTHER_COMMANDS}
    assert {"python agf_jax.convert", "python samovar_jax.convert", "python benchmarks.peers",
            "python notebooks/run_notebooks.py", "python benchmarks.agf_scaling", "python benchmarks.samovar_scaling",
            "python benchmarks.htgn_scaling"} <= programs, programs


# The README writes what lies outside the repository as a `$NAME` it explains: the official checkouts
# the peers benchmark times. The test fills each with a temporary folder laid out as that checkout (every
# file benchmarks/peers.py looks for), so the command is parsed, source checks included, as printed.
PLACEHOLDERS = {"AGF_SRC": "agf", "SAMOVAR_SRC": "samovar"}
OUTSIDE = re.compile(r"(?:^|[\s=])(?:~|\$HOME\b|/(?:home|root|work|shared|mnt)/)")


def _fill_placeholders(command: str, tmp_path, monkeypatch) -> str:
    from benchmarks import peers

    for name in set(re.findall(r"\$\{?(\w+)", command)):
        assert name in PLACEHOLDERS, f"{command}: ${name} is not one of the README's placeholders {sorted(PLACEHOLDERS)}"
        src = tmp_path / name.lower()
        for which, rel in peers.OFFICIAL_FILES.values():
            if which == PLACEHOLDERS[name]:
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                (src / rel).touch()
        monkeypatch.setenv(name, str(src))
    return os.path.expandvars(command)


def test_readme_commands_read_nothing_outside_the_repository():
    for command in README_OTHER_COMMANDS + README_COMMANDS:
        assert not OUTSIDE.search(command), f"{command}: a path outside the repository (write a placeholder)"


@pytest.mark.parametrize("command", README_OTHER_COMMANDS, ids=[f"readme-other-{i}" for i in range(len(README_OTHER_COMMANDS))])
def test_a_readme_command_works_as_printed(command, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    tokens = shlex.split(_fill_placeholders(command, tmp_path, monkeypatch))
    if tokens[0] == "pytest":
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *tokens[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and re.search(r"\b[1-9]\d* (tests? )?(selected|collected)|^\d+/\d+ tests",
                                                  proc.stdout, re.M), proc.stdout[-2000:] + proc.stderr[-2000:]
        return
    name, argv = _script_module(tokens)
    args = importlib.import_module(name).parse_args(_globbed(argv))
    if name.endswith(".convert"):
        package = name.split("_")[0]
        assert sorted(args.check) == sorted(map(str, (ROOT / "tests/testdata" / package).glob("*.npz"))), command
