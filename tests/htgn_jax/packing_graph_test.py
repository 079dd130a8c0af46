"""Packed documents in HTGN's graph attention (docs/htgn_packing.md): a packed row equals each document
computed alone (values, gradients, the KL term), and NaN in padding or in another document changes
nothing; the causal window's scan, chunked and step forms reset at document starts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax import graph_causal as GC
from htgn_jax import graph_ops as G
from htgn_jax.graph_layers import CrossGraphAttention, WindowGraphAttention
from zoo_core.testing import F32_SIMPLE, assert_trees_close

H, C = 2, 3
LENGTHS = (5, 8, 4)            # documents of one row; 2 padding nodes after the second, 3 at the end


def _layout(lengths=LENGTHS, gap=2, tail=3):
    """(segment ids `[1, L]`, the slice of each document): padding (id 0) between and after."""
    ids, spans, pos = [], [], 0
    for d, n in enumerate(lengths):
        ids += [d + 1] * n
        spans.append(slice(pos, pos + n))
        pos += n
        if d == 1:
            ids += [0] * gap
            pos += gap
    ids += [0] * tail
    return np.asarray([ids], np.int32), spans


def _normal(seed, shape):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), shape), np.float32)


CASES = {
    "window": dict(window=2),
    "globals": dict(window=1, num_global=2),
    "skips_neighbour_kl": dict(window=1, num_global=1, skip_offsets=(3,), kl_mode="neighbour"),
    "grid_distance_kl": dict(window=1, num_global=1, grid_width=3, kl_tau=0.5),
    "causal_skips": dict(window=2, causal=True, skip_offsets=(3,)),
    "dot": dict(window=1, num_global=2, version="dot"),
    "v1": dict(window=1, num_global=1, version="v1"),
}


def _kernel_inputs(case, length):
    kw = dict(CASES[case])
    version = kw.pop("version", "v2")
    q, k = _normal(0, (1, length, H, C)), _normal(1, (1, length, H, C))
    attn = None if version == "dot" else _normal(2, (H, C))
    value = _normal(3, (1, length, H, C + 1)) if version == "v1" else None
    offsets = G.window_offsets(kw["window"], kw.get("causal", False), kw.get("grid_width"),
                               kw.get("skip_offsets", ()))
    kw["rel_bias"] = _normal(4, (H, len(offsets)))
    if kw.get("num_global"):
        kw["global_bias"] = _normal(5, (H,))
    return q, k, value, attn, kw


def _window(q, k, v, attn, kw, ids=None):
    out, aux = G.window_graph_attention(q, k, k if v is None else v, attn, segment_ids=ids, **kw)
    return out, aux["kl_sum"], aux["kl_count"]


@pytest.mark.parametrize("case", list(CASES))
def test_window_packed_equals_each_document_alone(case):
    ids, spans = _layout()
    q, k, v, attn, kw = _kernel_inputs(case, ids.shape[1])
    packed = jax.jit(lambda q, k, v: _window(q, k, v, attn, kw, ids))
    alone = jax.jit(lambda q, k, v: _window(q, k, v, attn, kw))
    out, kl_sum, kl_count = packed(q, k, v)
    kl = np.zeros(2)
    for s in spans:
        o, ks, kc = alone(q[:, s], k[:, s], None if v is None else v[:, s])
        assert_trees_close(out[:, s], o, **F32_SIMPLE)
        kl += [ks, kc]
    np.testing.assert_array_equal(np.asarray(out)[ids == 0], 0.0)
    np.testing.assert_allclose([kl_sum, kl_count], kl, rtol=1e-5)
    # NaN in the padding and in the other documents changes nothing of document 2.
    dirty = lambda x: None if x is None else np.where((ids != 2)[..., None, None], np.nan, x)
    out_d = packed(dirty(q), dirty(k), dirty(v))[0]
    assert_trees_close(out_d[:, spans[1]], out[:, spans[1]], **F32_SIMPLE)


@pytest.mark.parametrize("case", ["globals", "causal_skips"])
def test_window_packed_gradients_equal_each_document_alone(case):
    ids, spans = _layout()
    q, k, _, attn, kw = _kernel_inputs(case, ids.shape[1])
    loss = lambda q, k, i: jnp.sum(jnp.sin(_window(q, k, None, attn, kw, i)[0])) + \
        _window(q, k, None, attn, kw, i)[1]
    grads = jax.jit(jax.grad(lambda q, k: loss(q, k, ids), argnums=(0, 1)))(q, k)
    alone = jax.jit(jax.grad(lambda q, k: loss(q, k, None), argnums=(0, 1)))
    for s in spans:
        assert_trees_close(tuple(g[:, s] for g in grads), alone(q[:, s], k[:, s]), **F32_SIMPLE)
    assert all(np.all(np.asarray(g)[ids == 0] == 0) for g in grads)


def _cross_layout():
    """Decoder documents (4, 6, 3) and their memory documents (6, 9, 4) stored in reverse order."""
    tl, ml = (4, 6, 3), (6, 9, 4)
    ids = np.zeros((1, sum(tl) + 2), np.int32)
    kv = np.zeros((1, sum(ml) + 3), np.int32)
    q_spans, m_spans, pos = [], {}, 0
    for d, n in enumerate(tl):
        ids[0, pos:pos + n] = d + 1
        q_spans.append(slice(pos, pos + n))
        pos += n
    pos = 1                                     # one padding node first
    for d in reversed(range(len(ml))):
        kv[0, pos:pos + ml[d]] = d + 1
        m_spans[d] = slice(pos, pos + ml[d])
        pos += ml[d]
    return ids, kv, q_spans, [m_spans[d] for d in range(len(ml))]


@pytest.mark.parametrize("num_global,skips", [(2, ()), (0, (3,))])
def test_cross_graph_packed_equals_each_document_alone(num_global, skips):
    ids, kv, q_spans, m_spans = _cross_layout()
    q, k = _normal(0, (1, ids.shape[1], H, C)), _normal(1, (1, kv.shape[1], H, C))
    kw = dict(window=1, num_global=num_global, rho=1.3, skip_offsets=skips,
              rel_bias=_normal(4, (H, 3 + 2 * len(skips))),
              global_bias=_normal(5, (H,)) if num_global else None)
    attn = _normal(2, (H, C))
    run = lambda q, k, i=None, kv_i=None: G.cross_graph_attention(
        q, k, k, attn, segment_ids=i, kv_segment_ids=kv_i, **kw)
    out, aux = jax.jit(lambda q, k: run(q, k, ids, kv))(q, k)
    alone = jax.jit(run)
    kl = np.zeros(2)
    for qs, ms in zip(q_spans, m_spans):
        o, a = alone(q[:, qs], k[:, ms])
        assert_trees_close(out[:, qs], o, **F32_SIMPLE)
        np.testing.assert_array_equal(aux["centres"][:, qs], a["centres"])
        kl += [a["kl_sum"], a["kl_count"]]
    np.testing.assert_allclose([aux["kl_sum"], aux["kl_count"]], kl, rtol=1e-5)
    # Gradients of a loss summed over the documents equal those of the documents alone.
    loss = lambda out_aux: jnp.sum(jnp.sin(out_aux[0])) + out_aux[1]["kl_sum"]
    grads = jax.jit(jax.grad(lambda q, k: loss(run(q, k, ids, kv)), argnums=(0, 1)))(q, k)
    grad_alone = jax.jit(jax.grad(lambda q, k: loss(run(q, k)), argnums=(0, 1)))
    for qs, ms in zip(q_spans, m_spans):
        gq, gk = grad_alone(q[:, qs], k[:, ms])
        assert_trees_close((grads[0][:, qs], grads[1][:, ms]), (gq, gk), **F32_SIMPLE)
    # NaN in the memory's padding and in the other memory documents changes nothing of document 1.
    k_dirty = np.where((kv != 2)[..., None, None], np.nan, k)
    q_dirty = np.where((ids != 2)[..., None, None], np.nan, q)
    out_d = jax.jit(lambda q, k: run(q, k, ids, kv))(q_dirty, k_dirty)[0]
    assert_trees_close(out_d[:, q_spans[1]], out[:, q_spans[1]], **F32_SIMPLE)


def test_causal_forms_reset_at_document_starts():
    """scan, chunked scan and chunked parallel equal the packed parallel form; a call continuing a
    state (its first token continues the state's document) equals the whole."""
    ids = np.asarray([[1] * 5 + [2] * 6 + [0] * 2 + [3] * 6, [1] * 3 + [2] * 9 + [3] * 7], np.int32)
    t = ids.shape[1]
    q, k, attn = _normal(0, (2, t, H, C)), _normal(1, (2, t, H, C)), _normal(2, (H, C))
    offsets = G.window_offsets(2, True, skip_offsets=(4,))
    rb = _normal(4, (H, len(offsets)))
    want = jax.jit(lambda q, k: G.window_graph_attention(
        q, k, k, attn, window=2, causal=True, skip_offsets=(4,), segment_ids=ids, rel_bias=rb)[0])(q, k)
    empty = GC.init_window_state(2, 4, H, C)
    kw = dict(rel_bias=rb, offsets=offsets)

    @jax.jit
    def forms(q, k):
        outs = [GC.causal_window_scan(q, k, k, attn, empty, segment_ids=ids, **kw)[0]]
        for form in (GC.causal_window_chunked_scan, GC.causal_window_chunked_parallel):
            outs.append(form(q, k, k, attn, empty, chunk_size=4, segment_ids=ids, **kw)[0])
        first, state = GC.causal_window_scan(q[:, :8], k[:, :8], k[:, :8], attn, empty,
                                             segment_ids=ids[:, :8], **kw)
        rest = GC.causal_window_chunked_scan(q[:, 8:], k[:, 8:], k[:, 8:], attn, state,
                                             chunk_size=3, segment_ids=ids[:, 8:], **kw)[0]
        return outs + [jnp.concatenate([first, rest], axis=1)]

    for out in forms(q, k):
        assert_trees_close(out, want, **F32_SIMPLE)
    # One step at a document start with `start_t` forgets the state.
    _, state = GC.causal_window_scan(q[:, :5], k[:, :5], k[:, :5], attn, empty, **kw)
    step = jax.jit(lambda s, start: GC.causal_window_step(q[:, 5], k[:, 5], k[:, 5], s, attn,
                                                          start_t=start, **kw)[0])
    assert_trees_close(step(state, np.ones(2, bool)), step(empty, np.zeros(2, bool)), **F32_SIMPLE)


def _layer_check(layer, x, ids, spans, call, grads):
    params = layer.init(jax.random.PRNGKey(0), x[:, spans[0]])
    packed = jax.jit(lambda p, x: call(layer, p, x, ids))
    alone = jax.jit(lambda p, x: call(layer, p, x, None))
    y, kl = packed(params, x)
    total = 0.0
    for s in spans:
        y_s, kl_s = alone(params, x[:, s])
        assert_trees_close(y[:, s], y_s, **F32_SIMPLE)
        total += kl_s
    np.testing.assert_allclose(kl, total, rtol=1e-5)
    if grads:
        loss = lambda y_kl: jnp.sum(y_kl[0] ** 2) + y_kl[1]
        grad = jax.jit(jax.grad(lambda p: loss(call(layer, p, x, ids))))(params)
        grad_alone = jax.jit(jax.grad(lambda p: sum(loss(call(layer, p, x[:, s], None))
                                                    for s in spans)))(params)
        assert_trees_close(grad, grad_alone, **F32_SIMPLE)


@pytest.mark.parametrize("kind", ["global", "chunked", "scan"])
def test_window_layer_packed_equals_each_document_alone(kind):
    ids, spans = _layout((5, 8))
    x = _normal(7, (1, ids.shape[1], 8))
    x = np.where((ids == 0)[..., None], np.nan, x)           # padding holds NaN
    if kind == "global":
        layer = WindowGraphAttention(num_heads=H, window=1, num_global=2, skip_offsets=(3,))
    else:
        layer = WindowGraphAttention(num_heads=H, window=2, causal=True, chunk_size=3)

    def call(m, p, x, i):
        if kind == "scan":
            return m.apply(p, x, segment_ids=i, method="scan")[0], 0.0
        y, aux = m.apply(p, x, segment_ids=i)
        return y, aux["kl_sum"]

    _layer_check(layer, x, ids, spans, call, grads=kind != "scan")


def test_cross_layer_packed_equals_each_document_alone():
    ids, kv, q_spans, m_spans = _cross_layout()
    x, memory = _normal(7, (1, ids.shape[1], 8)), _normal(8, (1, kv.shape[1], 8))
    layer = CrossGraphAttention(num_heads=H, window=1, num_global=1, rho=0.8)
    params = layer.init(jax.random.PRNGKey(0), x[:, q_spans[0]], memory[:, m_spans[0]])
    y, aux = jax.jit(lambda p: layer.apply(p, x, memory, segment_ids=ids, kv_segment_ids=kv))(params)
    alone = jax.jit(lambda p, x, m: layer.apply(p, x, m))
    for qs, ms in zip(q_spans, m_spans):
        assert_trees_close(y[:, qs], alone(params, x[:, qs], memory[:, ms])[0], **F32_SIMPLE)
    np.testing.assert_array_equal(np.asarray(y)[ids == 0], 0.0)
