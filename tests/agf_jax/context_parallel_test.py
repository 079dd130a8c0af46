"""Context-parallel AGF (agf_jax/context_parallel.py): a sequence split over a `sequence` mesh axis gives the
single-device numbers, values and gradients, packed documents spanning shards included, and moves a
number of bytes that does not grow with the length."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agf_jax import AGFAttention, context_parallel, ops
from tests.environment import assert_host_devices, run_on_host_devices, sequence_mesh
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close, collective_bytes, packed_segment_ids

B, T, H, D, M, CHUNK = 2, 24, 2, 4, 3, 2
BASIS = dict(basis="jacobi", alpha=2.0, beta=-1.0)
COEFFS = np.array([1.0, 0.6, -0.4, 0.3], np.float32)


def _inputs(seed=0, t=T):
    ks = jax.random.split(jax.random.key(seed), 4)
    normal = lambda k, shape, s=1.0: np.asarray(s * jax.random.normal(k, shape))  # noqa: E731
    x = (normal(ks[0], (B, t, H, D), 2.0), normal(ks[1], (B, t, H, D), 3.0),
         normal(ks[2], (B, t, H, D)), normal(ks[3], (B, t, H, M)))
    mask = np.arange(t)[None] < np.array([[t], [t - 7]])
    return x, mask


def _packed(t=T):
    """Documents of lengths that cross every shard boundary for P up to 8 (and padding between)."""
    return packed_segment_ids(([5, 9, 2, 7], [1, 10, 3, 4]), t)


def _causal(mesh, mask, ids=None):
    if mesh is None:
        return lambda *x: ops.agf_chunked(*x, COEFFS, chunk_size=CHUNK, mask=mask, segment_ids=ids, **BASIS)[0]
    return lambda *x: context_parallel.causal(*x, COEFFS, chunk_size=CHUNK, mesh=mesh, mask=mask,
                                              segment_ids=ids, **BASIS)


def _noncausal(mesh, mask, ids=None):
    if mesh is None:
        return lambda *x: ops.agf_with_orthogonality(*x, COEFFS, mask=mask, segment_ids=ids, **BASIS)
    return lambda *x: context_parallel.noncausal(*x, COEFFS, mesh=mesh, mask=mask, segment_ids=ids, **BASIS)


def _loss(fn, ids=None):
    def loss(*x):
        out = fn(*x)
        y, reg = out if isinstance(out, tuple) else (out, 0.0)
        keep = np.ones(y.shape[:2], bool) if ids is None else ids > 0
        return jnp.sum(jnp.where(keep[..., None, None], jnp.sin(3.0 * y), 0.0)) + jnp.sum(reg)
    return loss


def _check(form, p, mask, ids, x):
    """Values in float32, gradients in float64 (the shards' sums round in another order)."""
    mesh = sequence_mesh(p)
    got, want = jax.jit(form(mesh, mask, ids))(*x), jax.jit(form(None, mask, ids))(*x)
    if ids is not None:     # outputs of padding (id 0) are not defined
        keep = ids > 0
        got, want = ((o[0][keep], o[1]) if isinstance(o, tuple) else o[keep] for o in (got, want))
    assert_trees_close(got, want, **F32_SIMPLE)
    with jax.enable_x64(True):
        x64 = [np.asarray(a, np.float64) for a in x]
        grads = jax.jit(jax.grad(_loss(form(mesh, mask, ids), ids), argnums=(0, 1, 2, 3)))(*x64)
        expected = jax.jit(jax.grad(_loss(form(None, mask, ids), ids), argnums=(0, 1, 2, 3)))(*x64)
        assert_trees_close(grads, expected, **F64)


@pytest.mark.parametrize("form,packed", [(_causal, False), (_causal, True), (_noncausal, False), (_noncausal, True)],
                         ids=["causal", "causal-packed", "global", "global-packed"])
def test_two_shards_equal_one_device(form, packed):
    x, mask = _inputs()
    _check(form, 2, mask, _packed() if packed else None, x)


def test_nan_in_padding_changes_nothing_and_a_nan_reaches_later_shards_of_its_document_only():
    x, mask = _inputs(1)
    ids = _packed()
    fn = jax.jit(_causal(sequence_mesh(2), None, ids))
    clean = np.asarray(fn(*x))
    dirty = [a.copy() for a in x]
    pad = ids == 0
    for a in dirty:
        a[pad] = np.nan
    np.testing.assert_array_equal(fn(*dirty)[~pad], clean[~pad])
    # Row 0, document 2 (tokens 5-13) spans the shard boundary at 12: a NaN key at token 7 reaches
    # tokens 7-13 of its head (the second shard's too) and nothing else, as on one device.
    zv = x[1].copy()
    zv[0, 7, 1, 0] = np.nan
    got = np.asarray(fn(x[0], zv, *x[2:]))
    want = np.asarray(jax.jit(_causal(None, None, ids))(x[0], zv, *x[2:]))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 7:14, 1]).all() and not np.isnan(got[0, 14:]).any() and not np.isnan(got[1]).any()
    assert not np.isnan(got[0, :, 0]).any()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_the_layer_takes_a_sequence_axis(causal, packed):
    """`AGFAttention(sequence_axis='sequence')` under `jax.set_mesh`, x sharded along T: the single-device
    layer's numbers and regulariser with the same parameters, packed documents included."""
    mesh = sequence_mesh(2)
    x = jax.random.normal(jax.random.key(6), (B, T, 8))
    kw = dict(num_heads=H, head_dim=D, causal=causal, chunk_size=4 if causal else None)
    plain, split = AGFAttention(**kw), AGFAttention(sequence_axis="sequence", **kw)
    params = jax.jit(plain.init)(jax.random.key(0), x)
    call = dict(mask=_inputs()[1], segment_ids=_packed() if packed else None)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
        y, aux = jax.jit(functools.partial(split.apply, **call))(params, xs)
    want, want_aux = jax.jit(functools.partial(plain.apply, **call))(params, x)
    keep = np.ones((B, T), bool) if not packed else _packed() > 0
    assert_trees_close((y[keep], aux), (want[keep], want_aux), **F32_SIMPLE)


def test_the_drop_in_takes_a_sequence_axis():
    """`attention.make('agf', ..., sequence_axis=...)` passes the field to the layer."""
    from zoo_core import attention

    mesh = sequence_mesh(2)
    x = jax.random.normal(jax.random.key(7), (B, T, 16))
    kw = dict(num_heads=2, qkv_features=16, causal=True)
    plain, split = attention.make("agf", **kw), attention.make("agf", sequence_axis="sequence", **kw)
    params = jax.jit(plain.init)(jax.random.key(0), x)
    with jax.set_mesh(mesh):
        y = jax.jit(split.apply)(params, jax.device_put(x, NamedSharding(mesh, P(None, "sequence"))))
    assert_trees_close(y, jax.jit(plain.apply)(params, x), **F32_SIMPLE)


def test_bytes_between_devices_do_not_grow_with_the_length():
    """Forward and backward over 2 devices at T and 4T: the collectives move the same bytes (the
    summaries' all-gather, the global sums' psum, and their transposes)."""
    mesh = sequence_mesh(2)

    def moved(fn, t):
        s = jax.ShapeDtypeStruct((1, t, H, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "sequence")))
        loss = lambda *x: jnp.sum(fn(*x)[0])                                       # noqa: E731
        return collective_bytes(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(s, s, s, s).compile().as_text())

    for fn in (lambda *x: (context_parallel.causal(*x, COEFFS, chunk_size=64, mesh=mesh),),
               lambda *x: context_parallel.noncausal(*x, COEFFS, mesh=mesh)):
        short, long = moved(fn, 1024), moved(fn, 4096)
        assert 0 < short and long <= 1.5 * short, (short, long)


@pytest.mark.slow
def test_up_to_eight_shards_equal_one_device():
    """P in {1, 2, 4, 8} in one process with 8 host devices (a subprocess: the suite runs on 2)."""
    assert run_on_host_devices("tests.agf_jax.context_parallel_test") == ["P=1", "P=2", "P=4", "P=8"]


def _check_all_shard_counts():
    x, mask = _inputs(2, t=48)
    for p in (1, 2, 4, 8):
        for form, ids in ((_causal, None), (_causal, _packed(48)), (_noncausal, None), (_noncausal, _packed(48))):
            _check(form, p, mask, ids, x)
        print(f"P={p}")


if __name__ == "__main__":
    assert_host_devices(8)
    _check_all_shard_counts()
