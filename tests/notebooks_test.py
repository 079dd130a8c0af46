"""The notebooks as stored: executed at full size with their figures (so GitHub shows them), the key figures
in docs/figures/ equal to the notebooks' own outputs, and every file, module and function they cite exists.

Executing them (smoke size, on copies) is done by tests/<package>/notebook_test.py through
notebooks/run_notebooks.py; these checks only read files and import modules.
"""
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "notebooks" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)
nbformat = pytest.importorskip("nbformat")

# notebook -> (its package, its key figures)
NOTEBOOKS = {
    "agf_filters": ("agf_jax", {"agf_filter"}),
    "samovar_var": ("samovar_jax", {"samovar_var_coefficients", "samovar_fig5_paths", "samovar_fig4_study"}),
    "htgn_graphs": ("htgn_jax", {"htgn_graph_attention"}),
}
PACKAGES = ("agf_jax", "samovar_jax", "htgn_jax", "zoo_core", "configs", "benchmarks")
FILE_REF = re.compile(r"[\w./-]*\w\.(?:py|md|ipynb|json|png|sh|txt|csv|ts)\b")
DOTTED_REF = re.compile(r"`((?:[a-z_]\w*\.)+[a-zA-Z_]\w*)(?:\([^`]*\))?`")


def _read(name):
    return nbformat.read(run_notebooks.notebook_path(name), as_version=4)


def _repo_files() -> set[str]:
    """Tracked files and new ones not ignored (a file about to be committed counts; a build output does not)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    files = set(out.split())
    # configs/ is a link to zoo_core/configs/: git lists the link, a reader opens the files through it.
    return files | {"configs/" + f[len("zoo_core/configs/"):] for f in files if f.startswith("zoo_core/configs/")}


def test_every_notebook_is_known_to_the_script():
    assert {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")} == set(run_notebooks.NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_stored_executed_with_its_figures(name):
    nb = _read(name)
    assert nb.metadata.get("run_notebooks") == {"smoke": False}, \
        f"store it executed at full size: python notebooks/run_notebooks.py {name}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "executed top to bottom, once"
    assert not run_notebooks.errors(nb)
    assert len(run_notebooks.images(nb)) >= run_notebooks.NOTEBOOKS[name]
    assert not any("execution" in c.metadata for c in code), "no timing metadata (stored outputs stay stable)"
    figures = run_notebooks.key_figures(nb)
    assert set(figures) == NOTEBOOKS[name][1]
    for fig, png in figures.items():
        path = run_notebooks.FIGURE_DIR / f"{fig}.png"
        assert path.read_bytes() == png, f"{path} is not the notebook's figure: rerun run_notebooks.py {name}"
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.get("output_type") == "stream")
    assert "/tmp" not in text and "WARNING" not in text, "outputs carry no temporary paths or log noise"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_references_only_files_and_functions_in_the_repository(name):
    package = NOTEBOOKS[name][0]
    files = _repo_files()
    basenames = {f.rsplit("/", 1)[-1] for f in files}
    for cell in _read(name).cells:
        src = cell.source
        assert not re.search(r"(?<![\w.])/(?:work|shared|home|root|mnt)/", src), f"a path outside the repository:\n{src}"
        assert "§" not in src, f"a section of a spec that is not in the repository:\n{src}"
        if cell.cell_type != "markdown":
            continue
        for ref in FILE_REF.findall(src):
            ok = ref in files if "/" in ref else ref in basenames
            assert ok, f"{name} cites {ref!r}, which is not in the repository"
        for ref in DOTTED_REF.findall(src):
            if FILE_REF.fullmatch(ref):
                continue                                       # a file, checked above
            head, *rest = ref.split(".")
            if head in PACKAGES:
                module, attrs = head, rest
            elif (ROOT / package / f"{head}.py").exists():
                module, attrs = f"{package}.{head}", rest
            else:
                continue                                   # a Python expression, not a reference
            obj = importlib.import_module(module)
            for i, attr in enumerate(attrs):
                if not hasattr(obj, attr):
                    obj = importlib.import_module(".".join([module] + attrs[: i + 1]))
                else:
                    obj = getattr(obj, attr)


def test_script_refuses_unknown_notebooks(capsys):
    with pytest.raises(SystemExit) as e:
        run_notebooks.main(["no_such_notebook"])
    assert e.value.code == 2 and "unknown notebook" in capsys.readouterr().err


def test_script_names_the_extra_when_a_package_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "nbclient", None)     # find_spec answers None: not installed
    with pytest.raises(SystemExit) as e:
        run_notebooks.main(["agf_filters", "--smoke"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: running the notebooks needs the [notebooks] extra (nbclient not installed): "
                   "pip install 'linear-attention-zoo[notebooks]'"]


def test_the_kernel_starts_without_the_unencrypted_tcp_warning(tmp_path, capfd):
    # The kernel talks over IPC sockets in a private folder, so ipykernel's "running over TCP without
    # encryption" warning (printed to the inherited stderr at every start) is not raised at all.
    import os
    import sys

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    sockets = tmp_path / "s"
    sockets.mkdir()
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    run_notebooks.notebook_client(nb, timeout=120, path=tmp_path, socket_dir=str(sockets)).execute(env=env)
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    err = capfd.readouterr().err
    assert "without encryption" not in err, err
    assert dict(run_notebooks.kernel_config(str(sockets)))["KernelManager"]["transport"] == "ipc"
    assert list(sockets.iterdir()) == []   # the socket files are removed with the kernel
