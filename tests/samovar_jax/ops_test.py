"""Tests of samovar_jax.ops: the four forms of the VAR chain and of causal linear attention agree,
state carry across split sequences, causality, numerical gradients, structural matrix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from samovar_jax import ops
from zoo_core.testing import F32_SIMPLE, F64

B, H, D, L = 2, 2, 4, 3
CHUNKS = (3, 4, 16)   # divides 16 / divides neither 7 nor 16 / longer than T


def _chain_inputs(t, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x0 = jax.random.normal(k[0], (B, t, H, D), dtype)
    # q/v are per-head RMS-normalised in the model; scale like the goldens to keep the chain O(1).
    g = (D * max(t, 1)) ** -0.25
    q = g * jax.random.normal(k[1], (L, B, t, H, D), dtype)
    v = g * jax.random.normal(k[2], (L, B, t, H, D), dtype)
    wk = 0.3 * jax.random.normal(k[3], (L, H * D, H * D), dtype)
    mask = jax.random.bernoulli(k[4], 0.8, (L, B, t, H, D)).astype(dtype) / 0.8
    return x0, q, v, wk, mask


def _naive_chain(x0, q, v, wk=None, mask=None):
    """Direct transcription of spec §2.6 with explicit double loops (float64 numpy)."""
    x0, q, v = (np.asarray(a, np.float64) for a in (x0, q, v))
    k = x0
    outs = []
    for m in range(q.shape[0]):
        if wk is not None:
            k = (k.reshape(k.shape[:2] + (-1,)) @ np.asarray(wk[m], np.float64)).reshape(k.shape)
        o = np.zeros_like(k)
        for t in range(k.shape[1]):
            for s in range(t + 1):
                o[:, t] += np.einsum("bhd,bhd->bh", q[m][:, t], k[:, s])[..., None] * v[m][:, s]
        if mask is not None:
            o = o * np.asarray(mask[m])
        outs.append(o)
        k = o
    return np.stack(outs)


def _all_forms(x0, q, v, wk=None, mask=None):
    """Every form of the chain and of plain linear attention (run eagerly: JAX caches every primitive
    per shape, which is cheaper here than compiling one large program per shape).

    The step forms are called once per token (a Python loop unrolled into the trace), so this checks
    `*_step` itself, not only the scans built on it.
    """
    kw = dict(key_kernels=wk, dropout_mask=mask)
    out = {"parallel": ops.var_chain_parallel(x0, q, v, **kw)}
    out["recurrent"], out["recurrent_state"] = ops.var_chain_recurrent(x0, q, v, **kw)
    for c in CHUNKS:
        out[f"chunked{c}"], out[f"chunked{c}_state"] = ops.var_chain_chunked(x0, q, v, c, **kw)
    state, steps = ops.var_chain_init_state(L, B, H, D), []
    for i in range(x0.shape[1]):
        state, o = ops.var_chain_step(state, x0[:, i], q[:, :, i], v[:, :, i], key_kernels=wk,
                                      dropout_mask_t=None if mask is None else mask[:, :, i])
        steps.append(o)
    out["step"], out["step_state"] = jnp.stack(steps, axis=2), state
    # Plain causal linear attention on (q, k, v) = (q[0], x0, v[0]).
    la = {"la_parallel": ops.linear_attention_parallel(q[0], x0, v[0])}
    la["la_recurrent"], la["la_recurrent_state"] = ops.linear_attention_recurrent(q[0], x0, v[0])
    for c in CHUNKS[:2]:
        la[f"la_chunked{c}"], la[f"la_chunked{c}_state"] = ops.linear_attention_chunked(q[0], x0, v[0], c)
    state, steps = ops.linear_attention_init_state(B, H, D, D), []
    for i in range(x0.shape[1]):
        state, o = ops.linear_attention_step(state, q[0][:, i], x0[:, i], v[0][:, i])
        steps.append(o)
    la["la_step"], la["la_step_state"] = jnp.stack(steps, axis=1), state
    return out, la


def _assert_forms(out, want):
    for name, value in out.items():
        ref = out["recurrent_state"] if name.endswith("state") else want
        np.testing.assert_allclose(value, ref, **F32_SIMPLE, err_msg=name)


@pytest.mark.parametrize("t", [1, 7, 16])
def test_four_forms_agree(t):
    x0, q, v, _, _ = _chain_inputs(t)
    out, la = _all_forms(x0, q, v)
    _assert_forms(out, _naive_chain(x0, q, v))
    want = _naive_chain(x0, q[:1], v[:1])[0]                       # one layer = plain linear attention
    for name, value in la.items():
        ref = la["la_recurrent_state"] if name.endswith("state") else want
        np.testing.assert_allclose(value, ref, **F32_SIMPLE, err_msg=name)


def test_four_forms_agree_with_key_kernels_and_dropout():
    x0, q, v, wk, mask = _chain_inputs(7, seed=1)
    out, _ = _all_forms(x0, q, v, wk, mask)
    _assert_forms(out, _naive_chain(x0, q, v, wk, mask))


def _split(x0, q, v, wk):
    a = 7
    full = ops.var_chain_recurrent(x0, q, v, key_kernels=wk)
    parts = {}
    for name, fn in [("recurrent", lambda *z, state=None: ops.var_chain_recurrent(*z, state=state, key_kernels=wk)),
                     ("chunked", lambda *z, state=None: ops.var_chain_chunked(*z, 4, state=state, key_kernels=wk))]:
        o1, s1 = fn(x0[:, :a], q[:, :, :a], v[:, :, :a])
        o2, s2 = fn(x0[:, a:], q[:, :, a:], v[:, :, a:], state=s1)
        parts[name] = (jnp.concatenate([o1, o2], axis=2), s2)
    oa, sa = ops.linear_attention_recurrent(q[0][:, :a], x0[:, :a], v[0][:, :a])
    ob, sb = ops.linear_attention_chunked(q[0][:, a:], x0[:, a:], v[0][:, a:], 3, sa)
    parts["linear_attention"] = (jnp.concatenate([oa, ob], 1), sb)
    return full, parts, ops.linear_attention_recurrent(q[0], x0, v[0])


def test_split_sequence_state_carry():
    x0, q, v, wk, _ = _chain_inputs(16, seed=2)
    full, parts, la_full = _split(x0, q, v, wk)
    for name, got in parts.items():
        want = la_full if name == "linear_attention" else full
        np.testing.assert_allclose(got[0], want[0], **F32_SIMPLE, err_msg=name)
        np.testing.assert_allclose(got[1], want[1], **F32_SIMPLE, err_msg=name)


def test_causality():
    t, cut = 16, 9
    x0, q, v, wk, _ = _chain_inputs(t, seed=3)
    noise = jax.random.normal(jax.random.PRNGKey(9), x0.shape)
    future = jnp.arange(t)[None, :, None, None] >= cut
    x0b = jnp.where(future, x0 + noise, x0)
    qb = jnp.where(future[None], q + 1.0, q)
    vb = jnp.where(future[None], v - 1.0, v)
    def fn(*z):
        return ops.var_chain_parallel(*z, key_kernels=wk), ops.var_chain_chunked(*z, 4, key_kernels=wk)[0]

    for a, b in zip(fn(x0, q, v), fn(x0b, qb, vb)):
        # Bitwise: masked terms are exact zeros and no later quantity enters an earlier sum.
        np.testing.assert_array_equal(np.asarray(a[:, :, :cut]), np.asarray(b[:, :, :cut]))
        assert not np.allclose(a[:, :, cut:], b[:, :, cut:])


def test_check_grads_float64(x64):
    x0, q, v, wk, mask = _chain_inputs(3, seed=4, dtype=jnp.float64)
    assert x0.dtype == jnp.float64
    # Chunked form with W_k and a dropout mask (also covers the inter-chunk state), recurrent form
    # (the scan), and D^-1 (triangular solves); jitted so the finite differences are cheap.
    chunked = jax.jit(lambda a, b, c, w: ops.var_chain_chunked(a, b, c, 2, key_kernels=w, dropout_mask=mask))
    check_grads(chunked, (x0, q, v, wk), order=1, modes=("rev",), **F64)
    recurrent = jax.jit(lambda a, b, c: ops.var_chain_recurrent(a, b, c)[0])
    check_grads(recurrent, (x0, q, v), order=1, modes=("rev",), **F64)
    check_grads(jax.jit(ops.structural_matrix_inverse), (0.3 * wk[:1, :4, :4],), order=1, modes=("rev",), **F64)


def test_structural_matrix_and_inverse():
    theta = 0.3 * jax.random.normal(jax.random.PRNGKey(5), (H, D, D))
    lower, upper = ops.lu_factors(theta)
    np.testing.assert_allclose(jnp.diagonal(lower, axis1=1, axis2=2), 1.0)
    assert np.all(np.asarray(jnp.diagonal(upper, axis1=1, axis2=2)) > 0)
    np.testing.assert_array_equal(np.triu(np.asarray(lower), 1), 0.0)
    np.testing.assert_array_equal(np.tril(np.asarray(upper), -1), 0.0)
    d = ops.structural_matrix(theta)
    np.testing.assert_allclose(d @ ops.structural_matrix_inverse(theta), np.broadcast_to(np.eye(D), d.shape),
                               **F32_SIMPLE)


def test_instance_norm_and_patchify():
    x = jax.random.normal(jax.random.PRNGKey(6), (B, 10, 3)) * 3.0 + 1.0
    mean, std = ops.instance_norm_stats(x, 4)
    np.testing.assert_allclose(mean[:, 0], np.mean(np.asarray(x)[:, -4:], 1), **F32_SIMPLE)
    np.testing.assert_allclose(std[:, 0], np.std(np.asarray(x), 1, ddof=1) + 1e-8, **F32_SIMPLE)
    np.testing.assert_allclose(ops.instance_norm_stats(x, 4, "window")[0][:, 0], np.mean(np.asarray(x), 1),
                               **F32_SIMPLE)
    with pytest.raises(ValueError, match="mean_mode"):
        ops.instance_norm_stats(x, 4, "median")
    seg = ops.patchify(x, 4)                                          # 10 -> 2 zeros on the left, 3 patches
    assert seg.shape == (B, 3, 3, 4)
    np.testing.assert_array_equal(seg[:, :, 0, :2], 0.0)
    np.testing.assert_array_equal(seg[:, 1, 1], x[:, 2:6, 1])
    np.testing.assert_array_equal(ops.unpatchify(seg)[:, 2:], x)


def test_chain_rejects_bad_shapes():
    x0, q, v, wk, mask = _chain_inputs(7)
    with pytest.raises(ValueError, match="VAR chain expects"):
        ops.var_chain_parallel(x0, q[0], v[0])
    with pytest.raises(ValueError, match="key_kernels"):
        ops.var_chain_parallel(x0, q, v, key_kernels=wk[:, :3])
    with pytest.raises(ValueError, match="dropout_mask"):
        ops.var_chain_recurrent(x0, q, v, dropout_mask=mask[:, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_attention_chunked(q[0], x0, v[0], 0)
