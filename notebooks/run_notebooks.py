"""Re-executes the notebooks, stores them with their outputs and saves their key figures as PNG files.

    python notebooks/run_notebooks.py                      # every notebook, full size, in place + docs/figures/
    python notebooks/run_notebooks.py agf_filters          # one notebook (names without .ipynb)
    python notebooks/run_notebooks.py --smoke              # smoke size (seconds), into a fresh temporary folder
    python notebooks/run_notebooks.py --output-dir DIR     # executed copies and figures into DIR, repository untouched

Each notebook runs in a fresh `python3` kernel of the interpreter running this script, on one CPU device
(`--platform` to change), with `ZOO_NOTEBOOK_SMOKE=1` under `--smoke`. A code cell tagged `figure:NAME`
(cell metadata `tags`) holds a key figure: its first PNG output is written to `<figures dir>/NAME.png`,
byte for byte the image stored in the notebook (README.md shows them from docs/figures/). A run fails, and
writes nothing, when a cell raises, when a notebook draws fewer figures than `NOTEBOOKS` expects, or when a
tagged cell draws none. The tests (`tests/*/notebook_test.py`) call `execute` at smoke size on copies.
"""
from __future__ import annotations

import argparse
import base64
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from zoo_core import checks, extras

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
FIGURE_DIR = ROOT / "docs" / "figures"
# name -> the number of figures (image/png outputs) it must draw.
NOTEBOOKS = {"agf_filters": 4, "samovar_var": 5, "htgn_graphs": 5}
FIGURE_TAG = "figure:"
DPI = 80        # inline figures: small enough to keep the stored notebooks light, large enough to read


def notebook_path(name: str) -> pathlib.Path:
    return NOTEBOOK_DIR / f"{name}.ipynb"


def kernel_env(*, smoke: bool, platform: str = "cpu", tmpdir: str | None = None,
               xla_flags: str = "") -> dict[str, str]:
    """The kernel's environment: this one, plus the interpreter, the repository, the device and the size;
    XLA_FLAGS is `xla_flags` (one device: the tests' conftest asks for two fake ones)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])   # kernelspec runs `python`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["XLA_FLAGS"] = xla_flags
    if platform:
        env["JAX_PLATFORMS"] = platform
    else:
        env.pop("JAX_PLATFORMS", None)
    env.pop("ZOO_NOTEBOOK_SMOKE", None)
    if smoke:
        env["ZOO_NOTEBOOK_SMOKE"] = "1"
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"    # compile time dominates at smoke size
    if tmpdir:
        env["TMPDIR"] = tmpdir
    return env


def images(nb) -> list[bytes]:
    """Every PNG output of the notebook, in order."""
    return [base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if "image/png" in o.get("data", {})]


def key_figures(nb) -> dict[str, bytes]:
    """{NAME: PNG bytes} of the cells tagged `figure:NAME` (their first PNG output; b'' if none)."""
    figures = {}
    for cell in nb.cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            if tag.startswith(FIGURE_TAG):
                pngs = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
                figures[tag[len(FIGURE_TAG):]] = base64.b64decode(pngs[0]) if pngs else b""
    return figures


def errors(nb) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def check(name: str, nb) -> None:
    """Raises if the executed notebook has an error output, too few figures, or a tagged cell without one."""
    problems = errors(nb)
    n = len(images(nb))
    if n < NOTEBOOKS.get(name, 1):
        problems.append(f"{n} figures, expected at least {NOTEBOOKS.get(name, 1)}")
    problems += [f"cell tagged {FIGURE_TAG}{k} drew no figure" for k, v in key_figures(nb).items() if not v]
    if problems:
        raise RuntimeError(f"{name}: " + "; ".join(problems))


def kernel_config(socket_dir: str):
    """The kernel manager's settings: the IPC transport, Unix sockets in `socket_dir`, where the platform
    has it. A local kernel needs no TCP port, and over TCP ipykernel warns at every start that it runs
    without encryption; over IPC the sockets are files only this user can reach, and there is no warning.
    Windows (no IPC in ZeroMQ) and a socket folder too long for a socket path keep TCP."""
    from traitlets.config import Config

    if os.name == "nt" or len(os.path.join(socket_dir, "kernel-99")) > 100:
        return Config()
    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(socket_dir, "kernel")}})


def notebook_client(nb, *, timeout: int, path: str | os.PathLike, socket_dir: str):
    """The nbclient client that runs `nb` in a fresh `python3` kernel, working directory `path`."""
    import nbclient

    return nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                   resources={"metadata": {"path": str(path)}}, config=kernel_config(socket_dir))


def execute(name: str, *, smoke: bool, output_dir: str | os.PathLike | None = None,
            figures_dir: str | os.PathLike | None = None, platform: str = "cpu", timeout: int = 1800,
            xla_flags: str = ""):
    """Executes notebooks/<name>.ipynb in a fresh kernel and writes it with its outputs, and its key figures.

    output_dir: where the executed notebook goes (None = in place) and the kernel's working directory;
    figures_dir: where the key figures go (None = docs/figures/ in place, output_dir otherwise);
    xla_flags: the kernel's XLA_FLAGS.
    Returns the executed notebook (nbformat node).
    """
    import nbformat

    src = notebook_path(name)
    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:                  # a failed run must not leave stale outputs behind
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    target = pathlib.Path(output_dir) / src.name if output_dir else src
    if output_dir:
        pathlib.Path(output_dir).mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"nb_{name}_", dir=output_dir)   # the kernel's TMPDIR: workdirs, data
    rc = pathlib.Path(tmp) / "matplotlibrc"
    rc.write_text(f"figure.dpi: {DPI}\n")
    env = kernel_env(smoke=smoke, platform=platform, tmpdir=tmp, xla_flags=xla_flags)
    env["MATPLOTLIBRC"] = str(rc)
    sockets = tempfile.mkdtemp(prefix="zk_")   # short: a Unix socket path has at most ~100 characters
    client = notebook_client(nb, timeout=timeout, path=target.parent, socket_dir=sockets)
    try:
        client.execute(env=env)            # raises CellExecutionError on the first failing cell
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
    nb.metadata["run_notebooks"] = {"smoke": smoke}
    check(name, nb)

    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    out = pathlib.Path(figures_dir) if figures_dir else (pathlib.Path(output_dir) if output_dir else FIGURE_DIR)
    out.mkdir(parents=True, exist_ok=True)
    for fig, png in key_figures(nb).items():
        (out / f"{fig}.png").write_bytes(png)
    return nb


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def smoke_check(name: str, output_dir: str | os.PathLike, *, xla_flags: str = ""):
    """The tests' check of one notebook: executed at smoke size on a copy in `output_dir` (the kernel's
    XLA_FLAGS: `xla_flags`), it must run every cell, draw its figures (`check`), write each key figure
    there as a PNG and leave the stored notebook untouched. Returns the executed notebook."""
    stored = notebook_path(name).read_bytes()
    nb = execute(name, smoke=True, output_dir=output_dir, xla_flags=xla_flags)   # raises on a failing cell
    out = pathlib.Path(output_dir)
    figures = key_figures(nb)
    if not figures or any((out / f"{fig}.png").read_bytes()[:8] != PNG_MAGIC for fig in figures):
        raise RuntimeError(f"{name}: key figures {sorted(figures)} not all written as PNG to {out}")
    if not (out / f"{name}.ipynb").exists() or notebook_path(name).read_bytes() != stored:
        raise RuntimeError(f"{name}: the smoke run did not go to the copy in {out}")
    return nb


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of this script (a bad one is one `error:` line, exit status 2)."""
    parser = checks.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"notebooks to run (default: all of {', '.join(NOTEBOOKS)})")
    parser.add_argument("--smoke", action="store_true", help="smoke size (ZOO_NOTEBOOK_SMOKE=1); "
                        "without --output-dir it writes into a fresh temporary folder, never in place")
    parser.add_argument("--output-dir", help="write the executed notebooks and figures here instead")
    parser.add_argument("--figures-dir", help="write the key figures here (default: docs/figures/ or --output-dir)")
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS of the kernel ('' = JAX's choice)")
    parser.add_argument("--timeout", type=checks.positive_int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n.removesuffix(".ipynb") not in NOTEBOOKS]
    if unknown:
        parser.error(f"unknown notebook(s) {unknown}; expected some of {list(NOTEBOOKS)}")
    checks.check_output_paths(parser, args, dirs=["output_dir", "figures_dir"])
    problem = platform_problem(args.platform)
    if problem:
        parser.error(f"--platform {args.platform!r}: {problem}")
    return args


def platform_problem(platform: str) -> str | None:
    """Why JAX cannot start `platform` here (its own last line), or None. Asked of a separate process:
    starting an accelerator here would hold its memory while the kernel runs."""
    if platform in ("", "cpu"):
        return None
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                           env=dict(os.environ, JAX_PLATFORMS=platform), timeout=300)
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return f"JAX cannot start it here ({lines[-1] if lines else f'exit status {probe.returncode}'})"


NOTEBOOK_PACKAGES = ("nbclient", "nbformat", "ipykernel")   # of the [notebooks] extra: what running them imports


def main(argv=None) -> int:
    args = parse_args(argv)
    extras.require_or_exit("notebooks", "running the notebooks", NOTEBOOK_PACKAGES)
    names = [n.removesuffix(".ipynb") for n in args.names] or list(NOTEBOOKS)
    output_dir = args.output_dir or (tempfile.mkdtemp(prefix="notebooks_smoke_") if args.smoke else None)
    for name in names:
        nb = execute(name, smoke=args.smoke, output_dir=output_dir, figures_dir=args.figures_dir,
                     platform=args.platform, timeout=args.timeout)
        where = pathlib.Path(output_dir or NOTEBOOK_DIR) / f"{name}.ipynb"
        print(f"{name}: {len(images(nb))} figures -> {where}; key figures: {sorted(key_figures(nb)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
