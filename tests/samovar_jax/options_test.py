"""Tests of SAMoVAR's paper-vs-code options (docs/samovar_options.md): the structural matrix D^-1 in every
form of the model, the released notebook's channel-drop augmentation, and the synthetic protocols'
config presets."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax import ops
from samovar_jax.model import Forecaster, Model
from zoo_core.tasks import forecast as forecast_task
from zoo_core.testing import F32_MODEL

# C=2 channels, L_I=10, P=3 -> 2 zeros of left padding, N=4 patches, T=8 tokens; width 8, 2 heads, 2 layers.
BASE = dict(kind="samovar", num_channels=2, input_len=10, patch_len=3, variant="tiny", width=8)
X = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, 10, 2)) * 2.0 + 1.0)
Y = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (2, 3, 2)))
BATCH = {"inputs": X, "target": Y}


def _model(**kw):
    return Model(**{**BASE, **kw})


@functools.lru_cache(maxsize=None)
def _params(**kw):
    return jax.jit(_model(**kw).init)(jax.random.PRNGKey(1), BATCH)["params"]


def _apply(kw, params, batch=BATCH, train=False, rng=0):
    return _model(**kw).apply({"params": params}, batch, train=train, rngs={"dropout": jax.random.PRNGKey(rng)})


# ------------------------------------------------------------------------------------- D^-1

def test_inverse_structural_matrix_is_the_mixture_in_every_form():
    """structural='lu_inverse': z = x0 + M D^-1 (checked against the chain by hand), the same forecast
    in the masked form, the chunked form (C = 3: a partial last chunk), under jit and eagerly, and
    through the recurrent (scan) rollout, which equals re-running the parallel form."""
    kw = dict(structural="lu_inverse", max_patches=6)
    params = _params(**kw)
    model = _model(**kw)
    out, aux = jax.jit(lambda p: model.apply({"params": p}, BATCH))(params)
    terms = jax.jit(lambda p: model.apply({"params": p}, BATCH, method="var_terms"))(params)
    fold = lambda a: a.reshape((-1,) + a.shape[-3:])  # noqa: E731
    q, v = (jnp.stack([fold(a) for a in terms[k]]) for k in ("q", "v"))
    x0 = fold(terms["x0"])
    o = ops.var_chain_parallel(x0, q, v)
    d_inv = ops.structural_matrix_inverse(params["structural"]["theta"])
    np.testing.assert_allclose(d_inv @ ops.structural_matrix(params["structural"]["theta"]),
                               np.broadcast_to(np.eye(4, dtype=np.float32), d_inv.shape), atol=1e-5)
    z = x0[:, 1::2] + jnp.einsum("bthd,hde->bthe", o.sum(0)[:, 1::2], d_inv)
    p = params
    z = ops.rms_norm(z.reshape(z.shape[:2] + (-1,)), p["final_norm"]["scale"], 1e-5)
    pred = (z @ p["head"]["kernel"] + p["head"]["bias"]).reshape(aux["next_patch"].shape)
    np.testing.assert_allclose(aux["next_patch"], pred, **F32_MODEL)
    eager = _apply(kw, params)[0]["forecast"]
    np.testing.assert_allclose(eager, out["forecast"], **F32_MODEL)
    chunked = jax.jit(functools.partial(_apply, dict(kw, chunk_size=3)))(params)[0]["forecast"]
    np.testing.assert_allclose(chunked, out["forecast"], **F32_MODEL)
    roll = jax.jit(lambda p, mode: model.apply({"params": p}, BATCH, 3, mode=mode, method="rollout"),
                   static_argnums=1)
    rec, par = roll(params, "recurrent"), roll(params, "parallel")
    np.testing.assert_allclose(rec, par, **F32_MODEL)
    np.testing.assert_allclose(par[:, :3], out["forecast"], **F32_MODEL)
    # D^-1 is not D at these parameters (model_test's ablation test: the forecasts differ too).
    assert not np.allclose(d_inv, ops.structural_matrix(params["structural"]["theta"]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_inverse_structural_matrix_keeps_a_nan_future_out_of_past_predictions(chunk_size):
    params = _params(structural="lu_inverse")
    model = _model(structural="lu_inverse", chunk_size=chunk_size)
    seg = np.asarray(model.apply({"params": params}, X, method="normalise")[0])
    seg2 = seg.copy()
    seg2[:, :, 2:] = np.nan
    fn = jax.jit(lambda s: model.apply({"params": params}, s, method="predict_segments"))
    a, b = np.asarray(fn(seg)), np.asarray(fn(seg2))
    np.testing.assert_array_equal(a[:, :, :2], b[:, :, :2])
    assert np.isfinite(a).all() and np.isnan(b[:, :, 2:]).all()


# ------------------------------------------------------------------------------------- channel drop

def test_channel_drop_off_changes_nothing_and_is_train_only():
    params = _params()
    kw = dict(dropout=0.3)
    base_train = _apply(kw, params, train=True, rng=4)
    off = _apply(dict(kw, channel_drop=False), params, train=True, rng=4)
    for got, want in ((off[0]["forecast"], base_train[0]["forecast"]), (off[1]["loss/ar"], base_train[1]["loss/ar"])):
        np.testing.assert_array_equal(got, want)
    assert "channel_keep" not in off[1]
    # Eval mode: no channel is dropped, the output is the default model's.
    on_eval = _apply(dict(channel_drop=True), params)
    np.testing.assert_array_equal(on_eval[0]["forecast"], _apply({}, params)[0]["forecast"])
    assert "channel_keep" not in on_eval[1]


def test_channel_drop_zeroes_the_chosen_channels_in_inputs_and_target():
    params = _params()
    seen = set()
    drop, plain = _model(channel_drop=True), _model()
    on = jax.jit(lambda key: drop.apply({"params": params}, BATCH, train=True, rngs={"dropout": key}))
    # The default model on the inputs with the dropped channels zeroed (dropout is 0 in 'tiny').
    ref = jax.jit(lambda x: plain.apply({"params": params}, {"inputs": x}, train=True))
    np.testing.assert_array_equal(_apply(dict(channel_drop=True), params, train=True, rng=3)[1]["channel_keep"],
                                  on(jax.random.PRNGKey(3))[1]["channel_keep"])   # a function of the key
    for rng in range(12):
        out, aux = on(jax.random.PRNGKey(rng))
        keep = np.asarray(aux["channel_keep"])
        seen.add(tuple(keep))
        ref_out, ref_aux = ref(np.where(keep, X, 0.0).astype(np.float32))
        np.testing.assert_allclose(aux["next_patch"], ref_aux["next_patch"], **F32_MODEL)
        np.testing.assert_allclose(aux["loss/ar"], ref_aux["loss/ar"], **F32_MODEL)
        # The task's error is prediction - target on kept channels and prediction - 0 on dropped ones.
        np.testing.assert_allclose(out["forecast"], ref_out["forecast"], **F32_MODEL)
        np.testing.assert_array_equal(out["forecast_keep"], keep[-Y.shape[-1]:])
        err = np.asarray(out["forecast"]) - np.asarray(jnp.where(out["forecast_keep"], Y, 0.0))
        task = forecast_task()(out, {"target": Y})
        np.testing.assert_allclose(task["mse"][0], np.mean(err ** 2, axis=(1, 2)), **F32_MODEL)
    assert len(seen) >= 3, seen                                          # kept-channel patterns vary


def test_channel_drop_rate_is_uniform_per_step_and_shared_by_the_batch():
    """P(drop) = E[1 - r] = 1/2 per channel, and both channels dropped together with P = E[(1-r)^2] = 1/3."""
    model = _model(num_channels=2, channel_drop=True)
    x = jnp.ones((3, 10, 2))
    draw = jax.jit(jax.vmap(lambda key: model.apply({}, x, True, method=Forecaster._drop_channels,
                                                     rngs={"dropout": key})))
    xs, keep = draw(jax.random.split(jax.random.PRNGKey(0), 4000))
    keep = np.asarray(keep)
    np.testing.assert_array_equal(np.asarray(xs), np.broadcast_to(keep[:, None, None, :], xs.shape))
    assert abs((~keep).mean() - 0.5) < 0.03
    assert abs((~keep).all(1).mean() - 1 / 3) < 0.03


def test_channel_drop_needs_no_target():
    params = _params()
    out, _ = _apply(dict(channel_drop=True), params, {"inputs": X}, train=True)   # the task masks the target
    assert out["forecast_keep"].dtype == jnp.bool_


# ------------------------------------------------------------------------------------- config presets

@pytest.mark.parametrize("protocol, train_orders, val_orders", [("code", {1, 2}, {3, 4}),
                                                                ("paper", {1, 2, 3}, {3, 4, 5})])
def test_synthetic_var_protocol_presets(protocol, train_orders, val_orders):
    from zoo_core.configs.samovar import synthetic_var
    from zoo_core.data import synthetic_var as data

    c = synthetic_var.get_config(f"smoke,protocol={protocol}")
    assert c.data.options.protocol == protocol
    options = {**c.data.options.to_dict(), "num_train": 60, "num_validation": 40}
    arrays = data.generate(data.SyntheticVarConfig(name="test", **options))
    assert set(arrays["train"]["order"]) == train_orders and set(arrays["validation"]["order"]) == val_orders
    model = Model(**c.model.to_dict())
    assert (model.structural, model.channel_drop) == (None, False)          # the released code's defaults


def test_synthetic_var_option_arguments():
    from zoo_core.configs.samovar import synthetic_var

    c = synthetic_var.get_config("smoke,structural=lu_inverse,channel_drop")
    model = Model(**c.model.to_dict())
    assert (model.resolved.structural, model.channel_drop) == ("lu_inverse", True)
    assert Model(**synthetic_var.get_config("kind=fixedvar,structural=lu_inverse").model.to_dict()).structural \
        == "lu_inverse"
    for arg, match in (("protocol=both", "protocol must be one of"), ("structural=D", "structural must be one of"),
                       ("kind=lintrans,structural=lu", "structural must be one of"), ("channel_drop=2", "not a bool")):
        with pytest.raises(ValueError, match=match):
            synthetic_var.get_config(arg)


def test_forecasting_structural_argument():
    from zoo_core.configs.samovar import forecasting

    model = Model(**forecasting.get_config("smoke,structural=lu_inverse").model.to_dict())
    assert model.resolved.structural == "lu_inverse"
    assert Model(**forecasting.get_config("smoke").model.to_dict()).resolved.structural == "lu"
    for arg in ("structural=D", "kind=lintrans,structural=lu", "kind=dlinear,structural=none"):
        with pytest.raises(ValueError, match="structural must be one of"):
            forecasting.get_config(arg)


@pytest.mark.slow
def test_options_smoke_trains_in_process(tmp_path):
    from zoo_core import trainer
    from zoo_core.configs.samovar import synthetic_var

    config = synthetic_var.get_config("smoke,protocol=paper,structural=lu_inverse,channel_drop")
    config.unlock()
    config.data.data_dir = str(tmp_path / "data")
    config.lock()
    result = trainer.train_and_evaluate(config, str(tmp_path / "work"), Model)
    assert 0 < result["eval/mse"] < 1
