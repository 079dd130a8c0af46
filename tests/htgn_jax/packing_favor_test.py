"""Packed FAVOR+ (issue 42): a packed call equals each document computed alone, values and gradients, in
every form and feature map, self- and cross-attention; NaN in padding or in another document changes
nothing; positions and the HRPE tables restart per document."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax import hrpe, ops
from htgn_jax.layers import FavorAttention
from zoo_core.ops import packing, positions
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

H, D, M = 2, 4, 8
# Two rows of packed documents with padding (0) between and after them; T = 13.
IDS = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 3, 3, 0, 0],
                [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7]], np.int32)
B, T = IDS.shape
DOCS = [(b, np.flatnonzero(IDS[b] == i)) for b in range(B) for i in np.unique(IDS[b]) if i]


def _inputs(seed=0, t=T, rows=B):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(np.asarray(jax.random.normal(k, (rows, t, H, D))) for k in ks)


def _alone(x, t=T):
    """Each document of the packed rows moved to the start of its own row (one row per document), and
    the key mask of those rows: the documents computed alone, in one call of one shape."""
    out = np.zeros((len(DOCS), t) + x.shape[2:], x.dtype)
    for row, (b, idx) in enumerate(DOCS):
        out[row, :len(idx)] = x[b, idx]
    return out


ALONE_MASK = np.arange(T)[None] < np.array([[len(idx)] for _, idx in DOCS])


def _scatter_alone(y):
    """Outputs `[docs, T, ...]` of `_alone` rows back to the packed layout (0 at padding)."""
    out = np.zeros((B, T) + y.shape[2:], y.dtype)
    for row, (b, idx) in enumerate(DOCS):
        out[b, idx] = y[row, :len(idx)]
    return out


OMEGA = np.asarray(ops.draw_projection(jax.random.PRNGKey(3), 0, num_features=M, dim=D))
# (feature_map, causal, causal_impl): every form of favor_attention.
FORMS = [("softmax", False, "chunked"), ("trig", False, "chunked"), ("relu", False, "chunked"),
         ("exact", False, "chunked"), ("softmax", True, "chunked"), ("softmax", True, "scan"),
         ("softmax", True, "quadratic"), ("elu", True, "chunked")]
FORMS32 = tuple(f for f in FORMS if f[0] != "trig")   # trig: in float64 (its test says why)


def _attention(feature_map, causal, impl, q, k, v, mask=None, segment_ids=None):
    projection = OMEGA.astype(q.dtype) if feature_map in ops.RANDOM_FEATURE_MAPS else None
    return ops.favor_attention(q, k, v, feature_map=feature_map, projection=projection, causal=causal,
                               causal_impl=impl, chunk_size=4, key_mask=mask, segment_ids=segment_ids)


@functools.partial(jax.jit, static_argnames=("packed", "forms"))
def _all_forms(q, k, v, packed, forms=FORMS32):
    """{form: (y, (dq, dk, dv))} of every form, packed (IDS) or alone (ALONE_MASK rows)."""
    kw = dict(segment_ids=IDS) if packed else dict(mask=ALONE_MASK)
    valid = (IDS > 0) if packed else ALONE_MASK
    weights = jnp.sin(jnp.arange(D, dtype=q.dtype) + 1.0)
    out = {}
    for form in forms:
        fn = functools.partial(_attention, *form, **kw)
        loss = lambda q, k, v: jnp.sum(jnp.where(valid[..., None, None], fn(q, k, v) * weights, 0.0))
        out[form] = (fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    return out


def _assert_packed_equals_alone(forms, tolerance, dtype=np.float32):
    q, k, v = (x.astype(dtype) for x in _inputs())
    packed = _all_forms(q, k, v, True, forms)
    alone = _all_forms(_alone(q), _alone(k), _alone(v), False, forms)
    for form in forms:
        y, grads = jax.tree_util.tree_map(np.asarray, packed[form])
        y_alone, grads_alone = jax.tree_util.tree_map(lambda a: _scatter_alone(np.asarray(a)), alone[form])
        assert np.all(y[IDS == 0] == 0), form
        assert_trees_close((y, grads), (y_alone, grads_alone), **tolerance)


def test_packed_equals_each_document_alone_in_every_form():
    _assert_packed_equals_alone(FORMS32, F32_SIMPLE)


def test_packed_trig_equals_each_document_alone_in_float64():
    """The trig estimate of a short document's denominator is near its floor (outputs and gradients
    ~1e5 with M = 8), so float32 rounding is amplified beyond 1e-5; in float64 the forms agree."""
    with jax.enable_x64(True):
        _assert_packed_equals_alone(tuple(f for f in FORMS if f[0] == "trig"), F64, np.float64)


def test_nan_in_padding_and_in_another_document_changes_nothing():
    q, k, v = _inputs(1)
    clean = _all_forms(q, k, v, True)
    dirty = [x.copy() for x in (q, k, v)]
    for x in dirty:
        x[IDS == 0] = np.nan
    padded = _all_forms(*dirty, True)
    dirty = [x.copy() for x in dirty]   # the CPU may alias the arrays passed above: edit copies
    for x in dirty:
        x[0, 4] = np.nan      # a valid token of document 2 of row 0
    poisoned = _all_forms(*dirty, True)
    other = IDS != 2
    for form in FORMS32:
        np.testing.assert_array_equal(np.asarray(padded[form][0]), np.asarray(clean[form][0]), err_msg=str(form))
        np.testing.assert_array_equal(np.asarray(poisoned[form][0])[other], np.asarray(clean[form][0])[other],
                                      err_msg=str(form))
        # inside document 2, the NaN reaches the rows the recurrence (causal) or the global sum gives it
        row = np.asarray(poisoned[form][0])[0]
        assert np.isnan(row[4]).all() and (form[1] or np.isnan(row[3]).all()), form


_jit_attention = jax.jit(_attention, static_argnums=(0, 1, 2))


def test_one_documents_large_keys_do_not_change_anothers_max_stabiliser():
    """The 'max' key stabiliser is per document: a document whose keys are 30x larger (its max
    dominates the row) leaves another document's features as computed alone."""
    q, k, v = _inputs(2)
    k = k.copy()
    k[IDS == 2] *= 30.0
    for fmap in ("softmax", "trig"):
        y = np.asarray(_jit_attention(fmap, False, "chunked", q, k, v, segment_ids=IDS))
        alone = _scatter_alone(np.asarray(_jit_attention(fmap, False, "chunked", _alone(q), _alone(k),
                                                         _alone(v), mask=ALONE_MASK)))
        np.testing.assert_allclose(y[IDS == 1], alone[IDS == 1], **F32_SIMPLE)


KV_IDS = np.array([[1, 1, 2, 2, 2, 2, 0, 3, 3, 3], [7, 7, 7, 5, 5, 0, 0, 0, 0, 0]], np.int32)


def _alone_memory(x, kv_ids=KV_IDS):
    """Each query document's memory moved to the start of its row (rows as `_alone`), and its mask."""
    out, mask = np.zeros((len(DOCS),) + x.shape[1:], x.dtype), np.zeros((len(DOCS), x.shape[1]), bool)
    for row, (b, idx) in enumerate(DOCS):
        keys = np.flatnonzero(kv_ids[b] == IDS[b, idx[0]])
        out[row, :len(keys)], mask[row, :len(keys)] = x[b, keys], True
    return out, mask


def test_packed_cross_attention_equals_each_document_alone():
    """Queries of documents [B, T] read only the memory of their own document [B, S] (ids matched;
    a query document without memory reads nothing)."""
    q, _, _ = _inputs(3)
    _, k, v = _inputs(4, t=KV_IDS.shape[1])
    (k_alone, mask), (v_alone, _) = _alone_memory(k), _alone_memory(v)
    run = jax.jit(lambda fmap, *a, **kw: ops.favor_attention(
        *a, feature_map=fmap, projection=OMEGA if fmap == "softmax" else None, **kw), static_argnums=0)
    for fmap in ("softmax", "exact"):
        y = np.asarray(run(fmap, q, k, v, segment_ids=IDS, kv_segment_ids=KV_IDS))
        want = _scatter_alone(np.asarray(run(fmap, _alone(q), k_alone, v_alone, key_mask=mask)))
        np.testing.assert_allclose(y[IDS > 0], want[IDS > 0], **F32_SIMPLE, err_msg=fmap)


def _layer(**kw):
    return FavorAttention(**{"num_heads": H, "head_dim": D, "num_features": M, "use_rotary": True, **kw})


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, chunk_size=3),
                                dict(feature_map="relu", num_features=None)],
                         ids=["global", "causal", "chunked", "relu"])
def test_layer_packed_equals_each_document_alone_with_restarting_rope(kw):
    layer = _layer(**kw)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (B, T, 8)))
    params = layer.init(jax.random.PRNGKey(0), x)
    run = jax.jit(lambda p, x, **a: layer.apply(p, x, **a)[0])
    y = np.asarray(run(params, x, segment_ids=IDS))
    alone = _scatter_alone(np.asarray(run(params, _alone(x), mask=ALONE_MASK)))
    np.testing.assert_allclose(y[IDS > 0], alone[IDS > 0], **F32_SIMPLE)
    if kw.get("causal"):   # the scan form, packed, is the same
        ys, _ = jax.jit(functools.partial(layer.apply, method="scan"))(params, x, segment_ids=IDS)
        np.testing.assert_allclose(np.asarray(ys)[IDS > 0], y[IDS > 0], **F32_SIMPLE)


def test_layer_packed_cross_attention():
    layer = FavorAttention(num_heads=H, head_dim=D, num_features=M)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(6), (B, T, 8)))
    memory = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (B, KV_IDS.shape[1], 8)))
    params = layer.init(jax.random.PRNGKey(0), x)
    run = jax.jit(lambda *a, **kw: layer.apply(params, *a, method="cross", **kw)[0])
    y = np.asarray(run(x, memory, segment_ids=IDS, kv_segment_ids=KV_IDS))
    memory_alone, mask = _alone_memory(memory)
    want = _scatter_alone(np.asarray(run(_alone(x), memory_alone, memory_mask=mask)))
    np.testing.assert_allclose(y[IDS > 0], want[IDS > 0], **F32_SIMPLE)


def test_positions_and_tables_restart_per_document():
    pos = np.asarray(packing.positions_from_segments(IDS))
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(pos[1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6])
    table = positions.sinusoidal_table(T, 7)
    np.testing.assert_allclose(np.asarray(positions.sinusoidal_at(pos, 7)), table[pos], rtol=0, atol=1e-6)
    mask = np.ones((B, T), bool)
    mask[1, 8] = False       # a masked token inside document 7 is not a node of its path
    docs = [(b, idx[mask[b, idx]]) for b, idx in DOCS]
    rows = np.arange(T)[None] < np.array([[len(idx)] for _, idx in docs])    # each document alone
    for fn in (jax.jit(lambda m, **kw: hrpe.masked_path_graph_pe(m, 3, **kw)),
               jax.jit(lambda m, **kw: hrpe.masked_skip_path_graph_pe(m, 3, (2,), **kw))):
        pe, alone = np.asarray(fn(mask, segment_ids=IDS)), np.asarray(fn(rows))
        assert np.all(pe[(IDS == 0) | ~mask] == 0)
        for row, (b, idx) in enumerate(docs):
            np.testing.assert_allclose(pe[b, idx], alone[row, :len(idx)], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(fn(mask)), np.asarray(fn(mask, segment_ids=np.ones((B, T), np.int32))))


def test_segment_max_is_the_document_max():
    values = np.asarray(jax.random.normal(jax.random.PRNGKey(8), (B, T, H)))
    got = np.asarray(jax.jit(ops.segment_max)(values, IDS))
    for b, idx in DOCS:     # documents are runs (two padding runs of id 0 are not one document)
        for t in idx:
            np.testing.assert_array_equal(got[b, t], values[b, IDS[b] == IDS[b, t]].max(axis=0))
