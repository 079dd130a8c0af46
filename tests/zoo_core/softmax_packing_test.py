"""The softmax baseline packed and context-parallel (issue 42; agf_jax/softmax.py): a packed call equals each
document computed alone in every form (values and gradients), padding rows are 0, NaN in padding or in
another document changes nothing, and the sequence split over up to 8 host devices gives the single-device
numbers (one subprocess)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agf_jax import softmax as sm
from tests.environment import assert_host_devices, run_on_host_devices, sequence_mesh
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

B, T, H, D, M = 2, 16, 2, 4, 3
# Row 0: documents 1, 2, 3 and end padding; row 1: padding between documents and a one-token document.
IDS = np.array([[1] * 5 + [2] * 7 + [3] * 2 + [0] * 2,
                [4] * 3 + [0] * 2 + [5] * 6 + [6] + [7] * 4], np.int32)


def _inputs(seed=0, t=T, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, t, H, w)).astype(dtype) for w in (D, D, M))


def _forms(causal):
    """name -> f(q, k, v, segment_ids) of the packed forms (the self-attention ones)."""
    if not causal:
        return {"parallel": lambda q, k, v, ids: sm.softmax_parallel(q, k, v, segment_ids=ids)}
    out = {"parallel": lambda q, k, v, ids: sm.softmax_parallel(q, k, v, causal=True, segment_ids=ids),
           "scan": lambda q, k, v, ids: sm.softmax_scan(q, k, v, segment_ids=ids,
                                                        cache=sm.init_cache(B, q.shape[1], H, D, M, q.dtype))[0]}
    for c in (1, 3):
        out[f"chunked({c})"] = lambda q, k, v, ids, c=c: sm.softmax_chunked(q, k, v, chunk_size=c, segment_ids=ids)
        out[f"batched({c})"] = lambda q, k, v, ids, c=c: sm.softmax_chunked_batched(q, k, v, chunk_size=c,
                                                                                     segment_ids=ids)
    return out


def _documents():
    """Each document of IDS in its own row: (row, position) indices `[N, L]` and their validity."""
    docs = [(b, np.flatnonzero(IDS[b] == doc)) for b in range(B) for doc in sorted(set(IDS[b].tolist()) - {0})]
    length = max(len(idx) for _, idx in docs)
    rows = np.array([[b] * length for b, _ in docs])
    cols = np.array([np.pad(idx, (0, length - len(idx))) for _, idx in docs])
    valid = np.array([np.arange(length) < len(idx) for _, idx in docs])
    return rows, cols, valid


def _alone(causal):
    """f(q, k, v) -> every document of IDS computed on its own, scattered back to `[B, T, H, M]` (0 on
    padding): one call on a batch of one document per row (end padding, which changes no valid row)."""
    rows, cols, valid = _documents()

    def run(q, k, v):
        o = sm.softmax_parallel(q[rows, cols], k[rows, cols], v[rows, cols], mask=valid, causal=causal)
        o = jnp.where(valid[..., None, None], o, 0.0)
        return jnp.zeros(q.shape[:3] + (M,), o.dtype).at[rows[valid], cols[valid]].set(o[valid])
    return jax.jit(run)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_packed_equals_each_document_alone(causal):
    q, k, v = _inputs()
    want = _alone(causal)(q, k, v)
    for name, form in _forms(causal).items():
        got = jax.jit(form)(q, k, v, IDS)
        assert_trees_close({name: got}, {name: want}, **F32_SIMPLE)
        assert np.all(np.asarray(got)[IDS == 0] == 0), name   # a padding row attends nothing: 0, not NaN


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_packed_gradients_equal_each_document_alone(causal):
    with jax.enable_x64(True):
        q, k, v = _inputs(1, dtype=np.float64)
        weights = np.random.default_rng(2).standard_normal((B, T, H, M))

        alone = lambda q, k, v: jnp.sum(jnp.sin(_alone(causal)(q, k, v)) * weights)
        want = jax.grad(alone, argnums=(0, 1, 2))(q, k, v)
        for name, form in _forms(causal).items():
            if "(1)" in name:   # the one-token chunks: their values are checked above, compiling grads is slow
                continue
            got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(form(q, k, v, IDS)) * weights),
                                   argnums=(0, 1, 2)))(q, k, v)
            assert_trees_close({name: got}, {name: want}, **F64)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_nan_in_padding_or_in_another_document_changes_nothing(causal):
    q, k, v = _inputs(3)
    forms = _forms(causal)
    clean = {name: np.asarray(jax.jit(f)(q, k, v, IDS)) for name, f in forms.items()}
    pad = (IDS == 0)[..., None, None]
    dirty = [np.where(pad, np.nan, x) for x in (q, k, v)]
    for name, f in forms.items():
        out = np.asarray(jax.jit(f)(*dirty, IDS))
        np.testing.assert_array_equal(out, clean[name], err_msg=name)
        # A NaN value in document 2 of row 0, head 1: that head of document 2 is NaN (from there on when
        # causal; the whole head where the XLA forms' guard poisons it, the NaN feature in the scan), nothing else.
        bad_v = v.copy()
        bad_v[0, 7, 1, 0] = np.nan
        out = np.asarray(jax.jit(f)(q, k, bad_v, IDS))
        hit = np.zeros((B, T), bool)
        hit[0, 7 if causal else 5:12] = True
        assert np.isnan(out[hit][:, 1, 0]).all(), name
        np.testing.assert_array_equal(out[~hit], clean[name][~hit], err_msg=name)
        np.testing.assert_array_equal(out[:, :, 0], clean[name][:, :, 0], err_msg=name)


def test_cross_attention_keeps_packed_documents_apart():
    q, _, _ = _inputs(4)
    s = 12
    k, v = (np.random.default_rng(5).standard_normal((B, s, H, w)).astype(np.float32) for w in (D, M))
    kv_ids = np.array([[1] * 4 + [2] * 3 + [3] * 3 + [0] * 2, [4] * 2 + [5] * 5 + [6] * 2 + [7] * 3], np.int32)
    mask = np.ones((B, s), bool)
    mask[1, 3] = False
    got = np.asarray(jax.jit(lambda *a: sm.softmax_cross(*a, mask=mask, segment_ids=IDS, kv_segment_ids=kv_ids))(
        q, k, v))
    for b in range(B):
        for doc in set(IDS[b].tolist()) - {0}:
            qi, ki = np.flatnonzero(IDS[b] == doc), np.flatnonzero((kv_ids[b] == doc) & mask[b])
            logits = np.einsum("thd,shd->hts", q[b, qi].astype(np.float64), k[b, ki]) / np.sqrt(D)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            want = np.einsum("hts,shm->thm", w / w.sum(-1, keepdims=True), v[b, ki])
            np.testing.assert_allclose(got[b, qi], want, rtol=1e-5, atol=1e-6)
    assert np.all(got[IDS == 0] == 0)


def test_the_layer_takes_segment_ids_in_every_form():
    from agf_jax.layers import SoftmaxAttention

    x = np.random.default_rng(6).standard_normal((B, T, 8)).astype(np.float32)
    parallel = SoftmaxAttention(num_heads=H, head_dim=D, causal=True, max_length=T)
    chunked = parallel.clone(chunk_size=5)
    params = parallel.init(jax.random.PRNGKey(0), x)
    run = lambda layer, method=None: jax.jit(lambda x, ids: layer.apply(params, x, segment_ids=ids, method=method)[0])
    want = run(parallel)(x, IDS)
    alone = run(parallel)(x[:, 5:11], np.ones((B, 6), np.int32))   # documents 2 and 5 (their first 6 tokens)
    assert_trees_close(want[:, 5:11], alone, **F32_SIMPLE)
    assert_trees_close(run(chunked)(x, IDS), want, **F32_SIMPLE)
    assert_trees_close(run(parallel, "scan")(x, IDS), want, **F32_SIMPLE)


# --- context parallelism: one subprocess with 8 host devices -----------------------------------------------


def _cp(mesh, causal, mask, ids):
    if mesh is None:
        return lambda q, k, v: sm.softmax_parallel(q, k, v, causal=causal, mask=mask, segment_ids=ids)
    return lambda q, k, v: sm.softmax_context_parallel(q, k, v, causal=causal, mesh=mesh, mask=mask,
                                                       segment_ids=ids)


def _check_all_shard_counts():
    t = 32
    q, k, v = _inputs(7, t=t)
    mask = np.arange(t)[None] < np.array([[t], [t - 5]])
    ids = np.concatenate([IDS, IDS[:, ::-1]], axis=1)     # documents that cross every boundary for P <= 8
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))))
    for p in (1, 2, 4, 8):
        for causal in (True, False):
            for m, i in ((mask, None), (mask, ids)):
                want = jax.jit(_cp(None, causal, m, i))(q, k, v)
                assert_trees_close(jax.jit(_cp(sequence_mesh(p), causal, m, i))(q, k, v), want, **F32_SIMPLE)
                with jax.enable_x64(True):
                    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
                    split = loss(_cp(sequence_mesh(p), causal, m, i))
                    grads = jax.jit(jax.grad(split, argnums=(0, 1, 2)))(q64, k64, v64)
                    want_g = jax.jit(jax.grad(loss(_cp(None, causal, m, i)), argnums=(0, 1, 2)))(q64, k64, v64)
                    assert_trees_close(grads, want_g, **F64)
        print(f"P={p}")
    # The layer's sequence_axis under jax.set_mesh, inputs sharded along T: the single-device numbers.
    from agf_jax.layers import SoftmaxAttention

    x = np.random.default_rng(8).standard_normal((B, t, 8)).astype(np.float32)
    for causal in (True, False):
        plain = SoftmaxAttention(num_heads=H, head_dim=D, causal=causal)
        params = plain.init(jax.random.PRNGKey(0), x)
        split = plain.clone(sequence_axis="sequence")
        mesh = sequence_mesh(4)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
            got = jax.jit(lambda x: split.apply(params, x, segment_ids=ids)[0])(xs)
        assert_trees_close(got, plain.apply(params, x, segment_ids=ids)[0], **F32_SIMPLE)
    print("layer")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_two_shards_equal_one_device(causal):
    """In this process (2 host devices): packed documents across the shard boundary and padding, values
    and float64 gradients."""
    t = 16
    q, k, v = _inputs(9, t=t)
    mask = np.arange(t)[None] < np.array([[t], [t - 3]])
    split, whole = _cp(sequence_mesh(2), causal, mask, IDS), _cp(None, causal, mask, IDS)
    assert_trees_close(jax.jit(split)(q, k, v), jax.jit(whole)(q, k, v), **F32_SIMPLE)
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))))
    with jax.enable_x64(True):
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        assert_trees_close(jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(q, k, v),
                           jax.jit(jax.grad(loss(whole), argnums=(0, 1, 2)))(q, k, v), **F64)


@pytest.mark.slow
def test_up_to_eight_shards_equal_one_device():
    """P in {1, 2, 4, 8}, causal and not, masked and packed: values, float64 gradients and the layer's
    `sequence_axis` equal one device (a subprocess: the suite runs on 2 devices)."""
    assert run_on_host_devices("tests.zoo_core.softmax_packing_test") == ["P=1", "P=2", "P=4", "P=8", "layer"]


if __name__ == "__main__":
    assert_host_devices(8)
    _check_all_shard_counts()
