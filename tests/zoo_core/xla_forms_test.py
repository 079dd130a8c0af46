"""zoo_core.ops.xla_forms: the same values and gradients as the plain forms."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from zoo_core.ops import xla_forms


@pytest.mark.parametrize("x_dtype, table_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                                  (jnp.bfloat16, jnp.bfloat16)])
def test_add_to_each_is_the_broadcast_add(x_dtype, table_dtype):
    x = jax.random.normal(jax.random.key(0), (3, 5, 4)).astype(x_dtype)
    table = jax.random.normal(jax.random.key(1), (5, 4)).astype(table_dtype)
    y = jax.jit(xla_forms.add_to_each)(x, table)
    want = x + table[None]
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    w = jax.random.normal(jax.random.key(2), (3, 5, 4))
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * w)  # noqa: E731
    got = jax.jit(jax.grad(loss(xla_forms.add_to_each), argnums=(0, 1)))(x, table)
    # The cotangent of y is w in y's dtype; x gets it as is, the table its batch sum taken in float32
    # and rounded once (the plain form's own gradient, a bfloat16 running sum, is less exact).
    g = np.asarray(w.astype(y.dtype), np.float32)
    for got_g, want_g, like in zip(got, (g, g.sum(0)), (x, table)):
        assert got_g.dtype == like.dtype
        np.testing.assert_array_equal(np.asarray(got_g, np.float32),
                                      np.asarray(jnp.asarray(want_g).astype(like.dtype), np.float32))
    if x_dtype == table_dtype == jnp.float32:   # and in float32 it is the plain form's gradient
        ref = jax.grad(loss(lambda a, b: a + b[None]), argnums=(0, 1))(x, table)
        for got_g, r in zip(got, ref):
            np.testing.assert_allclose(got_g, r, rtol=1e-6, atol=1e-6)


def test_add_to_each_gradients_in_float64(x64):
    x = jax.random.normal(jax.random.key(0), (2, 3, 2), jnp.float64)
    table = jax.random.normal(jax.random.key(1), (3, 2), jnp.float64)
    check_grads(xla_forms.add_to_each, (x, table), order=2, modes=("rev",))


def test_add_to_each_refuses_a_table_of_another_shape():
    with pytest.raises(ValueError, match=r"table shape \(4, 4\) must be x's shape without the batch axis"):
        xla_forms.add_to_each(jnp.zeros((2, 5, 4)), jnp.zeros((4, 4)))


_DENSE_CASES = [
    # (layout class, flax class, fields, input shape)
    (xla_forms.Dense, "Dense", dict(features=5), (2, 3, 4)),
    (xla_forms.Dense, "Dense", dict(features=5, use_bias=False), (3, 4)),
    (xla_forms.DenseGeneral, "DenseGeneral", dict(features=(2, 3)), (2, 3, 4)),
    (xla_forms.DenseGeneral, "DenseGeneral", dict(features=5, axis=(-2, -1)), (2, 3, 2, 4)),
    (xla_forms.DenseGeneral, "DenseGeneral", dict(features=(2, 3), axis=-1, use_bias=False), (4,)),
]


@pytest.mark.parametrize("cls, flax_name, fields, shape", _DENSE_CASES)
def test_dense_layers_are_flax_layers_with_two_dimensional_dots(cls, flax_name, fields, shape):
    import flax.linen as nn

    init = dict(kernel_init=nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                bias_init=nn.initializers.uniform(0.5)) if fields.get("use_bias", True) else {}
    ours, theirs = cls(**fields, **init), getattr(nn, flax_name)(**fields, **init)
    x = np.asarray(jax.random.normal(jax.random.key(0), shape))
    params = theirs.init(jax.random.key(1), x)
    # The same tree and initial values (the initialisers see the same flattened shapes) ...
    jax.tree_util.tree_map(np.testing.assert_array_equal, ours.init(jax.random.key(1), x), params)
    # ... the same outputs and gradients (one program: eagerly each op compiles on its own) ...
    loss = lambda m: lambda p, x: jnp.sum(jnp.sin(m.apply(p, x)))  # noqa: E731
    y_ours, y_theirs, got, want = jax.jit(lambda p, x: (
        ours.apply(p, x), theirs.apply(p, x), jax.grad(loss(ours), (0, 1))(p, x),
        jax.grad(loss(theirs), (0, 1))(p, x)))(params, x)
    np.testing.assert_allclose(y_ours, y_theirs, rtol=1e-6, atol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           got, want)
    # ... and every dot of the gradient contracts one axis of two matrices (no transposing copies).
    jaxpr = jax.make_jaxpr(jax.grad(loss(ours)))(params, x)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.ndim == e.invars[1].aval.ndim == 2 and
                        len(e.params["dimension_numbers"][0][0]) == 1 for e in dots), dots


class _Group(nn.Module):
    """Layers reading the same x, called one by one or through `xla_forms.dense_group`."""
    layers: tuple
    grouped: bool = True

    def setup(self):
        self.children_ = [cls(**fields, name=f"l{i}") for i, (cls, fields) in enumerate(self.layers)]

    def __call__(self, x):
        if self.grouped:
            return xla_forms.dense_group(x, self.children_)
        return tuple(layer(x) for layer in self.children_)


_GROUPS = [
    ((xla_forms.DenseGeneral, dict(features=(2, 3))), (xla_forms.DenseGeneral, dict(features=(2, 3))),
     (xla_forms.DenseGeneral, dict(features=(1, 4)))),
    # Two contracted axes: the kernels [3, 4, *out] side by side.
    ((xla_forms.DenseGeneral, dict(features=(2, 3), axis=(-2, -1))),
     (xla_forms.DenseGeneral, dict(features=5, axis=(-2, -1)))),
    ((xla_forms.Dense, dict(features=5)), (xla_forms.Dense, dict(features=3))),
    ((xla_forms.Dense, dict(features=5, use_bias=False)), (xla_forms.Dense, dict(features=2, use_bias=False))),
    # Not fusable (a bias and none, another dtype): each layer called, the same numbers.
    ((xla_forms.Dense, dict(features=5)), (xla_forms.Dense, dict(features=2, use_bias=False))),
    ((xla_forms.Dense, dict(features=5)), (xla_forms.Dense, dict(features=2, dtype=jnp.bfloat16))),
]


@pytest.mark.parametrize("layers", _GROUPS)
def test_dense_group_is_each_layer_called(layers, x64):
    x = jax.random.normal(jax.random.key(0), (2, 3, 4), jnp.float64)
    grouped, separate = _Group(layers), _Group(layers, grouped=False)
    params = separate.init(jax.random.key(1), x)
    # The same parameters (initialising, every layer is called) ...
    jax.tree_util.tree_map(np.testing.assert_array_equal, grouped.init(jax.random.key(1), x), params)
    # ... and the same outputs and gradients, with respect to x and every parameter.
    w = [jax.random.normal(jax.random.key(2 + i), y.shape, jnp.float64) for i, y in enumerate(separate.apply(params, x))]
    loss = lambda m: lambda p, x: sum(jnp.sum(jnp.sin(y.astype(jnp.float64)) * wi)  # noqa: E731
                                      for y, wi in zip(m.apply(p, x), w))
    for f in (lambda m: m.apply, lambda m: jax.grad(loss(m), argnums=(0, 1))):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12),
                               jax.jit(f(grouped))(params, x), jax.jit(f(separate))(params, x))


def test_dense_general_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="contracts trailing axes only"):
        xla_forms.DenseGeneral(3, axis=0).init(jax.random.key(0), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="contracts trailing axes only"):
        xla_forms.DenseGeneral(3, batch_dims=0).init(jax.random.key(0), jnp.ones((2, 4)))


@pytest.mark.parametrize("x_dtype, dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                            (jnp.bfloat16, jnp.bfloat16)])
def test_layer_norm_is_flax_layer_norm(x_dtype, dtype):
    import flax.linen as nn

    x = (3.0 * jax.random.normal(jax.random.key(0), (2, 5, 8)) + 1.0).astype(x_dtype)
    ours, theirs = xla_forms.LayerNorm(epsilon=1e-5, dtype=dtype), nn.LayerNorm(epsilon=1e-5, dtype=dtype)
    params = theirs.init(jax.random.key(1), x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, ours.init(jax.random.key(1), x), params)
    params = {"params": {"scale": 1.0 + jax.random.normal(jax.random.key(2), (8,)),
                         "bias": jax.random.normal(jax.random.key(3), (8,))}}
    w = jax.random.normal(jax.random.key(4), x.shape)
    loss = lambda m: lambda p, x: jnp.sum(m.apply(p, x).astype(jnp.float32) * w)  # noqa: E731
    y_ours, y_theirs, got, want = jax.jit(lambda p, x: (
        ours.apply(p, x), theirs.apply(p, x), jax.grad(loss(ours), (0, 1))(p, x),
        jax.grad(loss(theirs), (0, 1))(p, x)))(params, x)
    assert y_ours.dtype == y_theirs.dtype
    # flax multiplies by rsqrt(var + eps) * scale, this by rsqrt(var + eps), then scale: one rounding.
    tol = 1e-6 if y_ours.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(y_ours, np.float32), np.asarray(y_theirs, np.float32),
                               rtol=tol, atol=tol)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype
        tol = 1e-5 if a.dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                                   atol=tol)


def test_layer_norm_gradients_in_float64(x64):
    x = 2.0 * jax.random.normal(jax.random.key(0), (3, 4, 6), jnp.float64) - 0.5
    scale = 1.0 + jax.random.normal(jax.random.key(1), (6,), jnp.float64)
    bias = jax.random.normal(jax.random.key(2), (6,), jnp.float64)
    check_grads(lambda x, s, b: xla_forms.layer_norm(x, s, b, 1e-5), (x, scale, bias), order=1,
                modes=("rev",), atol=1e-6, rtol=1e-6)


def test_layer_norm_refuses_what_it_does_not_compute():
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"flax's defaults only; got a different \['use_bias'\]"):
        xla_forms.LayerNorm(use_bias=False).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"\['mask', 'reduction_axes'\]"):
        xla_forms.LayerNorm(reduction_axes=(0, 1)).init(jax.random.key(0), x, mask=x > 0)
    with pytest.raises(ValueError, match=r"\['force_float32_reductions'\]"):
        xla_forms.LayerNorm(force_float32_reductions=False).init(jax.random.key(0), x)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_embed_is_flax_embed_with_the_lookup_in_the_table_dtype(dtype):
    ids = jnp.array([[0, 3, 3, 1], [2, 2, 0, 3]], jnp.int32)
    ours, theirs = xla_forms.Embed(4, 5, dtype=dtype), nn.Embed(4, 5, dtype=dtype)
    v = ours.init(jax.random.key(0), ids)
    assert jax.tree.map(jnp.shape, theirs.init(jax.random.key(0), ids)) == jax.tree.map(jnp.shape, v)
    y, y_flax = ours.apply(v, ids), theirs.apply(v, ids)
    assert y.dtype == y_flax.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_flax, np.float32))
    w = jax.random.normal(jax.random.key(1), y.shape)
    grad = lambda m: jax.grad(lambda p: jnp.sum(m.apply(p, ids).astype(jnp.float32) * w))(v)  # noqa: E731
    np.testing.assert_allclose(grad(ours)["params"]["embedding"],
                               grad(nn.Embed(4, 5))["params"]["embedding"], rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="integer"):
        ours.apply(v, ids.astype(jnp.float32))


def test_plain_is_read_at_trace_time_nests_and_restores():
    assert not any(xla_forms.is_plain(n) for n in xla_forms.PLAIN_FORMS)
    with xla_forms.plain("embed"):
        with xla_forms.plain("dense", "dropout"):
            assert {n for n in xla_forms.PLAIN_FORMS if xla_forms.is_plain(n)} == {"embed", "dense", "dropout"}
        assert {n for n in xla_forms.PLAIN_FORMS if xla_forms.is_plain(n)} == {"embed"}
    assert not xla_forms.is_plain("embed")

    class Proj(nn.Module):
        @nn.compact
        def __call__(self, x):
            return (nn.Dense if xla_forms.is_plain("dense") else xla_forms.Dense)(3)(x)

    x = jax.random.normal(jax.random.key(0), (2, 5, 4))
    params = Proj().init(jax.random.key(1), x)
    fast = jax.jit(Proj().apply).lower(params, x).as_text()
    with xla_forms.plain("dense"):
        plain = jax.jit(Proj().apply).lower(params, x).as_text()
        np.testing.assert_allclose(jax.jit(Proj().apply)(params, x), Proj().apply(params, x), rtol=1e-6)
    # The 2-D matmul form reshapes to [B*T, E]; flax's Dense contracts [B, T, E] directly.
    assert "10x4" in fast and "10x4" not in plain


@pytest.mark.parametrize("names, message", [(("layernorm",), r"`plain` must be one of"),
                                            (("dense", "dense"), r"`plain` names a part twice")])
def test_plain_refuses_bad_names(names, message):
    with pytest.raises(ValueError, match=message):
        with xla_forms.plain(*names):
            pass
    assert not xla_forms.is_plain("dense")


def test_plain_reaches_a_function_jitted_inside_the_block():
    def f(x):
        return x * (2.0 if xla_forms.is_plain("dense") else 3.0)

    assert float(jax.jit(f)(1.0)) == 3.0
    with xla_forms.plain("dense"):
        assert float(jax.jit(lambda x: f(x))(1.0)) == 2.0
    assert float(jax.jit(lambda x: f(x))(1.0)) == 3.0


@pytest.mark.parametrize("y_dtype, bias_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                                 (jnp.bfloat16, jnp.bfloat16)])
def test_add_bias_is_the_cast_add_with_its_sum_in_float32(y_dtype, bias_dtype):
    y = jax.random.normal(jax.random.key(0), (3, 5, 4)).astype(y_dtype)
    bias = jax.random.normal(jax.random.key(1), (4,)).astype(bias_dtype)
    got_y = jax.jit(xla_forms.add_bias)(y, bias)
    want = y + bias.astype(y.dtype)      # flax's promotion: the bias cast to the compute dtype, then added
    assert got_y.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got_y, np.float32), np.asarray(want, np.float32))
    w = jax.random.normal(jax.random.key(2), (3, 5, 4))
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * w)  # noqa: E731
    got = jax.jit(jax.grad(loss(xla_forms.add_bias), argnums=(0, 1)))(y, bias)
    # y gets its cotangent (w in y's dtype) as is; the bias its sum over the leading axes, taken in
    # float32 and rounded once to the bias's dtype.
    g = np.asarray(w.astype(y_dtype), np.float32)
    for got_g, want_g, like in zip(got, (g, g.sum((0, 1))), (y, bias)):
        assert got_g.dtype == like.dtype
        np.testing.assert_allclose(np.asarray(got_g, np.float32),
                                   np.asarray(jnp.asarray(want_g).astype(like.dtype), np.float32), rtol=1e-6)
    if y_dtype == bias_dtype == jnp.float32:   # in float32 it is autodiff's gradient
        ref = jax.grad(loss(lambda a, b: a + b), argnums=(0, 1))(y, bias)
        for got_g, r in zip(got, ref):
            np.testing.assert_allclose(got_g, r, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"bias shape \(5,\) must be y's last axis, \(4,\)"):
        xla_forms.add_bias(y, jnp.zeros(5))


def test_add_bias_gradients_in_float64(x64):
    y = jax.random.normal(jax.random.key(0), (2, 3, 2), jnp.float64)
    bias = jax.random.normal(jax.random.key(1), (2,), jnp.float64)
    check_grads(xla_forms.add_bias, (y, bias), order=2, modes=("rev",))


def test_a_bfloat16_dense_layer_sums_its_bias_gradient_in_float32():
    x = jax.random.normal(jax.random.key(0), (4096, 8))
    g = jax.random.normal(jax.random.key(1), (4096, 8))
    for cls in (xla_forms.Dense, lambda *a, **k: xla_forms.DenseGeneral(*a, axis=-1, **k)):
        layer = cls(8, dtype=jnp.bfloat16)
        params = layer.init(jax.random.key(2), x)
        grad = jax.grad(lambda p: jnp.sum(layer.apply(p, x).astype(jnp.float32) * g))(params)["params"]["bias"]
        # The float32 sum of the bfloat16 cotangent, rounded once (a bfloat16 running sum is ~1e-2 off).
        want = np.asarray(g.astype(jnp.bfloat16), np.float32).sum(0)
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-4)
