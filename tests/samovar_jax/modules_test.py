"""Tests of samovar_jax.modules: norms, tokeniser layout, embeddings, structural matrix, dtype policy
(the causal attention layers: layers_test.py; argument errors: the table there)."""
import jax
import jax.numpy as jnp
import numpy as np

from samovar_jax import modules, ops
from zoo_core.testing import F32_SIMPLE

B, T, E, H = 2, 7, 8, 2


def _x(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def test_rms_norms_match_formula():
    x = _x((B, T, H, 4), 3) * 3.0
    y = modules.RMSNorm(4).apply({"params": {"scale": jnp.full((4,), 2.0)}}, x)
    want = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-5) * 2.0
    np.testing.assert_allclose(y, want, **F32_SIMPLE)
    g = _x((H, 4), 4)
    y = modules.MultiHeadRMSNorm(H, 4).apply({"params": {"scale": g}}, x)
    np.testing.assert_allclose(y, x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-8) * g, **F32_SIMPLE)


def test_tokenizer_layout_and_univariate():
    seg = _x((B, 3, 4, 5), 5)                                         # C=3 channels, N=4 patches, P=5
    tok = modules.ARXTokenizer(5, 3, 2, E)                             # C_t = 2 (the last two channels)
    variables = tok.init(jax.random.PRNGKey(0), seg)
    out = tok.apply(variables, seg)
    assert out.shape == (B, 2, 8, E)
    p = variables["params"]
    endo = ops.rms_norm(seg[:, 1:] @ p["endogenous"]["kernel"] + p["endogenous"]["bias"],
                        p["endogenous_norm"]["scale"], 1e-5)
    mixed = jnp.einsum("bcnp,ck->bknp", seg, p["channel_mix"]["kernel"]) + p["channel_mix"]["bias"][:, None, None]
    exo = ops.rms_norm(mixed @ p["exogenous"]["kernel"] + p["exogenous"]["bias"], p["exogenous_norm"]["scale"], 1e-5)
    np.testing.assert_allclose(out[:, :, 1::2], endo, **F32_SIMPLE)   # odd = endogenous
    np.testing.assert_allclose(out[:, :, 0::2], exo, **F32_SIMPLE)    # even = exogenous, first
    uni = modules.ARXTokenizer(5, 3, 2, E, univariate=True)
    uv = uni.init(jax.random.PRNGKey(0), seg)
    assert set(uv["params"]) == {"endogenous", "endogenous_norm"}
    np.testing.assert_array_equal(uni.apply(uv, seg)[:, :, 0::2], 0.0)


def test_embedding_layout():
    emb = modules.ARXEmbedding(2, 8, E)
    v = emb.init(jax.random.PRNGKey(0), jnp.arange(6))
    p = v["params"]
    out = emb.apply(v, jnp.arange(6))
    t = 5                                                             # patch 2, endogenous
    want = p["position"][2] + p["channel"][:, 5] + p["type"][1] + p["channel_type"][:, 1]
    np.testing.assert_allclose(out[:, t], want, **F32_SIMPLE)
    lin = modules.ARXEmbedding(2, 8, E, with_types=False)
    lv = lin.init(jax.random.PRNGKey(0), jnp.arange(6))
    np.testing.assert_allclose(lin.apply(lv, jnp.arange(6))[:, t],
                               lv["params"]["position"][5] + lv["params"]["channel"][:, 5], **F32_SIMPLE)


def test_structural_matrix_inverse_option():
    v = modules.StructuralMatrix(H, 4).init(jax.random.PRNGKey(0), method="matrix")
    d = modules.StructuralMatrix(H, 4).apply(v, method="matrix")
    d_inv = modules.StructuralMatrix(H, 4, inverse=True).apply(v, method="matrix")
    np.testing.assert_allclose(d @ d_inv, np.broadcast_to(np.eye(4), (H, 4, 4)), **F32_SIMPLE)
    x = _x((B, H, 4), 6)
    y = modules.StructuralMatrix(H, 4).apply(v, x)
    np.testing.assert_allclose(y, np.einsum("bhd,hde->bhe", x, d), **F32_SIMPLE)
    # samovar.md §5 init: D ~ softplus(~0) I = 0.69 I plus small terms.
    np.testing.assert_allclose(np.diagonal(d, axis1=1, axis2=2), np.log(2.0), atol=0.3)


def test_norm_dtype_policy_bfloat16():
    y = modules.RMSNorm(E, dtype=jnp.bfloat16).apply({"params": {"scale": jnp.ones(E)}}, _x((B, T, E)))
    assert y.dtype == jnp.bfloat16
