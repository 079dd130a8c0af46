"""Tests of samovar_jax.baselines: DLinear's decomposition, parameters, forward contract and checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax.baselines import DLinear, moving_average, series_decomposition, time_linear
from zoo_core.testing import F32_SIMPLE, param_shapes

# B=2, L_I=16, C=2, horizon 7.
X = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 2))
BATCH = {"inputs": X, "target": jnp.zeros((2, 7, 2))}
BASE = dict(num_channels=2, input_len=16, horizon=7, kernel_size=5)


def _init(model, seed=0):
    """Jitted init (an eager first init compiles every primitive one by one)."""
    return jax.jit(lambda key: model.init(key, BATCH))(jax.random.PRNGKey(seed))["params"]


def _numpy_moving_average(x, k):
    """The reference's AvgPool1d over the edge-replicated series, written as an explicit loop."""
    half = (k - 1) // 2
    padded = np.concatenate([np.repeat(x[:, :1], half, 1), x, np.repeat(x[:, -1:], half, 1)], 1)
    return np.stack([padded[:, i:i + k].mean(1) for i in range(padded.shape[1] - k + 1)], 1)


@pytest.mark.parametrize("k", [1, 5, 25])
def test_moving_average_matches_a_direct_loop(k):
    x = np.asarray(X)
    np.testing.assert_allclose(moving_average(X, k), _numpy_moving_average(x, k), **F32_SIMPLE)


def test_decomposition_adds_up_and_keeps_constants_in_the_trend():
    seasonal, trend = series_decomposition(X, 5)
    np.testing.assert_allclose(seasonal + trend, X, **F32_SIMPLE)
    const = jnp.full((1, 16, 2), 3.0)
    s, t = series_decomposition(const, 5)
    np.testing.assert_allclose(t, const, **F32_SIMPLE)
    np.testing.assert_allclose(s, 0.0, **F32_SIMPLE)


def test_parameter_snapshot_shared_and_individual():
    shared = _init(DLinear(**BASE), 0)
    assert param_shapes(shared) == {"seasonal/kernel": (16, 7), "seasonal/bias": (7,),
                                    "trend/kernel": (16, 7), "trend/bias": (7,)}
    indiv = _init(DLinear(**BASE, individual=True), 0)
    assert param_shapes(indiv) == {"seasonal/kernel": (2, 16, 7), "seasonal/bias": (2, 7),
                                   "trend/kernel": (2, 16, 7), "trend/bias": (2, 7)}
    bound = 1 / np.sqrt(16)
    for leaf in jax.tree_util.tree_leaves(indiv):
        assert np.all(np.abs(np.asarray(leaf)) <= bound) and np.std(leaf) > 0.1 * bound


@pytest.mark.parametrize("individual", [False, True])
def test_forward_equals_the_formula(individual):
    model = DLinear(**BASE, individual=individual)
    params = _init(model, 1)
    (out, aux) = model.apply({"params": params}, BATCH, train=True)
    assert aux == {} and out["forecast"].shape == (2, 7, 2) and out["forecast"].dtype == jnp.float32
    x = np.asarray(X, np.float64)
    trend = _numpy_moving_average(x, 5)
    seasonal = x - trend
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    for c in range(2):
        pick = (lambda a: a[c]) if individual else (lambda a: a)
        want = (seasonal[:, :, c] @ pick(p["seasonal"]["kernel"]) + pick(p["seasonal"]["bias"])
                + trend[:, :, c] @ pick(p["trend"]["kernel"]) + pick(p["trend"]["bias"]))
        np.testing.assert_allclose(out["forecast"][:, :, c], want, **F32_SIMPLE)


def test_time_linear_shared_equals_individual_with_tiled_weights():
    k = jax.random.normal(jax.random.PRNGKey(2), (16, 7))
    b = jax.random.normal(jax.random.PRNGKey(3), (7,))
    np.testing.assert_allclose(time_linear(X, k, b), time_linear(X, jnp.stack([k, k]), jnp.stack([b, b])),
                               **F32_SIMPLE)


def test_num_targets_forecasts_the_last_channels():
    full = DLinear(**BASE)
    params = _init(full, 1)
    y_all = full.apply({"params": params}, BATCH)[0]["forecast"]
    y_last = DLinear(**BASE, num_targets=1).apply({"params": params}, BATCH)[0]["forecast"]
    np.testing.assert_array_equal(y_last, y_all[:, :, -1:])


def test_a_trained_dlinear_learns_a_linear_trend():
    """Extrapolating a noiseless line is in DLinear's span: a few hundred Adam steps get it close."""
    import optax

    t = jnp.arange(23.0)
    slopes = jax.random.normal(jax.random.PRNGKey(4), (32, 1, 2))
    series = slopes * t[None, :, None] / 10.0
    batch = {"inputs": series[:, :16], "target": series[:, 16:]}
    model = DLinear(**BASE)
    params = jax.jit(lambda key: model.init(key, batch))(jax.random.PRNGKey(0))["params"]
    tx = optax.adam(3e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, batch)[0]["forecast"]
                                                         - batch["target"]) ** 2))(params)
        u, opt = tx.update(g, opt)
        return optax.apply_updates(params, u), opt, loss

    first = None
    for _ in range(300):
        params, opt, loss = step(params, opt)
        first = loss if first is None else first
    assert float(loss) < 1e-3 * float(first)


def test_bfloat16_compute_is_close_to_float32():
    params = _init(DLinear(**BASE), 1)
    y32 = DLinear(**BASE).apply({"params": params}, BATCH)[0]["forecast"]
    y16 = DLinear(**BASE, dtype="bfloat16").apply({"params": params}, BATCH)[0]["forecast"]
    assert y16.dtype == jnp.float32
    np.testing.assert_allclose(y16, y32, rtol=3e-2, atol=3e-2)
