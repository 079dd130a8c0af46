"""Tests of samovar_jax.model.Model: parameter snapshot and counts, forward contract, dtype policy,
ablation switches, argument checks, forms, causality, and rollout == parallel re-run."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax.model import VARIANTS, Model
from zoo_core.testing import BF16, F32_MODEL, param_shapes

# Models mostly run eagerly: after the first call warms JAX's per-primitive cache, an eager forward at
# the shared shapes costs ~0.1 s, against ~0.4 s to compile every distinct configuration under jit.
# C=2 channels, L_I=10, P=3 -> 2 zeros of left padding, N=4 patches, T=8 tokens; width 8, 2 heads, 2 layers.
BASE = dict(kind="samovar", num_channels=2, input_len=10, patch_len=3, variant="tiny", width=8)
X = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, 10, 2)) * 2.0 + 1.0)   # numpy: slicing compiles nothing
BATCH = {"inputs": X}


def _model(**kw):
    return Model(**{**BASE, **kw})


def _shapes(model):
    return param_shapes(jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), BATCH))["params"])


@functools.lru_cache(maxsize=None)
def _params(**kw):
    model = Model(**{**BASE, **kw})
    return model.init(jax.random.PRNGKey(1), BATCH)["params"]


def _run(params, train=False, rng=0, **kw):
    model = Model(**{**BASE, **kw})
    return model.apply({"params": params}, BATCH, train=train, rngs={"dropout": jax.random.PRNGKey(rng)})


SAMOVAR_SNAPSHOT = {
    "embedding/channel": (2, 8, 8), "embedding/channel_type": (2, 2, 8), "embedding/position": (8, 8),
    "embedding/type": (2, 8), "final_norm/scale": (8,), "head/bias": (3,), "head/kernel": (8, 3),
    "pre_norm/scale": (8,), "structural/theta": (2, 4, 4), "var_norm/scale": (8,),
    "tokenizer/channel_mix/bias": (2,), "tokenizer/channel_mix/kernel": (2, 2),
    "tokenizer/endogenous/bias": (8,), "tokenizer/endogenous/kernel": (3, 8),
    "tokenizer/endogenous_norm/scale": (8,), "tokenizer/exogenous/bias": (8,),
    "tokenizer/exogenous/kernel": (3, 8), "tokenizer/exogenous_norm/scale": (8,),
    **{f"mlp_{i:02d}/{k}": s for i in range(2) for k, s in [
        ("fc_in/bias", (16,)), ("fc_in/kernel", (8, 16)), ("fc_out/bias", (8,)), ("fc_out/kernel", (16, 8)),
        ("norm/scale", (8,))]},
    **{f"var/layer_{i:02d}/{k}": s for i in range(2) for k, s in [
        ("query/bias", (8,)), ("query/kernel", (8, 8)), ("query_norm/scale", (2, 4)),
        ("value/bias", (8,)), ("value/kernel", (8, 8)), ("value_norm/scale", (2, 4))]},
}


def test_param_snapshot_all_kinds():
    assert _shapes(_model()) == SAMOVAR_SNAPSHOT
    shared = {k: s for k, s in SAMOVAR_SNAPSHOT.items() if k.startswith(("tokenizer/", "head/", "final_norm",
                                                                           "pre_norm", "embedding/channel"))}
    shared.pop("embedding/channel_type")
    lintrans = {**shared, "embedding/position": (8, 8),
                **{f"block_{i:02d}/{k}": s for i in range(2) for k, s in [
                    *[(f"attention/{n}/kernel", (8, 8)) for n in ("query", "key", "value", "out")],
                    *[(f"attention/{n}/bias", (8,)) for n in ("query", "key", "value", "out")],
                    ("attention_norm/scale", (8,)), ("mlp/norm/scale", (8,)), ("mlp/fc_in/bias", (16,)),
                    ("mlp/fc_in/kernel", (8, 16)), ("mlp/fc_out/bias", (8,)), ("mlp/fc_out/kernel", (16, 8))]}}
    assert _shapes(_model(kind="lintrans")) == lintrans
    fixed = {k: s for k, s in SAMOVAR_SNAPSHOT.items() if not k.startswith("var/")}
    fixed.update({f"var/layer_{i:02d}/{n}": (2, 128, 2, 4) for i in range(2) for n in ("query", "value")})
    assert _shapes(_model(kind="fixedvar")) == fixed


@pytest.mark.parametrize("kind, heads, input_len, patch_len, channels, want", [
    # samovar.md §6 measured counts minus the parameters without effect (transformer.pns.*: l*d for
    # SAMoVAR/FixedVAR; transformer.layer_attn: d*2l + 2l for LinTrans).
    ("samovar", 2, 64, 1, 2, 45_095 - 3 * 32),
    ("lintrans", 2, 64, 1, 2, 50_701 - (32 * 6 + 6)),
    ("fixedvar", 1, 64, 1, 2, 88_231 - 3 * 32),
    ("samovar", 8, 1024, 96, 7, 156_824 - 3 * 64),
    ("samovar", 8, 4096, 720, 7, 272_136 - 3 * 64),
    ("lintrans", 8, 1024, 96, 7, 180_190 - (64 * 6 + 6)),
    ("fixedvar", 1, 1024, 96, 7, 479_128 - 3 * 64),     # measured with 1 head, as the notebook
])
def test_parameter_counts_match_spec(kind, heads, input_len, patch_len, channels, want):
    variant = "synthetic" if patch_len == 1 else "paper"
    model = Model(num_channels=channels, input_len=input_len, patch_len=patch_len, kind=kind, variant=variant,
                  num_heads=heads)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               {"inputs": jnp.zeros((1, input_len, channels))}))
    assert sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(shapes)) == want


@pytest.mark.parametrize("kind", ["samovar", "lintrans", "fixedvar"])
def test_forward_contract_and_ar_loss(kind):
    params = _params(kind=kind)
    (out, aux), (out_t, aux_t) = _run(params, kind=kind), _run(params, train=True, kind=kind)
    assert out["forecast"].shape == (2, 3, 2) and out["forecast"].dtype == jnp.float32
    assert "loss/ar" not in aux and set(aux_t) == {"loss/ar", "ar_mse", "next_patch"}
    # dropout is 0 in the tiny variant: train and eval agree.
    np.testing.assert_allclose(out_t["forecast"], out["forecast"], **F32_MODEL)
    seg, mean, std = (np.asarray(a) for a in _model(kind=kind).apply({"params": params}, X, method="normalise"))
    pred = np.asarray(aux["next_patch"])
    assert pred.shape == (2, 2, 4, 3)
    np.testing.assert_allclose(aux_t["loss/ar"], np.mean((pred[:, :, :-1] - seg[:, :, 1:]) ** 2), **F32_MODEL)
    np.testing.assert_allclose(out["forecast"], np.transpose(pred[:, :, -1], (0, 2, 1)) * std + mean, **F32_MODEL)
    assert np.isfinite(np.asarray(out["forecast"])).all() and np.isfinite(float(aux_t["loss/ar"]))


def test_attention_forms_agree_at_model_level():
    params = _params()
    want = _run(params)[0]["forecast"]
    for chunk_size in (2, 3, 16):
        got = jax.jit(functools.partial(_run, chunk_size=chunk_size))(params)[0]["forecast"]
        np.testing.assert_allclose(got, want, **F32_MODEL, err_msg=f"chunk_size={chunk_size}")


def test_dropout_only_in_train_mode():
    params = _params()
    kw = dict(dropout=0.5)
    eval_out = _run(params, **kw)[0]["forecast"]
    np.testing.assert_allclose(eval_out, _run(params)[0]["forecast"], **F32_MODEL)
    a, b, c = (_run(params, train=True, rng=r, **kw)[0]["forecast"] for r in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, eval_out)


def test_dtype_policy_bfloat16():
    params = _params()
    # jitted: eagerly every primitive compiles again in bfloat16
    out, aux = jax.jit(functools.partial(_run, dtype="bfloat16"))(params)  # configs give dtypes as strings
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    assert aux["next_patch"].dtype == jnp.bfloat16
    assert out["forecast"].dtype == jnp.float32                      # de-normalised in float32
    np.testing.assert_allclose(np.asarray(aux["next_patch"], np.float32), _run(params)[1]["next_patch"], **BF16)


def _with_identity_d(params):
    """theta with zero off-diagonals and softplus(diag) = 1, so D = L U = I exactly."""
    theta = np.broadcast_to(np.eye(4, dtype=np.float32) * np.float32(np.log(np.e - 1.0)),
                            params["structural"]["theta"].shape)
    return {**params, "structural": {"theta": theta}}


def test_ablation_switches():
    params = _params()
    base = _run(params)[0]["forecast"]
    # w/o D: no structural parameter; equal to the default when D = I, different otherwise.
    assert "structural/theta" not in _shapes(_model(structural="none"))
    no_d = {k: v for k, v in params.items() if k != "structural"}
    none_out = _run(no_d, structural="none")[0]["forecast"]
    np.testing.assert_allclose(_run(_with_identity_d(params))[0]["forecast"], none_out, **F32_MODEL)
    assert not np.allclose(none_out, base, rtol=1e-3, atol=1e-3)
    # D^-1 and identity-inside options: same at D = I, different from the default otherwise.
    for kw in (dict(structural="lu_inverse"), dict(shortcut_inside=True)):
        np.testing.assert_allclose(_run(_with_identity_d(params), **kw)[0]["forecast"], none_out, **F32_MODEL)
        assert not np.allclose(_run(params, **kw)[0]["forecast"], base, rtol=1e-3, atol=1e-3), kw
    # w/o QV norm: the per-head norm gains disappear and the output changes.
    shapes = _shapes(_model(use_qv_norm=False))
    assert not any("norm/scale" in k and k.startswith("var/") for k in shapes)
    no_norm = {**params, "var": {layer: {k: v for k, v in p.items() if "norm" not in k}
                                 for layer, p in params["var"].items()}}
    assert not np.allclose(_run(no_norm, use_qv_norm=False)[0]["forecast"], base, rtol=1e-3, atol=1e-3)
    # w/ W_k: a key matrix per layer; the chain output changes.
    kp = _params(use_key_proj=True)
    assert kp["var"]["layer_00"]["key"].shape == (8, 8)
    assert not np.allclose(_run(kp, use_key_proj=True)[0]["forecast"],
                           _run({**kp, "var": {l: {k: v for k, v in p.items() if k != "key"}
                                               for l, p in kp["var"].items()}})[0]["forecast"], rtol=1e-3, atol=1e-3)


def test_univariate_removes_cross_channel_dependence():
    x2 = X.copy()
    x2[:, :, 0] += np.random.default_rng(3).standard_normal(X[:, :, 0].shape).astype(np.float32)
    for univariate in (True, False):
        model = _model(univariate=univariate)
        params = _params(univariate=univariate)
        fn = lambda p, x: model.apply({"params": p}, {"inputs": x})[0]["forecast"]  # noqa: E731
        a, b = np.asarray(fn(params, X)), np.asarray(fn(params, x2))
        assert not np.allclose(a[..., 0], b[..., 0])                 # channel 0 always follows its input
        if univariate:
            np.testing.assert_array_equal(a[..., 1], b[..., 1])
        else:
            assert not np.allclose(a[..., 1], b[..., 1])


def test_instance_norm_mean_option():
    params = _params()
    seg_w, mean_w, _ = _model(norm_mean="window").apply({"params": params}, X, method="normalise")
    np.testing.assert_allclose(np.asarray(mean_w)[:, 0], np.mean(X, 1), **F32_MODEL)
    seg, mean, _ = _model().apply({"params": params}, X, method="normalise")
    np.testing.assert_allclose(np.asarray(mean)[:, 0], np.mean(X[:, -3:], 1), **F32_MODEL)
    assert not np.allclose(_run(params, norm_mean="window")[0]["forecast"], _run(params)[0]["forecast"])


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("bad", ["shift", "nan"])
def test_causality_over_patches(bad, chunk_size):
    # The training path (the VAR chain's per-layer form), masked and chunked: changing patches 2, 3,
    # even to NaN, leaves the predictions from patches 0, 1 bit for bit.
    params = _params()
    model = _model(chunk_size=chunk_size)
    seg = np.asarray(_model().apply({"params": params}, X, method="normalise")[0])
    seg2 = seg.copy()
    if bad == "shift":
        seg2[:, :, 2:] += np.float32(1.0)
    else:
        seg2[:, :, 2:] = np.nan
    fn = lambda s: np.asarray(model.apply({"params": params}, s, method="predict_segments"))  # noqa: E731
    a, b = fn(seg), fn(seg2)
    np.testing.assert_array_equal(a[:, :, :2], b[:, :, :2])
    assert not np.allclose(a[:, :, 2:], b[:, :, 2:])


@pytest.mark.parametrize("kind, extra", [
    ("samovar", dict(max_patches=6)),
    ("lintrans", dict(position_overflow="clamp")),
    ("fixedvar", dict(max_patches=6, chunk_size=3)),
])
def test_rollout_equals_parallel_rerun(kind, extra):
    """Recurrent rollout (prefix state, then one patch per scan step) == re-running the parallel form
    on the input extended by the predicted patches, over 3 patches; via `rollout` for SAMoVAR and via
    `__call__(horizon=8)` (a horizon that is not a multiple of P) for the baselines."""
    kw = dict(kind=kind, **extra)
    params = _params(kind=kind, **({"max_patches": 6} if "max_patches" in extra else {}))
    model = _model(**kw)
    # jit here: the re-runs have new sequence lengths, where one compile beats eager op-by-op warm-up.
    roll = jax.jit(lambda p, mode: model.apply({"params": p}, BATCH, 3, mode=mode, method="rollout"),
                   static_argnums=1)
    par = np.asarray(roll(params, "parallel"))
    assert par.shape == (2, 9, 2)
    if kind == "samovar":
        np.testing.assert_allclose(roll(params, "recurrent"), par, **F32_MODEL)
    else:
        long = _model(horizon=8, **kw)
        out = jax.jit(lambda p: long.apply({"params": p}, BATCH)[0]["forecast"])(params)
        np.testing.assert_allclose(out, par[:, :8], **F32_MODEL)
    # The first rolled-out patch is the one-patch forecast.
    np.testing.assert_allclose(par[:, :3], _run(params, **kw)[0]["forecast"], **F32_MODEL)


def test_variants_exist():
    assert set(VARIANTS) >= {"paper", "synthetic", "tiny"}


def test_model_is_a_factory_over_kinds():
    from samovar_jax import DLinear, Forecaster
    assert isinstance(_model(), Forecaster) and isinstance(_model(kind="lintrans"), Forecaster)
    dl = Model(kind="dlinear", num_channels=2, input_len=16, horizon=4)
    assert isinstance(dl, DLinear)
    # Without a variant the Forecaster's defaults are the 'paper' sizes.
    paper = Model(kind="samovar", num_channels=2, input_len=10, patch_len=3)
    assert all(getattr(paper, k) == v for k, v in VARIANTS["paper"].items())


def test_crop_inputs():
    params = _params()
    longer = {"inputs": np.concatenate([np.zeros((2, 5, 2), np.float32), X], axis=1)}
    model = _model(crop_inputs=True)
    np.testing.assert_allclose(model.apply({"params": params}, longer)[0]["forecast"],
                               _run(params)[0]["forecast"], **F32_MODEL)
