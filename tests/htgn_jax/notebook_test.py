"""The HTGN graphs notebook runs end to end in smoke mode (through notebooks/run_notebooks.py, on a copy)
and draws its figures."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "htgn_graphs.ipynb"
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "notebooks" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)


def test_notebook_executes_in_smoke_mode_and_draws(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    monkeypatch.delenv("HTGN_NW_WORKDIR", raising=False)
    stored = NOTEBOOK.read_bytes()
    nb = run_notebooks.execute("htgn_graphs", smoke=True, output_dir=tmp_path)   # raises on a failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not run_notebooks.errors(nb)
    # Stencil graphs, spectral encodings, attention maps, offset profile, FAVOR+ error.
    assert len(run_notebooks.images(nb)) >= 5
    assert (tmp_path / "htgn_graph_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "max |L u_k - lambda_k u_k|" in text and "restored step 2" in text
    assert (tmp_path / "htgn_graphs.ipynb").exists() and NOTEBOOK.read_bytes() == stored
