"""The zoo's layer contract (README "Layer contract"), checked on every attention layer alike.

Shapes and aux keys, jit == eager, every form equal (parallel, chunked, scan, step loop), NaN and
1e30 in padding and in the future change no valid or past output (nor the aux losses), and bf16
compute within the BF16 tolerance of float32.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core import attention
from zoo_core.testing import BF16, F32_SIMPLE, assert_forms_agree

B, T, E, HEADS = 2, 7, 16, 2
FUTURE = 4   # the position that holds garbage in the causality checks

# (name, causal, options)
CASES = [
    ("agf", False, {}),
    ("agf", True, {}),
    ("softmax", False, {}),
    ("softmax", True, {"max_length": T}),
    ("favor", False, {"num_features": 8}),
    ("favor", True, {"num_features": 8}),
    ("window_graph", False, {"window": 2}),
    ("window_graph", True, {"window": 2}),
    ("linear", True, {}),
    ("linformer", False, {"max_length": T, "proj_len": 4}),
    ("nystromformer", False, {"num_landmarks": 3}),
    ("nystromformer", False, {"num_landmarks": 3, "conv_kernel": 3}),
    ("reformer", False, {"num_buckets": 4, "chunk_length": 3}),
    ("reformer", True, {"num_buckets": 4, "chunk_length": 3}),
    ("longformer", False, {"window": 2, "num_global": 1}),
    ("longformer", True, {"window": 2, "num_global": 1}),
]
IDS = [f"{n}-{'causal' if c else 'full'}" + ("-conv" if "conv_kernel" in o else "") for n, c, o in CASES]


def _recurrent(name):
    """Whether the causal layer has the recurrent forms (init_state / scan / step); Reformer has
    `__call__` only."""
    return attention.capabilities(name)["decode"]


def _layer(name, causal, options, **extra):
    return attention.layer(name, num_heads=HEADS, qkv_features=E, causal=causal, **{**options, **extra})


@functools.lru_cache(maxsize=None)
def _inputs():
    # numpy, made once: eager jnp ops on them would compile each op per shape
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (B, T, E)))
    mask = np.arange(T)[None, :] < np.array([[T], [T - 3]])
    x.flags.writeable = mask.flags.writeable = False     # shared by every test
    return x, mask


@functools.lru_cache(maxsize=None)
def _init_cached(lay):
    # jitted: eager init compiles every initialiser separately
    return jax.jit(lay.init)({"params": jax.random.PRNGKey(0)}, _inputs()[0])


def _init(lay, x):
    assert x is _inputs()[0]
    return _init_cached(lay)


def _apply(lay, params, x, mask=None):
    return lay.apply(params, x, mask=mask)


@functools.lru_cache(maxsize=None)
def _jit_apply(lay, causal):
    """Jitted (params, x, mask) -> (y, aux, y of `scan` from a fresh state or None), one compile per layer."""
    def fn(params, x, mask):
        y, aux = lay.apply(params, x, mask=mask)
        y_scan = None
        if causal and hasattr(lay, "scan"):
            state = lay.apply(params, x.shape[0], method="init_state")
            y_scan = lay.apply(params, x, state, mask=mask, method="scan")[0]
        return y, aux, y_scan
    return jax.jit(fn)


def _frozen(options):
    return tuple(sorted(options.items()))


def _fill(x, where, bad):
    """x with `bad` wherever `where` is False (numpy, x's dtype)."""
    return np.where(where, x, bad).astype(x.dtype)


@pytest.mark.parametrize("name,causal,options", CASES, ids=IDS)
def test_shapes_aux_and_jit(name, causal, options):
    lay = _layer(name, causal, options)
    x, mask = _inputs()
    params = _init(lay, x)
    y, aux = _apply(lay, params, x, mask)
    assert y.shape == (B, T, E) and y.dtype == jnp.float32
    assert isinstance(aux, dict)
    for key, value in aux.items():
        if key.startswith("loss/"):
            assert jnp.shape(value) == (), key
    y_jit, aux_jit, _ = _jit_apply(lay, causal)(params, x, mask)
    assert_forms_agree({"eager": (y, aux), "jit": (y_jit, aux_jit)}, **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("name,causal,options", CASES, ids=IDS)
def test_padding_changes_nothing_valid(name, causal, options, bad):
    lay = _layer(name, causal, options)
    x, mask = _inputs()
    params = _init(lay, x)
    # Both runs through one compiled program (that of test_shapes_aux_and_jit), so they are comparable bit for bit.
    fn = _jit_apply(lay, causal)
    y, aux, y_scan = fn(params, x, mask)
    y_bad, aux_bad, y_scan_bad = fn(params, _fill(x, mask[..., None], bad), mask)
    valid = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y)[valid])
    for key in aux:
        if key.startswith("loss/"):
            np.testing.assert_array_equal(np.asarray(aux_bad[key]), np.asarray(aux[key]), err_msg=key)
    if y_scan is not None:
        np.testing.assert_array_equal(np.asarray(y_scan_bad)[valid], np.asarray(y_scan)[valid])


CAUSAL = [c for c in CASES if c[1]]
CAUSAL_IDS = [i for i, c in zip(IDS, CASES) if c[1]]


@functools.lru_cache(maxsize=None)
def _all_forms_fn(name, options):
    """Jitted (params, x) -> {form: y}: every causal form in one program, compiled once per layer."""
    options = dict(options)
    lay = _layer(name, True, options)
    chunked = (None if name == "softmax" or not _recurrent(name) or "chunk_size" not in attention.options(name)
               else _layer(name, True, options, chunk_size=3))

    def fn(params, x):
        out = {"parallel": _apply(lay, params, x)[0]}
        if chunked is not None:
            out["chunked(3)"] = _apply(chunked, params, x)[0]
        if not _recurrent(name):
            return out
        state = lay.apply(params, B, method="init_state")
        out["scan"] = lay.apply(params, x, state, method="scan")[0]
        if hasattr(lay, "prefill"):   # two prompts, the second from the first's final state
            out["prefill"] = _prefill_twice(lay, params, x, getattr(lay, "use_rotary", False))
        ys = []
        for t in range(T):
            y_t, state = lay.apply(params, state, x[:, t], method="step")
            ys.append(y_t)
        out["step"] = jnp.stack(ys, axis=1)
        return out
    return jax.jit(fn)


def _prefill_twice(lay, params, x, rotary=False, axis=1, **kw):
    """`prefill` of x's first half from no state, then of the rest from its final state, outputs joined."""
    half = x.shape[1] // 2
    positions = lambda lo, hi: {"positions": jnp.arange(lo, hi)} if rotary else {}   # noqa: E731
    y1, state = lay.apply(params, x[:, :half], None, method="prefill", **positions(0, half),
                          **{k: v[:, :half] for k, v in kw.items()})
    y2, _ = lay.apply(params, x[:, half:], state, method="prefill", **positions(half, x.shape[1]),
                      **{k: v[:, half:] for k, v in kw.items()})
    return jnp.concatenate([y1, y2], axis=axis)


def _all_forms(name, options, x, params):
    return _all_forms_fn(name, _frozen(options))(params, x)


@pytest.mark.parametrize("name,causal,options", [c for c in CAUSAL if _recurrent(c[0])],
                         ids=[i for i, c in zip(CAUSAL_IDS, CAUSAL) if _recurrent(c[0])])
def test_causal_forms_agree(name, causal, options):
    x, _ = _inputs()
    params = _init(_layer(name, True, options), x)
    assert_forms_agree(_all_forms(name, options, x, params), **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("name,causal,options", CAUSAL, ids=CAUSAL_IDS)
def test_future_changes_nothing_past(name, causal, options, bad):
    x, _ = _inputs()
    params = _init(_layer(name, True, options), x)
    clean = _all_forms(name, options, x, params)
    x_bad = x.copy()
    x_bad[:, FUTURE] = bad
    dirty = _all_forms(name, options, x_bad, params)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(dirty[form])[:, :FUTURE],
                                      np.asarray(clean[form])[:, :FUTURE], err_msg=form)


@pytest.mark.parametrize("name,causal,options", CASES, ids=IDS)
def test_bf16_compute_close_to_float32(name, causal, options):
    x, mask = _inputs()
    params = _init(_layer(name, causal, options), x)
    y32, _, _ = _jit_apply(_layer(name, causal, options), causal)(params, x, mask)
    y16, _, _ = _jit_apply(_layer(name, causal, options, dtype=jnp.bfloat16), False)(params, x, mask)
    assert y16.dtype == jnp.bfloat16
    valid = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(y16, np.float32)[valid], np.asarray(y32)[valid], **BF16)


# ---------------------------------------------------------------------------------------------
# The two attention layers with extra inputs: the Cross-Graph layer (an encoder memory) and the
# VAR chain (every layer's output, [L, B, T, H, D]). Same checks, through small adapters.
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _memory():
    memory = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (B, 1 + 6, E)))   # one global + 6 nodes
    memory_mask = np.arange(7)[None, :] < np.array([[7], [5]])
    memory.flags.writeable = memory_mask.flags.writeable = False
    return memory, memory_mask


def _cross(dtype=jnp.float32):
    from htgn_jax import CrossGraphAttention
    return CrossGraphAttention(num_heads=HEADS, head_dim=E // HEADS, window=1, num_global=1,
                               out_features=E, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _cross_params():
    return jax.jit(_cross().init)(jax.random.PRNGKey(0), _inputs()[0], _memory()[0])


@functools.lru_cache(maxsize=None)
def _cross_jit(lay):
    return jax.jit(lambda params, x, memory, mask, memory_mask:
                   lay.apply(params, x, memory, mask=mask, memory_mask=memory_mask))


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
def test_cross_graph_contract(bad):
    x, mask = _inputs()
    memory, memory_mask = _memory()
    lay = _cross()
    params = _cross_params()

    def run(lay, x, memory):
        return _cross_jit(lay)(params, x, memory, mask, memory_mask)
    y, aux = lay.apply(params, x, memory, mask=mask, memory_mask=memory_mask)
    assert y.shape == (B, T, E) and isinstance(aux, dict)
    assert all(jnp.shape(v) == () for k, v in aux.items() if k.startswith("loss/"))
    y_jit, aux_jit = run(lay, x, memory)
    assert_forms_agree({"eager": (y, aux), "jit": (y_jit, aux_jit)}, **F32_SIMPLE)
    # The padded run against the jitted clean one: the same compiled program.
    y_bad, aux_bad = run(lay, _fill(x, mask[..., None], bad), _fill(memory, memory_mask[..., None], bad))
    valid = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y_jit)[valid])
    for key in aux:
        if key.startswith("loss/"):
            np.testing.assert_array_equal(np.asarray(aux_bad[key]), np.asarray(aux_jit[key]), err_msg=key)
    y16, _ = run(_cross(jnp.bfloat16), x, memory)
    np.testing.assert_allclose(np.asarray(y16, np.float32)[valid], np.asarray(y)[valid], **BF16)


def _chain(**kw):
    from samovar_jax import VARChain
    return VARChain(width=E, num_heads=HEADS, num_layers=2, **kw)


@functools.lru_cache(maxsize=None)
def _chain_forms_fn(masked):
    """Jitted (params, x, mask) -> {form: o} for the chain, compiled once per mask use."""
    def fn(params, x, mask):
        mask = mask if masked else None
        out = {"parallel": _chain().apply(params, x, mask=mask)[0],
               "chunked(3)": _chain(chunk_size=3).apply(params, x, mask=mask)[0]}
        lay = _chain()
        state = lay.apply(params, B, method="init_state")
        out["scan"] = lay.apply(params, x, state, mask=mask, method="scan")[0]
        out["prefill"] = _prefill_twice(lay, params, x, axis=2, **({} if mask is None else {"mask": mask}))
        if mask is None:
            ys = []
            for t in range(T):
                y_t, state = lay.apply(params, state, x[:, t], method="step")
                ys.append(y_t)
            out["step"] = jnp.stack(ys, axis=2)     # [L, B, T, H, D]
        return out
    return jax.jit(fn)


def _chain_forms(x, params, mask=None):
    return _chain_forms_fn(mask is not None)(params, x, _inputs()[1] if mask is None else mask)


@functools.lru_cache(maxsize=None)
def _chain_jit(lay):
    return jax.jit(lambda p, x: lay.apply(p, x)[0])


def test_an_empty_sequence_is_refused_by_every_layer_and_form():
    """T = 0 is one clear ValueError in every form, not an IndexError or ZeroDivisionError from
    inside a kernel (as some forms raised) nor a made-up output (as others returned)."""
    x, mask = _inputs()
    message = "must hold at least one token, got shape (2, 0, 16)"
    for name, causal, options in CASES + [("var_chain", True, {})]:
        lay = _chain() if name == "var_chain" else _layer(name, causal, options)
        params = _init(lay, x)
        forms = {"call": {}}
        if causal and (name == "var_chain" or "chunk_size" in attention.options(name)):
            forms["chunked"] = dict(chunk_size=3)
        if causal and (name == "var_chain" or _recurrent(name)):
            forms["scan"] = dict(method="scan")
        for kw in forms.values():
            layer = lay.clone(chunk_size=kw.pop("chunk_size")) if "chunk_size" in kw else lay
            with pytest.raises(ValueError, match=re.escape(message)):
                layer.apply(params, x[:, :0], mask=mask[:, :0], **kw)
    chain_params = _init(_chain(), x)
    with pytest.raises(ValueError, match=re.escape(message)):
        _chain().apply(chain_params, x[:, :0], method="layer_outputs")


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
def test_var_chain_contract(bad):
    x, mask = _inputs()
    params = _init(_chain(), x)
    y, aux = _chain().apply(params, x)
    assert y.shape == (2, B, T, HEADS, E // HEADS) and isinstance(aux, dict)
    assert_forms_agree({"eager": y, "jit": _chain_jit(_chain())(params, x)}, **F32_SIMPLE)
    clean = _chain_forms(x, params)
    assert_forms_agree(clean, **F32_SIMPLE)
    x_bad = x.copy()
    x_bad[:, FUTURE] = bad
    dirty = _chain_forms(x_bad, params)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(dirty[form])[:, :, :FUTURE],
                                      np.asarray(clean[form])[:, :, :FUTURE], err_msg=form)
    clean = _chain_forms(x, params, mask)
    dirty = _chain_forms(_fill(x, mask[..., None], bad), params, mask)
    valid = np.asarray(mask)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(dirty[form])[:, valid], np.asarray(clean[form])[:, valid],
                                      err_msg=form)
    # The chain's sums have no normaliser: here they reach |y| ~ 120 beside entries near 0, and
    # rounding only the inputs to bf16 (float32 compute) already moves such entries by more than
    # BF16's elementwise bound (measured: 34 of 448 entries). So the bf16 run is held to the BF16
    # tolerance relative to the output's scale, the error any bf16 rounding of the inputs implies.
    y16 = np.asarray(_chain_jit(_chain(dtype=jnp.bfloat16))(params, x), np.float32)
    scale = np.max(np.abs(np.asarray(y)))
    assert np.max(np.abs(y16 - np.asarray(y))) <= BF16["rtol"] * scale, np.max(np.abs(y16 - np.asarray(y))) / scale


# ---------------------------------------------------------------------------------------------
# The forms `zoo_core.attention.make` adds to the layers': cross-attention in the MHDPA call style
# for every mechanism with a cross form, and linear attention's global (non-causal) self form.
# Same checks: jit == eager, padding holding NaN or 1e30 changes no valid output, bf16 close.
# ---------------------------------------------------------------------------------------------

DROPIN = [("cross", n) for n in attention.names("cross")] + [("self", "linear")]
# The Cross-Graph memory as HTGN lays it out (and as test_cross_graph_contract holds it to BF16):
# one global node, then the tokens.
DROPIN_OPTIONS = {"favor": {"num_features": 8}, "cross_graph": {"window": 1, "num_global": 1}}


@functools.lru_cache(maxsize=None)
def _dropin(role, name, dtype=jnp.float32):
    """(module, jitted (params, x, memory, mask) -> y) of a drop-in, compiled once."""
    attn = attention.make(name, num_heads=HEADS, qkv_features=E, dtype=dtype, **DROPIN_OPTIONS.get(name, {}))
    if role == "cross":
        return attn, jax.jit(lambda p, x, memory, mask: attn.apply(p, x, memory, mask=mask))
    return attn, jax.jit(lambda p, x, memory, mask: attn.apply(p, x, mask=mask))


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("role,name", DROPIN, ids=[f"{r}-{n}" for r, n in DROPIN])
def test_dropin_forms_contract(role, name, bad):
    x, mask = _inputs()
    memory, memory_mask = _memory()
    attn, fn = _dropin(role, name)
    if role == "cross":
        keys, key_mask = memory, memory_mask
        params = jax.jit(attn.init)(jax.random.PRNGKey(0), x, memory, mask=memory_mask)
        valid = np.ones((B, T), bool)     # every query is valid; the memory is padded
    else:
        keys, key_mask = x, mask
        params = jax.jit(attn.init)(jax.random.PRNGKey(0), x, mask=mask)
        valid = np.asarray(mask)
    y = fn(params, x, memory, key_mask)
    assert y.shape == (B, T, E) and y.dtype == jnp.float32
    args = (x, memory) if role == "cross" else (x,)
    eager = attn.apply(params, *args, mask=key_mask)
    assert_forms_agree({"jit": y, "eager": eager}, **F32_SIMPLE)
    dirty = _fill(keys, key_mask[..., None], bad)
    y_bad = fn(params, x, dirty, key_mask) if role == "cross" else fn(params, dirty, memory, key_mask)
    np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y)[valid])
    y16 = _dropin(role, name, jnp.bfloat16)[1](params, x, memory, key_mask)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32)[valid], np.asarray(y)[valid], **BF16)
