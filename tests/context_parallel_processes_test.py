"""Context parallelism across processes (issue 42): jax.distributed over 2 local processes of 2 CPU
devices each, the `sequence` axis spanning both, for every mechanism's context-parallel form on packed
documents that cross the shard (and process) boundaries: values and float64 gradients equal one device.
(Linear attention's own two-process test is tests/zoo_core/context_parallel_test.py.)"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.environment import run_two_processes
from zoo_core.testing import F64, assert_trees_close

MECHANISMS = ("agf_causal", "agf_global", "favor_causal", "var_chain", "window_graph", "softmax_causal")


@pytest.mark.slow
def test_every_mechanism_splits_one_sequence_over_two_processes():
    for lines in run_two_processes("tests.context_parallel_processes_test", timeout=1200):
        said = [line for line in lines if line in MECHANISMS + ("ok",)]   # (gloo prints its own lines)
        assert said == list(MECHANISMS) + ["ok"], lines

def _cases():
    """(name, arrays, form(mesh) -> f(*arrays) -> pytree, segment ids `[B, T]`): packed documents; the
    positions with id 0 are padding, not compared."""
    from htgn_jax import context_parallel as favor_cp
    from htgn_jax import ops as favor_ops
    from tests.agf_jax import context_parallel_test as agf_t
    from tests.htgn_jax import graph_context_parallel_test as graph_t
    from tests.samovar_jax import context_parallel_test as var_t
    from tests.zoo_core import softmax_packing_test as soft_t

    x, mask = agf_t._inputs()
    ids = agf_t._packed()
    yield "agf_causal", x, lambda mesh: agf_t._causal(mesh, mask, ids), ids
    yield "agf_global", x, lambda mesh: agf_t._noncausal(mesh, mask, ids), ids

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 24, 2, 4)) for _ in range(3))

    def favor(mesh):
        if mesh is None:
            return lambda q, k, v: favor_ops.favor_attention(q, k, v, feature_map="relu", causal=True, key_mask=mask,
                                                             eps=1e-3, chunk_size=2, segment_ids=ids)
        return lambda q, k, v: favor_cp.favor(q, k, v, None, axis_name="sequence", feature_map="relu", causal=True,
                                              chunk_size=2, eps=1e-3, mask=mask, segment_ids=ids, mesh=mesh)
    yield "favor_causal", (q, k, v), favor, ids

    x0, q, v, wk, drop, vmask = var_t._inputs()
    vids = var_t._packed()
    yield "var_chain", (x0, q, v), lambda mesh: var_t._chain(mesh, wk, drop, vmask, vids), vids

    q, k, attn, gmask, kw = graph_t._inputs("globals")
    gids = graph_t._packed()
    yield "window_graph", (q, k), lambda mesh: graph_t._form(mesh, attn, gmask, gids, kw), gids

    sq, sk, sv = soft_t._inputs()
    yield "softmax_causal", (sq, sk, sv), lambda mesh: soft_t._cp(mesh, True, None, soft_t.IDS), soft_t.IDS


def _t_axis(shape, keep_shape):
    """The axis of T in an array `[..., B, T, ...]` (B, T: keep's shape), or None (a scalar, a weight)."""
    for i in range(len(shape) - 1):
        if tuple(shape[i:i + 2]) == tuple(keep_shape):
            return i + 1
    return None


def _kept(tree, keep):
    """Every leaf `[..., B, T, ...]` zeroed where `keep` `[B, T]` is False; other leaves as they are."""
    def one(x):
        axis = _t_axis(jnp.shape(x), keep.shape)
        if axis is None:
            return x
        k = keep.reshape((1,) * (axis - 1) + keep.shape + (1,) * (jnp.ndim(x) - axis - 1))
        return jnp.where(k, x, 0)
    return jax.tree_util.tree_map(one, tree)


def _loss(fn, keep):
    def loss(*arrays):
        return sum(jnp.sum(jnp.sin(3.0 * leaf)) for leaf in jax.tree_util.tree_leaves(_kept(fn(*arrays), keep)))
    return loss


def _check_two_processes(process_id: int, port: int):
    from jax.experimental import multihost_utils

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    assert jax.device_count() == 4 and jax.process_count() == 2
    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
    jax.config.update("jax_enable_x64", True)    # gradients in float64, as in the one-process tests
    gather = lambda tree: jax.tree_util.tree_map(                                  # noqa: E731
        lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)
    local = jax.local_devices()[0]
    for name, arrays, form, ids in _cases():
        arrays = tuple(np.asarray(a, np.float64) for a in arrays)
        keep = np.asarray(ids) > 0
        # Each array split along its T axis: global arrays built from this process's copies (a jitted
        # function may not close over arrays of other processes).
        spec = lambda a: P(*[("sequence" if i == _t_axis(a.shape, keep.shape) else None)  # noqa: E731
                             for i in range(a.ndim)])
        glob = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec(a)), lambda i, a=a: a[i])
                for a in arrays]
        fn, argnums = form(mesh), tuple(range(len(arrays)))
        values = gather(jax.jit(lambda *a: _kept(fn(*a), keep))(*glob))
        grads = gather(jax.jit(jax.grad(_loss(fn, keep), argnums=argnums))(*glob))
        with jax.default_device(local):
            expected = form(None)
            want = jax.jit(lambda *a: _kept(expected(*a), keep))(*arrays)
            want_grads = jax.jit(jax.grad(_loss(expected, keep), argnums=argnums))(*arrays)
        assert_trees_close(values, want, **F64)
        assert_trees_close(grads, want_grads, **F64)
        print(name, flush=True)
    jax.distributed.shutdown()
    print("ok")


if __name__ == "__main__":
    _check_two_processes(int(sys.argv[1]), int(sys.argv[2]))
