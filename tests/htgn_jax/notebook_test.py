"""The HTGN graphs notebook runs end to end in smoke mode (through notebooks/run_notebooks.py, on a copy)
and draws its figures."""
import importlib.util
import pathlib

import pytest

from tests.environment import fast_compile_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "notebooks" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)


def test_notebook_executes_in_smoke_mode_and_draws(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    monkeypatch.delenv("HTGN_NW_WORKDIR", raising=False)
    nb = run_notebooks.smoke_check("htgn_graphs", tmp_path, xla_flags=fast_compile_xla_flags())   # raises on a failing cell or a missing figure
    assert (tmp_path / "htgn_graph_attention.png").is_file()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "max |L u_k - lambda_k u_k|" in text and "restored step 2" in text
