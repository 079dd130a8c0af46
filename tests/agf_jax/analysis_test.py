"""Tests of the filter-analysis API (agf_jax/analysis.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import analysis
from agf_jax.layers import AGFAttention
from agf_jax.model import VARIANTS, Model
from zoo_core.testing import F32_SIMPLE

B, T, E, H, D = 2, 7, 8, 2, 4
X = np.asarray(jax.random.normal(jax.random.key(0), (B, T, E)))


def _layer_vars(layer, seed=0, theta=(0.6, -0.5)):
    v = jax.jit(layer.init)(jax.random.key(seed), X)
    params = dict(v["params"])
    params["theta"] = jnp.asarray(theta, jnp.float32)
    return {"params": params}


def _model_params(model, batch):
    """A model's params tree with the real structure, filled with zeros (no model compile)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), batch)["params"]
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


def test_filter_coefficients_and_response():
    model = Model(kind="uea_classifier", variant="tiny", num_classes=3, feat_dim=2, max_len=T,
                  order=2, basis="monomial", learn_c0=True)
    params = _model_params(model, {"inputs": np.zeros((B, T, 2), np.float32)})
    coeffs = analysis.filter_coefficients_of({"params": params})
    assert list(coeffs) == ["block_00/attention", "block_01/attention"]
    # learn_c0 at init: every coefficient is tanh(0) = 0, so the filter is identically 0.
    s, g = analysis.filter_response(params, basis="monomial", num_points=11)
    assert s.shape == (11,) and all(np.all(gi == 0.0) for gi in g.values())
    params["block_01"]["attention"]["theta_0"] = np.float32(0.2)
    params["block_01"]["attention"]["theta"] = np.array([0.5, -1.0], np.float32)
    c = analysis.filter_coefficients_of(params)["block_01/attention"]
    np.testing.assert_allclose(c, np.tanh([0.2, 0.5, -1.0]), **F32_SIMPLE)
    s, g = analysis.filter_response(params, basis="monomial", num_points=5)
    np.testing.assert_allclose(g["block_01/attention"], c[0] + c[1] * s + c[2] * s ** 2,
                               **F32_SIMPLE)
    # Frozen c_0 (LRA) with theta = 0: g == 1.
    lra = Model(kind="lra_classifier", variant="tiny", num_classes=2, vocab_size=5, max_len=8,
                order=3)
    pl = _model_params(lra, {"inputs": np.ones((1, 4), np.int32)})
    _, gl = analysis.filter_response(pl, basis="jacobi", alpha=2.0, beta=-1.0)
    assert list(gl) == ["encoder/block_00/attention", "encoder/block_01/attention"]
    assert all(np.all(gi == 1.0) for gi in gl.values())


@pytest.mark.parametrize("causal", [False, True])
def test_implicit_attention_reproduces_the_layer(causal):
    layer = AGFAttention(num_heads=H, head_dim=D, order=2, causal=causal)
    v = _layer_vars(layer, seed=3)
    mask = np.arange(T)[None] < np.array([[T], [5]])
    hmat = analysis.implicit_attention(layer, v, X, mask=mask)
    assert hmat.shape == (B, H, T, T)
    if causal:
        assert np.all(np.triu(hmat, 1) == 0.0)
    y, f = jax.jit(lambda v, x, mask: (layer.apply(v, x, mask=mask)[0],
                                       layer.apply(v, x, mask=mask, method="factors")))(v, X, mask)
    o = np.einsum("bhtj,bjhd->bthd", hmat, np.asarray(f["value"]))
    p = jax.tree.map(np.asarray, v["params"]["out"])
    np.testing.assert_allclose(np.einsum("bthd,hde->bte", o, p["kernel"]) + p["bias"], y,
                               **F32_SIMPLE)
    sm = analysis.softmax_attention_matrix(layer, v, X, mask=mask)
    np.testing.assert_allclose(sm.sum(-1), 1.0, **F32_SIMPLE)
    assert np.all(sm[1, :, :, 5:] < 1e-6)      # padded keys get no softmax weight


def test_frequency_energy():
    t = 8
    y = np.random.default_rng(0).normal(size=(2, t, 3))
    low, high = analysis.frequency_energy(y, axis=1)
    np.testing.assert_allclose(low + high, t * np.sum(y ** 2, axis=1), rtol=1e-10)   # Parseval
    np.testing.assert_allclose(low, t ** 2 * np.mean(y, axis=1) ** 2, rtol=1e-10)    # DC term
    const = np.ones((1, t, 1))
    alt = np.cos(np.pi * np.arange(t))[None, :, None]                             # Nyquist only
    assert analysis.high_frequency_fraction(const)[0] == 0.0
    np.testing.assert_allclose(analysis.high_frequency_fraction(alt)[0], 1.0)
    low2, _ = analysis.frequency_energy(np.cos(2 * np.pi * np.arange(t) / t)[None, :, None],
                                        num_low=2)
    np.testing.assert_allclose(low2, t ** 2 / 2)   # the |f| = 1 pair counts as low with num_low=2
    with pytest.raises(ValueError):
        analysis.frequency_energy(y, num_low=0)


def test_frequency_comparison_softmax_is_low_pass_agf_is_not():
    # With zero query/key kernels and biases, softmax attention is the uniform average (a pure DC
    # output), while AGF keeps token-specific spectra g_t from the Sigma projection.
    layer = AGFAttention(num_heads=H, head_dim=D, order=2)
    v = _layer_vars(layer, seed=4, theta=(0.9, -0.9))
    params = jax.tree.map(lambda x: x, v["params"])
    for name in ("query", "key"):
        params[name] = jax.tree.map(np.zeros_like, params[name])
    res = analysis.frequency_comparison(layer, {"params": params}, X)
    assert set(res) == {"input", "agf", "softmax", "agf_gain", "softmax_gain"}
    assert res["agf"].shape == (B, H)
    np.testing.assert_allclose(res["softmax"], 0.0, atol=1e-12)
    assert np.all(res["agf"] > 1e-3) and np.all(res["input"] > 0.1)
    assert np.all(res["softmax_gain"] < 1e-10) and np.all(res["agf_gain"] > 1e-6)


def test_token_cosine_similarity():
    same = np.tile(np.array([1.0, 2.0, 3.0]), (1, 4, 1))
    np.testing.assert_allclose(analysis.token_cosine_similarity(same), [1.0])
    onehot = np.eye(4)[None]
    np.testing.assert_allclose(analysis.token_cosine_similarity(onehot), [0.0])
    mixed = np.concatenate([same[:, :3], -same[:, :1]], axis=1)
    np.testing.assert_allclose(analysis.token_cosine_similarity(mixed, np.array([[1, 1, 1, 0]])),
                               [1.0])
    with pytest.raises(ValueError):
        analysis.token_cosine_similarity(same[0])


def test_oversmoothing_profile():
    model = Model(kind="lra_classifier", variant="tiny", num_classes=2, vocab_size=10, max_len=8,
                  order=2)
    batch = {"inputs": jnp.array([[1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 0, 0, 0, 0]], jnp.int32)}
    v = model.init(jax.random.key(5), batch)
    prof = analysis.oversmoothing_profile(model, v, batch)
    assert prof.shape == (VARIANTS["tiny"]["num_layers"] + 1, B)
    assert np.all(np.isfinite(prof)) and np.all(np.abs(prof) <= 1.0 + 1e-9)
    _, state = model.apply(v, batch, mutable=["intermediates"])
    h0 = state["intermediates"]["encoder"]["hidden_states"][0]
    np.testing.assert_allclose(prof[0], analysis.token_cosine_similarity(
        h0, np.asarray(batch["inputs"]) != 0), rtol=1e-12)


def test_oversmoothing_profile_with_cls_pooling_masks_the_shifted_tokens():
    """With a CLS token the encoder holds input token t at position t + 1 (the last one dropped)."""
    model = Model(kind="lra_classifier", variant="tiny", num_classes=2, vocab_size=10, max_len=8,
                  order=2, pooling="cls")
    batch = {"inputs": jnp.array([[1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 0, 0, 0, 0]], jnp.int32)}
    v = model.init(jax.random.key(5), batch)
    shifted = np.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)       # CLS + 3 tokens in row 1
    np.testing.assert_allclose(analysis.oversmoothing_profile(model, v, batch),
                               analysis.oversmoothing_profile(model, v, batch, mask=shifted), rtol=0)
