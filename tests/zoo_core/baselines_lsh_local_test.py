"""Reformer (shared-QK LSH) and Longformer (sliding window + global tokens) attention against dense
numpy oracles of their definitions (docs/baselines_reformer_longformer.md), the seeds' equality
properties on `SoftmaxAttention`'s parameters, and the layer contract: NaN / 1e30 in padding and in
the future, jit == eager, chunk lengths that do not divide T, finite gradients, one training step.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax.layers import SoftmaxAttention
from zoo_core.baselines.longformer import LongformerAttention, longformer_attention
from zoo_core.baselines.reformer import ReformerAttention
from zoo_core.testing import BF16, F32_SIMPLE

B, T, E, H, D = 2, 7, 16, 2, 8
FUTURE = 4
# Row 0 is all valid, row 1 has a padded hole and a padded tail.
MASK = np.array([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0, 0]], bool)

# (class, fields): multi-bucket / multi-round LSH with a chunk that does not divide T, and a
# window with global tokens.
CASES = [
    (ReformerAttention, dict(num_buckets=4, num_hashes=2, chunk_length=3, hash_seed=1)),
    (ReformerAttention, dict(num_buckets=2, num_hashes=3, chunk_length=2, hash_seed=2)),
    (LongformerAttention, dict(window=2, num_global=1)),
    (LongformerAttention, dict(window=4, num_global=2)),
]
IDS = ["reformer-b4c3", "reformer-b2c2", "longformer-w2g1", "longformer-w4g2"]


@functools.lru_cache(maxsize=None)
def _x():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (B, T, E)))
    x.flags.writeable = False
    return x


@functools.lru_cache(maxsize=None)
def _softmax_params():
    """`SoftmaxAttention`'s parameters: query, key, value `[E, H, D]`, out `[H, D, E]`."""
    return SoftmaxAttention(num_heads=H, head_dim=D).init(jax.random.PRNGKey(0), _x())


def _params_for(cls):
    p = _softmax_params()
    if cls is ReformerAttention:   # shared-QK: no key projection
        return {"params": {k: v for k, v in p["params"].items() if k != "key"}}
    return p


def _layer(cls, causal, fields, **extra):
    return cls(num_heads=H, head_dim=D, causal=causal, **fields, **extra)


@functools.lru_cache(maxsize=None)
def _jit(cls, causal, frozen):
    lay = _layer(cls, causal, dict(frozen))
    return jax.jit(lambda p, x, m: lay.apply(p, x, mask=m)[0])


def _apply_jit(cls, causal, fields, x, mask):
    return np.asarray(_jit(cls, causal, tuple(sorted(fields.items())))(_params_for(cls), x, mask))


# ----------------------------------------------------------------------------------------------
# Dense numpy oracles (float64), straight from the definitions.
# ----------------------------------------------------------------------------------------------

def _proj(name, x):
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), _softmax_params()["params"])
    return np.einsum("bte,ehd->bthd", x, p[name]["kernel"]) + p[name]["bias"]


def _out(o):
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), _softmax_params()["params"])
    return np.einsum("bthd,hde->bte", o, p["out"]["kernel"]) + p["out"]["bias"]


def _dense(logits, allowed, v, own=None):
    """Softmax rows of `[B, H, T, S]` logits (masked -1e9, own key -1e5) -> (o `[B, T, H, M]`, lse)."""
    logits = np.where(allowed, logits, -1e9)
    if own is not None:
        logits = np.where(allowed & own, -1e5, logits)
    m = logits.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
    w = np.exp(logits - lse[..., None])
    return np.einsum("bhts,bshm->bthm", w, v), lse


def reformer_reference(x, mask, *, causal, num_buckets, num_hashes, chunk_length, hash_seed):
    """Shared-QK LSH attention with dense `[T, T]` masks per round, combined by log-sum-exp."""
    x64 = np.asarray(x, np.float64)
    q, v = _proj("query", x64), _proj("value", x64)
    k = q / np.linalg.norm(q, axis=-1, keepdims=True)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    pos = np.arange(T)
    rot = np.asarray(jax.random.normal(jax.random.PRNGKey(hash_seed),
                                       (H, num_hashes, D, num_buckets // 2)), np.float64)
    outs, lses = [], []
    for r in range(num_hashes):
        if num_buckets == 1:
            bucket = np.zeros((B, H, T), int)
        else:
            xr = np.einsum("bthd,hdn->bhtn", k, rot[:, r])
            bucket = np.argmax(np.concatenate([xr, -xr], -1), -1)
        bucket = np.where(mask[:, None, :], bucket, num_buckets)
        rank = np.argsort(np.argsort(bucket * T + pos, axis=-1), axis=-1)   # sorted position
        same = bucket[..., :, None] == bucket[..., None, :]
        gap = rank[..., :, None] - rank[..., None, :]
        if causal:
            near = (gap >= 0) & (gap <= chunk_length)
        else:
            chunk = rank // chunk_length
            near = np.isin(chunk[..., :, None] - chunk[..., None, :], [0, 1])
        allowed = same & near & mask[:, None, None, :]
        o, lse = _dense(logits, allowed, v, own=pos[:, None] == pos[None, :])
        outs.append(o)
        lses.append(lse)
    lse = np.stack(lses)                                              # [R, B, H, T]
    w = np.exp(lse - lse.max(0))
    w = w / w.sum(0)
    o = np.einsum("rbht,rbthm->bthm", w, np.stack(outs))
    return _out(o)


def longformer_reference(x, mask, *, causal, window, num_global):
    """Sliding window + global tokens with a dense `[T, T]` mask."""
    x64 = np.asarray(x, np.float64)
    q, k, v = _proj("query", x64), _proj("key", x64), _proj("value", x64)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    near = ((i - j >= 0) & (i - j < window)) if causal else np.abs(i - j) <= window // 2
    near = near | (j < num_global) | (i < num_global)
    if causal:
        near = near & (j <= i)
    o, _ = _dense(logits, near[None, None] & mask[:, None, None, :], v)
    return _out(o)


def _reference(cls, x, mask, causal, fields):
    ref = reformer_reference if cls is ReformerAttention else longformer_reference
    return ref(x, mask, causal=causal, **fields)


# ----------------------------------------------------------------------------------------------
# The seeds' properties (baselines.md): equal to (shared-QK) softmax attention.
# ----------------------------------------------------------------------------------------------

def _shared_qk_softmax(x, mask, causal):
    """softmax(q k^T / sqrt(D)) with k = q / ||q||, the own key at -1e5, padded keys masked."""
    x64 = np.asarray(x, np.float64)
    q, v = _proj("query", x64), _proj("value", x64)
    k = q / np.linalg.norm(q, axis=-1, keepdims=True)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    allowed = np.broadcast_to(mask[:, None, None, :], logits.shape)
    if causal:
        allowed = allowed & np.tril(np.ones((T, T), bool))
    o, _ = _dense(logits, allowed, v, own=np.eye(T, dtype=bool))
    return _out(o)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reformer_one_bucket_one_chunk_is_shared_qk_softmax(causal):
    fields = dict(num_buckets=1, num_hashes=2, chunk_length=T)
    y = _apply_jit(ReformerAttention, causal, fields, _x(), MASK)
    ref = _shared_qk_softmax(_x(), MASK, causal)
    np.testing.assert_allclose(y[MASK], ref[MASK], **F32_SIMPLE)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_longformer_covering_window_is_softmax(causal):
    fields = dict(window=2 * T, num_global=0)
    y = _apply_jit(LongformerAttention, causal, fields, _x(), MASK)
    ref, _ = SoftmaxAttention(num_heads=H, head_dim=D, causal=causal).apply(
        _softmax_params(), _x(), mask=MASK)
    np.testing.assert_allclose(y[MASK], np.asarray(ref)[MASK], **F32_SIMPLE)


# ----------------------------------------------------------------------------------------------
# Against the dense oracles, and the layer contract.
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cls,fields", CASES, ids=IDS)
def test_matches_dense_oracle(cls, fields, causal):
    y = _apply_jit(cls, causal, fields, _x(), MASK)
    np.testing.assert_allclose(y[MASK], _reference(cls, _x(), MASK, causal, fields)[MASK],
                               **F32_SIMPLE)


# Eager runs compile op by op (seconds each on a shared CPU): one causal and one full case.
@pytest.mark.parametrize("cls,fields,causal", [CASES[0] + (True,), CASES[3] + (False,)],
                         ids=[IDS[0] + "-causal", IDS[3] + "-full"])
def test_jit_equals_eager(cls, fields, causal):
    y_eager, aux = _layer(cls, causal, fields).apply(_params_for(cls), _x(), mask=MASK)
    assert aux == {} and y_eager.shape == (B, T, E) and y_eager.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y_eager), _apply_jit(cls, causal, fields, _x(), MASK),
                               **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cls,fields", CASES, ids=IDS)
def test_padding_changes_nothing_valid(cls, fields, causal, bad):
    y = _apply_jit(cls, causal, fields, _x(), MASK)
    y_bad = _apply_jit(cls, causal, fields, np.where(MASK[..., None], _x(), bad).astype(np.float32), MASK)
    np.testing.assert_array_equal(y_bad[MASK], y[MASK])


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("cls,fields", CASES, ids=IDS)
def test_future_changes_nothing_past(cls, fields, bad):
    full = np.ones((B, T), bool)
    y = _apply_jit(cls, True, fields, _x(), full)
    x_bad = _x().copy()
    x_bad[:, FUTURE] = bad
    y_bad = _apply_jit(cls, True, fields, x_bad, full)
    np.testing.assert_array_equal(y_bad[:, :FUTURE], y[:, :FUTURE])


@pytest.mark.parametrize("cls,fields", CASES[::2], ids=IDS[::2])
def test_bf16_compute_close_to_float32(cls, fields):
    lay = _layer(cls, False, fields, dtype=jnp.bfloat16)
    y16 = jax.jit(lambda p, x: lay.apply(p, x, mask=MASK)[0])(_params_for(cls), _x())
    assert y16.dtype == jnp.bfloat16
    y32 = _apply_jit(cls, False, fields, _x(), MASK)
    np.testing.assert_allclose(np.asarray(y16, np.float32)[MASK], y32[MASK], **BF16)


@pytest.mark.parametrize("cls,fields", CASES[::2], ids=IDS[::2])
def test_gradients_finite_and_one_step_decreases_loss(cls, fields):
    lay = _layer(cls, True, fields, dropout_rate=0.1)
    # Finite padding: a NaN input reaches the projection kernels' gradients (x^T dq) in any layer.
    x = np.where(MASK[..., None], _x(), 3.0).astype(np.float32)
    target = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (B, T, E)))

    def loss(p, rng, deterministic):
        y, _ = lay.apply(p, x, mask=MASK, deterministic=deterministic, rngs={"dropout": rng})
        return jnp.sum(jnp.where(MASK[..., None], (y - target) ** 2, 0.0)) / MASK.sum()

    @jax.jit
    def step(p, rng):
        value, grads = jax.value_and_grad(loss)(p, rng, False)
        return value, grads, jax.tree_util.tree_map(lambda a, g: a - 0.05 * g, p, grads), loss(p, rng, True)

    params = _params_for(cls)
    _, grads, new, before = step(params, jax.random.PRNGKey(1))
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    _, _, _, after = step(new, jax.random.PRNGKey(1))
    assert float(after) < float(before)


def _largest_intermediate(jaxpr) -> int:
    """The element count of the largest value any equation of `jaxpr` (sub-jaxprs included) makes."""
    sizes = [0]
    for eqn in jaxpr.eqns:
        sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    sizes.append(_largest_intermediate(inner))
    return max(sizes)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cls,fields", [
    (ReformerAttention, dict(num_buckets=4, num_hashes=2, chunk_length=8)),
    (LongformerAttention, dict(window=8, num_global=1)),
], ids=["reformer", "longformer"])
def test_no_t_by_t_intermediate(cls, fields, causal):
    """Banded / chunked: at T = 64 no value the layer computes holds a [T, T] block per head."""
    n = 64
    x = jnp.zeros((1, n, E))
    lay = _layer(cls, causal, fields)
    jaxpr = jax.make_jaxpr(lambda p: lay.apply(p, x, mask=jnp.ones((1, n), bool))[0])(_params_for(cls))
    assert _largest_intermediate(jaxpr.jaxpr) < H * n * n


# --- Longformer over packed documents (issue 42; docs/baselines.md) ---------------------------------------
# Row 0: documents of 6, 5 and 3 tokens then padding; row 1: padding between documents, one of a token.
PACKED = np.array([[1] * 6 + [2] * 5 + [3] * 3 + [0] * 2,
                   [4] * 4 + [0] * 2 + [5] * 7 + [6] + [7] * 2], np.int32)


def _documents_alone(fn, q, k, v):
    """fn on each document of PACKED alone (a batch of one document per row, end padding masked),
    scattered back to `[B, T, H, M]` with 0 on padding."""
    docs = [(b, np.flatnonzero(PACKED[b] == d)) for b in range(2) for d in sorted(set(PACKED[b]) - {0})]
    n = max(len(i) for _, i in docs)
    rows = np.array([[b] * n for b, _ in docs])
    cols = np.array([np.pad(i, (0, n - len(i))) for _, i in docs])
    valid = np.array([np.arange(n) < len(i) for _, i in docs])
    o = jnp.where(valid[..., None, None], fn(q[rows, cols], k[rows, cols], v[rows, cols], valid), 0.0)
    return jnp.zeros(q.shape[:3] + v.shape[3:], o.dtype).at[rows[valid], cols[valid]].set(o[valid])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window,num_global", [(4, 2), (3, 1)])
def test_longformer_packed_equals_each_document_alone(window, num_global, causal):
    """Window and global tokens per document (a document's global tokens are its own first ones):
    values and float64 gradients; a padding row is 0; NaN in padding or another document changes nothing."""
    rng = np.random.default_rng(window)
    q, k, v = (rng.standard_normal((2, 16, 2, 4)) for _ in range(3))
    kw = dict(window=window, num_global=num_global, causal=causal)
    packed = lambda q, k, v: longformer_attention(q, k, v, segment_ids=PACKED, **kw)
    alone = lambda q, k, v: _documents_alone(lambda *a: longformer_attention(*a[:3], mask=a[3], **kw), q, k, v)
    with jax.enable_x64(True):
        got, want = jax.jit(packed)(q, k, v), jax.jit(alone)(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        assert np.all(np.asarray(got)[PACKED == 0] == 0)
        loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * v[..., ::-1]))
        for a, b in zip(jax.jit(jax.grad(loss(packed), (0, 1, 2)))(q, k, v),
                        jax.jit(jax.grad(loss(alone), (0, 1, 2)))(q, k, v)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    run = jax.jit(packed)
    clean = np.asarray(run(q32, k32, v32))
    pad = (PACKED == 0)[..., None, None]
    np.testing.assert_array_equal(np.asarray(run(*(np.where(pad, np.nan, x) for x in (q32, k32, v32)))), clean)
    bad = v32.copy()
    bad[1, 8, 0, 1] = np.nan                           # document 5 of row 1
    out = np.asarray(run(q32, k32, bad))
    other = PACKED != 5
    np.testing.assert_array_equal(out[other], clean[other])
    assert np.isnan(out[1, 8, 0]).all() and np.isfinite(out[:, :, 1]).all()


def test_longformer_layer_takes_segment_ids():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 8))
    layer = LongformerAttention(num_heads=2, head_dim=4, window=4, num_global=1)
    params = layer.init(jax.random.PRNGKey(1), x)
    y = jax.jit(lambda x: layer.apply(params, x, segment_ids=PACKED)[0])(x)
    alone = jax.jit(lambda x: layer.apply(params, x)[0])(x[1:2, 6:13])   # document 5, alone
    np.testing.assert_allclose(y[1, 6:13], alone[0], **F32_SIMPLE)
