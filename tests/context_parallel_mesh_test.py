"""Every mesh a user builds (issue 49 item 5): each name of `attention.names('context_parallel')` and SAMoVAR's
VAR chain, with `sequence_axis='sequence'`, under `jax.make_mesh`'s default axes (Explicit) and under
`AxisType.Auto`, `init` and `apply` eager or jitted inside `jax.set_mesh`, x split along T: one device's
parameters and numbers (on the suite's 2 host devices)."""
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


def _equal_under(mesh, module, params, x, expected, **kwargs) -> None:
    """init and apply, eager and jitted, under `jax.set_mesh(mesh)` with x split along T."""
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
        for init in (module.init, jax.jit(module.init)):
            # the parameters, and what init sows (AGF's regulariser); jit may round an initialiser's
            # product differently from eager (an ulp)
            assert_trees_close(init(jax.random.PRNGKey(0), xs, **kwargs), params, **F32_SIMPLE)
        for apply in (module.apply, jax.jit(module.apply)):
            assert_trees_close(apply(params, xs, **kwargs), expected, **F32_SIMPLE)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("name", SELF_CP)
def test_every_context_parallel_mechanism_under_either_axis_type(name, axis_type):
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, E))
    assert _modes(name)
    for causal in _modes(name):
        kw = dict(num_heads=HEADS, qkv_features=E, causal=causal, **OPTIONS.get(name, {}))
        plain, split = attention.make(name, **kw), attention.make(name, sequence_axis="sequence", **kw)
        params = plain.init(jax.random.PRNGKey(0), x)
        _equal_under(_mesh(axis_type), split, params, x, plain.apply(params, x))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_the_var_chain_under_either_axis_type(axis_type):
    from samovar_jax.layers import VARChain

    x0 = 0.3 * jax.random.normal(jax.random.PRNGKey(2), (B, T, E))
    plain, split = (VARChain(E, HEADS, num_layers=2, chunk_size=4, sequence_axis=axis) for axis in (None, "sequence"))
    params = plain.init(jax.random.PRNGKey(0), x0)
    _equal_under(_mesh(axis_type), split, params, x0, plain.apply(params, x0))


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
            params = layer.init(jax.random.PRNGKey(0), x)
            state = layer.apply(params, B, method="init_state")
            for platform in ("cuda", "tpu"):
                program = testing.exported_program(lambda p, x, s: layer.apply(p, x, s, method="prefill"),
                                                   params, x, state, platform=platform)
                assert testing.while_loops(program) == 0 and "all_gather" in program, (type(layer).__name__, platform)
