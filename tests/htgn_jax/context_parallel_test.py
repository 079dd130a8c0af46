"""Context-parallel FAVOR+ (htgn_jax/context_parallel.py): `FavorAttention(sequence_axis='sequence')` under
`jax.set_mesh`, x sharded along T, gives the one-device layer's values and gradients, causal and global,
packed documents spanning shards included; P in {1, 2, 4, 8} in one subprocess with 8 host devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from htgn_jax import context_parallel, ops
from htgn_jax.layers import FavorAttention
from tests.environment import assert_host_devices, run_on_host_devices, sequence_mesh
from zoo_core.testing import F32_SIMPLE, assert_trees_close, collective_bytes, packed_segment_ids

B, T, E = 2, 48, 8
# (causal, chunk_size, feature_map): the causal chunked form (constant key stabiliser) and the global
# form with the 'max' key stabiliser reduced over the shards (softmax), and a deterministic map.
CASES = [(True, 4, "softmax"), (False, None, "softmax"), (False, None, "relu")]


def _packed(t=T):
    """Documents whose lengths cross every shard boundary for P up to 8, padding (0) between some."""
    return packed_segment_ids(([5, 9, 2, 13, 7], [1, 17, 3, 4]), t)


def _layers(causal, chunk_size, feature_map):
    kw = dict(num_heads=2, head_dim=4, causal=causal, chunk_size=chunk_size, feature_map=feature_map,
              num_features=8 if feature_map == "softmax" else None, use_rotary=True)
    return FavorAttention(**kw), FavorAttention(sequence_axis="sequence", **kw)


def _check(p, case, packed):
    """Values and gradients (parameters and x) of the layer split over p shards equal one device's."""
    plain, split = _layers(*case)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, E))
    x = x.at[1, T - 3:].set(jnp.nan)                       # NaN in padding changes nothing
    mask = np.arange(T)[None] < np.array([[T], [T - 3]])
    ids = _packed() if packed else None
    if packed:
        ids[1, T - 3:] = 0
    params = plain.init(jax.random.PRNGKey(0), x[:, :4])
    weights = jnp.cos(jnp.arange(E, dtype=jnp.float32))

    def loss(layer, params, x):
        y = layer.apply(params, x, mask=mask, segment_ids=ids)[0]
        return jnp.sum(jnp.where(mask[..., None], y * weights, 0.0)), y

    grad = lambda layer: jax.jit(jax.value_and_grad(lambda p, x: loss(layer, p, x), argnums=(0, 1), has_aux=True))
    (_, want), want_grads = grad(plain)(params, x)
    mesh = sequence_mesh(p)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
        (_, got), got_grads = grad(split)(params, xs)
    assert_trees_close(jnp.where(mask[..., None], got, 0), jnp.where(mask[..., None], want, 0), **F32_SIMPLE)
    assert_trees_close(jax.tree_util.tree_map(lambda g: jnp.nan_to_num(g, nan=7.0), got_grads),
                       jax.tree_util.tree_map(lambda g: jnp.nan_to_num(g, nan=7.0), want_grads), **F32_SIMPLE)


@pytest.mark.parametrize("case", CASES, ids=["causal", "global", "global_relu"])
def test_two_shards_equal_one_device_packed(case):
    """Documents spanning the shard boundary (rows of one document each: the subprocess test)."""
    _check(2, case, True)


def test_max_stabiliser_of_a_document_spanning_shards():
    """The packed 'max' reduction over the shards gives each key its document's max over the whole
    sequence, whichever shards the document spans."""
    ids = _packed()
    values = jax.random.normal(jax.random.PRNGKey(2), (B, T, 2))
    mesh = sequence_mesh(2)
    body = lambda v, i: context_parallel.shard_key_max(v, i, axis_name="sequence")
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sequence"),) * 2,
                                out_specs=P(None, "sequence")))(values, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(ops.segment_max)(values, ids)))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_bytes_between_devices_do_not_grow_with_the_length(causal):
    """Forward and backward of the packed layer at T and 4T over 2 devices: the collectives (the
    summaries' all-gather, the stabiliser's maxima, their transposes) move the same bytes."""
    plain, split = _layers(causal, 64 if causal else None, "softmax")
    mesh = sequence_mesh(2)
    params = jax.eval_shape(plain.init, jax.random.PRNGKey(0), jnp.zeros((1, 8, E)))

    def moved(t):
        sharded = lambda dtype: jax.ShapeDtypeStruct((1, t), dtype, sharding=NamedSharding(mesh, P(None, "sequence")))
        x = jax.ShapeDtypeStruct((1, t, E), jnp.float32, sharding=NamedSharding(mesh, P(None, "sequence")))
        loss = lambda p, x, ids: jnp.sum(split.apply(p, x, segment_ids=ids)[0])
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, sharded(jnp.int32)).compile()
        return collective_bytes(compiled.as_text())

    small, large = moved(1024), moved(4096)
    assert 0 < small and large <= 1.5 * small, (small, large)


@pytest.mark.slow
def test_up_to_eight_shards_equal_one_device():
    """P in {1, 2, 4, 8} in one process with 8 host devices (a subprocess: the suite runs on 2)."""
    assert run_on_host_devices("tests.htgn_jax.context_parallel_test") == ["P=1", "P=2", "P=4", "P=8"]


if __name__ == "__main__":
    assert_host_devices(8)
    for shards in (1, 2, 4, 8):
        for case in CASES:
            for packed in (False, True):
                _check(shards, case, packed)
        print(f"P={shards}")
