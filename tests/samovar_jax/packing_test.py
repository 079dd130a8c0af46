"""Packed rows (issue 42) in SAMoVAR's VAR chain and layers: a packed call equals each document computed
alone, values (float32, 1e-5) and gradients (float64), in every form of the chain; NaN in padding or in
another document changes nothing; a given state reaches the first document only and the final state is
the last document's."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax import ops
from samovar_jax.layers import LinearAttention, LinTransBlock, VARChain, document_positions
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

H, D, L = 2, 3, 3
# Two rows of packed documents, padding (0) between and after them; T = 13.
IDS = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 3, 3, 0, 0],
                [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7]], np.int32)
B, T = IDS.shape
DOCS = [(b, np.flatnonzero(IDS[b] == doc)) for b in range(B) for doc in sorted(set(IDS[b]) - {0})]


def _inputs(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    g = dtype((D * T) ** -0.25)          # the per-head norms' scale in the goldens: the chain stays O(1)
    x0, q, v = normal(B, T, H, D), g * normal(L, B, T, H, D), g * normal(L, B, T, H, D)
    wk = dtype(0.3) * normal(L, H * D, H * D)
    drop = (rng.random((L, B, T, H, D)) < 0.8).astype(dtype) / dtype(0.8)
    return x0, q, v, wk, drop


FORMS = {
    "parallel": lambda x0, q, v, **kw: ops.var_chain_parallel(x0, q, v, **kw),
    "chunked1": lambda x0, q, v, **kw: ops.var_chain_chunked(x0, q, v, 1, **kw)[0],
    "chunked4": lambda x0, q, v, **kw: ops.var_chain_chunked(x0, q, v, 4, **kw)[0],
    "batched5": lambda x0, q, v, **kw: ops.var_chain_chunked_batched(x0, q, v, 5, **kw)[0],
    "scan": lambda x0, q, v, **kw: ops.var_chain_scan(x0, q, v, **kw)[0],
    "layers": lambda x0, q, v, **kw: jnp.stack(ops.var_chain_layers(x0, list(q), list(v), **kw)),
    "layers_chunked3": lambda x0, q, v, **kw: jnp.stack(ops.var_chain_layers(x0, list(q), list(v), chunk_size=3,
                                                                              **kw)),
}


@functools.lru_cache(maxsize=None)
def _form(name, packed):
    def fn(x0, q, v, wk, drop, ids):
        return FORMS[name](x0, q, v, key_kernels=wk, dropout_mask=drop, segment_ids=ids if packed else None)
    return jax.jit(fn)


def _rows(*arrays, layered=(False,) * 5):
    """Each document alone in a row of its own, at its start, zeros after it (a causal chain never reads
    later tokens, so the zeros change nothing): one call for every document. `layered` marks [L, B, ...]."""
    out = []
    for a, lay in zip(arrays, layered):
        a = np.moveaxis(a, 1, 0) if lay else a
        rows = np.zeros((len(DOCS),) + a.shape[1:], a.dtype)
        for r, (b, idx) in enumerate(DOCS):
            if lay:
                rows[r, :, :len(idx)] = a[b][:, idx]
            else:
                rows[r, :len(idx)] = a[b, idx]
        out.append(np.moveaxis(rows, 0, 1) if lay else rows)
    return out


def _unrows(rows, like):
    """[L, docs, T, ...] outputs of `_rows` back at the packed positions of `like` [L, B, T, ...]."""
    out = np.zeros(like.shape, rows.dtype)
    for r, (b, idx) in enumerate(DOCS):
        out[:, b, idx] = rows[:, r, :len(idx)]
    return out


def _separate(name, x0, q, v, wk, drop):
    """Each document alone, written back at its positions; padding rows 0."""
    x0r, qr, vr, dr = _rows(x0, q, v, drop, layered=(False, True, True, True))
    return _unrows(np.asarray(_form(name, False)(x0r, qr, vr, wk, dr, None)), q)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_packed_chain_equals_each_document_alone(name):
    x0, q, v, wk, drop = _inputs()
    packed = _form(name, True)(x0, q, v, wk, drop, IDS)
    assert_trees_close(np.asarray(packed), _separate(name, x0, q, v, wk, drop), **F32_SIMPLE)


@pytest.mark.parametrize("name", ["parallel", "chunked4", "scan"])
def test_packed_chain_gradients_equal_each_document_alone_in_float64(name):
    with jax.enable_x64(True):
        x0, q, v, wk, drop = _inputs(1, np.float64)
        weights = np.random.default_rng(9).standard_normal(q.shape)

        @functools.partial(jax.jit, static_argnums=6)
        def grads(x0, q, v, drop, w, ids, packed):
            def loss(x0, q, v):
                o = FORMS[name](x0, q, v, key_kernels=wk, dropout_mask=drop, segment_ids=ids if packed else None)
                return jnp.sum(w * o)
            return jax.grad(loss, argnums=(0, 1, 2))(x0, q, v)

        packed = grads(x0, q, v, drop, weights, IDS, True)
        layered = (False, True, True, True, True)
        g = grads(*_rows(x0, q, v, drop, weights, layered=layered), None, False)
        separate = [np.zeros_like(a) for a in (x0, q, v)]
        for r, (b, idx) in enumerate(DOCS):
            separate[0][b, idx] = g[0][r, :len(idx)]
            for out, gi in zip(separate[1:], g[1:]):
                out[:, b, idx] = gi[:, r, :len(idx)]
        assert_trees_close(packed, tuple(separate), **F64)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_nan_in_padding_and_in_another_document_stays_there(name):
    x0, q, v, wk, drop = _inputs(2)
    fn = _form(name, True)
    clean = np.asarray(fn(x0, q, v, wk, drop, IDS))
    pad = (IDS == 0)[..., None, None]
    dirty = fn(np.where(pad, np.nan, x0), np.where(pad, np.float32(1e30), q), np.where(pad, np.nan, v), wk, drop, IDS)
    np.testing.assert_array_equal(np.asarray(dirty), clean)
    bad = x0.copy()
    bad[1, 2, 0, 1] = np.nan            # document 5 of row 1, position 2 (the first layer's key)
    out = np.asarray(fn(bad, q, v, wk, drop, IDS))
    doc5, doc7 = IDS[1] == 5, IDS[1] == 7
    np.testing.assert_array_equal(out[:, 1, doc7], clean[:, 1, doc7])
    np.testing.assert_array_equal(out[:, 0], clean[:, 0])
    np.testing.assert_array_equal(out[:, 1, :2], clean[:, 1, :2])     # before the bad token
    assert np.isnan(out[:, 1, doc5 & (np.arange(T) >= 2), 0]).all()


def test_a_given_state_reaches_the_first_document_only_and_the_final_state_is_the_last_ones():
    x0, q, v, _, _ = _inputs(3)
    forms = {"chunked": jax.jit(lambda *a, **kw: ops.var_chain_chunked(*a, 4, **kw)),
             "batched": jax.jit(lambda *a, **kw: ops.var_chain_chunked_batched(*a, 3, **kw)),
             "scan": jax.jit(ops.var_chain_scan)}
    last = IDS[1] == 7
    alone = forms["scan"](x0[1:, last], q[:, 1:, last], v[:, 1:, last])[1]
    first = IDS == IDS[:, :1]
    for name, form in forms.items():
        o, final = form(x0, q, v, segment_ids=IDS)
        assert_trees_close(np.asarray(final)[:, 1:], np.asarray(alone), **F32_SIMPLE)
        o_state, _ = form(x0, q, v, segment_ids=IDS, state=np.asarray(final) + np.float32(0.5))
        o, o_state = np.asarray(o), np.asarray(o_state)
        assert not np.allclose(o_state[:, first], o[:, first]), name
        np.testing.assert_allclose(o_state[:, ~first], o[:, ~first], **F32_SIMPLE, err_msg=name)


def test_document_positions_restart_at_each_document():
    pos = np.asarray(document_positions(jnp.asarray(IDS), 4))
    assert pos[0].tolist() == [4, 5, 6, 0, 1, 2, 3, 4, 0, 0, 1, 0, 1]   # padding runs count too (unread)
    assert pos[1].tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6]


E = H * D
LAYERS = {
    "var_chain": VARChain(E, H, L),
    "var_chain_chunked": VARChain(E, H, L, use_key_proj=True, chunk_size=4),
    "fixed_var_chain": VARChain(E, H, L, qv_source="fixed", use_qv_norm=False, max_tokens=T),
    "linear_attention_scan": LinearAttention(num_heads=H, head_dim=D),
    "lintrans_block": LinTransBlock(E, H, 2 * E, chunk_size=3),
    "lintrans_block_scan": LinTransBlock(E, H, 2 * E),
}


@functools.lru_cache(maxsize=None)
def _layer_fn(name):
    layer = LAYERS[name]
    x = np.zeros((B, T, E), np.float32)
    variables = layer.init(jax.random.PRNGKey(1), x)
    if isinstance(layer, VARChain):   # unit-gain q/v norms scaled as in the goldens (the chain stays O(1))
        variables = jax.tree_util.tree_map_with_path(
            lambda p, a: a * (D * T) ** -0.25 if "norm" in jax.tree_util.keystr(p) else a, variables)

    def fn(x, ids):
        if name.endswith("_scan"):
            return layer.apply(variables, x, segment_ids=ids, method="scan")[0]
        return layer.apply(variables, x, segment_ids=ids)[0]
    return jax.jit(fn), isinstance(layer, VARChain)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_packed_layers_equal_each_document_alone(name):
    fn, chain = _layer_fn(name)
    x = np.random.default_rng(4).standard_normal((B, T, E)).astype(np.float32)
    x[IDS == 0] = np.nan                 # padding holds NaN: no valid output sees it
    packed = np.asarray(fn(x, IDS))
    alone = np.asarray(fn(_rows(x)[0], None))
    if not chain:
        packed, alone = packed[None], alone[None]
    assert_trees_close(packed[:, IDS > 0], _unrows(alone, packed)[:, IDS > 0], **F32_SIMPLE)


def test_fixed_tables_read_per_row_positions_as_shared_ones():
    """FixedVAR's per-row positions [B, T] (what packing gives) read the tables as the shared [T] ones do,
    an out-of-table position NaN in both."""
    chain = LAYERS["fixed_var_chain"]
    x = np.zeros((B, T, E), np.float32)
    variables = chain.init(jax.random.PRNGKey(2), x)
    pos = np.arange(T) + 1                                   # the last one is past the table (max_tokens = T)
    project = jax.jit(lambda p: chain.apply(variables, x, p, method="project")[1:3])
    assert_trees_close(project(np.tile(pos, (B, 1))), project(pos), rtol=0, atol=0)
    assert np.isnan(np.asarray(project(pos)[0])[:, :, -1]).all()
