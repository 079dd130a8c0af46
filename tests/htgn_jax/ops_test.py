"""Tests of the FAVOR+ kernels in htgn_jax.ops (htgn.md §2, §5.4, §5.14 items 1-3)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from htgn_jax import ops
from zoo_core.ops import linear_attention as la
from zoo_core.testing import F32_SIMPLE, F64, TESTDATA, Golden, assert_forms_agree, golden_excess

B, T, H, D, M = 2, 7, 2, 4, 8


def _qkv(seed=0, length=T, dtype=jnp.float32, scale=1.0):
    # numpy (the same values): slicing and editing the inputs then compiles nothing
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (B, length, H, D)
    return tuple(scale * np.asarray(jax.random.normal(k, shape, dtype)) for k in (kq, kk, kv))


# Jitted entry points: one compile per distinct (shape, option) set instead of op-by-op dispatch.
_attn = jax.jit(ops.favor_attention, static_argnames=(
    "feature_map", "causal", "eps", "key_stabiliser", "causal_impl", "chunk_size"))
_exact = jax.jit(ops.exact_softmax_attention, static_argnames=("causal",))
_draw = jax.jit(ops.draw_projection, static_argnames=(
    "num_features", "dim", "redraw_every", "orthogonal", "scaling", "fix_signs", "dtype"))
_orthogonal = jax.jit(lambda key, **kw: ops.gaussian_orthogonal_random_matrix(key, **kw),
                      static_argnames=("num_features", "dim", "scaling", "fix_signs"))
_favor_features = jax.jit(ops.favor_features,
                          static_argnames=("feature_map", "eps", "key_stabiliser"))
_favor_parallel = jax.jit(ops.favor_parallel)
_normalize = jax.jit(ops.normalize)


@jax.jit
def _stacked_orthogonal(key, draws=128, num_features=4 * D):
    """{fix_signs: `draws` independent ORF draws of `num_features` rows (whole blocks) stacked to
    [draws * num_features, D]}: as many independent blocks as one draw of 2048 rows, in one program
    of 4 key splits vmapped over the draws (one draw of 2048 rows unrolls 512 sequential splits)."""
    keys = jax.random.split(key, draws)
    draw = lambda fix_signs: jax.vmap(lambda k: ops.gaussian_orthogonal_random_matrix(  # noqa: E731
        k, num_features=num_features, dim=D, fix_signs=fix_signs))(keys).reshape(-1, D)
    return {True: draw(True), False: draw(False)}


@functools.lru_cache(maxsize=None)
def _omega(num_features=M, seed=1):
    return _draw(jax.random.PRNGKey(seed), 0, num_features=num_features, dim=D)


def _features(q, k, stab="constant", mask=None, omega=None):
    return _favor_features(q, k, projection=_omega() if omega is None else omega,
                           key_mask=mask, key_stabiliser=stab)


# ------------------------------------------------------------------------------------------
# Golden parity with the original google-research implementation
# ------------------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("case", ["performer_noncausal", "performer_causal"])
def test_golden_parity(case):
    g = Golden(TESTDATA / "performer" / f"{case}.npz")
    causal = g.meta["constructor_args"]["unidirectional"]
    q, k, v = (np.asarray(g.inputs[n]) for n in "qkv")
    omega = np.asarray(g.params["projection_matrix"])
    num_features, dim = omega.shape

    # The recorded matrix is the original constructor's output for PRNGKey(seed) (with the CPU's
    # QR sign convention, which fix_signs=False inherits).
    ours = _orthogonal(jax.random.PRNGKey(g.meta["seed"]), num_features=num_features, dim=dim,
                       fix_signs=False)
    assert golden_excess(ours, omega) <= 0

    # The original's key stabiliser (max over all positions) is 'max' without a mask.
    phi_q, phi_k, guard = _favor_features(q, k, projection=omega, key_stabiliser="max",
                                          eps=g.meta["constructor_args"]["numerical_stabilizer"])
    to_bhl = lambda a: np.moveaxis(np.asarray(a), 2, 1)  # ours [B, L, H, .] -> golden [B, H, L, .]
    assert golden_excess(to_bhl(phi_q), g.outputs["phi_q"]) <= 0
    assert golden_excess(to_bhl(phi_k), g.outputs["phi_k"]) <= 0
    if causal:
        # FAVOR+'s causal forms are the zoo's shared kernels with a denominator.
        forms = jax.jit(lambda a, b, c: [
            la.causal_scan(a, b, c, denominator=True)[:2],
            la.causal_chunked(a, b, c, chunk_size=5, denominator=True)[:2],
            la.causal_parallel(a, b, c, denominator=True)])(phi_q, phi_k, v)
    else:
        forms = [_favor_parallel(phi_q, phi_k, v)]
    for num, den in forms:
        assert golden_excess(to_bhl(num), g.outputs["numerator"]) <= 0
        assert golden_excess(to_bhl(den), g.outputs["denominator"]) <= 0
        assert golden_excess(_normalize(num, den, guard), g.outputs["attention"]) <= 0
    y = _attn(q, k, v, projection=omega, causal=causal, key_stabiliser="max")
    assert golden_excess(y, g.outputs["attention"]) <= 0


# ------------------------------------------------------------------------------------------
# Causal forms agree: chunked == masked quadratic == recurrent scan == step loop
# ------------------------------------------------------------------------------------------


@jax.jit
def _all_causal_forms(phi_q, phi_k, v):
    """{form: (num, den, state)} of the shared causal kernels on FAVOR+ features, plus a step loop
    over the first tokens from a zero state."""
    out = {"quadratic": la.causal_parallel(phi_q, phi_k, v, denominator=True) + (None,)}
    for chunk in (3, 4, 64):  # C dividing T or not, C > T (clipped to T); T = 1 gives C = 1
        out[f"chunked_{chunk}"] = la.causal_chunked(phi_q, phi_k, v, chunk_size=chunk,
                                                    denominator=True)
    out["recurrent"] = la.causal_scan(phi_q, phi_k, v, denominator=True)
    state, steps = la.init_state(B, H, M, D, denominator=True), []
    for t in range(min(3, phi_q.shape[1])):
        num_t, den_t, state = la.causal_step(state, phi_q[:, t], phi_k[:, t], v[:, t])
        steps.append((num_t, den_t))
    return out, steps


@pytest.mark.parametrize("length", [1, 7, 16])
def test_causal_forms_agree(length):
    q, k, v = _qkv(seed=length, length=length)
    phi_q, phi_k, guard = _features(q, k)
    forms, steps = _all_causal_forms(phi_q, phi_k, v)
    final = forms["recurrent"][2]
    assert final.num.dtype == final.den.dtype == jnp.float32
    assert_forms_agree({name: (num, den) for name, (num, den, _) in forms.items()}, **F32_SIMPLE)
    assert_forms_agree({name: state for name, (_, _, state) in forms.items()
                        if state is not None}, **F32_SIMPLE)
    ref_num, ref_den = (np.asarray(a) for a in forms["quadratic"][:2])
    n = len(steps)
    assert_forms_agree({"quadratic": (ref_num[:, :n], ref_den[:, :n]),
                        "step": (np.stack([s[0] for s in steps], 1),
                                 np.stack([s[1] for s in steps], 1))}, **F32_SIMPLE)
    # ... and favor_attention's three causal_impl give the same attention.
    omega = _omega()
    assert_forms_agree({impl: _attn(q, k, v, projection=omega, causal=True, causal_impl=impl,
                                    chunk_size=3)
                        for impl in ops.CAUSAL_IMPLS}, **F32_SIMPLE)


def test_state_carry_split_sequence():
    q, k, v = _qkv(seed=3, length=16)
    phi_q, phi_k, _ = _features(q, k)
    a = 5

    @jax.jit
    def run(phi_q, phi_k, v):
        kw = dict(chunk_size=4, denominator=True)
        full = la.causal_chunked(phi_q, phi_k, v, **kw)
        n1, d1, s1 = la.causal_chunked(phi_q[:, :a], phi_k[:, :a], v[:, :a], **kw)
        rest = (phi_q[:, a:], phi_k[:, a:], v[:, a:])
        return full, (n1, d1), [la.causal_chunked(*rest, state=s1, **kw),
                                la.causal_scan(*rest, state=s1, denominator=True)]

    (full_num, full_den, full_state), (n1, d1), continued = run(phi_q, phi_k, v)
    forms = {"full": (full_num, full_den, full_state)}
    for name, (num, den, state) in zip(("chunked", "scan"), continued):
        forms[name] = (np.concatenate([n1, num], 1), np.concatenate([d1, den], 1), state)
    assert_forms_agree(forms, **F32_SIMPLE)


def test_causal_constant_stabiliser_is_exactly_causal():
    q, k, v = _qkv(seed=4, length=16)
    cut = 9
    # Large future keys would move the original's global key max.
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    k2[:, cut:] *= np.float32(8.0)
    v2[:, cut:] += np.float32(3.0)
    q2[:, cut:] += np.float32(1.0)
    omega = _omega()
    run = lambda q, k, v, stab, impl: _attn(q, k, v, projection=omega, causal=True,
                                            key_stabiliser=stab, causal_impl=impl, chunk_size=4)
    for impl in ops.CAUSAL_IMPLS:
        y1 = np.asarray(run(q, k, v, "constant", impl))
        y2 = np.asarray(run(q2, k2, v2, "constant", impl))
        np.testing.assert_array_equal(y1[:, :cut], y2[:, :cut], err_msg=impl)
        assert not np.allclose(y1[:, cut:], y2[:, cut:])
    # The original's data-dependent key max leaks the future into the past (htgn.md §2.5).
    l1 = np.asarray(run(q, k, v, "max", "chunked"))
    l2 = np.asarray(run(q2, k2, v2, "max", "chunked"))
    assert not np.array_equal(l1[:, :cut], l2[:, :cut])


# ------------------------------------------------------------------------------------------
# Masks, exact oracle, deterministic feature maps
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", ["softmax", "relu", "exact"])  # elu masks as relu does
def test_key_padding_mask_equals_truncation(causal, feature_map):
    q, k, v = _qkv(seed=5)
    mask = np.arange(T)[None, :] < np.array([[7], [4]])
    # Garbage in the padded keys/values must not matter.
    k = np.where(mask[..., None, None], k, np.float32(50.0))
    v = np.where(mask[..., None, None], v, np.float32(-50.0))
    omega = _omega() if feature_map == "softmax" else None
    run = lambda q, k, v, m: _attn(q, k, v, feature_map=feature_map, projection=omega,
                                   causal=causal, key_mask=m, chunk_size=3)
    y = run(q, k, v, mask)
    ref = run(q[:, :4], k[:, :4], v[:, :4], None)  # example 1 truncated to its length
    np.testing.assert_allclose(np.asarray(y)[1, :4], np.asarray(ref)[1], **F32_SIMPLE)
    if not causal:
        # A fully padded example gives zeros (the denominator guard), not NaN.
        none_valid = mask.copy()
        none_valid[1] = False
        y0 = run(q, k, v, none_valid)
        np.testing.assert_array_equal(np.asarray(y0)[1], 0.0)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_oracle_equals_dot_product_attention(causal):
    q, k, v = _qkv(seed=6)
    mask = np.array([[1] * 7, [1, 1, 0, 1, 1, 0, 0]], bool)
    y = _attn(q, k, v, feature_map="exact", causal=causal, key_mask=mask)
    ref = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")(
        q, k, v, mask=mask[:, None, None, :], is_causal=causal)
    np.testing.assert_allclose(y, ref, **F32_SIMPLE)


def test_favor_approximates_softmax_with_many_features():
    # Spec §5.14 item 3: m = 2048 is within ~1e-2 mean abs error of exact softmax attention.
    q, k, v = _qkv(seed=7, scale=0.5)
    # m = 2048 rows stacked from independent ORF draws of whole blocks: the same distribution as one
    # draw of 2048 rows, whose blocks are independent too (each its own Gaussian matrix and key,
    # every row norm an independent chi_D), at a fraction of its compile time.
    many = _stacked_orthogonal(jax.random.PRNGKey(1))[True]
    assert many.shape == (2048, D)
    for causal in (False, True):
        exact = np.asarray(_exact(q, k, v, causal=causal))
        err = lambda omega: float(np.mean(np.abs(
            np.asarray(_attn(q, k, v, projection=omega, causal=causal)) - exact)))
        # ... and clearly better than a few-feature estimate, so the bound is not vacuous.
        assert err(many) < min(1e-2, err(_omega(4)) / 3), causal


def test_relu_and_elu_features():
    q, k, v = _qkv(seed=8)
    # All the feature maps' values in one program (eagerly each op compiles on its own).
    feats = jax.jit(lambda q, k: {"relu": (ops.relu_features(q), ops.relu_features(k)),
                                  "elu": (ops.elu_features(q), ops.elu_features(k)),
                                  "elu_negative": ops.elu_features(-30.0 * jnp.abs(q))})(q, k)
    np.testing.assert_allclose(feats["relu"][0], np.maximum(q, 0) + ops.RELU_EPS, **F32_SIMPLE)
    np.testing.assert_allclose(feats["elu"][0], np.where(q > 0, q + 1, np.exp(q)), **F32_SIMPLE)
    assert float(np.min(feats["elu_negative"])) > 0
    for name in ("relu", "elu"):
        pq, pk = (np.asarray(a, np.float64) for a in feats[name])
        scores = np.einsum("bihm,bjhm->bhij", pq, pk)
        for causal in (False, True):
            s = np.tril(scores) if causal else scores
            ref = np.einsum("bhij,bjhd->bihd", s, v) / s.sum(-1).transpose(0, 2, 1)[..., None]
            y = _attn(q, k, v, feature_map=name, causal=causal, chunk_size=3)
            np.testing.assert_allclose(y, ref, **F32_SIMPLE, err_msg=f"{name} causal={causal}")


def test_softmax_features_stabilisers():
    q, k, _ = _qkv(seed=9, scale=6.0)  # large inputs: the unstabilised exp would overflow
    omega = _omega()
    phi_q, phi_k, guard = _features(q, k, "constant", omega=omega)
    ratio = M ** -0.5
    m_w = float(jax.jit(ops.constant_key_stabiliser)(omega))
    phi_q, phi_k = np.asarray(phi_q), np.asarray(phi_k)
    # Constant key stabiliser: every exp() term is <= 1 (complete-the-square bound).
    assert float(np.max(phi_k)) <= ratio * (1 + 1e-6 * np.exp(-m_w)) * (1 + 1e-6)
    assert np.isclose(float(guard), 1e-6 * np.exp(-m_w), rtol=1e-5)
    # Query stabiliser: each token's largest feature is ratio * (exp(-||q'||^2 / 2) + eps).
    half_sq = 0.5 * np.sum(np.square(np.asarray(q, np.float64) * D ** -0.25), axis=-1)
    np.testing.assert_allclose(np.max(phi_q, -1), ratio * (np.exp(-half_sq) + 1e-6), **F32_SIMPLE)
    # Key max stabiliser over valid positions only.
    mask = np.arange(T)[None, :] < np.array([[7], [3]])
    big = k.copy()
    big[1, 3:] = 100.0
    _, phi_k, _ = _features(q, big, "max", mask=mask, omega=omega)
    _, ref, _ = _features(q[1:, :3], k[1:, :3], "max", omega=omega)
    phi_k = np.asarray(phi_k)
    np.testing.assert_allclose(phi_k[1:, :3], ref, **F32_SIMPLE)
    np.testing.assert_array_equal(phi_k[1, 3:], 0.0)
    assert bool(np.all(np.isfinite(phi_k)))


def test_constant_stabiliser_keeps_float32_in_range():
    # In exact arithmetic the constant stabiliser cancels (eps included), so float32 must match
    # float64, also at D=128 where M_w ~ 90 would underflow every feature without the cap
    # (module docstring).
    dim = 128
    omega = _draw(jax.random.PRNGKey(0), 0, num_features=256, dim=dim)
    q, k, v = (jax.random.normal(key, (1, T, 1, dim)) for key in jax.random.split(
        jax.random.PRNGKey(1), 3))
    y32 = _attn(q, k, v, projection=omega, causal=True)
    with jax.enable_x64(True):
        y64 = _attn(*(np.asarray(a, np.float64) for a in (q, k, v)),
                    projection=np.asarray(omega, np.float64), causal=True)
        y64 = np.asarray(y64)
    np.testing.assert_allclose(y32, y64, **F32_SIMPLE)


# ------------------------------------------------------------------------------------------
# Random projections and redraw
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fix_signs", [True, False])
def test_orthogonal_random_matrix_blocks(fix_signs):
    key = jax.random.PRNGKey(11)
    omega = np.asarray(_orthogonal(key, num_features=10, dim=D, fix_signs=fix_signs), np.float64)
    assert omega.shape == (10, D)
    norms = np.linalg.norm(omega, axis=1)
    # scaling=0: row norms are those of an independent Gaussian [M, D] draw (chi_D).
    np.testing.assert_allclose(norms, np.linalg.norm(jax.random.normal(key, (10, D)), axis=1),
                               **F32_SIMPLE)
    unit = omega / norms[:, None]
    for start, stop in ((0, 4), (4, 8), (8, 10)):  # two full blocks and a partial one
        block = unit[start:stop]
        np.testing.assert_allclose(block @ block.T, np.eye(stop - start), atol=1e-5)
    ones = _orthogonal(key, num_features=10, dim=D, scaling=1, fix_signs=fix_signs)
    np.testing.assert_allclose(np.linalg.norm(ones, axis=1), np.sqrt(D), **F32_SIMPLE)


def test_orthogonal_rows_are_isotropic_only_with_sign_fix():
    # Row i of every block: the original QR sign convention biases its i-th coordinate.
    # 512 blocks (128 draws of 4): coordinate i of a uniform unit vector in R^4 has variance 1/4, so
    # the mean over 512 blocks has standard error 0.5 / sqrt(512) = 0.022; both bounds (0.1 with the
    # fix, 0.3 below the unfixed bias of ~0.4) are 4.5 standard errors away.
    for fix_signs, lo, hi in ((True, 0.0, 0.1), (False, 0.3, 1.0)):
        omega = np.asarray(_stacked_orthogonal(jax.random.PRNGKey(12))[fix_signs])
        unit = omega / np.linalg.norm(omega, axis=1, keepdims=True)
        bias = [abs(unit[i::D, i].mean()) for i in range(D)]  # |mean of coordinate i of row i|
        assert all(lo <= b < hi for b in bias), (fix_signs, bias)


def test_redraw_is_deterministic():
    key = jax.random.PRNGKey(13)
    # The step is a traced int32 (one compile), as inside a jitted train step.
    draw = lambda step, every=5: _draw(key, None if step is None else np.int32(step),
                                       num_features=M, dim=D, redraw_every=every)
    first = draw(0)
    for step in (1, 4):
        np.testing.assert_array_equal(draw(step), first)
    np.testing.assert_array_equal(draw(None), first)
    second = draw(5)
    assert not np.allclose(second, first)
    np.testing.assert_array_equal(draw(9), second)
    np.testing.assert_array_equal(draw(7, every=0), first)


# ------------------------------------------------------------------------------------------
# Numerical gradients (float64, order 1)
# ------------------------------------------------------------------------------------------


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _softmax_forms(q, k, v):
    """Every FAVOR+ softmax path, as one function so that one check_grads covers them all."""
    omega = _omega().astype(jnp.float64)
    mask = jnp.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    attn = functools.partial(ops.favor_attention, q, k, v, projection=omega)
    return {
        # eps = 0 makes the stop_gradient'ed key max an exact constant of the function; with
        # eps > 0 the max enters the output at O(eps) and finite differences would see it.
        "noncausal_max_masked": attn(key_mask=mask, eps=0.0),
        "causal_chunked": attn(causal=True, chunk_size=3),
        # (the recurrent form is a lax.scan of la.causal_step, so this covers the step too)
        "causal_scan": attn(causal=True, causal_impl="scan"),
    }


def _other_maps(q, k, v):
    mask = jnp.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    # Keep finite differences away from relu's kink at 0.
    q_r, k_r = q + 0.05 * jnp.sign(q), k + 0.05 * jnp.sign(k)
    return {
        "relu_causal": ops.favor_attention(q_r, k_r, v, feature_map="relu", causal=True,
                                           chunk_size=3),
        "elu_noncausal": ops.favor_attention(q, k, v, feature_map="elu", key_mask=mask),
        "exact_causal_masked": ops.favor_attention(q, k, v, feature_map="exact", key_mask=mask,
                                                   causal=True),
    }


@pytest.mark.parametrize("fn", [_softmax_forms, _other_maps], ids=["softmax", "other_maps"])
def test_check_grads_float64(x64, fn):
    q, k, v = _qkv(seed=14, dtype=jnp.float64, scale=0.7)
    fn = jax.jit(fn)   # the one program check_grads then reuses (eagerly each op compiles alone)
    assert all(y.dtype == jnp.float64 for y in fn(q, k, v).values())
    check_grads(fn, (q, k, v), order=1, modes=("rev",), **F64)


# ------------------------------------------------------------------------------------------
# NaN-safe masking: garbage in padded keys / future positions changes no valid / past output
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("feature_map", ["softmax", "relu", "exact"])
def test_padding_and_future_garbage_change_nothing(feature_map, bad):
    q, k, v = _qkv(seed=15)
    mask = np.arange(T)[None, :] < np.array([[T], [4]])
    omega = _omega() if feature_map == "softmax" else None
    dirty = lambda a: np.where(mask[..., None, None], a, np.float32(bad))
    for causal in (False, True):
        impls = ops.CAUSAL_IMPLS if causal else ("chunked",)
        for impl in impls:
            run = lambda q, k, v: _attn(q, k, v, feature_map=feature_map, projection=omega,
                                        causal=causal, key_mask=mask, causal_impl=impl,
                                        chunk_size=3)
            y, y_bad = run(q, k, v), run(dirty(q), dirty(k), dirty(v))
            valid = np.asarray(mask)
            np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y)[valid],
                                          err_msg=f"causal={causal} {impl}")
    cut = 4   # causal: a garbage future token changes no earlier output
    for impl in ops.CAUSAL_IMPLS:
        run = lambda q, k, v: _attn(q, k, v, feature_map=feature_map, projection=omega,
                                    causal=True, causal_impl=impl, chunk_size=3)
        edited = tuple(a.copy() for a in (q, k, v))
        for a in edited:
            a[:, cut] = bad
        y, y_bad = run(q, k, v), run(*edited)
        np.testing.assert_array_equal(np.asarray(y_bad)[:, :cut], np.asarray(y)[:, :cut],
                                      err_msg=impl)
