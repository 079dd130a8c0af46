"""notebooks/agf_filters.ipynb runs top to bottom (smoke mode) and draws its figures; plus the two
analysis helpers that exist for it (`attention_probes`, `operator_oversmoothing`)."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import analysis
from agf_jax.model import Model
from zoo_core.testing import F32_MODEL

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "agf_filters.ipynb"
B, T = 2, 7


def test_notebook_runs_and_plots(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "outputs are stripped"
    # The kernel inherits this environment: a few training steps, one plain CPU device, fast compiles.
    monkeypatch.setenv("ZOO_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=240,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()   # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 4, f"expected the 4 figures, got {len(images)} images"


@pytest.mark.parametrize("kind", ["uea_classifier", "lra_classifier"])
def test_attention_probes_reproduce_the_blocks_attention(kind):
    if kind == "uea_classifier":
        model = Model(kind=kind, variant="tiny", num_classes=3, feat_dim=2, max_len=T, order=2,
                      basis="legendre", learn_c0=True)
        batch = {"inputs": jax.random.normal(jax.random.key(1), (B, T, 2)),
                 "mask": jnp.arange(T)[None] < jnp.array([[T], [4]])}
    else:
        model = Model(kind=kind, variant="tiny", num_classes=3, vocab_size=16, max_len=8, order=2,
                      alpha=2.0, beta=-1.0, ortho_weight=0.01)
        batch = {"inputs": jnp.array([[3, 5, 7, 9, 2, 4, 6], [1, 2, 3, 4, 0, 0, 0]], jnp.int32)}
    variables = model.init(jax.random.key(0), batch)
    probes = analysis.attention_probes(model, variables, batch)
    assert [p["name"].split("/")[-2] for p in probes] == ["block_00", "block_01"]
    # Each rebuilt layer on its probed input gives the block's attention output, as sown by Flax.
    _, state = model.apply(variables, batch, capture_intermediates=True, mutable=["intermediates"])
    inter = state["intermediates"]
    tree = inter["encoder"] if kind == "lra_classifier" else inter
    for i, p in enumerate(probes):
        want = tree[f"block_{i:02d}"]["attention"]["__call__"][0][0]
        got, _ = p["layer"].apply(p["variables"], p["x"], mask=p["mask"])
        np.testing.assert_allclose(got, want, **F32_MODEL)


def test_operator_oversmoothing():
    vals = jax.random.normal(jax.random.key(2), (B, T, 2, 3))
    uniform = np.full((B, 2, T, T), 1.0 / T)      # every token becomes the mean: similarity 1 after one step
    curve = analysis.operator_oversmoothing(uniform, vals, num_steps=2)
    assert curve.shape == (3, B)
    np.testing.assert_allclose(curve[0], analysis.token_cosine_similarity(np.reshape(vals, (B, T, 6))))
    np.testing.assert_allclose(curve[1:], 1.0, atol=1e-12)
    identity = np.broadcast_to(np.eye(T), (B, 2, T, T))
    np.testing.assert_allclose(analysis.operator_oversmoothing(identity, vals, num_steps=3),
                               np.repeat(curve[:1], 4, axis=0), atol=1e-12)
    with pytest.raises(ValueError, match="matrix must be"):
        analysis.operator_oversmoothing(uniform[:, :1], vals)
