"""The HTGN graphs notebook runs end to end in smoke mode and draws its figures."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "htgn_graphs.ipynb"


def test_notebook_executes_in_smoke_mode_and_draws(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook with its outputs stripped"
    monkeypatch.setenv("ZOO_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("HTGN_NW_WORKDIR", raising=False)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()   # raises CellExecutionError on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    # Stencil graphs, spectral encodings, attention maps, offset profile, FAVOR+ error.
    assert len(images) >= 5
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "max |L u_k - lambda_k u_k|" in text and "restored step 2" in text
