"""Tests of samovar_jax.analysis: lag matrices reproduce the chain and the model, path weights and
counts, VAR-coefficient estimator and distance."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax import analysis, ops
from samovar_jax.model import Model
from zoo_core.testing import F32_MODEL, F32_SIMPLE

B, T, H, D, L = 2, 7, 2, 4, 3
E = H * D


def _operands(seed=0):
    # numpy: eager jax.random compiles every op
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    g = np.float32((D * T) ** -0.25)
    x0 = normal(B, T, H, D)
    q, v = (g * normal(L, B, T, H, D) for _ in range(2))
    wk = np.float32(0.3) * normal(L, E, E)
    theta = np.float32(0.3) * normal(H, D, D)
    return x0, q, v, wk, theta


@functools.partial(jax.jit, static_argnames=("structural", "inside"))
def _mixture(x0, q, v, wk, theta, structural, inside):
    """(structural matrix or None, the chain's mixture z [B, T, H, D]) in one program."""
    s = {"lu": ops.structural_matrix, "lu_inverse": ops.structural_matrix_inverse}.get(structural)
    s = None if s is None else s(theta)
    m = ops.var_chain_parallel(x0, q, v, key_kernels=wk).sum(0)                    # [B, T, H, D]
    if inside:
        m = m + x0
    if s is not None:
        m = jnp.einsum("bthd,hde->bthe", m, s)
    return s, (m if inside else x0 + m)


@pytest.mark.parametrize("use_wk, structural, inside", [
    (False, "lu", False), (True, "lu_inverse", False), (False, "lu", True), (False, None, False)])
def test_lag_matrices_reproduce_the_mixture(use_wk, structural, inside):
    x0, q, v, wk, theta = _operands()
    wk = wk if use_wk else None
    s, z = _mixture(x0, q, v, wk, theta, structural, inside)
    gamma = analysis.lag_matrices(q, v, key_kernels=wk, structural=s, shortcut_inside=inside)
    assert gamma.shape == (B, T, T, E, E)
    got = np.einsum("btjef,bjf->bte", np.asarray(gamma), x0.reshape(B, T, E))
    np.testing.assert_allclose(got, np.asarray(z).reshape(B, T, E), **F32_SIMPLE)
    assert np.all(np.asarray(gamma)[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)
    if use_wk:
        # Per-layer terms sum to the VAR part (Gamma without the shortcut).
        layers = analysis.lag_matrices(q, v, key_kernels=wk, structural=s, per_layer=True)
        eye = np.einsum("tj,ef->tjef", np.eye(T), np.eye(E))
        np.testing.assert_allclose(np.asarray(layers).sum(0) + eye, gamma, **F32_SIMPLE)
    else:
        # Without W_k heads never mix in the key chain: every lag matrix is block-diagonal over heads.
        blocks = np.asarray(gamma).reshape(B, T, T, H, D, H, D)
        np.testing.assert_array_equal(blocks[:, :, :, 0, :, 1, :], 0.0)


def test_model_lag_matrices_reproduce_the_prediction():
    model = Model(kind="samovar", num_channels=2, input_len=10, patch_len=3, variant="tiny", width=8)
    batch = {"inputs": np.random.default_rng(1).standard_normal((2, 10, 2)).astype(np.float32)}
    # jitted: eagerly every op of the model compiles on its own
    params = jax.jit(model.init)(jax.random.PRNGKey(2), batch)["params"]
    res = jax.jit(functools.partial(analysis.model_lag_matrices, model))(params, batch)

    @jax.jit
    def prediction(lags, x0, params):
        z = jnp.einsum("bctjef,bcjf->bcte", lags, x0)[:, :, 1::2]                  # endogenous tokens
        return ops.rms_norm(z, params["final_norm"]["scale"], 1e-5) @ params["head"]["kernel"] + params["head"]["bias"]
    pred = prediction(res["lags"], res["x0"], params)
    np.testing.assert_allclose(pred, jax.jit(model.apply)({"params": params}, batch)[1]["next_patch"], **F32_MODEL)
    assert res["heatmap"].shape == (2, 2, 8, 8, 3, 3)
    w = np.asarray(params["head"]["kernel"])
    var_part = np.asarray(analysis.lag_matrices(res["q"], res["v"], structural=res["structural"],
                                                include_shortcut=False))
    np.testing.assert_allclose(np.asarray(res["heatmap"])[1, 0, 5, 2], w.T @ var_part[1, 0, 5, 2] @ w, **F32_MODEL)


def test_path_weights_count_paths():
    # q = v = e_1 in every head: q_t . v_s = 1, so the summed path weight is the number of paths.
    unit = np.zeros((L, 1, T, H, D), np.float32)
    unit[..., 0] = 1.0
    weights = np.asarray(jax.jit(analysis.temporal_path_weights)(unit, unit))
    assert weights.shape == (L, 1, H, T, T)
    for m in range(1, L + 1):
        for t, j in itertools.product(range(T), repeat=2):
            want = analysis.num_temporal_paths(t - j, m) if j <= t else 0
            assert weights[m - 1, 0, 1, t, j] == want
    # Brute force: non-increasing index chains t >= i_1 >= ... >= i_{m-1} >= j.
    for lag, m in itertools.product(range(5), range(1, 4)):
        chains = [c for c in itertools.product(range(lag + 1), repeat=m - 1) if list(c) == sorted(c)]
        assert analysis.num_temporal_paths(lag, m) == len(chains)
    assert analysis.total_num_paths(2, 3) == 1 + 1 + 3 + 6


def test_path_weights_match_scalar_chain():
    x0, q, v, _, _ = _operands(1)
    w = np.asarray(jax.jit(analysis.temporal_path_weights)(q, v))
    a = np.einsum("lbthd,lbshd->lbhts", q, v) * np.tril(np.ones((T, T), np.float32))
    np.testing.assert_allclose(w[2], a[2] @ a[1] @ a[0], **F32_SIMPLE)


def test_model_temporal_paths_are_the_chain_factors_of_the_model():
    # Fig. 5's operands: edge factors a^(m) = tril(q^(m) v^(m)T) of the model's own q, v, and per depth
    # the product a^(m) ... a^(1).
    model = Model(kind="samovar", num_channels=2, input_len=10, patch_len=3, variant="tiny", width=8)
    batch = {"inputs": np.random.default_rng(1).standard_normal((2, 10, 2)).astype(np.float32)}
    params = jax.jit(model.init)(jax.random.PRNGKey(2), batch)["params"]
    res = jax.jit(functools.partial(analysis.model_temporal_paths, model))(params, batch)
    terms = jax.jit(lambda p: model.apply({"params": p}, batch, method="var_terms"))(params)
    a, paths = np.asarray(res["factors"]), np.asarray(res["paths"])
    assert a.shape == paths.shape == (2, 2, 2, 2, 8, 8)                      # [L, B, C_t, H, T, T]
    want = np.einsum("lbcthd,lbcshd->lbchts", terms["q"], terms["v"]) * np.tril(np.ones((8, 8), np.float32))
    np.testing.assert_allclose(a, want, **F32_SIMPLE)
    np.testing.assert_allclose(paths[0], a[0], **F32_SIMPLE)
    np.testing.assert_allclose(paths[1], a[1] @ a[0], **F32_SIMPLE)
    np.testing.assert_array_equal(np.triu(paths, 1), 0.0)


def test_jacobian_estimator_recovers_a_linear_var():
    c, p, length = 3, 2, 12
    coefs = np.float32(0.4) * np.random.default_rng(3).standard_normal((p, c, c)).astype(np.float32)

    def var_forecast(x):                                 # x [B, L, C] -> [B, 1, C], the exact VAR(2) predictor
        return jnp.einsum("jab,njb->na", coefs, x[:, ::-1][:, :p])[:, None]

    x = np.random.default_rng(4).standard_normal((4, length, c)).astype(np.float32)
    est = np.asarray(analysis.jacobian_var_coefficients(var_forecast, x, num_lags=4))
    assert est.shape == (4, 4, c, c)
    np.testing.assert_allclose(est[:, :p], np.broadcast_to(coefs, (4, p, c, c)), **F32_SIMPLE)
    np.testing.assert_array_equal(est[:, p:], 0.0)
    dist = analysis.var_coefficient_distance(coefs, est)
    np.testing.assert_allclose(dist["rel_frobenius"], 0.0, atol=1e-6)
    # Known distances: a perturbation on one lag and mass on a lag beyond the true order.
    est2 = np.zeros((3, c, c))
    est2[:p] = coefs
    est2[0, 0, 1] += 0.3
    est2[2, 1, 1] = 0.4
    d2 = analysis.var_coefficient_distance(coefs, est2)
    np.testing.assert_allclose(d2["frobenius"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(d2["rel_frobenius"], 0.5 / np.linalg.norm(coefs), rtol=1e-6)
    np.testing.assert_allclose(d2["max_abs"], 0.4, rtol=1e-6)
    np.testing.assert_allclose(d2["per_lag"], [0.3, 0.0, 0.4], atol=1e-7)


def test_jacobian_estimator_on_a_model():
    model = Model(kind="samovar", num_channels=2, input_len=10, patch_len=1, variant="tiny", width=8)
    x = np.random.default_rng(5).standard_normal((2, 10, 2)).astype(np.float32)
    # jitted: eagerly every op of the model compiles on its own
    params = jax.jit(model.init)(jax.random.PRNGKey(6), {"inputs": x})["params"]
    forecast = lambda xb: model.apply({"params": params}, {"inputs": xb})[0]["forecast"]  # noqa: E731
    est = np.asarray(analysis.jacobian_var_coefficients(forecast, x, num_lags=10))
    assert est.shape == (2, 10, 2, 2)
    # Instance normalisation makes the forecaster equivariant to per-channel shifts and scalings
    # (f(x + c) = f(x) + c, f(a x) = a f(x)), so over all lags sum_j A_j = I and
    # sum_j A_j x_{L+1-j} = forecast (Euler's identity): exact checks of the estimator.
    np.testing.assert_allclose(est.sum(1), np.broadcast_to(np.eye(2), (2, 2, 2)), **F32_MODEL)
    euler = np.einsum("bjac,bjc->ba", est, x[:, ::-1])
    np.testing.assert_allclose(euler, np.asarray(jax.jit(forecast)(x))[:, 0], **F32_MODEL)
