"""The zoo's other commands answer a bad command line as the training commands do: one `error:` line on
stderr and exit status 2, no argparse usage block (`checks.ArgumentParser`)."""
import importlib.util

import pytest

from tests.environment import ROOT


def _run_notebooks():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "notebooks" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse_args(name):
    if name == "notebooks/run_notebooks.py":
        return _run_notebooks().parse_args
    return importlib.import_module(name).parse_args


@pytest.mark.parametrize("command, argv, message", [
    ("zoo_core.data.download", [], "the following arguments are required: source"),
    ("zoo_core.data.download", ["nope"], "argument source: invalid choice: 'nope'"),
    ("zoo_core.data.download", ["uea", "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    ("zoo_core.data.lra_prepare", ["--tasks"], "argument --tasks: expected one argument"),
    ("zoo_core.study.__main__", [], "the following arguments are required: study"),
    ("examples.wmt.train", ["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ("examples.wmt.train", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("notebooks/run_notebooks.py", ["--timeout", "0"], "argument --timeout: must be an integer >= 1"),
])
def test_a_bad_command_line_is_one_error_line(command, argv, message, capsys):
    parse_args = _parse_args(command)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err



def test_download_without_arguments_names_only_what_is_required(capsys):
    from zoo_core.data import download
    with pytest.raises(SystemExit):
        download.parse_args([])
    assert capsys.readouterr().err == "error: the following arguments are required: source\n"
