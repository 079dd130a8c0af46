"""Packed sequences (zoo_core/ops/packing.py) in linear attention: a packed call equals each document
computed alone, values and gradients, in every form; padding and another document's NaN change nothing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core.ops import linear_attention, packing
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

H, D, M = 2, 3, 4
# Two rows of packed documents, padding (0) between and after them; T = 13.
IDS = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 3, 3, 0, 0],
                [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7]], np.int32)
B, T = IDS.shape


def _inputs(seed=0, dtype=np.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.nn.elu(jax.random.normal(ks[0], (B, T, H, D))) + 1
    k = jax.nn.elu(jax.random.normal(ks[1], (B, T, H, D))) + 1
    v = jax.random.normal(ks[2], (B, T, H, M))
    return tuple(np.asarray(x, dtype) for x in (q, k, v))


FORMS = {
    "parallel": lambda q, k, v, **kw: linear_attention.causal_parallel(q, k, v, denominator=True, **kw),
    **{f"chunked{c}": functools.partial(
        lambda q, k, v, c, **kw: linear_attention.causal_chunked(q, k, v, chunk_size=c, denominator=True,
                                                                 **kw)[:2], c=c) for c in (1, 4, 5, 13)},
    "batched3": lambda q, k, v, **kw: linear_attention.causal_chunked_batched(
        q, k, v, chunk_size=3, denominator=True, **kw)[:2],
    "scan": lambda q, k, v, **kw: linear_attention.causal_scan(q, k, v, denominator=True, **kw)[:2],
    "noncausal": lambda q, k, v, **kw: linear_attention.noncausal(q, k, v, denominator=True, **kw),
}


def _separate(form, q, k, v):
    """Each document alone, written back at its positions; padding rows 0."""
    num, den = np.zeros(q.shape[:3] + (M,), q.dtype), np.zeros(q.shape[:3], q.dtype)
    for b in range(B):
        for doc in set(IDS[b]) - {0}:
            idx = np.flatnonzero(IDS[b] == doc)
            n, d = jax.jit(FORMS[form])(q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx])
            num[b, idx], den[b, idx] = n[0], d[0]
    return num, den


@pytest.mark.parametrize("form", sorted(FORMS))
def test_packed_equals_separate(form):
    q, k, v = _inputs()
    packed = jax.jit(lambda q, k, v: FORMS[form](q, k, v, segment_ids=IDS))(q, k, v)
    assert_trees_close(packed, _separate(form, q, k, v), **F32_SIMPLE)


@pytest.mark.parametrize("form", ["parallel", "chunked4", "scan", "noncausal"])
def test_packed_gradients_equal_separate_in_float64(form):
    with jax.enable_x64(True):
        q, k, v = _inputs(1, np.float64)
        weights = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (B, T, H, M)), np.float64)

        @functools.partial(jax.jit, static_argnums=4)
        def grads(q, k, v, w, packed):
            def loss(q, k, v):
                num, den = FORMS[form](q, k, v, **({"segment_ids": IDS} if packed else {}))
                return jnp.sum(w * num) + jnp.sum(jnp.sin(den))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        packed = grads(q, k, v, weights, True)
        separate = [np.zeros_like(x) for x in (q, k, v)]
        for b in range(B):
            for doc in set(IDS[b]) - {0}:
                idx = np.flatnonzero(IDS[b] == doc)
                g = grads(q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx], weights[b:b + 1, idx], False)
                for out, gi in zip(separate, g):
                    out[b, idx] = gi[0]
        assert_trees_close(packed, tuple(separate), **F64)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_nan_in_padding_and_in_another_document_stays_there(form):
    q, k, v = _inputs(2)
    fn = jax.jit(lambda q, k, v: FORMS[form](q, k, v, segment_ids=IDS))
    clean = fn(q, k, v)
    pad = (IDS == 0)[..., None, None]
    assert_trees_close(fn(*[np.where(pad, np.nan, x) for x in (q, k, v)]), clean, **F32_SIMPLE)
    bad_k = k.copy()
    bad_k[1, 2, 0, 1] = np.nan           # document 5 of row 1, position 2: document 7 is untouched
    num, den = fn(q, bad_k, v)
    doc7 = IDS[1] == 7
    assert_trees_close((num[1, doc7], den[1, doc7]), (clean[0][1, doc7], clean[1][1, doc7]), **F32_SIMPLE)
    assert_trees_close((num[0], den[0]), (clean[0][0], clean[1][0]), **F32_SIMPLE)
    reach = np.arange(T) >= (0 if form == "noncausal" else 2)    # the recurrence's NaN reach in document 5
    assert np.isnan(num[1, (IDS[1] == 5) & reach, 0]).all()
    assert np.isfinite(num[1, (IDS[1] == 5) & ~reach]).all()


def test_the_final_state_is_the_last_documents_and_a_given_state_reaches_the_first_only():
    q, k, v = _inputs(3)
    chunked = jax.jit(functools.partial(linear_attention.causal_chunked, chunk_size=4, denominator=True))
    _, _, packed = chunked(q, k, v, segment_ids=IDS)
    last = IDS[1] == 7
    _, _, alone = chunked(q[1:, last], k[1:, last], v[1:, last])
    assert_trees_close(jax.tree_util.tree_map(lambda x: x[1:], packed), alone, **F32_SIMPLE)
    state = linear_attention.LinearState(*jax.tree_util.tree_map(lambda x: x + 1.0, tuple(packed)))
    for form in (functools.partial(linear_attention.causal_chunked, chunk_size=4),
                 functools.partial(linear_attention.causal_chunked_batched, chunk_size=3),
                 linear_attention.causal_scan):
        form = jax.jit(functools.partial(form, denominator=True, segment_ids=IDS))
        with_state, without = form(q, k, v, state=state), form(q, k, v)
        first = (IDS == IDS[:, :1])
        assert not np.allclose(with_state[0][first], without[0][first])
        assert_trees_close(with_state[0][~first], without[0][~first], **F32_SIMPLE)


def test_starts_marks_each_document_start():
    start = packing.starts(jnp.asarray(IDS))
    assert start[0].tolist() == [False, False, False, True, False, False, False, False, True, True,
                                 False, True, False]


# Packed cross-attention: queries and memory packed apart, documents matched by id (in another order).
KV_IDS = np.array([[2, 2, 0, 1, 1, 1, 1, 3, 0],
                   [7, 7, 7, 0, 5, 5, 5, 5, 5]], np.int32)


@jax.jit
def _cross_inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.nn.elu(jax.random.normal(ks[0], (B, T, H, D))) + 1
    k = jax.nn.elu(jax.random.normal(ks[1], (B, KV_IDS.shape[1], H, D))) + 1
    v = jax.random.normal(ks[2], (B, KV_IDS.shape[1], H, M))
    return q, k, v


_cross_noncausal = jax.jit(functools.partial(linear_attention.noncausal, denominator=True))


def _cross_documents():
    return [(b, IDS[b] == doc, KV_IDS[b] == doc) for b in range(B) for doc in sorted(set(IDS[b].tolist()) - {0})]


@jax.jit
def _cross_alone(q, k, v):
    """Each query document against its own memory document alone (every document in one program)."""
    return [linear_attention.noncausal(q[b:b + 1, rows], k[b:b + 1, keys], v[b:b + 1, keys], denominator=True)
            for b, rows, keys in _cross_documents()]


def _cross_separate(q, k, v):
    """Each query document against its own memory document alone, scattered back; 0 at padding."""
    num, den = np.zeros((B, T, H, M), np.float32), np.zeros((B, T, H), np.float32)
    for (b, rows, _), (n, d) in zip(_cross_documents(), _cross_alone(q, k, v)):
        num[b, rows], den[b, rows] = n[0], d[0]
    return num, den


def test_packed_cross_attention_equals_each_document_alone():
    q, k, v = (np.asarray(x) for x in _cross_inputs())
    packed = functools.partial(_cross_noncausal, segment_ids=IDS, kv_segment_ids=KV_IDS)
    got = packed(q, k, v)
    assert_trees_close(got, _cross_separate(q, k, v), **F32_SIMPLE)
    # NaN in memory padding changes nothing; NaN in document 2's memory reaches only document 2's queries.
    k_bad = np.asarray(k).copy()
    k_bad[0, 2] = np.nan
    assert_trees_close(packed(q, k_bad, v), got, **F32_SIMPLE)
    k_bad[0, 0] = np.nan
    num, _ = packed(q, k_bad, v)
    num = np.asarray(num)
    assert np.isnan(num[0, IDS[0] == 2]).all() and np.isfinite(num[0, IDS[0] != 2]).all() and np.isfinite(num[1]).all()


def test_packed_cross_attention_gradients_equal_each_document_alone_in_float64():
    with jax.enable_x64(True):
        q, k, v = (np.asarray(x, np.float64) for x in _cross_inputs(1))

        def packed(q, k, v):
            num, den = linear_attention.noncausal(q, k, v, denominator=True, segment_ids=IDS, kv_segment_ids=KV_IDS)
            return jnp.sum(jnp.sin(num)) + jnp.sum(jnp.cos(den))

        def alone(q, k, v):
            total = 0.0
            for b in range(B):
                for doc in set(IDS[b].tolist()) - {0}:
                    rows, keys = np.flatnonzero(IDS[b] == doc), np.flatnonzero(KV_IDS[b] == doc)
                    num, den = linear_attention.noncausal(q[b:b + 1, rows], k[b:b + 1, keys], v[b:b + 1, keys],
                                                          denominator=True)
                    total = total + jnp.sum(jnp.sin(num)) + jnp.sum(jnp.cos(den))
            return total

        # Both gradients in one program: eagerly every op of both compiles on its own.
        got, want = jax.jit(lambda *x: (jax.grad(packed, argnums=(0, 1, 2))(*x), jax.grad(alone, argnums=(0, 1, 2))(*x)))(
            q, k, v)
        assert_trees_close(got, want, **F64)
