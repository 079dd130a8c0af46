"""Packed AGF (issue 42; docs/specs/context_parallel.md §2): with `segment_ids` every form computes each
document as if it were alone (values, final states, the regulariser and gradients), and NaN in padding
or in another document changes nothing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import AGFAttention, ops
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

B, T, H, D, M = 2, 13, 2, 4, 3
BASIS = dict(basis="jacobi", alpha=2.0, beta=-1.0)
COEFFS = np.array([1.0, 0.6, -0.4, 0.3], np.float32)
# Documents that cross the chunk boundaries of C = 3 and 5, padding (0) between and at the end, a
# document of one token, and a row whose first document starts at a chunk boundary.
IDS = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 3, 0, 0],
                [5, 5, 5, 5, 5, 5, 7, 1, 1, 1, 1, 1, 1]], np.int32)
# Padding inside a document (mask False, id > 0) behaves as in an unpacked row.
MASK = np.ones((B, T), bool)
MASK[1, 9] = False


def _inputs(seed=0, dtype=np.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    normal = lambda k, shape, s=1.0: np.asarray(s * jax.random.normal(k, shape), dtype)  # noqa: E731
    return (normal(ks[0], (B, T, H, D), 2.0), normal(ks[1], (B, T, H, D), 3.0),
            normal(ks[2], (B, T, H, D)), normal(ks[3], (B, T, H, M)))


def _causal_form(name, chunk=3):
    fn = {"parallel": lambda *x, **k: ops.agf_parallel(*x, causal=True, **k),
          "chunked": functools.partial(ops.agf_chunked, chunk_size=chunk),
          "chunked_scan": functools.partial(ops.agf_chunked_scan, chunk_size=chunk),
          "chunked_parallel": functools.partial(ops.agf_chunked_parallel, chunk_size=chunk),
          "scan": ops.agf_scan,
          "noncausal": ops.agf_parallel}[name]

    def run(zu, zv, zs, val, **kw):
        out = fn(zu, zv, zs, val, COEFFS, **BASIS, **kw)
        return out[0] if isinstance(out, tuple) else out
    return run


FORMS = ["parallel", "chunked", "chunked_scan", "chunked_parallel", "scan", "noncausal"]


def _documents(ids=IDS):
    for b in range(ids.shape[0]):
        for doc in np.unique(ids[b]):
            if doc:
                yield b, np.flatnonzero(ids[b] == doc)


def _separate(x, mask=None, ids=IDS):
    """Each document of the packed rows alone in a row of its own, left-aligned, the rest of the
    row masked (a causal output never reads later tokens, and a masked key has weight exactly 0):
    arrays `[N, T, ...]`, the mask `[N, T]`, and the (row, indices) of each document."""
    docs = list(_documents(ids))
    out = [np.zeros((len(docs),) + a.shape[1:], a.dtype) for a in x]
    valid = np.zeros((len(docs), ids.shape[1]), bool)
    for n, (b, idx) in enumerate(docs):
        for o, a in zip(out, x):
            o[n, :len(idx)] = a[b, idx]
        valid[n, :len(idx)] = True if mask is None else mask[b, idx]
    return out, valid, docs


def _reference(form):
    """The unpacked form of the document's kind: the causal parallel form or the global one."""
    return jax.jit(_causal_form("noncausal" if form == "noncausal" else "parallel"))


@pytest.mark.parametrize("form,chunk", [(f, 3) for f in FORMS] + [(f, 5) for f in FORMS if "chunked" in f])
def test_packed_equals_each_document_alone(form, chunk):
    x = _inputs()
    got = jax.jit(_causal_form(form, chunk))(*x, mask=MASK, segment_ids=IDS)
    sep, valid, docs = _separate(x, MASK)
    alone = _reference(form)(*sep, mask=valid)
    for n, (b, idx) in enumerate(docs):
        assert_trees_close(got[b, idx], alone[n, :len(idx)], **F32_SIMPLE)


@pytest.mark.parametrize("form", ["chunked_scan", "chunked_parallel", "scan"])
def test_final_state_is_the_last_document_alone_and_a_state_continues_the_first(form):
    x = _inputs(1)
    fn = jax.jit({"chunked_scan": functools.partial(ops.agf_chunked_scan, chunk_size=4),
                  "chunked_parallel": functools.partial(ops.agf_chunked_parallel, chunk_size=4),
                  "scan": ops.agf_scan}[form], static_argnames=BASIS.keys())
    ids = np.repeat(np.array([[1] * 5 + [2] * 8]), B, 0)
    scan = jax.jit(functools.partial(ops.agf_scan, **BASIS))
    _, final = fn(*x, COEFFS, segment_ids=ids, **BASIS)
    _, alone = scan(*(a[:, 5:] for a in x), COEFFS)
    assert_trees_close(final, alone, **F32_SIMPLE)
    # A state given to a packed call is read by its first document only.
    _, prefix = scan(*(a[:, :3] for a in x), COEFFS)
    y, _ = fn(*(a[:, 3:] for a in x), COEFFS, segment_ids=ids[:, 3:], state=prefix, **BASIS)
    whole = scan(*x, COEFFS, segment_ids=ids)[0]
    assert_trees_close(y, whole[:, 3:], **F32_SIMPLE)


@pytest.mark.parametrize("form", FORMS)
def test_nan_in_padding_or_another_document_changes_nothing(form):
    x = _inputs(2)
    fn = jax.jit(_causal_form(form))
    clean = np.asarray(fn(*x, segment_ids=IDS))
    dirty = [a.copy() for a in x]
    for a in dirty:
        a[0, 9] = np.nan          # padding (id 0)
        a[1, 2] = np.nan          # document 5 of row 1
    got = np.asarray(fn(*dirty, segment_ids=IDS))
    # Row 1's document 5 (tokens 0-5) holds the NaN at token 2: from there on in a causal form, all
    # of it in the global one (as the document alone gives); every other document is unchanged.
    reached = np.zeros((B, T), bool)
    reached[1, (0 if form == "noncausal" else 2):6] = True
    keep = (IDS > 0) & ~reached
    np.testing.assert_array_equal(got[keep], clean[keep])
    assert np.isnan(got[reached]).all()


def _loss(form):
    run = _causal_form(form)

    def loss(zu, zv, zs, val, valid, **kw):
        y = run(zu, zv, zs, val, **kw)
        return jnp.sum(jnp.where(valid[..., None, None], jnp.sin(3.0 * y), 0.0))
    return loss


@pytest.mark.parametrize("form", FORMS)
def test_gradients_equal_each_document_alone(form):
    """float64: the chunked and fwd + bwd sums round differently from the per-document reference."""
    with jax.enable_x64(True):
        x = [a.astype(np.float64) for a in _inputs(3)]
        x[0][0, 9] = x[1][0, 9] = np.nan       # NaN in padding: no NaN in any other gradient
        grads = jax.jit(jax.grad(_loss(form), argnums=(0, 1, 2, 3)))(*x, IDS > 0, segment_ids=IDS)
        sep, valid, docs = _separate(x)
        alone = jax.jit(jax.grad(_loss("noncausal" if form == "noncausal" else "parallel"),
                                 argnums=(0, 1, 2, 3)))(*sep, valid, mask=valid)
        for n, (b, idx) in enumerate(docs):
            assert_trees_close([g[b, idx] for g in grads], [g[n, :len(idx)] for g in alone], **F64)
        # The NaN-ed padded token's own gradient may be NaN (0 times its NaN); no other is.
        rest = np.ones((B, T), bool)
        rest[0, 9] = False
        assert all(np.isfinite(np.asarray(g)[rest]).all() for g in grads)


def test_regulariser_is_the_mean_of_the_documents_alone():
    zu, zv, zs, val = _inputs(4)
    loss = jax.jit(ops.orthogonality_loss, static_argnames="count_padding")
    got = loss(zu, zv, mask=MASK, count_padding=False, segment_ids=IDS)
    # Alone: each document in a row of its own, the rest masked and not counted.
    (zu_s, zv_s), valid, docs = _separate([zu, zv], MASK)
    alone = loss(zu_s, zv_s, mask=valid, count_padding=False)
    for b in range(B):
        np.testing.assert_allclose(got[b], np.mean([r for r, (bb, _) in zip(alone, docs) if bb == b]), rtol=1e-5)
    # count_padding=True counts a masked token of a document (row 1, token 9), never a token of id 0.
    counted = loss(zu, zv, mask=MASK, count_padding=True, segment_ids=IDS)
    assert counted[0] == got[0] and counted[1] != got[1]
    row1 = [loss(zu[1:2, i:j], zv[1:2, i:j], mask=MASK[1:2, i:j], count_padding=True)[0]
            for i, j in ((0, 6), (6, 7), (7, 13))]
    np.testing.assert_allclose(counted[1], np.mean(row1), rtol=1e-5)
    # The fused non-causal form returns the same regulariser, and NaN in padding changes none of it.
    zu_nan = zu.copy()
    zu_nan[0, 9] = np.nan
    fused = jax.jit(functools.partial(ops.agf_with_orthogonality, count_padding=False, **BASIS))
    np.testing.assert_allclose(fused(zu_nan, zv, zs, val, COEFFS, mask=MASK, segment_ids=IDS)[1], got, rtol=1e-6)


@pytest.mark.parametrize("causal,chunk", [(False, None), (True, None), (True, 4)])
def test_layer_packed_equals_each_document_alone(causal, chunk):
    layer = AGFAttention(num_heads=H, head_dim=D, causal=causal, chunk_size=chunk)
    x = jax.random.normal(jax.random.key(5), (B, T, 8))
    params = jax.jit(layer.init)(jax.random.key(0), x)
    y, aux = jax.jit(functools.partial(layer.apply, segment_ids=IDS))(params, x)
    # Alone: each document in a row of its own, the rest masked (the layer's regulariser then
    # leaves the padded rows out, `ortho_count_padding=False`).
    (sep,), valid, docs = _separate([np.asarray(x)])
    y_alone, aux_alone = jax.jit(layer.apply)(params, sep, mask=valid)
    ortho = aux_alone["orthogonality/per_sample"]
    for n, (b, idx) in enumerate(docs):
        assert_trees_close(y[b, idx], y_alone[n, :len(idx)], **F32_SIMPLE)
    for b in range(B):
        np.testing.assert_allclose(aux["orthogonality/per_sample"][b],
                                   np.mean([o for o, (bb, _) in zip(ortho, docs) if bb == b]), rtol=1e-5)
    if causal:
        y_scan, _ = jax.jit(functools.partial(layer.apply, segment_ids=IDS, method="scan"))(params, x)
        valid = IDS > 0
        assert_trees_close(y_scan[valid], y[valid], **F32_SIMPLE)
