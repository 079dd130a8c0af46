"""Tests of the Flax layers (agf_jax/layers.py)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

from agf_jax import ops
from agf_jax.layers import AGFAttention, SoftmaxAttention
from zoo_core.testing import BF16, F32_SIMPLE, assert_trees_close, param_shapes

B, T, E, H, D = 2, 7, 8, 2, 4
X = jax.random.normal(jax.random.key(0), (B, T, E))
MASK = jnp.asarray(np.arange(T)[None] < np.array([[T], [5]]))


def _jit_apply(layer):
    """layer.apply jitted once per layer (eager applies would re-trace lax.scan on every call)."""
    return jax.jit(layer.apply, static_argnames=("method",))


def _with_theta(variables, theta=(0.6, -0.5, 0.4), theta_0=None):
    """Replaces the zero-initialised thetas so that the filter is non-trivial."""
    params = dict(variables["params"])
    params["theta"] = jnp.asarray(theta, jnp.float32)
    if theta_0 is not None:
        params["theta_0"] = jnp.asarray(theta_0, jnp.float32)
    return {"params": params}


def test_param_names_snapshot():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, learn_c0=True)
    shapes = param_shapes(jax.eval_shape(layer.init, jax.random.key(0), X)["params"])
    assert shapes == {
        "query/kernel": (E, H, D), "query/bias": (H, D),
        "key/kernel": (E, H, D), "key/bias": (H, D),
        "sigma/kernel": (E, H, D), "sigma/bias": (H, D),
        "value/kernel": (E, H, D), "value/bias": (H, D),
        "out/kernel": (H, D, E), "out/bias": (E,),
        "theta": (3,), "theta_0": (),
    }
    # Frozen c_0 has no parameter; K = 0 has no theta at all.
    frozen = AGFAttention(num_heads=H, head_dim=D, order=0, out_features=5)
    shapes = param_shapes(jax.eval_shape(frozen.init, jax.random.key(0), X)["params"])
    assert "theta" not in shapes and "theta_0" not in shapes
    assert shapes["out/kernel"] == (H, D, 5)


def test_forward_matches_ops_and_init_filters():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, basis="legendre")
    v = layer.init(jax.random.key(1), X)
    # theta = 0 and frozen c_0: g == 1, i.e. plain U (V^T Val) (spec §2.4).
    f = layer.apply(v, X, mask=MASK, method="factors")
    assert np.all(np.asarray(f["g"]) == 1.0)
    v = _with_theta(v)
    apply = _jit_apply(layer)
    y, aux = apply(v, X, mask=MASK)
    f = apply(v, X, mask=MASK, method="factors")
    o = ops.agf_parallel(f["zu"], f["zv"], f["zs"], f["value"], f["coeffs"], basis="legendre",
                         mask=MASK)
    p = v["params"]["out"]
    np.testing.assert_allclose(y, jnp.einsum("bthd,hde->bte", o, p["kernel"]) + p["bias"],
                               **F32_SIMPLE)
    np.testing.assert_allclose(aux["orthogonality"],
                               ops.orthogonality_loss(f["zu"], f["zv"], mask=MASK), **F32_SIMPLE)
    # Learnable c_0 at init: the filter is 0 and the output is the out-projection bias only.
    learn = AGFAttention(num_heads=H, head_dim=D, order=3, learn_c0=True,
                         bias_init=nn.initializers.normal(1.0))
    vl = learn.init(jax.random.key(2), X)
    yl, _ = learn.apply(vl, X)
    np.testing.assert_allclose(yl, jnp.broadcast_to(vl["params"]["out"]["bias"], yl.shape),
                               **F32_SIMPLE)


def test_ortho_scale_and_theta_gradients():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, ortho_scale=0.25)
    v = _with_theta(layer.init(jax.random.key(3), X))
    _, aux = layer.apply(v, X)
    _, aux1 = AGFAttention(num_heads=H, head_dim=D, order=3).apply(v, X)
    np.testing.assert_allclose(aux["orthogonality"], 0.25 * aux1["orthogonality"], **F32_SIMPLE)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, X)[0] ** 2)))(
        v["params"])
    assert float(jnp.min(jnp.abs(grads["theta"]))) > 0.0


def test_causal_layer_forms_agree():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, causal=True)
    apply = _jit_apply(layer)
    v = _with_theta(layer.init(jax.random.key(4), X))
    y, aux = apply(v, X, mask=MASK)
    assert aux["orthogonality"].shape == (B,)
    # Same parameter tree, chunked form (chunk size not dividing T).
    y_chk, _ = _jit_apply(AGFAttention(num_heads=H, head_dim=D, order=3, causal=True,
                                       chunk_size=3))(v, X, mask=MASK)
    np.testing.assert_allclose(y_chk, y, **F32_SIMPLE)
    y_scan, state = apply(v, X, mask=MASK, method="scan")
    np.testing.assert_allclose(y_scan, y, **F32_SIMPLE)
    # Unmasked: scan over a prefix, then step the rest, equals the parallel form.
    y_full, _ = apply(v, X, mask=jnp.ones((B, T), bool))
    _, st = apply(v, X[:, :3], method="scan")
    steps = []
    for t in range(3, T):
        y_t, st = apply(v, st, X[:, t], method="step")
        steps.append(y_t)
    np.testing.assert_allclose(jnp.stack(steps, 1), y_full[:, 3:], **F32_SIMPLE)
    st0 = layer.apply(v, B, method="init_state")
    assert st0.num.shape == (B, H, D, D) and st0.max.shape == (B, H, D)
    assert all(s.dtype == jnp.float32 for s in st0)


def test_dtype_policy_bf16():
    kw = dict(num_heads=H, head_dim=D, order=3, causal=True)
    v = _with_theta(AGFAttention(**kw).init(jax.random.key(5), X))
    layer16 = AGFAttention(dtype=jnp.bfloat16, **kw)
    v16 = _with_theta(layer16.init(jax.random.key(5), X))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(v16))
    y16, aux16 = _jit_apply(layer16)(v, X.astype(jnp.bfloat16))
    y32, _ = _jit_apply(AGFAttention(**kw))(v, X)
    assert y16.dtype == jnp.bfloat16
    assert aux16["orthogonality"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, **BF16)
    _, state = _jit_apply(layer16)(v, X.astype(jnp.bfloat16), method="scan")
    assert all(s.dtype == jnp.float32 for s in state)


class _Foreign(nn.Module):
    """Someone else's model: embeds, calls AGF, adds the regulariser to its own output."""

    @nn.compact
    def __call__(self, x, mask):
        h = nn.Dense(E, name="proj")(x)
        y, aux = AGFAttention(num_heads=H, head_dim=D, order=2, name="agf")(h, mask=mask)
        return nn.Dense(3, name="head")(y).mean(1), jnp.mean(aux["orthogonality"])


def test_inside_foreign_module_and_nnx_bridge():
    model = _Foreign()
    v = model.init(jax.random.key(6), X, MASK)
    assert set(v["params"]) == {"proj", "agf", "head"}
    out, reg = jax.jit(model.apply)(v, X, MASK)
    assert out.shape == (B, 3) and reg.shape == ()
    grads = jax.grad(lambda p: model.apply({"params": p}, X, MASK)[1])(v["params"])
    assert float(jnp.sum(jnp.abs(grads["agf"]["key"]["kernel"]))) > 0.0

    # NNX: wrap the Linen layer with ToNNX, lazily initialise, train one step with nnx APIs.
    linen_layer = AGFAttention(num_heads=H, head_dim=D, order=2)
    layer = bridge.ToNNX(linen_layer, rngs=nnx.Rngs(0))
    bridge.lazy_init(layer, X, mask=MASK)
    y, aux = layer(X, mask=MASK)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    y_linen, _ = linen_layer.apply({"params": params}, X, mask=MASK)
    np.testing.assert_allclose(y, y_linen, **F32_SIMPLE)

    def loss(m):
        y, aux = m(X, mask=MASK)
        return jnp.mean(y ** 2) + jnp.mean(aux["orthogonality"])

    grads = nnx.grad(loss)(layer)
    flat = nnx.to_pure_dict(grads)
    assert set(flat) == set(params)
    assert float(jnp.sum(jnp.abs(flat["theta"]))) > 0.0


def test_softmax_baseline_layer():
    layer = SoftmaxAttention(num_heads=H, head_dim=D)
    v = layer.init(jax.random.key(7), X)
    assert set(v["params"]) == {"query", "key", "value", "out"}
    y, aux = layer.apply(v, X, mask=MASK)
    assert y.shape == X.shape and aux == {}
    p = v["params"]
    q, k, val = (jnp.einsum("bte,ehd->bthd", X, p[n]["kernel"]) + p[n]["bias"]
                 for n in ("query", "key", "value"))
    o = ops.softmax_attention(q, k, val, mask=MASK)
    np.testing.assert_allclose(y, jnp.einsum("bthd,hde->bte", o, p["out"]["kernel"])
                               + p["out"]["bias"], **F32_SIMPLE)


def test_bad_inputs_raise_value_error():
    layer = AGFAttention(num_heads=H, head_dim=D)
    v = layer.init(jax.random.key(8), X)
    with pytest.raises(ValueError, match="rank 3"):
        layer.apply(v, X[0])
    with pytest.raises(ValueError, match="mask"):
        layer.apply(v, X, mask=MASK[:, :5])
    with pytest.raises(ValueError, match="causal=True"):
        layer.apply(v, X, method="scan")
    with pytest.raises(ValueError, match="causal=True"):
        layer.apply(v, 2, method="init_state")
    bad = [dict(basis="hermite"), dict(basis="legendre", alpha=1.0), dict(order=-1),
           dict(order=2.5), dict(chunk_size=4), dict(causal=True, chunk_size=0), dict(dropout_rate=1.5)]
    for kw in bad:
        with pytest.raises(ValueError):
            AGFAttention(num_heads=H, head_dim=D, **kw).init(jax.random.key(0), X)
    causal = AGFAttention(num_heads=H, head_dim=D, causal=True)
    vc = causal.init(jax.random.key(9), X)
    st = causal.apply(vc, B, method="init_state")
    with pytest.raises(ValueError, match="rank 2"):
        causal.apply(vc, st, X, method="step")
    with pytest.raises(ValueError, match="state"):
        causal.apply(vc, ops.init_state(B, H, D + 1), X[:, 0], method="step")


def test_dropout_is_rng_driven():
    layer = AGFAttention(num_heads=H, head_dim=D, dropout_rate=0.5)
    v = layer.init(jax.random.key(10), X)
    y_eval, _ = layer.apply(v, X)
    y_a, _ = layer.apply(v, X, deterministic=False, rngs={"dropout": jax.random.key(1)})
    y_b, _ = layer.apply(v, X, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(y_a, y_b)
    y_eval2, _ = AGFAttention(num_heads=H, head_dim=D).apply(v, X)
    assert_trees_close(y_eval, y_eval2, **F32_SIMPLE)
