"""Tests of samovar_jax.ops: the four forms of the VAR chain agree (on the shared zoo_core kernels),
state carry across split sequences, causality and NaN-safety, numerical gradients, structural matrix."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from samovar_jax import ops
from zoo_core.testing import F32_SIMPLE, F64, exported_program, while_loops

B, H, D, L = 2, 2, 4, 3
CHUNKS = (3, 4, 16)   # divides 16 / divides neither 7 nor 16 / longer than T


def _chain_inputs(t, seed=0, dtype=jnp.float32):
    # numpy: jax.random and the edits of the inputs would compile each op eagerly
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    x0 = normal(B, t, H, D)
    # q/v are per-head RMS-normalised in the model; scale like the goldens to keep the chain O(1).
    g = dtype.type((D * max(t, 1)) ** -0.25)
    q = g * normal(L, B, t, H, D)
    v = g * normal(L, B, t, H, D)
    wk = dtype.type(0.3) * normal(L, H * D, H * D)
    mask = (rng.random((L, B, t, H, D)) < 0.8).astype(dtype) / dtype.type(0.8)
    return x0, q, v, wk, mask


def _naive_chain(x0, q, v, wk=None, mask=None):
    """Direct transcription of samovar.md §2.6 with explicit double loops (float64 numpy)."""
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


@jax.jit
def _sequence_forms(x0, q, v, wk, mask):
    kw = dict(key_kernels=wk, dropout_mask=mask)
    out = {"parallel": ops.var_chain_parallel(x0, q, v, **kw)}
    out["scan"], out["scan_state"] = ops.var_chain_scan(x0, q, v, **kw)
    for c in CHUNKS:
        out[f"chunked{c}"], out[f"chunked{c}_state"] = ops.var_chain_chunked(x0, q, v, c, **kw)
        out[f"batched{c}"], out[f"batched{c}_state"] = ops.var_chain_chunked_batched(x0, q, v, c, **kw)
    return out


_step = jax.jit(ops.var_chain_step)


def _all_forms(x0, q, v, wk=None, mask=None):
    """Every form of the chain: the sequence forms in one program per T, and `var_chain_step`
    called once per token (jitted on its own, so one program serves every T instead of the whole
    loop unrolled per T).
    """
    out = _sequence_forms(x0, q, v, wk, mask)
    state, steps = ops.var_chain_init_state(L, B, H, D), []
    for i in range(x0.shape[1]):
        state, o = _step(state, x0[:, i], q[:, :, i], v[:, :, i], key_kernels=wk,
                         dropout_mask_t=None if mask is None else mask[:, :, i])
        steps.append(np.asarray(o))
    out["step"], out["step_state"] = np.stack(steps, axis=2), state
    return out


def _assert_forms(out, want):
    for name, value in out.items():
        ref = out["scan_state"] if name.endswith("state") else want
        np.testing.assert_allclose(value, ref, **F32_SIMPLE, err_msg=name)


@pytest.mark.parametrize("t", [1, 7, 16])
def test_four_forms_agree(t):
    x0, q, v, _, _ = _chain_inputs(t)
    _assert_forms(_all_forms(x0, q, v), _naive_chain(x0, q, v))


def test_four_forms_agree_with_key_kernels_and_dropout():
    x0, q, v, wk, mask = _chain_inputs(7, seed=1)
    _assert_forms(_all_forms(x0, q, v, wk, mask), _naive_chain(x0, q, v, wk, mask))


@jax.jit
def _split(x0, q, v, wk):
    a = 7
    full = ops.var_chain_scan(x0, q, v, key_kernels=wk)
    parts = {}
    for name, fn in [("scan", lambda *z, state=None: ops.var_chain_scan(*z, state=state, key_kernels=wk)),
                     ("chunked", lambda *z, state=None: ops.var_chain_chunked(*z, 4, state=state, key_kernels=wk)),
                     ("batched", lambda *z, state=None: ops.var_chain_chunked_batched(*z, 3, state=state,
                                                                                     key_kernels=wk))]:
        o1, s1 = fn(x0[:, :a], q[:, :, :a], v[:, :, :a])
        o2, s2 = fn(x0[:, a:], q[:, :, a:], v[:, :, a:], state=s1)
        parts[name] = (jnp.concatenate([o1, o2], axis=2), s2)
    return full, parts


def test_split_sequence_state_carry():
    x0, q, v, wk, _ = _chain_inputs(16, seed=2)
    full, parts = _split(x0, q, v, wk)
    for name, got in parts.items():
        want = full
        np.testing.assert_allclose(got[0], want[0], **F32_SIMPLE, err_msg=name)
        np.testing.assert_allclose(got[1], want[1], **F32_SIMPLE, err_msg=name)


def test_causality():
    t, cut = 16, 9
    x0, q, v, wk, _ = _chain_inputs(t, seed=3)
    noise = np.random.default_rng(9).standard_normal(x0.shape).astype(np.float32)
    future = np.arange(t)[None, :, None, None] >= cut
    x0b = np.where(future, x0 + noise, x0)
    qb = np.where(future[None], q + np.float32(1.0), q)
    vb = np.where(future[None], v - np.float32(1.0), v)

    @jax.jit   # both inputs through one program
    def fn(*z):
        return ops.var_chain_parallel(*z, key_kernels=wk), ops.var_chain_chunked(*z, 4, key_kernels=wk)[0]

    for a, b in zip(fn(x0, q, v), fn(x0b, qb, vb)):
        a, b = np.asarray(a), np.asarray(b)
        # Bitwise: masked terms are exact zeros and no later quantity enters an earlier sum.
        np.testing.assert_array_equal(a[:, :, :cut], b[:, :, :cut])
        assert not np.allclose(a[:, :, cut:], b[:, :, cut:])


@jax.jit
def _chain_forms(x0, q, v, wk, drop, mask):
    """{form: o [L, B, T, H, D]} of every form of the chain (step: token by token, no padding mask);
    jitted, so the clean and the poisoned inputs run the same compiled program."""
    kw = dict(key_kernels=wk, dropout_mask=drop, mask=mask)
    out = {"parallel": ops.var_chain_parallel(x0, q, v, **kw),
           "scan": ops.var_chain_scan(x0, q, v, **kw)[0]}
    for c in (2, 3):
        out[f"chunked{c}"] = ops.var_chain_chunked(x0, q, v, c, **kw)[0]
        out[f"batched{c}"] = ops.var_chain_chunked_batched(x0, q, v, c, **kw)[0]
    if mask is None:
        state, steps = ops.var_chain_init_state(L, B, H, D), []
        for i in range(x0.shape[1]):
            state, o = ops.var_chain_step(state, x0[:, i], q[:, :, i], v[:, :, i], key_kernels=wk,
                                          dropout_mask_t=None if drop is None else drop[:, :, i])
            steps.append(o)
        out["step"] = jnp.stack(steps, axis=2)
    return out


@pytest.mark.parametrize("bad", [np.nan, 1e30])
@pytest.mark.parametrize("where", ["x0", "q", "v"])
def test_a_bad_future_value_changes_no_past_output_in_any_form(bad, where):
    """A NaN or 1e30 at step 3 (in x0, which is also the first key, or in one layer's q or v) leaves
    steps 0-2 of every layer bit for bit, through the chain and its dropout masks."""
    t, cut = 7, 3
    x0, q, v, wk, drop = _chain_inputs(t, seed=7)
    def poison(a, index):
        a = a.copy()
        a[index] = bad
        return a
    poisoned = {"x0": (poison(x0, np.s_[:, cut]), q, v), "q": (x0, poison(q, np.s_[0, :, cut]), v),
                "v": (x0, q, poison(v, np.s_[1, :, cut]))}[where]
    for kernels, mask in ((None, None), (wk, drop)):
        clean, dirty = _chain_forms(x0, q, v, kernels, mask, None), _chain_forms(*poisoned, kernels, mask, None)
        for name in clean:
            np.testing.assert_array_equal(np.asarray(dirty[name])[:, :, :cut], np.asarray(clean[name])[:, :, :cut],
                                          err_msg=name)


def test_padding_holding_nan_changes_no_valid_output():
    t = 7
    x0, q, v, wk, drop = _chain_inputs(t, seed=8)
    mask = np.asarray([[True] * 5 + [False] * 2, [True, False, True, True, False, True, True]])
    pad = ~mask[:, :, None, None]
    x0n, qn, vn = (np.where(pad, np.float32(bad), a) for bad, a in ((np.nan, x0), (1e30, q), (np.nan, v)))
    clean, dirty = _chain_forms(x0, q, v, wk, drop, mask), _chain_forms(x0n, qn, vn, wk, drop, mask)
    keep = np.asarray(mask)[None, :, :, None, None]
    for name in clean:
        np.testing.assert_array_equal(np.where(keep, dirty[name], 0.0), np.where(keep, clean[name], 0.0),
                                      err_msg=name)
        np.testing.assert_array_equal(np.where(keep, 0.0, dirty[name]), 0.0, err_msg=name)   # padded outputs are 0
    # Valid outputs equal the chain run on the valid tokens only (row 0: its first 5 tokens).
    short = jax.jit(ops.var_chain_parallel)(x0[:1, :5], q[:, :1, :5], v[:, :1, :5], key_kernels=wk,
                                            dropout_mask=drop[:, :1, :5])
    np.testing.assert_allclose(np.asarray(dirty["parallel"])[:, :1, :5], short, **F32_SIMPLE)


def test_check_grads_float64(x64):
    x0, q, v, wk, mask = _chain_inputs(3, seed=4, dtype=jnp.float64)
    assert x0.dtype == jnp.float64
    # Chunked form with W_k and a dropout mask (also covers the inter-chunk state), the scan form
    # (the scan), and D^-1 (triangular solves); jitted so the finite differences are cheap.
    chunked = jax.jit(lambda a, b, c, w: ops.var_chain_chunked(a, b, c, 2, key_kernels=w, dropout_mask=mask))
    check_grads(chunked, (x0, q, v, wk), order=1, modes=("rev",), **F64)
    batched = jax.jit(lambda a, b, c, w: ops.var_chain_chunked_batched(a, b, c, 2, key_kernels=w,
                                                                       dropout_mask=mask))
    check_grads(batched, (x0, q, v, wk), order=1, modes=("rev",), **F64)
    scan = jax.jit(lambda a, b, c: ops.var_chain_scan(a, b, c)[0])
    check_grads(scan, (x0, q, v), order=1, modes=("rev",), **F64)
    check_grads(jax.jit(ops.structural_matrix_inverse), (0.3 * wk[:1, :4, :4],), order=1, modes=("rev",), **F64)


def test_structural_matrix_and_inverse():
    theta = np.float32(0.3) * np.random.default_rng(5).standard_normal((H, D, D)).astype(np.float32)
    # one program: eagerly every op of the factorisation compiles on its own
    lower, upper, d, d_inv = (np.asarray(a) for a in jax.jit(
        lambda t: ops.lu_factors(t) + (ops.structural_matrix(t), ops.structural_matrix_inverse(t)))(theta))
    np.testing.assert_allclose(np.diagonal(lower, axis1=1, axis2=2), 1.0)
    assert np.all(np.diagonal(upper, axis1=1, axis2=2) > 0)
    np.testing.assert_array_equal(np.triu(lower, 1), 0.0)
    np.testing.assert_array_equal(np.tril(upper, -1), 0.0)
    np.testing.assert_allclose(d @ d_inv, np.broadcast_to(np.eye(D), d.shape), **F32_SIMPLE)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _stats_and_patches(x, patch_len, mean_mode):
    seg = ops.patchify(x, patch_len)
    return ops.instance_norm_stats(x, patch_len, mean_mode), seg, ops.unpatchify(seg)


def test_instance_norm_and_patchify():
    x = np.random.default_rng(6).standard_normal((B, 10, 3)).astype(np.float32) * np.float32(3.0) + np.float32(1.0)
    (mean, std), seg, unpatched = _stats_and_patches(x, 4, "last_patch")
    np.testing.assert_allclose(np.asarray(mean)[:, 0], np.mean(x[:, -4:], 1), **F32_SIMPLE)
    np.testing.assert_allclose(np.asarray(std)[:, 0], np.std(x, 1, ddof=1) + 1e-8, **F32_SIMPLE)
    np.testing.assert_allclose(np.asarray(_stats_and_patches(x, 4, "window")[0][0])[:, 0], np.mean(x, 1),
                               **F32_SIMPLE)
    seg = np.asarray(seg)                                             # 10 -> 2 zeros on the left, 3 patches
    assert seg.shape == (B, 3, 3, 4)
    np.testing.assert_array_equal(seg[:, :, 0, :2], 0.0)
    np.testing.assert_array_equal(seg[:, 1, 1], x[:, 2:6, 1])
    np.testing.assert_array_equal(np.asarray(unpatched)[:, 2:], x)


def test_per_head_product_is_the_per_head_einsum():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 5, 3, 4)).astype(np.float32)
    m = rng.normal(size=(3, 4, 4)).astype(np.float32)
    product = jax.jit(ops.per_head_product)
    np.testing.assert_allclose(product(x, m), np.einsum("...hd,hde->...he", x, m), **F32_SIMPLE)
    # a non-finite entry stays in its own row
    x[0, 1, 2, 3] = np.nan
    out = np.asarray(product(x, m))
    assert np.isnan(out[0, 1]).all() and np.isfinite(np.delete(out.reshape(10, 3, 4), 1, axis=0)).all()


@pytest.mark.parametrize("chunk", [None, 3])
def test_chain_layers_are_the_stacked_forms_unstacked(chunk):
    # The same values and gradients as var_chain_parallel / var_chain_chunked, per layer.
    x0, q, v, wk, mask = _chain_inputs(7)
    kw = dict(key_kernels=wk, dropout_mask=mask)

    def stacked(x0, q, v):
        if chunk is None:
            return ops.var_chain_parallel(x0, q, v, **kw)
        return ops.var_chain_chunked(x0, q, v, chunk, **kw)[0]

    def layers(x0, q, v):
        return jnp.stack(ops.var_chain_layers(x0, list(q), list(v), chunk_size=chunk, **kw))

    # (different programs, so compared at the float32 tolerance, not bit for bit)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    # value and gradients of each in one program: eagerly every op compiles on its own
    value_and_grads = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(loss(f), (0, 1, 2))(*a)))  # noqa: E731
    (y_layers, g_layers), (y_stacked, g_stacked) = (value_and_grads(f)(x0, q, v) for f in (layers, stacked))
    np.testing.assert_allclose(y_layers, y_stacked, **F32_SIMPLE)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **F32_SIMPLE), g_layers, g_stacked)


def _chain_train_program(heads: int, chunk: int, platform: str, per_layer: bool) -> str:
    """The exported forward + backward of the chunked chain (`var_chain_chunked` or, with
    `per_layer`, the model's `var_chain_layers`), with key kernels, dropout and a padding mask."""
    x0 = jax.ShapeDtypeStruct((B, 64, heads, D), jnp.float32)
    qv = jax.ShapeDtypeStruct((L,) + x0.shape, jnp.float32)
    wk = jax.ShapeDtypeStruct((L, heads * D, heads * D), jnp.float32)
    mask = jax.ShapeDtypeStruct((B, 64), jnp.bool_)

    def loss(x0, q, v, wk, drop, mask):
        kw = dict(key_kernels=wk, dropout_mask=drop, mask=mask)
        if per_layer:
            return sum(jnp.sum(o) for o in ops.var_chain_layers(x0, list(q), list(v), chunk_size=chunk, **kw))
        return jnp.sum(ops.var_chain_chunked(x0, q, v, chunk, **kw)[0])
    return exported_program(jax.grad(loss, argnums=(0, 1, 2, 3)), x0, qv, qv, wk, qv, mask, platform=platform)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_accelerator_chain_has_no_loop_and_does_not_grow_with_heads(platform, per_layer):
    # Chunk 4 is a per-head prefix sum on the CPU, chunk 16 (> 2 D) a scan over chunks there.
    assert while_loops(_chain_train_program(4, 16, "cpu", per_layer)) > 0
    dots = {}
    for heads in (4, 16):
        for chunk in (4, 16):
            program = _chain_train_program(heads, chunk, platform, per_layer)
            assert while_loops(program) == 0, (heads, chunk)
            dots.setdefault(chunk, set()).add(program.count("stablehlo.dot_general"))
    assert all(len(counts) == 1 for counts in dots.values()), dots
