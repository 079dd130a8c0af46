"""Tests of the pure AGF kernels (agf_jax.ops and its modules basis, factors, fused, forms): forms, masks, bases, n x n references, grads."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from agf_jax import ops
from zoo_core import testing
from zoo_core.ops import masking
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

B, H, D, M = 2, 2, 4, 3
BASIS = dict(basis="jacobi", alpha=2.0, beta=-1.0)
COEFFS = np.array([1.0, 0.6, -0.4, 0.3], np.float32)     # c_0..c_3, non-trivial filter


def _inputs(t, seed=0, dtype=jnp.float32):
    # numpy (the same values): slicing, editing and casting the inputs then compiles nothing
    ks = jax.random.split(jax.random.key(seed), 4)
    normal = lambda k, shape: np.asarray(jax.random.normal(k, shape, dtype))  # noqa: E731
    zu = 2.0 * normal(ks[0], (B, t, H, D))
    zv = 3.0 * normal(ks[1], (B, t, H, D))   # wide range: tests the running max
    zs = normal(ks[2], (B, t, H, D))
    val = normal(ks[3], (B, t, H, M))
    return zu, zv, zs, val


def _mask(t):
    # Second sample padded from position t - t//3 on (left part real).
    lengths = np.array([t, max(1, t - t // 3)])
    return np.arange(t)[None] < lengths[:, None]


# Jitted forms: one compile per shape (eager lax.scan would retrace its closure on every call).
parallel = jax.jit(functools.partial(ops.agf_parallel, **BASIS), static_argnames=("causal",))
chunked = jax.jit(functools.partial(ops.agf_chunked, **BASIS), static_argnames=("chunk_size",))
# The two forms agf_chunked chooses between per platform, called directly (the CPU runs the first).
chunked_forms = {name: jax.jit(functools.partial(fn, **BASIS), static_argnames=("chunk_size",))
                 for name, fn in (("scan", ops.agf_chunked_scan),
                                  ("parallel", ops.agf_chunked_parallel))}
recurrent = jax.jit(functools.partial(ops.agf_scan, **BASIS))
_step = jax.jit(functools.partial(ops.agf_step, **BASIS))
_masked_logits = jax.jit(ops.masked_logits)
_init_state = jax.jit(ops.init_state, static_argnums=(0, 1, 2, 3))
attention_matrix = jax.jit(functools.partial(ops.agf_attention_matrix, **BASIS),
                           static_argnames=("causal",))


def _step_loop(zu, zv, zs, val, coeffs, mask=None, state=None):
    zv = np.asarray(_masked_logits(zv, mask))
    state = _init_state(B, H, D, M) if state is None else state
    ys = []
    for t in range(zu.shape[1]):
        state, y = _step(state, zu[:, t], zv[:, t], zs[:, t], val[:, t], coeffs)
        ys.append(np.asarray(y))
    return np.stack(ys, 1), state


# ------------------------------------------------------------------------------------------
# Causal forms.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,chunks", [(1, (1, 4)), (7, (3, 7, 16)), (16, (4, 5))])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_forms_agree(t, chunks, masked):
    zu, zv, zs, val = _inputs(t, seed=t)
    # Always pass a mask (all ones when unmasked): same jit signature, fewer compiles.
    mask = _mask(t) if masked else np.ones((B, t), bool)
    y_par = parallel(zu, zv, zs, val, COEFFS, mask=mask, causal=True)
    y_rec, s_rec = recurrent(zu, zv, zs, val, COEFFS, mask=mask)
    y_step, s_step = _step_loop(zu, zv, zs, val, COEFFS, mask)
    assert y_par.shape == (B, t, H, M)
    assert bool(np.all(np.isfinite(y_par)))
    np.testing.assert_allclose(y_rec, y_par, **F32_SIMPLE)
    np.testing.assert_allclose(y_step, y_par, **F32_SIMPLE)
    assert_trees_close(s_step, s_rec, **F32_SIMPLE)
    for c in chunks:
        for name, form in chunked_forms.items():
            y_chk, s_chk = form(zu, zv, zs, val, COEFFS, chunk_size=c, mask=mask)
            np.testing.assert_allclose(y_chk, y_par, **F32_SIMPLE, err_msg=f"{name}, C={c}")
            assert_trees_close(s_chk, s_rec, **F32_SIMPLE)


def test_causal_last_position_equals_noncausal():
    # V^(T) is the whole-sequence softmax, so the last causal output is the non-causal one.
    zu, zv, zs, val = _inputs(7, seed=3)
    mask = _mask(7)
    y_c = np.asarray(parallel(zu, zv, zs, val, COEFFS, mask=mask, causal=True))
    y_n = np.asarray(parallel(zu, zv, zs, val, COEFFS, mask=mask, causal=False))
    np.testing.assert_allclose(y_c[:, -1], y_n[:, -1], **F32_SIMPLE)
    assert not np.allclose(y_c[:, 0], y_n[:, 0], atol=1e-3)


def test_split_sequence_state_carry():
    zu, zv, zs, val = _inputs(16, seed=4)
    ones = np.ones((B, 16), bool)
    y_full, s_full = recurrent(zu, zv, zs, val, COEFFS, mask=ones)
    y_full = np.asarray(y_full)
    first, rest = slice(0, 7), slice(7, 16)
    a = [x[:, first] for x in (zu, zv, zs, val)]
    b = [x[:, rest] for x in (zu, zv, zs, val)]
    # Any form continues any other's state: chunked -> chunked, chunked -> recurrent / step.
    y_a, s_a = chunked(*a, COEFFS, chunk_size=3, mask=ones[:, first])
    for name, form in chunked_forms.items():
        y_b, s_b = form(*b, COEFFS, chunk_size=3, mask=ones[:, rest], state=s_a)
        np.testing.assert_allclose(np.concatenate([y_a, y_b], 1), y_full, **F32_SIMPLE,
                                   err_msg=name)
        assert_trees_close(s_b, s_full, **F32_SIMPLE)
    y_c, _ = recurrent(*b, COEFFS, mask=ones[:, rest], state=s_a)
    np.testing.assert_allclose(y_c, y_full[:, rest], **F32_SIMPLE)
    y_d, s_d = _step_loop(*b, COEFFS, state=s_a)
    np.testing.assert_allclose(y_d, y_full[:, rest], **F32_SIMPLE)
    assert_trees_close(s_d, s_full, **F32_SIMPLE)


def test_causality():
    zu, zv, zs, val = _inputs(16, seed=5)
    ones = np.ones((B, 16), bool)
    t0 = 6
    new = _inputs(16, seed=6)
    future = [np.concatenate([a[:, :t0 + 1], b[:, t0 + 1:]], 1) for a, b in zip((zu, zv, zs, val),
                                                                                 new)]
    for fn in (lambda *a: parallel(*a, COEFFS, mask=ones, causal=True),
               lambda *a: chunked_forms["scan"](*a, COEFFS, chunk_size=4, mask=ones)[0],
               lambda *a: chunked_forms["parallel"](*a, COEFFS, chunk_size=4, mask=ones)[0]):
        y1 = np.asarray(fn(zu, zv, zs, val))
        y2 = np.asarray(fn(*future))
        np.testing.assert_allclose(y2[:, :t0 + 1], y1[:, :t0 + 1], **F32_SIMPLE)
        assert not np.allclose(y2[:, t0 + 1:], y1[:, t0 + 1:], atol=1e-3)


@pytest.mark.parametrize("poison", [np.nan, 1e30], ids=["nan", "1e30"])
def test_chunked_forms_ignore_bad_padding_and_agree_on_a_bad_valid_token(poison):
    # Padding holding NaN / 1e30 changes no valid output; the same at a valid position (t0) leaves the
    # outputs before it unchanged and makes both chunked forms give the recurrence's NaNs after it.
    t, t0 = 16, 6
    zu, zv, zs, val = _inputs(t, seed=18)
    mask = _mask(t)
    n = int(mask[1].sum())
    padded = [x.copy() for x in (zu, zv, zs, val)]
    for x in padded:
        x[1, n:] = poison
    future = [x.copy() for x in (zu, zv, zs, val)]
    future[1][0, t0] = poison                      # Z_V of sample 0 at valid position t0
    future[3][0, t0 + 2] = poison                  # and a value further on
    for name, form in chunked_forms.items():
        y, s = form(zu, zv, zs, val, COEFFS, chunk_size=5, mask=mask)
        y_p, s_p = form(*padded, COEFFS, chunk_size=5, mask=mask)
        assert_trees_close((y_p[0], y_p[1, :n], s_p), (y[0], y[1, :n], s), **F32_SIMPLE)
        y_f, _ = form(*future, COEFFS, chunk_size=5, mask=mask)
        np.testing.assert_allclose(y_f[0, :t0], y[0, :t0], **F32_SIMPLE, err_msg=name)
        np.testing.assert_allclose(y_f[1], y[1], **F32_SIMPLE, err_msg=name)
    want = chunked_forms["scan"](*future, COEFFS, chunk_size=5, mask=mask)
    got = chunked_forms["parallel"](*future, COEFFS, chunk_size=5, mask=mask)
    assert_trees_close(got, want, **F32_SIMPLE)        # NaNs at the same places
    if poison != poison:
        assert np.all(np.isnan(np.asarray(got[0])[0, t0:]))


def _causal_layer_and_args(chunk_size):
    from agf_jax.layers import AGFAttention
    layer = AGFAttention(num_heads=2, head_dim=4, causal=True, chunk_size=chunk_size, order=3,
                         **BASIS)
    x = jnp.zeros((2, 64, 8), jnp.float32)
    mask = jnp.ones((2, 64), bool)
    return layer, layer.init(jax.random.key(0), x, mask=mask), x, mask


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerator_programs_of_the_chunked_form_have_no_loop(platform):
    # An accelerator runs a while loop's control from the host; the chunked training form of
    # causal AGF and the causal layer's training step export without one. The CPU keeps its scan.
    zu, zv, zs, val = _inputs(64, seed=19)
    mask = _mask(64)

    def form_and_grad(zu, zv, zs, val, coeffs, mask):
        def loss(*a):
            return jnp.sum(ops.agf_chunked(*a, chunk_size=8, mask=mask, **BASIS)[0] ** 2)
        return loss(zu, zv, zs, val, coeffs), jax.grad(loss, argnums=(0, 1, 2, 3, 4))(
            zu, zv, zs, val, coeffs)

    args = (zu, zv, zs, val, COEFFS, mask)
    assert testing.while_loops(testing.exported_program(form_and_grad, *args,
                                                        platform=platform)) == 0
    assert testing.while_loops(testing.exported_program(form_and_grad, *args,
                                                        platform="cpu")) > 0
    layer, params, x, lmask = _causal_layer_and_args(8)

    def layer_step(params, x, mask):
        def loss(params):
            y, aux = layer.apply(params, x, mask=mask)
            return jnp.sum(y ** 2) + aux["loss/orthogonality"]
        return jax.value_and_grad(loss)(params)

    assert testing.while_loops(testing.exported_program(layer_step, params, x, lmask,
                                                        platform=platform)) == 0


# ------------------------------------------------------------------------------------------
# Masking.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(causal):
    # Real rows do not depend on what sits at padded positions, and equal the unpadded run.
    t, n = 16, 7
    zu, zv, zs, val = _inputs(t, seed=7)
    mask = np.arange(t)[None] < np.array([[t], [n]])
    y = np.asarray(parallel(zu, zv, zs, val, COEFFS, mask=mask, causal=causal))
    junk = _inputs(t, seed=8)
    keep = mask[:, :, None, None]
    mixed = [np.where(keep, a, 10 * b) for a, b in zip((zu, zv, zs, val), junk)]
    y2 = np.asarray(parallel(*mixed, COEFFS, mask=mask, causal=causal))
    np.testing.assert_allclose(y2[0], y[0], **F32_SIMPLE)
    np.testing.assert_allclose(y2[1, :n], y[1, :n], **F32_SIMPLE)
    # The padded sample equals the same tokens run unpadded (sample 0 is full length: skip it).
    short = parallel(*(a[:, :n] for a in (zu, zv, zs, val)), COEFFS, mask=mask[:, :n],
                     causal=causal)
    np.testing.assert_allclose(y[1, :n], np.asarray(short)[1], **F32_SIMPLE)


def test_mask_float_and_bool_agree_and_v_rows_zero():
    zu, zv, zs, val = _inputs(7, seed=9)
    mask = _mask(7)
    # The mask enters the maths only through the select of masked_logits: bit for bit the same
    # logits for a bool, a 0/1 float and a nonzero-is-valid mask, on any platform.
    logits = _masked_logits(zv, mask)
    np.testing.assert_array_equal(_masked_logits(zv, mask.astype(np.float32)), logits)
    np.testing.assert_array_equal(_masked_logits(zv, mask * np.float32(2.5)), logits)
    # The factors of each mask dtype are separate programs: their softmax sums may be reduced in
    # another order (a GPU tiles a reduction by its inputs' dtypes), so they agree to rounding.
    factors = jax.jit(functools.partial(ops.agf_factors, **BASIS))
    f_bool = factors(zu, zv, zs, COEFFS, mask=mask)
    f_float = factors(zu, zv, zs, COEFFS, mask=mask.astype(np.float32))
    assert_trees_close(f_float, f_bool, **F32_SIMPLE)
    v, u = np.asarray(f_bool.v), np.asarray(f_bool.u)
    assert float(np.max(np.abs(v[1, 5:]))) == 0.0       # padded rows of V are exactly 0
    assert float(np.max(np.abs(np.asarray(f_float.v)[1, 5:]))) == 0.0
    np.testing.assert_allclose(np.sum(v, axis=1), 1.0, **F32_SIMPLE)
    np.testing.assert_allclose(np.sum(u, axis=-1), 1.0, **F32_SIMPLE)


# ------------------------------------------------------------------------------------------
# Bases and coefficients.
# ------------------------------------------------------------------------------------------

X = np.linspace(0.0, 1.0, 9)


def _cheb_scale(k):
    return math.factorial(2 * k) / (4 ** k * math.factorial(k) ** 2)


def test_bases_against_closed_forms():
    x = jnp.asarray(X, jnp.float32)
    leg = np.asarray(ops.polynomial_basis(x, 3, basis="legendre"))
    np.testing.assert_allclose(leg[:, 2], (3 * X ** 2 - 1) / 2, **F32_SIMPLE)
    np.testing.assert_allclose(leg[:, 3], (5 * X ** 3 - 3 * X) / 2, **F32_SIMPLE)
    cheb = np.asarray(ops.polynomial_basis(x, 4, basis="chebyshev"))
    for k in range(5):   # Jacobi(-1/2, -1/2) = (2k)!/(4^k k!^2) T_k, not T_k itself
        np.testing.assert_allclose(cheb[:, k], _cheb_scale(k) * np.cos(k * np.arccos(X)),
                                   **F32_SIMPLE)
    mono = np.asarray(ops.polynomial_basis(x, 3, basis="monomial"))
    np.testing.assert_allclose(mono, X[:, None] ** np.arange(4), **F32_SIMPLE)
    for a, b in [(2.0, -1.0), (1.5, 2.0), (2.0, -2.0), (1.0, 0.2)]:
        jac = np.asarray(ops.polynomial_basis(x, 2, basis="jacobi", alpha=a, beta=b))
        p1 = 0.5 * ((a - b) + (a + b + 2) * X)
        p2 = ((a + 1) * (a + 2) / 2 + (a + 2) * (a + b + 3) * (X - 1) / 2
              + (a + b + 3) * (a + b + 4) * (X - 1) ** 2 / 8)
        np.testing.assert_allclose(jac[:, 0], 1.0)
        np.testing.assert_allclose(jac[:, 1], p1, **F32_SIMPLE)
        np.testing.assert_allclose(jac[:, 2], p2, **F32_SIMPLE)
    # Default Jacobi parameters are the reference's (1.0, 0.2).
    np.testing.assert_array_equal(ops.polynomial_basis(x, 3),
                                  ops.polynomial_basis(x, 3, alpha=1.0, beta=0.2))


def test_graph_filter_is_coefficient_sum():
    s = jax.random.uniform(jax.random.key(0), (3, 5))
    for kw in (BASIS, dict(basis="chebyshev"), dict(basis="legendre"), dict(basis="monomial")):
        want = jnp.sum(ops.polynomial_basis(s, 3, **kw) * COEFFS, -1)
        np.testing.assert_allclose(ops.graph_filter(s, COEFFS, **kw), want, **F32_SIMPLE)


def test_filter_coefficients():
    theta = jnp.array([0.5, -1.0])
    np.testing.assert_allclose(ops.filter_coefficients(theta), [1.0, np.tanh(0.5), np.tanh(-1.0)],
                               **F32_SIMPLE)
    np.testing.assert_allclose(ops.filter_coefficients(theta, jnp.array(0.3)),
                               [np.tanh(0.3), np.tanh(0.5), np.tanh(-1.0)], **F32_SIMPLE)
    np.testing.assert_array_equal(ops.filter_coefficients(None), [1.0])
    # At init (theta = 0) the frozen filter is exactly 1 and the learnable-c_0 filter exactly 0.
    s = jax.random.uniform(jax.random.key(1), (4,))
    assert np.all(ops.graph_filter(s, ops.filter_coefficients(jnp.zeros(3)), **BASIS) == 1.0)
    assert np.all(ops.graph_filter(s, ops.filter_coefficients(jnp.zeros(3), jnp.zeros(())),
                                   **BASIS) == 0.0)


# ------------------------------------------------------------------------------------------
# Explicit n x n references.
# ------------------------------------------------------------------------------------------


def _numpy_reference(zu, zv, zs, val, coeffs, mask, alpha, beta):
    """Independent float64 NumPy AGF with the explicit T x T matrix (agf.md §2.2-2.3)."""
    zu, zv, zs, val = (np.asarray(a, np.float64) for a in (zu, zv, zs, val))
    u = np.exp(zu - zu.max(-1, keepdims=True))
    u /= u.sum(-1, keepdims=True)
    zv = zv - 1e9 * (1 - np.asarray(mask, np.float64))[:, :, None, None]
    v = np.exp(zv - zv.max(1, keepdims=True))
    v /= v.sum(1, keepdims=True)
    s = 1 / (1 + np.exp(-zs))
    p = [np.ones_like(s), 0.5 * ((alpha - beta) + (alpha + beta + 2) * s)]
    for k in range(2, len(coeffs)):
        a_k, b_k, c_k = ops.jacobi_abc(k, alpha, beta)
        p.append((a_k * s + b_k) * p[-1] - c_k * p[-2])
    g = sum(c * pk for c, pk in zip(np.asarray(coeffs, np.float64), p))
    hmat = np.einsum("bthd,bjhd->bhtj", u * g, v)
    ortho = (np.abs(np.einsum("bthd,bthe->bhde", u, u) - np.eye(u.shape[-1])).mean((1, 2, 3))
             + np.abs(np.einsum("bthd,bthe->bhde", v, v) - np.eye(u.shape[-1])).mean((1, 2, 3)))
    return np.einsum("bhtj,bjhm->bthm", hmat, val), hmat, ortho


def test_linear_path_equals_explicit_matrix():
    zu, zv, zs, val = _inputs(7, seed=10)
    mask = _mask(7)
    y = parallel(zu, zv, zs, val, COEFFS, mask=mask, causal=False)
    y_np, h_np, ortho_np = _numpy_reference(zu, zv, zs, val, COEFFS, mask, 2.0, -1.0)
    np.testing.assert_allclose(y, y_np, **F32_SIMPLE)
    hmat = attention_matrix(zu, zv, zs, COEFFS, mask=mask)
    np.testing.assert_allclose(hmat, h_np, **F32_SIMPLE)
    np.testing.assert_allclose(jax.jit(ops.orthogonality_loss)(zu, zv, mask=mask), ortho_np,
                               **F32_SIMPLE)


def test_causal_matches_explicit_prefix_matrix():
    zu, zv, zs, val = _inputs(7, seed=11)
    hmat = np.asarray(attention_matrix(zu, zv, zs, COEFFS, causal=True))
    assert float(np.max(np.abs(np.triu(hmat, 1)))) == 0.0
    y = parallel(zu, zv, zs, val, COEFFS, mask=None, causal=True)
    np.testing.assert_allclose(y, np.einsum("bhtj,bjhm->bthm", hmat, val), **F32_SIMPLE)
    # Row t of the causal matrix is the non-causal matrix of the prefix [0, t].
    t = 4
    h_prefix = np.asarray(attention_matrix(*(a[:, :t + 1] for a in (zu, zv, zs)), COEFFS))
    np.testing.assert_allclose(hmat[:, :, t, :t + 1], h_prefix[:, :, t], **F32_SIMPLE)


def test_float32_math_for_bf16_inputs():
    zu, zv, zs, val = (a.astype(jnp.bfloat16) for a in _inputs(7, seed=12))
    y = parallel(zu, zv, zs, val, COEFFS)
    assert y.dtype == jnp.float32
    _, state = chunked(zu, zv, zs, val, COEFFS, chunk_size=3)
    assert all(s.dtype == jnp.float32 for s in state)


# ------------------------------------------------------------------------------------------
# Gradients (float64, order 1).
# ------------------------------------------------------------------------------------------


def test_check_grads_float64(x64):
    zu, zv, zs, val = (a.astype(jnp.float64) for a in _inputs(7, seed=13))
    zv = zv / 3.0
    mask = _mask(7)
    theta = np.array([0.7, -0.4, 0.3], np.float64)

    def noncausal(zu, zv, zs, val, theta):
        c = ops.filter_coefficients(theta)
        y = ops.agf_parallel(zu, zv, zs, val, c, mask=mask, **BASIS)
        return jnp.sum(y ** 2) + jnp.sum(ops.orthogonality_loss(zu, zv, mask=mask))

    def causal_par(zu, zv, zs, val, theta):
        return ops.agf_parallel(zu, zv, zs, val, ops.filter_coefficients(theta), causal=True,
                                **BASIS)

    def causal_chunk(zu, zv, zs, val, theta):
        return ops.agf_chunked(zu, zv, zs, val, ops.filter_coefficients(theta), chunk_size=3,
                               mask=mask, **BASIS)[0]

    def causal_chunk_parallel(zu, zv, zs, val, theta):
        return ops.agf_chunked_parallel(zu, zv, zs, val, ops.filter_coefficients(theta),
                                        chunk_size=3, mask=mask, **BASIS)[0]

    def causal_rec(zu, zv, zs, val, theta):
        return ops.agf_scan(zu, zv, zs, val, ops.filter_coefficients(theta), **BASIS)[0]

    def all_forms(*args):   # one function: one set of compiles for the four forms
        return tuple(fn(*args) for fn in (noncausal, causal_par, causal_chunk,
                                          causal_chunk_parallel, causal_rec))

    check_grads(jax.jit(all_forms), (zu, zv, zs, val, theta), order=1, modes=("rev",), **F64)


_FUSED_CASES = [dict(basis="jacobi", alpha=2.0, beta=-1.0), dict(basis="legendre"),
                dict(basis="chebyshev"), dict(basis="monomial")]


@pytest.mark.parametrize("count_padding", [True, False])
@pytest.mark.parametrize("basis", _FUSED_CASES, ids=lambda b: b["basis"])
def test_fused_form_equals_the_plain_maths_and_its_gradients(x64, basis, count_padding):
    # agf_with_orthogonality (a hand-written backward pass) against autodiff of the plain maths:
    # the explicit T x T attention matrix times the masked values, and orthogonality_loss.
    zu, zv, zs, val = (a.astype(jnp.float64) for a in _inputs(7, seed=15))
    zv = zv / 3.0
    mask = _mask(7)
    weights = np.asarray(jax.random.normal(jax.random.key(16), (B, 7, H, M), jnp.float64))

    def fused(zu, zv, zs, val, theta, theta_0):
        c = ops.filter_coefficients(theta, theta_0)
        y, reg = ops.agf_with_orthogonality(zu, zv, zs, val, c, mask=mask,
                                            count_padding=count_padding, **basis)
        return jnp.sum(jnp.sin(y) * weights) + jnp.sum(reg * jnp.array([0.7, -1.3]))

    def plain(zu, zv, zs, val, theta, theta_0):
        c = ops.filter_coefficients(theta, theta_0)
        hmat = ops.agf_attention_matrix(zu, zv, zs, c, mask=mask, **basis)
        y = jnp.einsum("bhtj,bjhm->bthm", hmat, ops.as_float(masking.zero_padding(val, mask)))
        reg = ops.orthogonality_loss(zu, zv, mask=mask, count_padding=count_padding)
        return jnp.sum(jnp.sin(y) * weights) + jnp.sum(reg * jnp.array([0.7, -1.3]))

    args = (zu, zv, zs, val, np.array([0.7, -0.4, 0.3], np.float64), np.float64(0.2))
    fused_jit = jax.jit(fused)   # the program check_grads then reuses
    grad = functools.partial(jax.grad, argnums=tuple(range(6)))
    # The plain value and both gradients in one program.
    plain_value, got, want = jax.jit(lambda *a: (plain(*a), grad(fused)(*a), grad(plain)(*a)))(
        *args)
    np.testing.assert_allclose(fused_jit(*args), plain_value, **F64)
    assert_trees_close(got, want, **F64)
    check_grads(fused_jit, args, order=1, modes=("rev",), **F64)


def test_fused_form_returns_the_reference_pair():
    zu, zv, zs, val = _inputs(7, seed=17)
    mask = _mask(7)

    @jax.jit   # one program: eagerly each op compiles on its own
    def run(zu, zv, zs, val, mask):
        fused = functools.partial(ops.agf_with_orthogonality, zu, zv, zs, val, COEFFS, mask=mask,
                                  **BASIS)
        return (fused(), fused(count_padding=False)[1],
                ops.orthogonality_loss(zu, zv, mask=mask, count_padding=False))
    (y, reg), reg_valid, want_valid = run(zu, zv, zs, val, mask)
    y_np, _, ortho_np = _numpy_reference(zu, zv, zs, val, COEFFS, mask, 2.0, -1.0)
    np.testing.assert_allclose(y, y_np, **F32_SIMPLE)
    np.testing.assert_allclose(reg, ortho_np, **F32_SIMPLE)
    np.testing.assert_allclose(reg_valid, want_valid, **F32_SIMPLE)


def test_where_masking_is_bit_identical_to_the_reference_offset():
    # Finite inputs: jnp.where(valid, Z_V, -1e9) gives the reference's Z_V - 1e9 (1 - mask) weights
    # bit for bit (padded weights are exactly 0 either way), and V^T Val is unchanged.
    zu, zv, zs, val = _inputs(7, seed=14)
    mask = _mask(7)
    v_ref = jax.nn.softmax(zv - 1e9 * (1.0 - mask.astype(jnp.float32))[:, :, None, None], axis=1)
    v = jax.nn.softmax(ops.masked_logits(zv, mask), axis=1)
    np.testing.assert_array_equal(v, v_ref)
    np.testing.assert_array_equal(jnp.einsum("bthd,bthm->bhdm", v, ops.as_float(masking.zero_padding(val, mask))),
                                  jnp.einsum("bthd,bthm->bhdm", v_ref, val))
