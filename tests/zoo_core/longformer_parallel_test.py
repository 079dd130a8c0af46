"""Longformer's context-parallel form (`longformer_context_parallel`, the layer's `sequence_axis`): the
sequence split over a `sequence` mesh axis equals one device, values and float64 gradients, causal and not,
with a padding mask and with packed documents that cross shard boundaries (and a document's global tokens
on another shard); NaN in padding changes nothing and a non-finite value reaches the rows it reaches on
one device; the bytes between devices do not grow with the length; P = 1, 2, 4 (a subprocess on 4 host
devices); Auto and Explicit mesh axes, `init` and `apply` jitted under `jax.set_mesh`."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.environment import assert_host_devices, run_on_host_devices, sequence_mesh
from zoo_core import attention
from zoo_core.baselines.longformer import longformer_attention, longformer_context_parallel
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close, collective_bytes

B, T, H, D = 2, 32, 2, 4
# Row 0: documents of 5, 10, 3 and 12 tokens, then padding; row 1: padding between documents, one of
# one token. Every shard boundary for P = 2, 4, 8 falls inside a document or between two.
IDS = np.array([[1] * 5 + [2] * 10 + [3] * 3 + [4] * 12 + [0] * 2,
                [1] * 14 + [0] * 2 + [5] + [6] * 15], np.int32)
# (window, num_global): globals on one shard; a document's globals across a shard boundary (g > T / 4);
# no globals with an odd window.
SETTINGS = [(4, 1), (8, 11), (3, 0)]


def _inputs(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(dtype) for _ in range(3))
    mask = np.arange(T)[None] < np.array([[T], [T - 5]])
    mask[1, 3] = False
    return q, k, v, mask


def _form(mesh, *, window, num_global, causal, mask, packed):
    kw = dict(window=window, num_global=num_global, causal=causal, mask=mask, segment_ids=IDS if packed else None)
    if mesh is None:
        return lambda q, k, v: longformer_attention(q, k, v, **kw)
    return lambda q, k, v: longformer_context_parallel(q, k, v, mesh=mesh, **kw)


def _loss(fn):
    weight = np.cos(np.arange(T * H * D).reshape(1, T, H, D))
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * weight)


def _check(mesh, gradients=True, expected=None, **kw):
    """Values (float32) and float64 gradients of the sharded form against one device (`expected`:
    `_results(None, gradients, **kw)`, where the caller has it already)."""
    want, want_grads = _results(None, gradients, **kw) if expected is None else expected
    got, grads = _results(mesh, gradients, **kw)
    assert_trees_close(got, want, **F32_SIMPLE)
    if gradients:
        assert_trees_close(grads, want_grads, **F64)


def _results(mesh, gradients=True, **kw):
    """The form over `mesh` (None: one device): its values (float32) and, with `gradients`, its float64
    gradients (else None)."""
    q, k, v, mask = _inputs()
    values = jax.jit(_form(mesh, mask=mask, **kw))(q, k, v)
    if not gradients:
        return values, None
    with jax.enable_x64(True):
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
        return values, jax.jit(jax.grad(_loss(_form(mesh, mask=mask, **kw)), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_two_shards_of_an_explicit_axis_equal_one_device(causal, packed):
    """An Explicit axis here (Auto ones: the subprocess below)."""
    _check(sequence_mesh(2, jax.sharding.AxisType.Explicit), window=8, num_global=11, causal=causal, packed=packed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_in_padding_changes_nothing_and_a_bad_value_reaches_the_rows_it_reaches_on_one_device(causal):
    q, k, v, mask = _inputs(1)
    mesh = sequence_mesh(2)
    for packed in (False, True):
        valid = mask & (IDS > 0) if packed else mask
        fn = jax.jit(_form(mesh, window=4, num_global=2, causal=causal, mask=mask, packed=packed))
        clean = np.asarray(fn(q, k, v))
        dirty = [np.where(valid[..., None, None], x, np.nan) for x in (q, k, v)]
        np.testing.assert_array_equal(np.asarray(fn(*dirty))[valid], clean[valid])
        bad = v.copy()
        bad[0, 17, 1, 2] = np.inf          # a valid token of row 0's document 3, on the second shard
        one = np.asarray(jax.jit(_form(None, window=4, num_global=2, causal=causal, mask=mask, packed=packed))(q, k, bad))
        got = np.asarray(fn(q, k, bad))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(one))
        assert np.isnan(got[0, 17, 1]).all() and np.isfinite(got[1]).all()


def test_bytes_between_devices_do_not_grow_with_the_length():
    """The gradient of the sharded form at T and 4T over 2 devices moves the same bytes: the halo, the
    global tokens and their rows' statistics, none of which depends on T."""
    mesh = sequence_mesh(2)

    def moved(t, causal):
        s = jax.ShapeDtypeStruct((1, t, H, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "sequence")))
        ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=NamedSharding(mesh, P(None, "sequence")))
        fn = lambda q, k, v, i: jnp.sum(longformer_context_parallel(q, k, v, window=16, num_global=2, causal=causal,
                                                                    segment_ids=i, mesh=mesh))
        return collective_bytes(jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(s, s, s, ids).compile().as_text())

    for causal in (False, True):
        small, large = moved(128, causal), moved(512, causal)
        assert 0 < small and large == small, (causal, small, large)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_readme_recipe_jitted_under_either_mesh_equals_one_device(causal):
    """`attention.make('longformer', sequence_axis='sequence')` with `jax.make_mesh`'s default (Explicit)
    axes and with Auto ones: `init` and `apply` jitted under `jax.set_mesh`, x sharded along T, a mask and
    packed documents: the single-device module's numbers on the same parameters."""
    x = jax.random.normal(jax.random.PRNGKey(6), (B, T, 16))
    mask = _inputs()[3]
    kw = dict(num_heads=2, qkv_features=16, causal=causal, window=6, num_global=3)
    plain, split = attention.make("longformer", **kw), attention.make("longformer", sequence_axis="sequence", **kw)
    params = jax.jit(plain.init)(jax.random.PRNGKey(0), x)
    want = jax.jit(lambda p, x: plain.apply(p, x, mask=mask, segment_ids=IDS))(params, x)
    for mesh in (jax.make_mesh((2,), ("sequence",), devices=jax.devices()[:2]), sequence_mesh(2)):
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
            sharded_params = jax.jit(split.init)(jax.random.PRNGKey(0), xs)
            got = jax.jit(lambda p, x, m, i: split.apply(p, x, mask=m, segment_ids=i))(sharded_params, xs, mask, IDS)
        assert_trees_close(sharded_params, params, **F32_SIMPLE)
        assert_trees_close(got, want, **F32_SIMPLE)


def test_dropout_draws_per_shard_and_keeps_the_rate():
    """With dropout the sharded layer runs (an explicit rng input to shard_map) and drops weights: the output
    differs from the deterministic one, is finite, and changes with the key."""
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, 16))
    split = attention.make("longformer", num_heads=2, qkv_features=16, window=4, num_global=1, dropout_rate=0.5,
                           sequence_axis="sequence")
    mesh = jax.make_mesh((2,), ("sequence",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        params = jax.jit(split.init)(jax.random.PRNGKey(0), x)
        run = jax.jit(lambda p, r: split.apply(p, x, deterministic=False, rngs={"dropout": r}))
        a, b = run(params, jax.random.PRNGKey(1)), run(params, jax.random.PRNGKey(2))
        fixed = jax.jit(lambda p: split.apply(p, x))(params)
    assert np.isfinite(a).all() and not np.allclose(a, b) and not np.allclose(a, fixed)


def test_one_two_and_four_shards_equal_one_device():
    """P in {1, 2, 4} in one process with 4 host devices (a subprocess: the suite runs on 2)."""
    assert run_on_host_devices("tests.zoo_core.longformer_parallel_test", count=4) == ["P=1", "P=2", "P=4"]


def _check_shard_counts():
    """Values in every setting; float64 gradients in the one whose globals cross a shard boundary."""
    cases = [dict(gradients=num_global == 11, window=window, num_global=num_global, causal=causal, packed=packed)
             for window, num_global in SETTINGS for causal in (False, True) for packed in (False, True)]
    expected = [_results(None, **kw) for kw in cases]   # the same for every P: computed once
    for p in (1, 2, 4):
        for kw, want in zip(cases, expected):
            _check(sequence_mesh(p), expected=want, **kw)
        print(f"P={p}")


if __name__ == "__main__":
    assert_host_devices(4)
    assert len(sys.argv) == 1
    _check_shard_counts()
