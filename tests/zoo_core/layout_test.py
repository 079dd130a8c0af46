"""zoo_core.layout: the same values and gradients as the plain forms."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from zoo_core import layout


@pytest.mark.parametrize("x_dtype, table_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                                  (jnp.bfloat16, jnp.bfloat16)])
def test_add_to_each_is_the_broadcast_add(x_dtype, table_dtype):
    x = jax.random.normal(jax.random.key(0), (3, 5, 4)).astype(x_dtype)
    table = jax.random.normal(jax.random.key(1), (5, 4)).astype(table_dtype)
    y = jax.jit(layout.add_to_each)(x, table)
    want = x + table[None]
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    w = jax.random.normal(jax.random.key(2), (3, 5, 4))
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * w)  # noqa: E731
    got = jax.jit(jax.grad(loss(layout.add_to_each), argnums=(0, 1)))(x, table)
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
    check_grads(layout.add_to_each, (x, table), order=2, modes=("rev",))


def test_add_to_each_refuses_a_table_of_another_shape():
    with pytest.raises(ValueError, match=r"table shape \(4, 4\) must be x's shape without the batch axis"):
        layout.add_to_each(jnp.zeros((2, 5, 4)), jnp.zeros((4, 4)))
