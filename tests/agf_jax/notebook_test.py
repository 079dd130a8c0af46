"""notebooks/agf_filters.ipynb runs top to bottom (smoke mode, through notebooks/run_notebooks.py) and draws
its figures; plus the two analysis helpers that exist for it (`attention_probes`, `operator_oversmoothing`)."""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import analysis
from agf_jax.model import Model
from tests.environment import fast_compile_xla_flags
from zoo_core.testing import F32_MODEL

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "notebooks" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)
B, T = 2, 7


def test_notebook_runs_and_plots(tmp_path):
    """Smoke size, on a copy in tmp_path: every cell runs, the 4 figures are drawn, the key one is saved."""
    pytest.importorskip("nbclient")
    run_notebooks.smoke_check("agf_filters", tmp_path, xla_flags=fast_compile_xla_flags())   # raises on a failing cell or a missing figure
    assert (tmp_path / "agf_filter.png").is_file()


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
