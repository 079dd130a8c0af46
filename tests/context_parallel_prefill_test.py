"""A prompt prefilled over P devices, then decoded token by token (issue 49 item 4): for every causal linear
form with context parallelism (linear attention, FAVOR+, AGF, SAMoVAR's VAR chain), the layer's `prefill` over
4 host devices from a state, in two calls (the second starts from the first's final state), then 16 `step`s
from the replicated final state, equal one device's token-by-token `scan` from the start, values at every
token; packed rows too (documents cross shards and calls, the state belongs to each row's last document).
The drop-in's `decode=True` takes the prompt in one call and steps from its cache."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.environment import assert_host_devices, run_on_host_devices
from zoo_core.testing import F32_SIMPLE, F64, assert_trees_close

B, E, H, FIRST, SECOND, DECODED = 2, 16, 2, 32, 16, 16
T = FIRST + SECOND + DECODED


def _ids() -> np.ndarray:
    """Documents `[B, T]` crossing the shard boundaries (8 tokens each over 4 devices) and the prompt's two
    calls (each row's document continues from the first call into the second, where row 1 starts two more),
    with padding inside; the decoded tokens continue each row's last document. (A call's first token
    continues the state it is given, as in `scan`: a caller starting a new document there passes zeros.)"""
    rows = ([1] * 5 + [2] * 9 + [0] * 2 + [3] * 20 + [4] * 28,
            [1] * 1 + [2] * 10 + [0] * 3 + [3] * 20 + [4] * 5 + [5] * 25)
    return np.asarray(rows, np.int32)


def _layers(name: str):
    """(one-device layer, its context-parallel twin) of a small causal `name`."""
    from agf_jax.layers import AGFAttention
    from htgn_jax.layers import FavorAttention
    from samovar_jax.layers import LinearAttention, VARChain

    make = {"linear": lambda **kw: LinearAttention(H, E // H, chunk_size=4, **kw),
            "favor": lambda **kw: FavorAttention(H, E // H, causal=True, chunk_size=4, num_features=8, **kw),
            "favor_rotary": lambda **kw: FavorAttention(H, E // H, causal=True, num_features=8, use_rotary=True, **kw),
            "agf": lambda **kw: AGFAttention(H, E // H, causal=True, chunk_size=4, **kw),
            # float64: the chain's outputs grow through its layers (to ~1e2 here), and float32 sums in two
            # orders differ beyond F32_SIMPLE there, which is rounding, not the question
            "var_chain": lambda **kw: VARChain(E, H, num_layers=3, chunk_size=4, param_dtype=jnp.float64, **kw)}[name]
    return make(), make(sequence_axis="sequence")


def _check(name: str, packed: bool, axis_type) -> None:
    with jax.enable_x64(name == "var_chain"):
        _check_layer(name, packed, axis_type, **(F64 if name == "var_chain" else F32_SIMPLE))


def _check_layer(name: str, packed: bool, axis_type, **tolerance) -> None:
    plain, split = _layers(name)
    x = jax.random.normal(jax.random.PRNGKey(len(name)), (B, T, E), jnp.float64 if name == "var_chain" else None)
    ids = _ids() if packed else None
    cut = lambda a, lo, hi: None if a is None else a[:, lo:hi]                         # noqa: E731
    params = jax.jit(plain.init)(jax.random.PRNGKey(0), x[:, :FIRST])
    rotary = name == "favor_rotary"
    expected, _ = jax.jit(lambda p, x, i: plain.apply(p, x, segment_ids=i, method="scan"))(params, x, ids)

    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(axis_type,))
    prefill = jax.jit(lambda p, x, s, i, pos: split.apply(p, x, s, segment_ids=i, method="prefill",
                                                          **({"positions": pos} if rotary else {})))
    with jax.set_mesh(mesh):
        along_t = lambda a: None if a is None else jax.device_put(a, NamedSharding(mesh, P(None, "sequence")))  # noqa: E731
        y1, first = prefill(params, along_t(x[:, :FIRST]), None, along_t(cut(ids, 0, FIRST)), jnp.arange(FIRST))
        y2, state = prefill(params, along_t(x[:, FIRST:FIRST + SECOND]), first,
                            along_t(cut(ids, FIRST, FIRST + SECOND)), FIRST + jnp.arange(SECOND))
    # One device's prefill (no mesh, the chunked form from the state) gives the same state.
    _, one_device = jax.jit(lambda p, x, i, pos: plain.apply(p, x, segment_ids=i, method="prefill",
                                                             **({"positions": pos} if rotary else {})))(
        params, x[:, :FIRST], cut(ids, 0, FIRST), jnp.arange(FIRST))
    assert_trees_close(first, one_device, **tolerance)
    ys = [np.asarray(y1), np.asarray(y2)]
    step = jax.jit(lambda p, s, x_t, pos: plain.apply(p, s, x_t, method="step",
                                                      **({"position": pos} if rotary else {})))
    for t in range(FIRST + SECOND, T):
        y_t, state = step(params, state, x[:, t], t)
        ys.append(np.expand_dims(y_t, 2 if name == "var_chain" else 1))
    assert_trees_close(np.concatenate(ys, axis=2 if name == "var_chain" else 1), expected, **tolerance)


def _check_drop_in(name: str, axis_type) -> None:
    """`attention.make(name, causal=True, decode=True, sequence_axis=...)`: init, one call with the prompt
    (prefilled over 4 devices), then 16 one-token calls equal the causal call over the whole sequence."""
    from zoo_core import attention

    kw = dict(num_heads=H, qkv_features=E, causal=True)
    x = jax.random.normal(jax.random.PRNGKey(3), (B, FIRST + DECODED, E))
    full = attention.make(name, **kw)
    decoder = attention.make(name, decode=True, sequence_axis="sequence", **kw)
    params = jax.jit(full.init)(jax.random.PRNGKey(0), x)
    expected = jax.jit(full.apply)(params, x)
    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(axis_type,))
    call = jax.jit(lambda c, x: decoder.apply({**params, "cache": c}, x, mutable=["cache"]))
    with jax.set_mesh(mesh):
        prompt = jax.device_put(x[:, :FIRST], NamedSharding(mesh, P(None, "sequence")))
        cache = jax.jit(decoder.init)(jax.random.PRNGKey(0), prompt)["cache"]
        y, variables = call(cache, prompt)
    ys = [np.asarray(y)]
    for t in range(FIRST, FIRST + DECODED):
        y_t, variables = call(variables["cache"], x[:, t:t + 1])
        ys.append(np.asarray(y_t))
    assert int(variables["cache"]["cache_index"]) == FIRST + DECODED
    assert_trees_close(np.concatenate(ys, axis=1), expected, **F32_SIMPLE)


GROUPS = {"linear": ("linear", "favor", "favor_rotary"), "agf_var_chain": ("agf", "var_chain")}


def _run(group: str) -> None:
    """One group's layers, rows and packed, under `jax.make_mesh`'s default (Explicit) axes; the drop-in's
    prompt for each of `prefills()`, and the linear layer's packed prefill under Auto axes too."""
    from zoo_core import attention

    explicit = jax.sharding.AxisType.Explicit
    if group == "drop_in":
        for name in attention.prefills():
            _check_drop_in(name, explicit)
        _check("linear", True, jax.sharding.AxisType.Auto)
    else:
        for name in GROUPS[group]:
            for packed in ((False,) if name == "favor_rotary" else (False, True)):
                _check(name, packed, explicit)
    print(group)


def test_prefill_over_four_devices_then_decoding_equals_one_device_scan():
    """Every group in one command: a command per group would cost a JAX import and its compiles each."""
    groups = (*GROUPS, "drop_in")
    assert run_on_host_devices("tests.context_parallel_prefill_test", count=4, args=groups) == list(groups)


def test_the_drop_in_prefills_the_causal_linear_forms():
    """Every causal linear form of the drop-in takes a prompt; a mechanism without `prefill` refuses one in a
    line naming those that do."""
    from zoo_core import attention

    assert {"agf", "favor", "linear"} <= set(attention.prefills()) <= set(attention.names("causal", "decode"))
    x = jnp.ones((1, 4, 8))
    decoder = attention.make("softmax", num_heads=2, qkv_features=8, causal=True, decode=True)
    cache = decoder.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"takes one token .* \(prefill\): \[.*'linear'"):
        decoder.apply(cache, x, mutable=["cache"])


if __name__ == "__main__":
    assert_host_devices(4)
    if len(sys.argv) == 4 and sys.argv[2] in ("rows", "packed"):   # one layer: NAME rows|packed AXIS_TYPE
        _check(sys.argv[1], sys.argv[2] == "packed", getattr(jax.sharding.AxisType, sys.argv[3]))
    else:                                                           # groups: GROUP ...
        for group in sys.argv[1:]:
            _run(group)
