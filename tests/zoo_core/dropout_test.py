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


@pytest.mark.parametrize("shape, axis", [((3, 40, 32), 1), ((2, 3, 40, 4, 5), 2), ((40, 7), 0)])
def test_position_keyed_bits_do_not_depend_on_the_length(shape, axis):
    """With `position_axis`, padding a sequence at its end (context parallelism's multiple of P) keeps every
    real position's bits; positions and the other axes still get distinct, fair bits."""
    key = jax.random.key(3)
    padded = shape[:axis] + (shape[axis] + 5,) + shape[axis + 1:]
    bits = np.asarray(zd.random_bits(key, shape, position_axis=axis))
    longer = np.asarray(zd.random_bits(key, padded, position_axis=axis))
    np.testing.assert_array_equal(bits, np.take(longer, np.arange(shape[axis]), axis=axis))
    assert len(np.unique(bits)) > 0.99 * bits.size       # no repeats across positions or other axes
    mask = np.asarray(zd.keep_mask(key, 0.9, (64, 256, 48), position_axis=1))
    assert abs(mask.mean() - 0.9) < 4 * np.sqrt(0.09 / mask.size)
    assert np.all(np.abs(mask.mean(axis=(0, 2)) - 0.9) < 0.03)   # every position fair on its own


def test_a_position_keyed_module_masks_a_padded_sequence_as_the_unpadded_one():
    x = jnp.arange(1.0, 1 + 2 * 9 * 16).reshape(2, 9, 16)
    padded = jnp.concatenate([x, jnp.full((2, 3, 16), jnp.nan)], axis=1)
    layer = zd.Dropout(0.4, position_axis=1)
    rngs = {"dropout": jax.random.key(7)}
    y = layer.apply({}, x, False, rngs=rngs)
    y_padded = layer.apply({}, padded, False, rngs=rngs)
    np.testing.assert_array_equal(y_padded[:, :9], y)
    assert 0 < np.mean(np.asarray(y) == 0) < 1
