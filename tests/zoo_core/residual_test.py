"""The residual wiring the packages' blocks share (zoo_core/ops/residual.py): Pre-LN, Post-LN, the MLP."""
import numpy as np

from zoo_core.ops.residual import feed_forward, residual


def test_pre_and_post_norm_wiring_and_the_mlp():
    x = np.array([1.0, -2.0, 3.0])
    norm, branch, drop = (lambda v: v / 2), (lambda v: v + 1), (lambda v: 10 * v)
    np.testing.assert_array_equal(residual(x, branch, norm=norm, drop=drop), x + 10 * (x / 2 + 1))
    np.testing.assert_array_equal(residual(x, branch, norm=norm, drop=drop, pre=False), (x + 10 * (x + 1)) / 2)
    dense_in, dense_out, relu = (lambda v: v - 1), (lambda v: 3 * v), (lambda v: np.maximum(v, 0))
    np.testing.assert_array_equal(feed_forward(x, dense_in, dense_out, relu), [0.0, 0.0, 6.0])
    np.testing.assert_array_equal(feed_forward(x, dense_in, dense_out, relu, drop), [0.0, 0.0, 60.0])

