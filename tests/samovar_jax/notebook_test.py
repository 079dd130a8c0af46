"""The SAMoVAR notebook runs end to end (smoke mode, through notebooks/run_notebooks.py) and the attention-map
helpers it uses are right."""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax import analysis, ops
from samovar_jax.model import Model
from tests.environment import fast_compile_xla_flags
from zoo_core.testing import F32_SIMPLE

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "notebooks" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)
X = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 2)) * 2.0 + 1.0
BASE = dict(num_channels=2, input_len=10, patch_len=3, variant="tiny", width=8)


def _init(model):
    """Jitted init: an eager first init dispatches (and compiles) every primitive one by one, ~10x slower."""
    return jax.jit(lambda key: model.init(key, {"inputs": X}))(jax.random.PRNGKey(1))["params"]


def test_notebook_executes_in_smoke_mode_and_draws(tmp_path):
    """Smoke size, on a copy in tmp_path: every cell runs, the 5 figures are drawn, the key ones are saved
    (the implied VAR coefficients, Fig. 5's temporal-influence paths and Fig. 4 from the study's curves)."""
    pytest.importorskip("nbclient")
    nb = run_notebooks.smoke_check("samovar_var", tmp_path, xla_flags=fast_compile_xla_flags())   # raises on a failing cell or a missing figure
    assert len(run_notebooks.images(nb)) == 5
    for name in ("samovar_var_coefficients", "samovar_fig5_paths", "samovar_fig4_study"):
        assert (tmp_path / f"{name}.png").is_file(), name


@pytest.mark.parametrize("kw", [dict(kind="samovar"), dict(kind="fixedvar"), dict(kind="samovar", use_key_proj=True)])
def test_var_attention_maps_reproduce_every_layer_output(kw):
    model = Model(**BASE, **kw)
    params = _init(model)
    # jitted: eager op-by-op dispatch of the whole model costs far more than compiling it once
    maps = jax.jit(lambda p: analysis.var_attention_maps(model, p, {"inputs": X}))(params)   # [L, B, C, H, T, T]
    terms = jax.jit(lambda p: model.apply({"params": p}, {"inputs": X}, method="var_terms"))(params)
    fold = lambda a: a.reshape((-1,) + a.shape[-3:])  # noqa: E731
    q = jnp.stack([fold(a) for a in terms["q"]])
    v = jnp.stack([fold(a) for a in terms["v"]])
    o = ops.var_chain_parallel(fold(terms["x0"]), q, v, key_kernels=terms["key_kernels"])   # [L, B', T, H, D]
    t = maps.shape[-1]
    assert maps.shape == (2, 2, 2, 2, t, t)
    flat = maps.reshape((2, -1) + maps.shape[3:])                                     # [L, B', H, T, T]
    np.testing.assert_allclose(jnp.einsum("lbhts,lbshd->lbthd", flat, v), o, **F32_SIMPLE)
    np.testing.assert_array_equal(np.triu(np.asarray(maps), 1), 0.0)


def test_lintrans_attention_maps_reproduce_the_attention_outputs():
    model = Model(**BASE, kind="lintrans")
    params = _init(model)
    maps = jax.jit(lambda p: analysis.attention_maps(model, p, {"inputs": X}))(params)   # [L, B, C, H, T, T]
    keep = lambda mdl, _: getattr(mdl, "name", None) in ("value", "out")  # noqa: E731
    _, state = model.apply({"params": params}, {"inputs": X}, capture_intermediates=keep, mutable=["intermediates"])
    r = model.resolved
    for i in range(r.num_layers):
        att = state["intermediates"][f"block_{i:02d}"]["attention"]
        v = att["value"]["__call__"][0].reshape(-1, maps.shape[-1], r.num_heads, r.head_dim)
        o = jnp.einsum("bhts,bshd->bthd", maps[i].reshape((-1,) + maps.shape[3:]), v).reshape(v.shape[:2] + (-1,))
        p = params[f"block_{i:02d}"]["attention"]["out"]
        np.testing.assert_allclose(o @ p["kernel"] + p["bias"], att["out"]["__call__"][0], **F32_SIMPLE)
    with pytest.raises(ValueError, match="kind='lintrans'"):
        analysis.lintrans_attention_maps(Model(**BASE, kind="samovar"), params, {"inputs": X})
