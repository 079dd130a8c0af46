"""The window graph split over a sequence axis (htgn_jax/graph_context_parallel.py): P shards give one
device's numbers, values and gradients, packed documents across shards and global nodes included, and
the bytes between devices do not grow with the length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from htgn_jax import graph_context_parallel as GCP
from htgn_jax import graph_ops as G
from htgn_jax.graph_layers import WindowGraphAttention
from tests.environment import assert_host_devices, run_on_host_devices, sequence_mesh
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close, collective_bytes, packed_segment_ids

B, L, H, C = 2, 48, 2, 3

CASES = {
    "globals": dict(window=1, num_global=2),
    "skips_neighbour_kl": dict(window=1, num_global=2, skip_offsets=(3,), kl_mode="neighbour"),
    "causal": dict(window=2, causal=True, skip_offsets=(4,)),
    "grid": dict(window=1, num_global=1, grid_width=3, kl_tau=0.5),
}


def _packed(length=L):
    """Documents crossing every shard boundary for P up to 8, every fourth run padding."""
    return packed_segment_ids(([5, 9, 2, 7, 13, 6], [1, 10, 3, 4, 20]), length)


def _inputs(case, seed=0, length=L):
    r = np.random.RandomState(seed)
    q, k = (r.randn(B, length, H, C).astype(np.float32) for _ in range(2))
    kw = dict(CASES[case])
    offsets = G.window_offsets(kw["window"], kw.get("causal", False), kw.get("grid_width"),
                               kw.get("skip_offsets", ()))
    kw["rel_bias"] = r.randn(H, len(offsets)).astype(np.float32)
    if kw.get("num_global"):
        kw["global_bias"] = r.randn(H).astype(np.float32)
    mask = np.arange(length)[None] < np.array([[length], [length - 5]])
    return q, k, r.randn(H, C).astype(np.float32), mask, kw


def _form(mesh, attn, mask, ids, kw):
    """(q, k) -> (out, kl_sum, kl_count): one device (mesh None) or split over the mesh."""
    def run(q, k):
        if mesh is None:
            out, aux = G.window_graph_attention(q, k, k, attn, mask=mask, segment_ids=ids, **kw)
        else:
            out, aux = GCP.window_graph_attention(q, k, k, attn, axis_name="sequence", mesh=mesh,
                                                  mask=mask, segment_ids=ids, **kw)
        return out, aux["kl_sum"], aux["kl_count"]
    return run


def _check(case, p, packed):
    """Values in float32; gradients in float64 (the float32 sums' rounding is not the question)."""
    q, k, attn, mask, kw = _inputs(case)
    ids = _packed() if packed else None
    want = jax.jit(_form(None, attn, mask, ids, kw))(q, k)
    assert_trees_close(jax.jit(_form(sequence_mesh(p), attn, mask, ids, kw))(q, k), want, **F32_SIMPLE)
    with jax.enable_x64(True):
        q, k, attn = (np.asarray(x, np.float64) for x in (q, k, attn))
        kw = {n: (np.asarray(v, np.float64) if isinstance(v, np.ndarray) else v) for n, v in kw.items()}
        loss = lambda form: lambda q, k: (lambda out: jnp.sum(jnp.sin(out[0])) + out[1])(form(q, k))
        grads = jax.jit(jax.grad(loss(_form(sequence_mesh(p), attn, mask, ids, kw)), argnums=(0, 1)))(q, k)
        expected = jax.jit(jax.grad(loss(_form(None, attn, mask, ids, kw)), argnums=(0, 1)))(q, k)
        assert_trees_close(grads, expected, **F64)


def test_two_shards_equal_one_device():
    _check("globals", 2, packed=True)
    _check("causal", 2, packed=True)


def test_the_layer_takes_a_sequence_axis():
    """`WindowGraphAttention(sequence_axis='sequence')` under `jax.set_mesh`, x sharded along L: the
    one-device layer's numbers with the same parameters, packed documents across the shards; and the
    drop-in `attention.make('window_graph', ..., sequence_axis=...)`."""
    mesh = sequence_mesh(2)
    x = np.random.RandomState(3).randn(B, L, 8).astype(np.float32)
    ids = _packed()
    for kw in (dict(num_global=2, skip_offsets=(3,)), dict(causal=True, chunk_size=5)):
        plain = WindowGraphAttention(num_heads=H, window=2, **kw)
        split = WindowGraphAttention(num_heads=H, window=2, sequence_axis="sequence", **kw)
        params = jax.jit(plain.init)(jax.random.PRNGKey(0), x)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
            got = jax.jit(lambda p, x: split.apply(p, x, segment_ids=ids))(params, xs)
        assert_trees_close(got, jax.jit(lambda p, x: plain.apply(p, x, segment_ids=ids))(params, x), **F32_SIMPLE)
    # The registry's drop-in passes the field through: attention.make(..., sequence_axis=NAME).
    from zoo_core import attention

    kw = dict(num_heads=H, qkv_features=8, window=2)
    plain = attention.make("window_graph", **kw)
    split = attention.make("window_graph", sequence_axis="sequence", **kw)
    params = jax.jit(plain.init)(jax.random.PRNGKey(1), x)
    with jax.set_mesh(mesh):
        got = jax.jit(split.apply)(params, jax.device_put(x, NamedSharding(mesh, P(None, "sequence"))))
    assert_trees_close(got, jax.jit(plain.apply)(params, x), **F32_SIMPLE)


def test_bytes_between_devices_do_not_grow_with_the_length():
    """Forward and backward at L and 4L over 2 shards, packed, with globals: the halo, the published
    global slots and the softmax summaries move the same bytes at both lengths."""
    mesh = sequence_mesh(2)

    def moved(length):
        q, k, attn, mask, kw = _inputs("skips_neighbour_kl", length=length)
        ids = _packed(length)
        s = jax.ShapeDtypeStruct((B, length, H, C), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "sequence")))
        form = _form(mesh, attn, mask, ids, kw)
        loss = lambda q, k: jnp.sum(form(q, k)[0]) + form(q, k)[1]
        return collective_bytes(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(s, s).compile().as_text())

    short, long = moved(256), moved(1024)
    assert 0 < short and long <= 1.5 * short, (short, long)


@pytest.mark.slow
def test_up_to_eight_shards_equal_one_device():
    """P in {1, 2, 4, 8} in one process with 8 host devices (a subprocess: the suite runs on 2);
    about 35 s of CPU, so opt-in (`-m slow`)."""
    assert run_on_host_devices("tests.htgn_jax.graph_context_parallel_test") == ["P=1", "P=2", "P=4", "P=8"]


def _check_all_shard_counts():
    """Every case packed at P = 8 (shards of 6 nodes: documents span up to 4 of them), a cycle of
    the cases packed and not below."""
    checks = {1: [("globals", True)], 2: [("grid", False), ("causal", True)],
              4: [("globals", False), ("skips_neighbour_kl", True)], 8: [(c, True) for c in CASES]}
    for p, cases in checks.items():
        for case, packed in cases:
            _check(case, p, packed)
        print(f"P={p}")


if __name__ == "__main__":
    assert_host_devices(8)
    _check_all_shard_counts()
