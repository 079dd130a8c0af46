"""zoo_core.ops.dropout: keep probability, lane independence, flax-compatible module behaviour."""
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core.ops import dropout as zd


def test_bits_are_uniform_and_shape_general():
    for shape in [(8, 64), (3, 5, 7), (13,), ()]:
        b = zd.random_bits(jax.random.key(0), shape)
        assert b.shape == shape and b.dtype == jnp.uint32
    b = np.asarray(zd.random_bits(jax.random.key(1), (512, 1024)), np.uint64)
    top = (b >> 28).ravel()   # 16 buckets of the top 4 bits
    counts = np.bincount(top, minlength=16)
    n = top.size
    assert np.all(np.abs(counts - n / 16) < 5 * np.sqrt(n / 16))
    assert abs(b.mean() / 2.0 ** 32 - 0.5) < 5 * np.sqrt(1 / 12 / b.size)


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.1])
def test_keep_fraction_and_lane_pairs(keep):
    n_words = 1 << 18
    lanes = zd.LANES
    m = np.asarray(zd.keep_mask(jax.random.key(2), keep, (n_words, lanes)))
    sd = np.sqrt(keep * (1 - keep) / m.size)
    assert abs(m.mean() - keep) < 5 * sd
    # The lanes of one threefry word: every pair's joint keep frequency is keep^2.
    for i in range(lanes):
        for j in range(i + 1, lanes):
            both = np.mean(m[:, i] & m[:, j])
            sd2 = np.sqrt(keep ** 2 * (1 - keep ** 2) / n_words)
            assert abs(both - keep ** 2) < 5 * sd2, (i, j, both)
    # Neighbouring words (adjacent counters) are not correlated either.
    both = np.mean(m[:-1, lanes - 1] & m[1:, 0])
    assert abs(both - keep ** 2) < 5 * np.sqrt(keep ** 2 * (1 - keep ** 2) / n_words)


def test_threshold_exact():
    assert zd.keep_threshold(0.5) == 2 ** 31
    assert zd.keep_threshold(0.0) == 0
    assert zd.keep_threshold(1.0) == 2 ** 32 - 1
    for keep in (0.9, 0.1, 1 / 3):
        assert abs(zd.keep_threshold(keep) / 2 ** 32 - keep) <= 2 ** -33
    with pytest.raises(ValueError):
        zd.keep_threshold(1.5)


def test_dropout_values_match_flax_scaling():
    x = jax.random.normal(jax.random.key(3), (4, 32, 16))
    y = zd.dropout(x, 0.25, jax.random.key(4))
    kept = y != 0
    np.testing.assert_array_equal(np.asarray(y)[np.asarray(kept)],
                                  np.asarray(x / 0.75)[np.asarray(kept)])
    assert zd.dropout(x, 0.0, None) is x
    assert zd.dropout(x, 0.5, None, deterministic=True) is x
    np.testing.assert_array_equal(zd.dropout(x, 1.0, jax.random.key(0)), jnp.zeros_like(x))
    xb = x.astype(jnp.bfloat16)
    yb = zd.dropout(xb, 0.1, jax.random.key(5))
    assert yb.dtype == jnp.bfloat16
    # 16-bit inputs are scaled by the exact 1/keep (0.9 is 0.8984375 in bfloat16): each kept value
    # is the float32 quotient rounded once.
    kept = np.asarray(yb != 0)
    want = (np.asarray(xb, np.float32) / np.float32(0.9)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(yb)[kept], want[kept])


def test_module_is_a_drop_in_for_flax_dropout():
    class M(nn.Module):
        rate: float
        flax_: bool = False

        @nn.compact
        def __call__(self, x, train):
            d = nn.Dropout(self.rate) if self.flax_ else zd.Dropout(self.rate)
            return d(x, deterministic=not train), d(x, deterministic=not train)

    x = jnp.ones((2, 64, 8))
    m = M(0.3)
    assert m.init(jax.random.key(0), x, False) == nn.FrozenDict({}) or not m.init(
        jax.random.key(0), x, False)
    a, b = m.apply({}, x, True, rngs={"dropout": jax.random.key(1)})
    assert not np.array_equal(a, b)           # every call draws a fresh key, as nn.Dropout
    a2, _ = m.apply({}, x, True, rngs={"dropout": jax.random.key(1)})
    np.testing.assert_array_equal(a, a2)      # reproducible per key
    e, _ = m.apply({}, x, False)
    np.testing.assert_array_equal(e, x)       # eval: identity, no rng needed
    g = jax.grad(lambda x: m.apply({}, x, True, rngs={"dropout": jax.random.key(1)})[0].sum())(x)
    np.testing.assert_array_equal(g, np.where(np.asarray(a) != 0, 1 / 0.7, 0).astype(np.float32))
    with pytest.raises(flax.errors.InvalidRngError):
        m.apply({}, x, True)                  # no 'dropout' rng: an error, as nn.Dropout
