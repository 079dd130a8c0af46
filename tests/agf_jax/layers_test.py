"""Tests of the Flax layers (agf_jax/layers.py) against the zoo's layer contract.

Every form of every causal layer gives the same numbers (`assert_forms_agree`), and a NaN or 1e30
at a padded or future position changes no valid or past output, nor the regulariser.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

import agf_jax
from agf_jax import ops, softmax
from agf_jax.layers import AGFAttention, SoftmaxAttention
from zoo_core.testing import BF16, F32_SIMPLE, assert_forms_agree, assert_trees_close, param_shapes

B, T, E, H, D = 2, 7, 8, 2, 4
X16 = np.asarray(jax.random.normal(jax.random.key(0), (B, 16, E)))   # numpy: slicing compiles nothing
X = X16[:, :T]
MASK = jnp.asarray(np.arange(T)[None] < np.array([[T], [5]]))


def _mask(t):
    return jnp.asarray(np.arange(t)[None] < np.array([[t], [max(1, t - t // 3)]]))


def _layer(kind, **kw):
    if kind == "agf":
        return AGFAttention(num_heads=H, head_dim=D, order=3, **kw)
    if kind in ("uvt", "svd"):   # the Table 6 variants
        return AGFAttention(num_heads=H, head_dim=D, graph_filter=kind, **kw)
    return SoftmaxAttention(num_heads=H, head_dim=D, **({"max_length": 16} if kw.get("causal")
                                                         else {}), **kw)


def _with_theta(variables, theta=(0.6, -0.5, 0.4), theta_0=None):
    """Replaces the zero-initialised thetas so that the filter is non-trivial."""
    params = dict(variables["params"])
    if "theta" in params:
        params["theta"] = jnp.asarray(theta, jnp.float32)
    if theta_0 is not None:
        params["theta_0"] = jnp.asarray(theta_0, jnp.float32)
    if "singular_values" in params:   # away from their initial ones
        params["singular_values"] = 1.0 + 0.5 * jnp.sin(jnp.arange(H * D, dtype=jnp.float32)).reshape(H, D)
    return {"params": params}


@functools.lru_cache(maxsize=None)
def _init_fn(layer):
    # jitted: eager init compiles every initialiser separately
    return jax.jit(layer.init)


def _init(layer, seed=1):
    return _with_theta(_init_fn(layer)(jax.random.key(seed), X))


@functools.lru_cache(maxsize=None)
def _jit(layer):
    """layer.apply jitted once per layer, compared by its fields (eager applies would re-trace lax.scan
    on every call, and a new jit per call compiles again)."""
    return jax.jit(layer.apply, static_argnames=("method", "deterministic"))


@functools.lru_cache(maxsize=None)
def _init_state(layer):
    return jax.jit(lambda v: layer.apply(v, B, method="init_state"))


def _all_forms(kind, v, x, mask, chunks):
    """{form: y} of one causal layer: parallel, chunked(C), scan and (unmasked) the step loop."""
    layer = _layer(kind, causal=True)
    apply = _jit(layer)
    out = {"parallel": apply(v, x, mask=mask)[0]}
    for c in chunks:
        out[f"chunked({c})"] = _jit(_layer(kind, causal=True, chunk_size=c))(v, x, mask=mask)[0]
    out["scan"] = apply(v, x, mask=mask, method="scan")[0]
    if mask is None:
        state, ys = _init_state(layer)(v), []
        for t in range(x.shape[1]):
            y_t, state = apply(v, state, x[:, t], method="step")
            ys.append(np.asarray(y_t))
        out["step"] = np.stack(ys, 1)
    return out


def test_param_names_snapshot():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, learn_c0=True)
    shapes = param_shapes(jax.eval_shape(layer.init, jax.random.key(0), X)["params"])
    assert shapes == {
        "query/kernel": (E, H, D), "query/bias": (H, D),
        "key/kernel": (E, H, D), "key/bias": (H, D),
        "sigma/kernel": (E, H, D), "sigma/bias": (H, D),
        "value/kernel": (E, H, D), "value/bias": (H, D),
        "out/kernel": (H, D, E), "out/bias": (E,),
        "theta": (3,), "theta_0": (),
    }
    # Frozen c_0 has no parameter; K = 0 has no theta at all.
    frozen = AGFAttention(num_heads=H, head_dim=D, order=0, out_features=5)
    shapes = param_shapes(jax.eval_shape(frozen.init, jax.random.key(0), X)["params"])
    assert "theta" not in shapes and "theta_0" not in shapes
    assert shapes["out/kernel"] == (H, D, 5)
    for causal in (False, True):   # the causal softmax layer has the same tree
        sm = param_shapes(jax.eval_shape(_layer("softmax", causal=causal).init, jax.random.key(0),
                                         X)["params"])
        assert set(sm) == {f"{n}/{p}" for n in ("query", "key", "value", "out")
                           for p in ("kernel", "bias")}


def test_exports():
    assert {"AGFAttention", "SoftmaxAttention", "AGFState", "KVCache", "Model"} <= set(agf_jax.__all__)
    assert agf_jax.AGFState is ops.AGFState and agf_jax.KVCache is softmax.KVCache


def test_forward_matches_ops_and_init_filters():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, basis="legendre")
    v = _init_fn(layer)(jax.random.key(1), X)
    apply = _jit(layer)
    # theta = 0 and frozen c_0: g == 1, i.e. plain U (V^T Val) (agf.md §2.4).
    f = apply(v, X, mask=MASK, method="factors")
    assert np.all(np.asarray(f["g"]) == 1.0)
    v = _with_theta(v)
    y, aux = apply(v, X, mask=MASK)
    f = apply(v, X, mask=MASK, method="factors")
    # the references in one program: eagerly every op compiles on its own
    o, ortho = jax.jit(lambda f: (
        ops.agf_parallel(f["zu"], f["zv"], f["zs"], f["value"], f["coeffs"], basis="legendre", mask=MASK),
        ops.orthogonality_loss(f["zu"], f["zv"], mask=MASK, count_padding=False)))(f)
    p = v["params"]["out"]
    np.testing.assert_allclose(y, np.einsum("bthd,hde->bte", np.asarray(o), np.asarray(p["kernel"]))
                               + np.asarray(p["bias"]), **F32_SIMPLE)
    assert set(aux) == {"loss/orthogonality", "orthogonality/per_sample", "filter/coefficients"}
    assert aux["loss/orthogonality"].shape == () and aux["orthogonality/per_sample"].shape == (B,)
    np.testing.assert_allclose(aux["orthogonality/per_sample"], ortho, **F32_SIMPLE)
    np.testing.assert_allclose(aux["loss/orthogonality"], np.mean(np.asarray(ortho)), **F32_SIMPLE)
    np.testing.assert_array_equal(aux["filter/coefficients"], f["coeffs"])
    # Learnable c_0 at init: the filter is 0 and the output is the out-projection bias only.
    learn = AGFAttention(num_heads=H, head_dim=D, order=3, learn_c0=True,
                         bias_init=nn.initializers.normal(1.0))
    vl = _init_fn(learn)(jax.random.key(2), X)
    yl, _ = _jit(learn)(vl, X)
    np.testing.assert_allclose(yl, np.broadcast_to(vl["params"]["out"]["bias"], yl.shape),
                               **F32_SIMPLE)


def test_ortho_scale_padding_rule_and_theta_gradients():
    layer = AGFAttention(num_heads=H, head_dim=D, order=3, ortho_scale=0.25)
    v = _init(layer, 3)
    _, aux = _jit(layer)(v, X)
    _, aux1 = _jit(AGFAttention(num_heads=H, head_dim=D, order=3))(v, X)
    np.testing.assert_allclose(aux["loss/orthogonality"], 0.25 * np.asarray(aux1["loss/orthogonality"]),
                               **F32_SIMPLE)
    # ortho_count_padding=True is the reference regulariser (padded U rows count, agf.md §2.5).
    # (eager on both sides: they are compared bit for bit)
    ref = AGFAttention(num_heads=H, head_dim=D, order=3, ortho_count_padding=True)
    f = ref.apply(v, X, mask=MASK, method="factors")
    _, aux_ref = ref.apply(v, X, mask=MASK)
    np.testing.assert_array_equal(aux_ref["orthogonality/per_sample"],
                                  ops.orthogonality_loss(f["zu"], f["zv"], mask=MASK))
    _, aux_contract = _jit(layer)(v, X, mask=MASK)
    assert abs(float(aux_contract["orthogonality/per_sample"][1])
               - 0.25 * float(aux_ref["orthogonality/per_sample"][1])) > 1e-4
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, X)[0] ** 2)))(
        v["params"])
    assert float(jnp.min(jnp.abs(grads["theta"]))) > 0.0


@pytest.mark.parametrize("kind", ["agf", "softmax"])
@pytest.mark.parametrize("t,chunks", [(1, (1,)), (7, (3, 7)), (16, (5, 16))])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_forms_agree(kind, t, chunks, masked):
    v = _init(_layer(kind, causal=True), 4)
    outs = _all_forms(kind, v, X16[:, :t], _mask(t) if masked else None, chunks)
    assert np.all(np.isfinite(np.asarray(outs["parallel"])))
    assert_forms_agree(outs, **F32_SIMPLE)


@pytest.mark.parametrize("kind", ["agf", "softmax"])
def test_state_continues_across_calls(kind):
    layer = _layer(kind, causal=True)
    apply = _jit(layer)
    v = _init(layer, 5)
    y_full, _ = apply(v, X)
    y_a, st = apply(v, X[:, :3], method="scan")
    y_b, st = apply(v, X[:, 3:5], st, method="scan")
    ys = [y_a, y_b]
    for t in range(5, T):
        y_t, st = apply(v, st, X[:, t], method="step")
        ys.append(np.asarray(y_t)[:, None])
    assert_forms_agree({"parallel": y_full, "scan+scan+step": np.concatenate([np.asarray(y) for y in ys], 1)},
                       **F32_SIMPLE)
    st0 = _init_state(layer)(v)
    assert isinstance(st0, agf_jax.AGFState if kind == "agf" else agf_jax.KVCache)
    assert all(s.dtype in (jnp.float32, jnp.int32) for s in st0)
    if kind == "softmax":
        assert st0.key.shape == (B, 16, H, D) and st.length.tolist() == [T, T]


def test_softmax_cache_overflow_is_an_error_under_jit():
    layer = SoftmaxAttention(num_heads=H, head_dim=D, causal=True, max_length=2)
    v = _init_fn(layer)(jax.random.key(6), X)
    st = _init_state(layer)(v)
    for t in range(2):
        y_t, st = _jit(layer)(v, st, X[:, t], method="step")
        assert np.all(np.isfinite(np.asarray(y_t)))
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="max_length given at init"):
        jax.block_until_ready(_jit(layer)(v, st, X[:, 2], method="step"))


# (layer kind, causal, form); forms: 'parallel', 'chunked' (C=3), 'scan', 'step'.
FORMS = [("agf", False, "parallel")] + [(k, True, f) for k in ("agf", "softmax")
                                        for f in ("parallel", "chunked", "scan", "step")] + [
    ("softmax", False, "parallel")]


def _run(kind, causal, form, v, x, mask):
    """(y, aux) of one form; the step loop has no mask (it only sees the tokens it is given)."""
    if form == "step":
        layer = _layer(kind, causal=True)
        state, ys = _init_state(layer)(v), []
        step = _jit(layer)
        for t in range(x.shape[1]):
            y_t, state = step(v, state, x[:, t], method="step")
            ys.append(np.asarray(y_t))
        return np.stack(ys, 1), {}
    layer = _layer(kind, causal=causal, **({"chunk_size": 3} if form == "chunked" else {}))
    if form == "scan":
        return np.asarray(_jit(layer)(v, x, mask=mask, method="scan")[0]), {}
    y, aux = _jit(layer)(v, x, mask=mask)
    return np.asarray(y), aux


@pytest.mark.parametrize("kind,causal,form", FORMS)
@pytest.mark.parametrize("poison", [np.nan, 1e30], ids=["nan", "1e30"])
def test_padding_and_future_cannot_leak(kind, causal, form, poison):
    v = _init(_layer(kind, causal=causal), 7)
    mask = MASK                                    # sample 1: positions 5, 6 are padding
    t0 = 3                                         # the future: positions > t0 of sample 0
    x_pad, x_fut = X.copy(), X.copy()
    x_pad[1, 5:] = poison
    x_fut[0, t0 + 1:] = poison
    if form != "step":                             # padding (the step form takes no mask)
        y, aux = _run(kind, causal, form, v, X, mask)
        y_p, aux_p = _run(kind, causal, form, v, x_pad, mask)
        assert_forms_agree({"clean": (y[0], y[1, :5], aux), "padding poisoned":
                            (y_p[0], y_p[1, :5], aux_p)}, **F32_SIMPLE)
    if causal:
        y, _ = _run(kind, causal, form, v, X, None if form == "step" else mask)
        y_f, _ = _run(kind, causal, form, v, x_fut, None if form == "step" else mask)
        assert_forms_agree({"clean": y[:, :t0 + 1], "future poisoned": y_f[:, :t0 + 1]},
                           **F32_SIMPLE)
        if poison != poison:                       # NaN reaches every later output of sample 0
            assert np.all(np.isnan(y_f[0, t0 + 1:]))


@pytest.mark.parametrize("kind", ["agf", "softmax"])
def test_dtype_policy_bf16(kind):
    v = _init(_layer(kind, causal=True), 8)
    layer16 = _layer(kind, causal=True, dtype=jnp.bfloat16)
    v16 = _init(layer16, 8)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(v16))
    apply16 = _jit(layer16)
    y16, aux16 = apply16(v, jnp.asarray(X, jnp.bfloat16), mask=MASK)
    y32, _ = _jit(_layer(kind, causal=True))(v, X, mask=MASK)
    assert y16.dtype == jnp.bfloat16
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(aux16))
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, **BF16)
    y16s, state = apply16(v, jnp.asarray(X, jnp.bfloat16), mask=MASK, method="scan")
    np.testing.assert_allclose(np.asarray(y16s, np.float32), y32, **BF16)
    assert all(s.dtype in (jnp.float32, jnp.int32) for s in state)


@pytest.mark.parametrize("kind", ["agf", "softmax"])
def test_jit_equals_eager(kind):
    layer = _layer(kind, causal=True, chunk_size=3)
    v = _init(layer, 9)
    eager = (layer.apply(v, X, mask=MASK), layer.apply(v, X, mask=MASK, method="scan")[0])
    jitted = (_jit(layer)(v, X, mask=MASK), _jit(layer)(v, X, mask=MASK, method="scan")[0])
    assert_forms_agree({"eager": eager, "jit": jitted}, **F32_SIMPLE)


class _Foreign(nn.Module):
    """Someone else's model: embeds, calls AGF, adds the regulariser to its own output."""

    @nn.compact
    def __call__(self, x, mask):
        h = nn.Dense(E, name="proj")(x)
        y, aux = AGFAttention(num_heads=H, head_dim=D, order=2, name="agf")(h, mask=mask)
        return nn.Dense(3, name="head")(y).mean(1), aux["loss/orthogonality"]


def test_inside_foreign_module_and_nnx_bridge():
    model = _Foreign()
    v = jax.jit(model.init)(jax.random.key(6), X, MASK)
    assert set(v["params"]) == {"proj", "agf", "head"}
    out, reg = jax.jit(model.apply)(v, X, MASK)
    assert out.shape == (B, 3) and reg.shape == ()
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, X, MASK)[1]))(v["params"])
    assert float(jnp.sum(jnp.abs(grads["agf"]["key"]["kernel"]))) > 0.0

    # NNX: wrap the Linen layer with ToNNX, lazily initialise, train one step with nnx APIs.
    linen_layer = AGFAttention(num_heads=H, head_dim=D, order=2)
    layer = bridge.ToNNX(linen_layer, rngs=nnx.Rngs(0))
    bridge.lazy_init(layer, X, mask=MASK)
    y, aux = layer(X, mask=MASK)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    y_linen, _ = _jit(linen_layer)({"params": params}, X, mask=MASK)
    np.testing.assert_allclose(y, y_linen, **F32_SIMPLE)

    def loss(m):
        y, aux = m(X, mask=MASK)
        return jnp.mean(y ** 2) + aux["loss/orthogonality"]

    grads = nnx.grad(loss)(layer)
    flat = nnx.to_pure_dict(grads)
    assert set(flat) == set(params)
    assert float(jnp.sum(jnp.abs(flat["theta"]))) > 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_layer_matches_explicit_formula(causal):
    layer = _layer("softmax", causal=causal)
    v = _init_fn(layer)(jax.random.key(7), X)
    y, aux = _jit(layer)(v, X, mask=MASK)
    assert y.shape == X.shape and aux == {}
    y = np.asarray(y)
    p = jax.tree.map(np.asarray, v["params"])       # the formula in numpy
    q, k, val = (np.einsum("bte,ehd->bthd", X, p[n]["kernel"]) + p[n]["bias"]
                 for n in ("query", "key", "value"))
    logits = np.einsum("bthd,bjhd->bhtj", q, k) / np.sqrt(D)
    allowed = np.asarray(MASK)[:, None, None, :] & (np.tril(np.ones((T, T), bool)) if causal else True)
    logits = np.where(allowed, logits, -1e9)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o = np.einsum("bhtj,bjhd->bthd", w, val)
    want = np.einsum("bthd,hde->bte", o, p["out"]["kernel"]) + p["out"]["bias"]
    rows = (slice(None), slice(None)) if not causal else (1, slice(0, 5))   # valid rows
    np.testing.assert_allclose(y[rows], want[rows], **F32_SIMPLE)
    np.testing.assert_allclose(y[0], want[0], **F32_SIMPLE)


@pytest.mark.parametrize("kind,form", [("agf", "parallel"), ("agf", "scan"),
                                       ("softmax", "parallel"), ("softmax", "chunked"),
                                       ("softmax", "scan")])
def test_dropout_is_rng_driven(kind, form):
    layer = _layer(kind, causal=True, dropout_rate=0.5,
                   **({"chunk_size": 3} if form == "chunked" else {}))
    v = _init_fn(layer)(jax.random.key(10), X)
    method = "scan" if form == "scan" else "__call__"
    apply = _jit(layer)
    y_eval = apply(v, X, method=method)[0]
    y_a = apply(v, X, method=method, deterministic=False, rngs={"dropout": jax.random.key(1)})[0]
    y_b = apply(v, X, method=method, deterministic=False, rngs={"dropout": jax.random.key(2)})[0]
    assert not np.allclose(y_a, y_b)
    y_eval2 = _jit(_layer(kind, causal=True))(v, X, method=method)[0]
    assert_trees_close(y_eval, y_eval2, **F32_SIMPLE)


# ---------------------------------------------------------------------------------------------
# The Table 6 variants (graph_filter='uvt' | 'svd').
# ---------------------------------------------------------------------------------------------


def test_graph_filter_variants_param_names_and_spectrum():
    for variant, extra in (("uvt", {}), ("svd", {"singular_values": (H, D)})):
        layer = _layer(variant)
        shapes = param_shapes(jax.eval_shape(layer.init, jax.random.key(0), X)["params"])
        assert shapes == {**{f"{n}/{p}": (E, H, D) if p == "kernel" else (H, D)
                             for n in ("query", "key", "value") for p in ("kernel", "bias")},
                          "out/kernel": (H, D, E), "out/bias": (E,), **extra}
    v = _init_fn(_layer("svd"))(jax.random.key(1), X)
    np.testing.assert_array_equal(v["params"]["singular_values"], np.ones((H, D)))   # H_SVD starts as H_UV^T
    y_svd0 = _jit(_layer("svd"))(v, X, mask=MASK)[0]
    p_uvt = {k: w for k, w in v["params"].items() if k != "singular_values"}
    np.testing.assert_allclose(y_svd0, _jit(_layer("uvt"))({"params": p_uvt}, X, mask=MASK)[0],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["uvt", "svd"])
def test_graph_filter_variants_match_the_explicit_matrix(variant):
    # y = out(H Val) with H_tj = sum_k U_tk sigma_hk V_jk (sigma = 1 for 'uvt'), non-causal and causal.
    for causal in (False, True):
        layer = _layer(variant, causal=causal)
        v = _init(layer, 2)
        y, aux = _jit(layer)(v, X, mask=MASK)
        f = _jit(layer)(v, X, mask=MASK, method="factors")
        assert f["zs"] is None and f["coeffs"].tolist() == [1.0]
        want_g = v["params"].get("singular_values", jnp.ones((H, D)))
        np.testing.assert_allclose(f["g"], np.broadcast_to(want_g, f["g"].shape), rtol=0, atol=0)
        spectrum = None if variant == "uvt" else v["params"]["singular_values"]
        m = ops.agf_attention_matrix(f["zu"], f["zv"], None, f["coeffs"], mask=MASK, causal=causal,
                                     spectrum=jnp.ones((H, D)) if spectrum is None else spectrum)
        val = jnp.where(MASK[:, :, None, None], f["value"], 0.0)
        o = jnp.einsum("bhtj,bjhm->bthm", m, val)
        want = jnp.einsum("bthm,hme->bte", o, v["params"]["out"]["kernel"]) + v["params"]["out"]["bias"]
        np.testing.assert_allclose(y, want, **F32_SIMPLE)
        assert aux["filter/coefficients"].tolist() == [1.0]
        assert ("filter/singular_values" in aux) == (variant == "svd")
        want_reg = ops.orthogonality_loss(f["zu"], f["zv"], mask=MASK, count_padding=False)
        np.testing.assert_allclose(aux["orthogonality/per_sample"], want_reg, **F32_SIMPLE)


@pytest.mark.parametrize("variant", ["uvt", "svd"])
@pytest.mark.parametrize("masked", [False, True])
def test_graph_filter_variants_causal_forms_agree(variant, masked):
    v = _init(_layer(variant, causal=True), 4)
    outs = _all_forms(variant, v, X16[:, :T], _mask(T) if masked else None, (3,))
    assert np.all(np.isfinite(np.asarray(outs["parallel"])))
    assert_forms_agree(outs, **F32_SIMPLE)
    # The chunked form's GPU/TPU kernel (every chunk at once) gives the CPU scan's numbers.
    layer = _layer(variant, causal=True)
    f = _jit(layer)(v, X16[:, :T], method="factors")
    spectrum = layer.bind(v).spectrum()
    kw = dict(chunk_size=3, mask=_mask(T) if masked else None, spectrum=spectrum)
    assert_forms_agree({"scan": ops.agf_chunked_scan(f["zu"], f["zv"], None, f["value"], f["coeffs"], **kw),
                        "parallel": ops.agf_chunked_parallel(f["zu"], f["zv"], None, f["value"],
                                                             f["coeffs"], **kw)}, **F32_SIMPLE)


@pytest.mark.parametrize("variant,causal,form", [(k, False, "parallel") for k in ("uvt", "svd")] + [
    ("svd", True, f) for f in ("parallel", "chunked", "scan", "step")])
def test_graph_filter_variants_padding_and_future_cannot_leak(variant, causal, form):
    test_padding_and_future_cannot_leak(variant, causal, form, np.nan)


@pytest.mark.parametrize("variant", ["uvt", "svd"])
def test_graph_filter_variants_gradients(variant):
    layer = _layer(variant)
    v = _init(layer, 3)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, X, mask=MASK)[0] ** 2)
                             + layer.apply({"params": p}, X, mask=MASK)[1]["loss/orthogonality"]))(
        v["params"])
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    assert float(jnp.max(jnp.abs(grads["query"]["kernel"]))) > 0.0
    if variant == "svd":
        assert float(jnp.min(jnp.abs(grads["singular_values"]))) > 0.0
