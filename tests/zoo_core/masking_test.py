"""zoo_core.ops.masking: the one mask check and the NaN-safe removal of padding."""
import jax.numpy as jnp
import numpy as np

from zoo_core.ops import masking


def test_check_mask_accepts_none_and_the_shape():
    masking.check_mask(None, (2, 3))
    masking.check_mask(np.ones((2, 3), bool), (2, 3))


def test_as_bool_treats_nonzero_as_valid():
    np.testing.assert_array_equal(masking.as_bool(None, (2, 3)), np.ones((2, 3), bool))
    got = masking.as_bool(np.array([[1.0, 0.0, 0.5]]), (1, 3))
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, [[True, False, True]])


def test_zero_padding_replaces_padding_whatever_it_holds():
    x = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)
    x[0, 1] = np.nan
    x[0, 2, 0] = 1e30
    mask = np.array([[True, False, True]])
    got = np.asarray(masking.zero_padding(jnp.asarray(x), mask))
    want = x.copy()
    want[0, 1] = 0.0
    np.testing.assert_array_equal(got, want)
    assert masking.zero_padding(x, None) is x
    # A [B] mask on a [B, ...] array (one decoding token), and a fill value in x's dtype.
    got = masking.zero_padding(jnp.ones((2, 3), jnp.bfloat16), np.array([0, 1]), fill=-1)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [[-1, -1, -1], [1, 1, 1]])
