"""The one NaN guard (zoo_core/ops/guard.py): what a recurrence does with a non-finite input, for the
forms that never loop over tokens."""
import jax.numpy as jnp
import numpy as np

from zoo_core.ops import guard


def test_nonfinite_reduces_trailing_axes_and_ignores_padding():
    k = np.zeros((1, 4, 2, 3), np.float32)
    v = np.zeros((1, 4, 2, 5), np.float32)
    k[0, 1, 0, 2] = np.nan
    v[0, 3, 1, 0] = np.inf
    bad = guard.nonfinite(k, v)
    np.testing.assert_array_equal(bad[0], [[0, 0], [1, 0], [0, 0], [0, 1]])
    padded = guard.nonfinite(k, v, valid=np.array([[1, 1, 1, 0]], bool))
    np.testing.assert_array_equal(padded[0], [[0, 0], [1, 0], [0, 0], [0, 0]])


def test_reach_runs_to_the_end_or_to_the_next_document():
    bad = np.array([[0, 1, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(guard.reach(bad)[0], [0, 1, 1, 1, 1, 1])
    segments = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
    np.testing.assert_array_equal(guard.reach(bad, segments)[0], [0, 1, 1, 0, 0, 0])


def test_last_clean_and_poison():
    poisoned = np.array([[[0], [1]]], bool)                       # [B, T, H]
    np.testing.assert_array_equal(guard.last(poisoned), [[True]])
    assert guard.last(np.zeros((2, 0, 3), bool)).shape == (2, 3)
    x = jnp.ones((1, 2, 1, 2))
    cleaned = guard.clean(x.at[0, 1, 0, 0].set(jnp.nan), poisoned)
    assert np.isfinite(np.asarray(cleaned)).all() and float(cleaned[0, 1, 0, 1]) == 0.0
    out = np.asarray(guard.poison(x, poisoned))
    assert np.isnan(out[0, 1]).all() and (out[0, 0] == 1).all()
    assert guard.poison(None, poisoned) is None
