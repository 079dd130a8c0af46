"""Context parallelism (zoo_core/ops/context_parallel.py): a sequence split over a `sequence` mesh axis gives
the single-device numbers, values and gradients, NaN-safety included, and moves a number of bytes that
does not grow with the length."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.environment import assert_host_devices, run_on_host_devices, run_two_processes, sequence_mesh
from zoo_core.ops import context_parallel, linear_attention
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close, collective_bytes, packed_segment_ids

B, T, H, D, M, CHUNK = 2, 24, 2, 4, 3, 5


def _inputs(seed=0, t=T):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.nn.elu(jax.random.normal(ks[0], (B, t, H, D))) + 1
    k = jax.nn.elu(jax.random.normal(ks[1], (B, t, H, D))) + 1
    v = jax.random.normal(ks[2], (B, t, H, M))
    mask = np.arange(t)[None] < np.array([[t], [t - 7]])
    return q, k, v, mask


def _packed(t=T):
    """Documents of lengths that cross every shard boundary for P up to 8 (and padding between)."""
    return packed_segment_ids(([5, 9, 2, 7], [1, 10, 3, 4]), t)


def _assert_grads_equal(form, mesh, q, k, v, mask, segment_ids=None, expected=None):
    """Gradients in float64: the float32 sums' rounding, amplified by the loss, is not the question.
    `expected`: one device's (`_grads(form, None, ...)`), where the caller has them already."""
    if expected is None:
        expected = _grads(form, None, q, k, v, mask, segment_ids)
    assert_trees_close(_grads(form, mesh, q, k, v, mask, segment_ids), expected, **F64)


def _grads(form, mesh, q, k, v, mask, segment_ids=None):
    """The float64 gradients of `_loss` of `form` over `mesh` (None: one device)."""
    with jax.enable_x64(True):
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        return jax.jit(jax.grad(_loss(form(mesh, mask, segment_ids)), argnums=(0, 1, 2)))(q, k, v)


def _loss(fn):
    def loss(q, k, v):
        num, den = fn(q, k, v)
        return jnp.sum(jnp.sin(num)) + jnp.sum(jnp.cos(den))
    return loss


def _causal(mesh, mask, segment_ids=None):
    if mesh is None:
        return lambda q, k, v: linear_attention.causal_chunked(q, k, v, chunk_size=CHUNK, mask=mask,
                                                                denominator=True, segment_ids=segment_ids)[:2]
    return lambda q, k, v: context_parallel.causal(q, k, v, chunk_size=CHUNK, mesh=mesh, mask=mask,
                                                   denominator=True, segment_ids=segment_ids)


def _noncausal(mesh, mask, segment_ids=None):
    if mesh is None:
        return lambda q, k, v: linear_attention.noncausal(q, k, v, mask=mask, query_mask=mask, denominator=True,
                                                          segment_ids=segment_ids)
    return lambda q, k, v: context_parallel.noncausal(q, k, v, mesh=mesh, mask=mask, query_mask=mask,
                                                      denominator=True, segment_ids=segment_ids)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("form", [_causal, _noncausal], ids=["causal", "noncausal"])
def test_two_shards_equal_one_device(form, axis_type, packed):
    q, k, v, mask = _inputs()
    ids = _packed() if packed else None
    mesh = sequence_mesh(2, getattr(jax.sharding.AxisType, axis_type))
    expected, actual = jax.jit(form(None, mask, ids)), jax.jit(form(mesh, mask, ids))
    assert_trees_close(actual(q, k, v), expected(q, k, v), **F32_SIMPLE)
    _assert_grads_equal(form, mesh, q, k, v, mask, ids)


def test_packed_documents_across_shards_equal_each_document_alone():
    """The packed single-device forms are tested equal to separate documents in packing_test; here a
    document that spans the shard boundary, computed sharded, equals it computed alone."""
    q, k, v, mask = _inputs(4)
    ids = _packed()
    for form in (_causal, _noncausal):
        num, den = jax.jit(form(sequence_mesh(2), None, ids))(q, k, v)
        for b in range(B):
            doc = ids[b, T // 2]
            idx = np.flatnonzero(ids[b] == doc)
            assert idx[0] < T // 2 <= idx[-1] or doc == 0
            alone = form(None, None)(q[b:b + 1, idx], k[b:b + 1, idx], v[b:b + 1, idx])
            assert_trees_close((num[b, idx], den[b, idx]), (alone[0][0], alone[1][0]), **F32_SIMPLE)


@pytest.mark.parametrize("form", [_causal, _noncausal], ids=["causal", "noncausal"])
def test_nan_in_padding_changes_nothing_and_a_nan_key_reaches_only_later_shards(form):
    q, k, v, mask = _inputs(1)
    mesh = sequence_mesh(2)
    fn = jax.jit(form(mesh, mask))
    clean = fn(q, k, v)
    dirty = [jnp.where(~mask[..., None, None], jnp.nan, x) for x in (q, k, v)]
    assert_trees_close(fn(*dirty), clean, **F32_SIMPLE)
    if form is _causal:   # a non-finite valid key in the first shard: NaN from there on, as the recurrence gives
        bad = k.at[0, 3, 1, 0].set(jnp.nan)
        num, den = fn(q, bad, v)
        ref_num, ref_den = form(None, mask)(q, bad, v)
        np.testing.assert_array_equal(np.isnan(num), np.isnan(ref_num))
        np.testing.assert_array_equal(np.isnan(den), np.isnan(ref_den))
        assert np.isnan(num[0, T - 1, 1]).all() and np.isfinite(num[0, :3]).all() and np.isfinite(num[1]).all()


def test_bytes_between_devices_do_not_grow_with_the_length():
    """Forward and backward of the causal form at T and 4T over 2 devices: the collectives move the
    same bytes (the summaries' all-gather and its transpose), where jit's own partitioning of the
    unsharded form moves bytes in proportion to T."""
    mesh = sequence_mesh(2)

    def moved(fn, t):
        s = jax.ShapeDtypeStruct((1, t, H, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "sequence")))
        loss = lambda q, k, v: jnp.sum(fn(q, k, v)[0])
        return collective_bytes(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(s, s, s).compile().as_text())

    ours = [moved(lambda q, k, v: context_parallel.causal(q, k, v, chunk_size=64, mesh=mesh), t)
            for t in (1024, 4096)]
    auto = [moved(lambda q, k, v: linear_attention.causal_chunked(q, k, v, chunk_size=64), t) for t in (1024, 4096)]
    assert 0 < ours[0] and ours[1] <= 1.5 * ours[0], ours
    assert auto[1] >= 3 * auto[0] and ours[1] < auto[1], (ours, auto)


def test_the_benchmark_records_memory_bytes_and_time(tmp_path):
    from benchmarks import context_parallel as bench_cp

    rows = bench_cp.main(["--lengths", "128", "--shards", "1,2", "--heads", "1", "--head_dim", "4", "--chunk", "16",
                          "--time_up_to", "128", "--cases", "linear,agf,favor,var_chain,window_graph,softmax,auto",
                          "--out", str(tmp_path / "cp.json")])
    cases = ("linear", "agf", "favor", "var_chain", "window_graph", "softmax", "auto")
    assert [(r["case"], r["shards"]) for r in rows] == [(c, p) for c in cases for p in (1, 2)]
    for sharded in rows[1::2]:
        assert sharded["moved_bytes"] > 0 and sharded["memory"]["total_bytes"] > 0 and sharded["time"]["median_s"] > 0
    assert (tmp_path / "cp.json").exists()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "global"])
def test_the_drop_in_takes_a_sequence_axis(causal):
    """`attention.make('linear', ..., sequence_axis='sequence')` under `jax.set_mesh`, x sharded along T:
    the single-device layer's numbers with the same parameters, packed documents included."""
    from zoo_core import attention

    mesh = sequence_mesh(2)
    x = jax.random.normal(jax.random.PRNGKey(6), (B, T, 16))
    kw = dict(num_heads=2, qkv_features=16, causal=causal)
    plain, split = attention.make("linear", **kw), attention.make("linear", sequence_axis="sequence", **kw)
    params = plain.init(jax.random.PRNGKey(0), x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
        y = jax.jit(split.apply)(params, xs)
    assert_trees_close(y, plain.apply(params, x), **F32_SIMPLE)
    # The layer itself with segment ids: packed documents, split over the axis, equal one device.
    layer = attention.layer("linear", num_heads=2, qkv_features=16, causal=True, chunk_size=4)
    split_layer = attention.layer("linear", num_heads=2, qkv_features=16, causal=True, chunk_size=4,
                                  sequence_axis="sequence")
    lp = layer.init(jax.random.PRNGKey(1), x)
    ids = _packed()
    call = (lambda m: m.apply(lp, x, segment_ids=ids)[0]) if causal else (
        lambda m: m.apply(lp, x, segment_ids=ids, method="global_self"))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda: call(split_layer))()
    assert_trees_close(got, call(layer), **F32_SIMPLE)


def test_up_to_eight_shards_equal_one_device():
    """P in {1, 2, 4, 8} in one process with 8 host devices (a subprocess: the suite runs on 2)."""
    assert run_on_host_devices("tests.zoo_core.context_parallel_test") == ["P=1", "P=2", "P=4", "P=8"]


def test_two_processes_split_one_sequence():
    """jax.distributed over 2 local processes of 2 CPU devices each: the sequence axis spans the
    processes, and both get the single-device numbers, values and gradients, packed and not."""
    for lines in run_two_processes("tests.zoo_core.context_parallel_test"):
        assert "\n".join(lines).split()[-1] == "ok", lines


def _check_two_processes(process_id: int, port: int):
    from jax.experimental import multihost_utils

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    assert jax.device_count() == 4 and jax.process_count() == 2
    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P(None, "sequence"))
    jax.config.update("jax_enable_x64", True)    # gradients in float64, as in the one-process tests
    q, k, v = (np.asarray(x, np.float64) for x in _inputs(5)[:3])
    mask = _inputs(5)[3]
    glob = lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    gather = lambda tree: jax.tree_util.tree_map(
        lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)
    local = jax.local_devices()[0]
    # values and gradients in one program per side
    both = lambda fn, q, k, v: (fn(q, k, v), jax.grad(_loss(fn), argnums=(0, 1, 2))(q, k, v))  # noqa: E731
    for form in (_causal, _noncausal):
        for ids in (None, _packed()):
            # mask and ids are arguments: a jitted function may not close over arrays of other processes
            run = jax.jit(lambda q, k, v, m, i: both(form(mesh, m, i), q, k, v))
            args = [glob(x) for x in (q, k, v)] + [glob(mask), None if ids is None else glob(ids)]
            with jax.default_device(local):
                want, want_grads = jax.jit(lambda q, k, v: both(form(None, mask, ids), q, k, v))(q, k, v)
            got, got_grads = gather(run(*args))
            assert_trees_close(got, want, **F64)
            assert_trees_close(got_grads, want_grads, **F64)
    jax.distributed.shutdown()
    print("ok")


def _check_all_shard_counts():
    q, k, v, mask = _inputs(2, t=48)
    cases = [(form, ids) for form in (_causal, _noncausal) for ids in (None, _packed(48))]
    # one device's values and gradients, the same for every P: computed once
    expected = [(jax.jit(form(None, mask, ids))(q, k, v), _grads(form, None, q, k, v, mask, ids))
                for form, ids in cases]
    for p in (1, 2, 4, 8):
        for (form, ids), (values, grads) in zip(cases, expected):
            assert_trees_close(jax.jit(form(sequence_mesh(p), mask, ids))(q, k, v), values, **F32_SIMPLE)
            _assert_grads_equal(form, sequence_mesh(p), q, k, v, mask, ids, expected=grads)
        print(f"P={p}")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        _check_two_processes(int(sys.argv[1]), int(sys.argv[2]))
    else:
        assert_host_devices(8)
        _check_all_shard_counts()
