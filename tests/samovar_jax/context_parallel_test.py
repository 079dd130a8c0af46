"""Context parallelism of SAMoVAR's VAR chain (samovar_jax/context_parallel.py): the chain split over a
`sequence` mesh axis gives one device's numbers, values and gradients, packed documents spanning shards
included, for P in {1, 2, 4, 8}; the bytes its collectives move do not grow with the length; the layers'
`sequence_axis` field gives the single-device layer's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from samovar_jax import context_parallel, ops
from samovar_jax.layers import LinTransBlock, VARChain
from tests.environment import assert_host_devices, run_on_host_devices, sequence_mesh
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close, collective_bytes, packed_segment_ids

B, T, H, D, L, CHUNK = 2, 16, 2, 3, 3, 3


def _inputs(seed=0, t=T, dtype=np.float32):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    g = dtype((D * t) ** -0.25)          # the per-head norms' scale in the goldens: the chain stays O(1)
    x0, q, v = normal(B, t, H, D), g * normal(L, B, t, H, D), g * normal(L, B, t, H, D)
    wk = dtype(0.3) * normal(L, H * D, H * D)
    drop = (rng.random((L, B, t, H, D)) < 0.8).astype(dtype) / dtype(0.8)
    mask = np.arange(t)[None] < np.array([[t], [t - 5]])
    return x0, q, v, wk, drop, mask


def _packed(t=T):
    """Documents whose lengths cross every shard boundary for P up to 8, padding (0) between some."""
    return packed_segment_ids(([5, 3, 2, 7], [1, 6, 3, 4]), t)


def _chain(mesh, wk, drop, mask, ids, per_layer=False):
    """(x0, q, v) -> o [L, B, T, H, D]: split over `mesh`'s sequence axis, or one device (mesh None)."""
    kw = dict(key_kernels=wk, dropout_mask=drop, mask=mask, segment_ids=ids)
    if mesh is None:
        return lambda x0, q, v: ops.var_chain_chunked(x0, q, v, CHUNK, **kw)[0]
    if per_layer:
        return lambda x0, q, v: jnp.stack(context_parallel.var_chain(x0, list(q), list(v), chunk_size=CHUNK,
                                                                     mesh=mesh, **kw))
    return lambda x0, q, v: context_parallel.var_chain(x0, q, v, chunk_size=CHUNK, mesh=mesh, **kw)


def _check(p, packed, axis_type=jax.sharding.AxisType.Auto, per_layer=False, t=T, grads=True, seed=None):
    """Values (float32) and gradients (float64) of the chain over p shards equal one device's, on inputs of
    `seed` (default: p)."""
    x0, q, v, wk, drop, mask = _inputs(p if seed is None else seed, t)
    ids = _packed(t) if packed else None
    mesh = sequence_mesh(p, axis_type)
    got = jax.jit(_chain(mesh, wk, drop, mask, ids, per_layer))(x0, q, v)
    assert_trees_close(got, jax.jit(_chain(None, wk, drop, mask, ids))(x0, q, v), **F32_SIMPLE)
    if not grads:
        return
    with jax.enable_x64(True):
        x0, q, v, wk, drop = (np.asarray(a, np.float64) for a in (x0, q, v, wk, drop))
        w = np.random.default_rng(9).standard_normal(q.shape)
        grads = lambda m: jax.jit(jax.grad(  # noqa: E731
            lambda *a: jnp.sum(w * _chain(m, wk, drop, mask, ids, per_layer)(*a)), argnums=(0, 1, 2)))(x0, q, v)
        assert_trees_close(grads(mesh), grads(None), **F64)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_two_shards_equal_one_device(packed):
    _check(2, packed)


def test_explicit_mesh_and_per_layer_operands():
    _check(2, True, jax.sharding.AxisType.Explicit, per_layer=True)


def test_nan_in_padding_changes_nothing():
    x0, q, v, wk, drop, mask = _inputs(1)
    ids = _packed()
    fn = jax.jit(_chain(sequence_mesh(2), wk, drop, mask, ids))
    pad = ~(mask & (ids > 0))[:, :, None, None]
    dirty = fn(np.where(pad, np.nan, x0), np.where(pad, np.float32(1e30), q), np.where(pad, np.nan, v))
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(fn(x0, q, v)))


def test_bytes_between_devices_do_not_grow_with_the_length():
    """Forward and backward at T and 4T over 2 devices: the chain's collectives (L all-gathers of
    [B, H, D, D] summaries and their transposes) move the same bytes, packed too, where jit's own
    partitioning of the single-device chunked chain moves bytes in proportion to T."""
    mesh = sequence_mesh(2)

    def moved(fn, t, packed):
        tokens, layered = NamedSharding(mesh, P(None, "sequence")), NamedSharding(mesh, P(None, None, "sequence"))
        x0 = jax.ShapeDtypeStruct((1, t, H, 16), jnp.float32, sharding=tokens)
        qv = jax.ShapeDtypeStruct((L, 1, t, H, 16), jnp.float32, sharding=layered)
        ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=tokens)
        loss = lambda x0, q, v, i: jnp.sum(fn(x0, q, v, i if packed else None))  # noqa: E731
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x0, qv, qv, ids)
        return collective_bytes(lowered.compile().as_text())

    def split(x0, q, v, i):
        return context_parallel.var_chain(x0, q, v, chunk_size=64, mesh=mesh, segment_ids=i)

    def auto(x0, q, v, i):
        return ops.var_chain_chunked(x0, q, v, 64, segment_ids=i)[0]

    for packed in (False, True):
        ours = [moved(split, t, packed) for t in (512, 2048)]
        assert 0 < ours[0] and ours[1] <= 1.5 * ours[0], (packed, ours)
    theirs = [moved(auto, t, False) for t in (512, 2048)]
    assert theirs[1] >= 3 * theirs[0] and ours[1] < theirs[1], (ours, theirs)


@pytest.mark.parametrize("name", ["var_chain", "fixed_var_chain", "lintrans_block"])
def test_the_layers_take_a_sequence_axis(name):
    """`sequence_axis='sequence'` under `jax.set_mesh`, x sharded along T, packed: the single-device
    layer's numbers with the same parameters (`__call__`, and the chain's `layer_outputs`)."""
    e, ids = H * D, _packed()
    layer = {"var_chain": VARChain(e, H, L, use_key_proj=True, chunk_size=CHUNK),
             "fixed_var_chain": VARChain(e, H, L, qv_source="fixed", use_qv_norm=False, max_tokens=T),
             "lintrans_block": LinTransBlock(e, H, 2 * e, chunk_size=CHUNK)}[name]
    x = np.random.default_rng(3).standard_normal((B, T, e)).astype(np.float32)
    variables = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
    methods = ("__call__", "layer_outputs") if isinstance(layer, VARChain) else ("__call__",)
    mesh = sequence_mesh(2)
    for method in methods:
        call = lambda m, x: m.apply(variables, x, segment_ids=ids, method=method)  # noqa: E731
        want = jax.jit(lambda x: call(layer, x))(x)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
            got = jax.jit(lambda x: call(layer.clone(sequence_axis="sequence"), x))(xs)
        assert_trees_close(got, want, **F32_SIMPLE)


def test_up_to_eight_shards_equal_one_device():
    """P in {1, 2, 4, 8} in one process with 8 host devices (a subprocess: the suite runs on 2)."""
    assert run_on_host_devices("tests.samovar_jax.context_parallel_test") == ["P=1", "P=2", "P=4", "P=8"]


if __name__ == "__main__":
    assert_host_devices(8)
    jax.config.update("jax_disable_most_optimizations", True)   # as the suite's process (tests/conftest.py)
    for shards in (1, 2, 4, 8):
        # values with and without packing; gradients packed (the gated fold's transpose; the plain
        # fold's gradients are checked over 2 shards in the suite's own process)
        # one seed for every P: one device's programs (the inputs are their constants) compile once
        _check(shards, False, grads=False, seed=0)
        _check(shards, True, seed=0)
        print(f"P={shards}")
