"""The module paths of 0.1.0 still import (zoo_core.moved): each old path of a moved module warns once with
a DeprecationWarning naming the new path and is the new module object; every other 0.1.0 path is still a
module of its own. tests/testdata/modules_0.1.0.txt lists the 0.1.0 layout (from git history)."""
import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys
import warnings

import pytest

from tests import environment
from zoo_core import moved

ROOT = pathlib.Path(__file__).resolve().parent.parent
OLD_MODULES = [line.strip() for line in (ROOT / "tests/testdata/modules_0.1.0.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")]


def _module_file(name: str):
    """The file of first-party module `name` in this checkout, or None."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=environment.command_env(), timeout=300)


def test_every_0_1_0_path_is_a_module_or_moved():
    assert len(OLD_MODULES) > 100 and "zoo_core.masking" in OLD_MODULES
    lost = [m for m in OLD_MODULES if _module_file(m) is None and m not in moved.MOVED]
    assert not lost, f"0.1.0 module paths neither present nor in zoo_core.moved.MOVED: {lost}"


def test_the_table_names_old_paths_and_existing_new_ones():
    for old, new in moved.MOVED.items():
        assert old in OLD_MODULES, f"{old} was no module of 0.1.0"
        assert _module_file(old) is None, f"{old} is a file again: the alias would hide it"
        assert _module_file(new) is not None, f"{old} -> {new}: no such module"
    assert "configs" not in moved.MOVED and not any(old.startswith("configs.") for old in moved.MOVED)


def test_the_finder_ignores_every_other_name():
    assert importlib.util.find_spec("zoo_core.no_such_module") is None
    assert importlib.util.find_spec("zoo_core.ops.masking").name == "zoo_core.ops.masking"


# Run in a fresh interpreter (nothing of the zoo imported yet): samovar_jax's old path first, so that the finder
# is shown to be installed by whichever package comes first; then every old path, twice, and by `from P import m`.
_CHECK = """
import importlib, json, sys, warnings
assert not any(m == "zoo_core" or m.startswith("zoo_core.") for m in sys.modules)
warnings.simplefilter("always")
report = {}
for old in ["samovar_jax.blocks"] + sorted(set(%r) - {"samovar_jax.blocks"}):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"import {old}", "<user>", "exec"), {})
        module = sys.modules[old]
        again = importlib.import_module(old)
        parent, _, leaf = old.rpartition(".")
        imported_from = getattr(__import__(parent, fromlist=[leaf]), leaf)
    from zoo_core import moved
    new = importlib.import_module(moved.MOVED[old])
    report[old] = {"warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught],
                   "same": module is new and again is new and imported_from is new and sys.modules[old] is new,
                   "spec": new.__spec__.name}
print(json.dumps(report))
"""


def test_every_old_path_warns_once_and_is_the_new_module():
    result = _run(_CHECK % sorted(moved.MOVED))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(moved.MOVED)
    for old, new in moved.MOVED.items():
        got = report[old]
        assert got["warnings"] == [["DeprecationWarning", f"{old} is deprecated and will be removed in "
                                    f"{moved.REMOVED_IN}; import {new}", "<user>"]], (old, got["warnings"])
        assert got["same"], old
        assert got["spec"] == new, (old, got["spec"])   # the module keeps its own spec


def test_an_old_path_under_W_error_fails_naming_the_new_one():
    """What .ci/wheel_check.sh checks from an installed wheel."""
    result = _run("import zoo_core.masking", "-W", "error::DeprecationWarning")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "DeprecationWarning: zoo_core.masking is deprecated and will be removed in 0.3.0; import zoo_core.ops.masking")


def test_python_shows_the_warning_by_default_at_the_importing_line():
    """Python's default filters show a DeprecationWarning raised in __main__: the warning points there."""
    result = _run("from zoo_core import masking\nimport zoo_core.optim")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "<string>:1: DeprecationWarning: zoo_core.masking is deprecated and will be removed in 0.3.0; import "
        "zoo_core.ops.masking",
        "<string>:2: DeprecationWarning: zoo_core.optim is deprecated and will be removed in 0.3.0; import "
        "zoo_core.run.optim"]


def test_every_renamed_name_warns_and_is_the_new_object():
    for old, new in moved.RENAMED.items():
        module_name, _, name = old.rpartition(".")
        module = importlib.import_module(module_name)
        assert name not in vars(module), f"{old} is defined again: the alias would never run"
        new_module, _, new_name = new.rpartition(".")
        expected = getattr(importlib.import_module(new_module), new_name)
        with pytest.warns(DeprecationWarning) as caught:
            got = getattr(module, name)
        assert got is expected, old
        assert [str(w.message) for w in caught] == [f"{old} is deprecated and will be removed in 0.3.0; use {new}"]
        assert caught[0].filename == __file__   # the line that asked for the name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            assert importlib.import_module("agf_jax.ops").no_such_name is None
