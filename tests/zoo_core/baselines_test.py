"""The Linformer and Nyströmformer baselines (zoo_core.baselines; docs/specs/baselines.md): the
equality properties of the spec on softmax's parameters, the options, the refusals, and a training
step. The layer contract itself (padding, jit, bf16) is checked in tests/contract_test.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax.layers import SoftmaxAttention
from zoo_core import attention
from zoo_core.baselines import linformer, nystromformer
from zoo_core.testing import F32_SIMPLE

B, T, E, HEADS = 2, 7, 16, 2
D = E // HEADS


@functools.lru_cache(maxsize=None)
def _inputs():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (B, T, E)))
    mask = np.arange(T)[None, :] < np.array([[T], [T - 3]])
    return x, mask


@functools.lru_cache(maxsize=None)
def _softmax():
    """(layer, params, y without mask, y with mask) of the softmax baseline."""
    x, mask = _inputs()
    lay = SoftmaxAttention(num_heads=HEADS, head_dim=D)
    params = jax.jit(lay.init)(jax.random.PRNGKey(0), x)
    return lay, params, lay.apply(params, x)[0], lay.apply(params, x, mask=mask)[0]


def _with_softmax_params(lay, **extra):
    """lay's parameters with softmax's query/key/value/out copied in (and `extra` set)."""
    x, _ = _inputs()
    own = jax.jit(lay.init)(jax.random.PRNGKey(1), x)["params"]
    soft = _softmax()[1]["params"]
    shared = {k: soft[k] for k in ("query", "key", "value", "out")}
    for k, v in shared.items():    # same names and shapes
        assert jax.tree_util.tree_map(jnp.shape, own[k]) == jax.tree_util.tree_map(jnp.shape, v), k
    return {"params": {**own, **shared, **extra}}


def test_parameter_trees_are_softmax_plus_their_own():
    x, _ = _inputs()
    names = lambda lay: set(jax.eval_shape(lay.init, jax.random.PRNGKey(0), x)["params"])
    base = names(SoftmaxAttention(num_heads=HEADS, head_dim=D))
    assert base == {"query", "key", "value", "out"}
    lin = dict(num_heads=HEADS, head_dim=D, max_length=10, proj_len=4)
    assert names(linformer.LinformerAttention(**lin)) == base | {"proj_key", "proj_value"}
    assert names(linformer.LinformerAttention(**lin, share_kv=True)) == base | {"proj_kv"}
    shapes = jax.eval_shape(linformer.LinformerAttention(**lin, share_heads=False).init, jax.random.PRNGKey(0), x)
    assert shapes["params"]["proj_key"].shape == (HEADS, 4, 10)
    assert names(nystromformer.NystromformerAttention(num_heads=HEADS, head_dim=D)) == base
    conv = nystromformer.NystromformerAttention(num_heads=HEADS, head_dim=D, conv_kernel=3)
    assert jax.eval_shape(conv.init, jax.random.PRNGKey(0), x)["params"]["conv"].shape == (HEADS, 3)


@pytest.mark.parametrize("share_kv", [False, True])
def test_linformer_with_identity_projections_is_softmax(share_kv):
    """k = n and E = F = I: softmax attention (spec "Linformer", Check), on softmax's parameters."""
    lay = linformer.LinformerAttention(num_heads=HEADS, head_dim=D, max_length=T, proj_len=T, share_kv=share_kv)
    eye = jnp.eye(T)
    params = _with_softmax_params(lay, **({"proj_kv": eye} if share_kv else {"proj_key": eye, "proj_value": eye}))
    y, aux = lay.apply(params, _inputs()[0])
    assert aux == {}
    np.testing.assert_allclose(np.asarray(y), np.asarray(_softmax()[2]), **F32_SIMPLE)


def test_linformer_shorter_input_uses_the_first_columns():
    x, mask = _inputs()
    long = linformer.LinformerAttention(num_heads=HEADS, head_dim=D, max_length=T + 5, proj_len=3)
    params = jax.jit(long.init)(jax.random.PRNGKey(0), x)
    cut = {"params": {**params["params"], **{k: params["params"][k][:, :T] for k in ("proj_key", "proj_value")}}}
    exact = long.clone(max_length=T)
    np.testing.assert_allclose(np.asarray(long.apply(params, x, mask=mask)[0]),
                               np.asarray(exact.apply(cut, x, mask=mask)[0]), **F32_SIMPLE)


def test_nystromformer_with_a_landmark_per_token_is_softmax():
    """m = T and the exact pseudo-inverse: F A^+ B = S S^+ S = S (spec "Nyströmformer", Check), with
    and without padding; enough iterations of the paper's pseudo-inverse give the same."""
    x, mask = _inputs()
    _, _, y_full, y_masked = _softmax()
    for iterations in (None, 30):
        lay = nystromformer.NystromformerAttention(num_heads=HEADS, head_dim=D, num_landmarks=T,
                                                   pinv_iterations=iterations)
        params = _with_softmax_params(lay)
        np.testing.assert_allclose(np.asarray(lay.apply(params, x)[0]), np.asarray(y_full), **F32_SIMPLE)
        y = lay.apply(params, x, mask=mask)[0]
        np.testing.assert_allclose(np.asarray(y)[mask], np.asarray(y_masked)[mask], **F32_SIMPLE)
    # More landmarks than tokens: the empty ones contribute nothing.
    lay = nystromformer.NystromformerAttention(num_heads=HEADS, head_dim=D, num_landmarks=3 * T, pinv_iterations=None)
    y = lay.apply(_with_softmax_params(lay), x, mask=mask)[0]
    np.testing.assert_allclose(np.asarray(y)[mask], np.asarray(y_masked)[mask], **F32_SIMPLE)


def test_iterative_pinv_and_segment_means():
    a = jnp.eye(5) + 0.1 * jax.random.normal(jax.random.PRNGKey(0), (3, 5, 5))
    np.testing.assert_allclose(np.asarray(nystromformer.iterative_pinv(a, 12)), np.asarray(jnp.linalg.pinv(a)),
                               **F32_SIMPLE)
    x = jnp.arange(1.0, 8.0).reshape(1, 7, 1, 1)
    valid = jnp.asarray([[True] * 5 + [False] * 2])
    means, full = nystromformer.segment_means(jnp.where(valid[..., None, None], x, jnp.nan), valid, 3)
    # ceil(7 / 3) = 3 positions per segment: {1, 2, 3}, {4, 5, pad}, {pad}
    np.testing.assert_array_equal(np.asarray(means[0, :, 0, 0]), [2.0, 4.5, 0.0])
    np.testing.assert_array_equal(np.asarray(full), [[True, True, False]])


def test_nystromformer_conv_skip_adds_the_depthwise_convolution_of_v():
    x, mask = _inputs()
    lay = nystromformer.NystromformerAttention(num_heads=HEADS, head_dim=D, num_landmarks=3, conv_kernel=3)
    params = jax.jit(lay.init)(jax.random.PRNGKey(0), x)
    plain = lay.clone(conv_kernel=None)
    no_conv = {"params": {k: v for k, v in params["params"].items() if k != "conv"}}
    zero = {"params": {**params["params"], "conv": jnp.zeros((HEADS, 3))}}
    np.testing.assert_allclose(np.asarray(lay.apply(zero, x, mask=mask)[0]),
                               np.asarray(plain.apply(no_conv, x, mask=mask)[0]), **F32_SIMPLE)
    # kernel [0, 1, 0] adds V itself (the identity convolution)
    v = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, HEADS, D)), jnp.float32)
    ident = jnp.tile(jnp.asarray([[0.0, 1.0, 0.0]]), (HEADS, 1))
    np.testing.assert_array_equal(np.asarray(nystromformer.depthwise_conv(v, ident)), np.asarray(v))
    shifted = nystromformer.depthwise_conv(v, jnp.tile(jnp.asarray([[1.0, 0.0, 0.0]]), (HEADS, 1)))
    np.testing.assert_allclose(np.asarray(shifted[:, 1:]), np.asarray(v[:, :-1]), **F32_SIMPLE)
    np.testing.assert_array_equal(np.asarray(shifted[:, 0]), 0.0)


@pytest.mark.parametrize("name,options", [("linformer", {"max_length": T, "proj_len": 4}),
                                          ("nystromformer", {"num_landmarks": 3, "conv_kernel": 3})])
def test_one_training_step_lowers_the_loss(name, options):
    x, mask = _inputs()
    target = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (B, T, E)))
    attn = attention.make(name, num_heads=HEADS, qkv_features=E, dropout_rate=0.1, **options)
    params = jax.jit(attn.init)(jax.random.PRNGKey(0), x, mask=mask)

    def loss(p, rng):
        y = attn.apply(p, x, mask=mask, deterministic=False, rngs={"dropout": rng})
        return jnp.sum(jnp.where(mask[..., None], (y - target) ** 2, 0.0)) / jnp.sum(mask)

    @jax.jit
    def step(p):
        value, grads = jax.value_and_grad(loss)(p, jax.random.PRNGKey(1))
        return value, grads, jax.tree_util.tree_map(lambda a, g: a - 0.05 * g, p, grads)

    before, grads, params_after = step(params)
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
    assert float(step(params_after)[0]) < float(before)
