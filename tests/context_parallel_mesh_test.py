"""Every mesh a user builds (issue 49 item 5): each name of `attention.names('context_parallel')` and SAMoVAR's
VAR chain, with `sequence_axis='sequence'`, under `jax.make_mesh`'s default axes (Explicit) and under
`AxisType.Auto`, `init` and `apply` jitted (and eager under Explicit) inside `jax.set_mesh`, x split along T:
one device's parameters and numbers (on the suite's 2 host devices)."""
import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zoo_core import attention, testing
from zoo_core.testing import F32_SIMPLE, assert_trees_close

B, T, E, HEADS = 2, 16, 16, 2
# Options that fit T = 16 on two shards: Longformer's halo (half its window) must fit in a shard's 8 tokens.
OPTIONS = {"longformer": dict(window=8, num_global=2)}
# The self-attention mechanisms with a context-parallel form (cross_graph's is a cross-attention's, tested with
# the HTGN decoder).
SELF_CP = [n for n in attention.names("context_parallel") if n in attention.names("self") + attention.names("causal")]


def _mesh(axis_type: str):
    """Two devices on one 'sequence' axis: `jax.make_mesh`'s defaults (Explicit), or Auto."""
    if axis_type == "Explicit":
        mesh = jax.make_mesh((2,), ("sequence",))
        assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
        return mesh
    return jax.make_mesh((2,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))


def _modes(name: str) -> tuple[bool, ...]:
    caps = attention.capabilities(name)
    return tuple(c for c, has in ((False, caps["self"]), (True, caps["causal"])) if has)


def _equal_under(mesh, module, params, x, expected, axis_type: str) -> None:
    """init and apply jitted (one program for both), and eager under the Explicit axis type (`jax.make_mesh`'s
    default; eager under Auto is the same op-by-op dispatch, many times slower than jit), inside
    `jax.set_mesh(mesh)` with x split along T."""
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
        calls = [jax.jit(lambda key, p, x: (module.init(key, x), module.apply(p, x)))]
        if axis_type == "Explicit":
            calls.append(lambda key, p, x: (module.init(key, x), module.apply(p, x)))
        for call in calls:
            got_params, got = call(jax.random.PRNGKey(0), params, xs)
            # the parameters, and what init sows (AGF's regulariser); jit may round an initialiser's
            # product differently from eager (an ulp)
            assert_trees_close(got_params, params, **F32_SIMPLE)
            assert_trees_close(got, expected, **F32_SIMPLE)


@functools.cache
def _one_device(name: str, causal: bool):
    """The one-device module's parameters and output, shared by both axis types' tests."""
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, E))
    plain = attention.make(name, num_heads=HEADS, qkv_features=E, causal=causal, **OPTIONS.get(name, {}))

    def init_apply(x):
        params = plain.init(jax.random.PRNGKey(0), x)
        return params, plain.apply(params, x)

    return x, jax.jit(init_apply)(x)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("name", SELF_CP)
def test_every_context_parallel_mechanism_under_either_axis_type(name, axis_type):
    assert _modes(name)
    for causal in _modes(name):
        x, (params, expected) = _one_device(name, causal)
        split = attention.make(name, num_heads=HEADS, qkv_features=E, causal=causal, sequence_axis="sequence",
                               **OPTIONS.get(name, {}))
        _equal_under(_mesh(axis_type), split, params, x, expected, axis_type)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_the_var_chain_under_either_axis_type(axis_type):
    from samovar_jax.layers import VARChain

    x0 = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (B, T, E))
    plain, split = (VARChain(E, HEADS, num_layers=2, chunk_size=4, sequence_axis=axis) for axis in (None, "sequence"))
    params = jax.jit(plain.init)(jax.random.PRNGKey(0), x0)
    _equal_under(_mesh(axis_type), split, params, x0, jax.jit(plain.apply)(params, x0), axis_type)


def test_a_missing_axis_names_the_field_to_set():
    """The hint names `sequence_axis=` (what `make` and the layers take), not only `axis_name=`."""
    layer = attention.make("linear", num_heads=HEADS, qkv_features=E, causal=True, sequence_axis="seq")
    x = np.ones((B, T, E), np.float32)
    with jax.set_mesh(_mesh("Explicit")), pytest.raises(ValueError, match="the mesh has no axis 'seq'.*sequence_axis="):
        layer.init(jax.random.PRNGKey(0), x)


def test_prefill_over_the_shards_exports_without_loops():
    """The context-parallel `prefill` of each causal linear form, from a state and to the replicated final one,
    exports for cuda and tpu without a while loop (an accelerator runs a loop's control from the host)."""
    from agf_jax.layers import AGFAttention
    from htgn_jax.layers import FavorAttention
    from samovar_jax.layers import LinearAttention, VARChain

    x = np.ones((B, T, E), np.float32)
    for layer in (LinearAttention(HEADS, E // HEADS, chunk_size=4, sequence_axis="sequence"),
                  FavorAttention(HEADS, E // HEADS, causal=True, chunk_size=4, num_features=8, sequence_axis="sequence"),
                  AGFAttention(HEADS, E // HEADS, causal=True, chunk_size=4, sequence_axis="sequence"),
                  VARChain(E, HEADS, num_layers=2, chunk_size=4, sequence_axis="sequence")):
        with jax.set_mesh(_mesh("Auto")):
            params = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
            state = layer.apply(params, B, method="init_state")
            prefill = functools.partial(layer.apply, method="prefill")
            for platform in ("cuda", "tpu"):
                program = testing.exported_program(prefill, params, x, state, platform=platform)
                assert testing.while_loops(program) == 0 and "all_gather" in program, (type(layer).__name__, platform)
