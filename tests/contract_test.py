"""The zoo's layer contract (README "Layer contract"), checked on every attention layer alike.

Shapes and aux keys, jit == eager, every form equal (parallel, chunked, scan, step loop), NaN and
1e30 in padding and in the future change no valid or past output (nor the aux losses), and bf16
compute within the BF16 tolerance of float32.
"""
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
]
IDS = [f"{n}-{'causal' if c else 'full'}" for n, c, _ in CASES]


def _layer(name, causal, options, **extra):
    return attention.layer(name, num_heads=HEADS, qkv_features=E, causal=causal, **{**options, **extra})


def _inputs():
    x = jax.random.normal(jax.random.PRNGKey(3), (B, T, E))
    mask = jnp.arange(T)[None, :] < jnp.array([[T], [T - 3]])
    return x, mask


def _init(lay, x):
    return lay.init({"params": jax.random.PRNGKey(0)}, x)


def _apply(lay, params, x, mask=None):
    return lay.apply(params, x, mask=mask)


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
    y_jit, aux_jit = jax.jit(lambda p, x, m: _apply(lay, p, x, m))(params, x, mask)
    assert_forms_agree({"eager": (y, aux), "jit": (y_jit, aux_jit)}, **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("name,causal,options", CASES, ids=IDS)
def test_padding_changes_nothing_valid(name, causal, options, bad):
    lay = _layer(name, causal, options)
    x, mask = _inputs()
    params = _init(lay, x)
    y, aux = _apply(lay, params, x, mask)
    y_bad, aux_bad = _apply(lay, params, jnp.where(mask[..., None], x, bad), mask)
    valid = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y)[valid])
    for key in aux:
        if key.startswith("loss/"):
            np.testing.assert_array_equal(np.asarray(aux_bad[key]), np.asarray(aux[key]), err_msg=key)
    if causal:
        state = lay.apply(params, B, method="init_state")
        y_scan, _ = lay.apply(params, x, state, mask=mask, method="scan")
        y_scan_bad, _ = lay.apply(params, jnp.where(mask[..., None], x, bad), state, mask=mask,
                                  method="scan")
        np.testing.assert_array_equal(np.asarray(y_scan_bad)[valid], np.asarray(y_scan)[valid])


CAUSAL = [c for c in CASES if c[1]]
CAUSAL_IDS = [i for i, c in zip(IDS, CASES) if c[1]]


def _all_forms(name, options, x, params):
    out = {"parallel": _apply(_layer(name, True, options), params, x)[0]}
    if name != "softmax":
        out["chunked(3)"] = _apply(_layer(name, True, options, chunk_size=3), params, x)[0]
    lay = _layer(name, True, options)
    state = lay.apply(params, B, method="init_state")
    out["scan"] = lay.apply(params, x, state, method="scan")[0]
    ys = []
    for t in range(T):
        y_t, state = lay.apply(params, state, x[:, t], method="step")
        ys.append(y_t)
    out["step"] = jnp.stack(ys, axis=1)
    return out


@pytest.mark.parametrize("name,causal,options", CAUSAL, ids=CAUSAL_IDS)
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
    dirty = _all_forms(name, options, x.at[:, FUTURE].set(bad), params)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(dirty[form])[:, :FUTURE],
                                      np.asarray(clean[form])[:, :FUTURE], err_msg=form)


@pytest.mark.parametrize("name,causal,options", CASES, ids=IDS)
def test_bf16_compute_close_to_float32(name, causal, options):
    x, mask = _inputs()
    params = _init(_layer(name, causal, options), x)
    y32, _ = _apply(_layer(name, causal, options), params, x, mask)
    y16, _ = _apply(_layer(name, causal, options, dtype=jnp.bfloat16), params, x, mask)
    assert y16.dtype == jnp.bfloat16
    valid = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(y16, np.float32)[valid], np.asarray(y32)[valid], **BF16)


# ---------------------------------------------------------------------------------------------
# The two attention layers with extra inputs: the Cross-Graph layer (an encoder memory) and the
# VAR chain (every layer's output, [L, B, T, H, D]). Same checks, through small adapters.
# ---------------------------------------------------------------------------------------------

def _memory():
    memory = jax.random.normal(jax.random.PRNGKey(5), (B, 1 + 6, E))   # one global + 6 nodes
    memory_mask = jnp.arange(7)[None, :] < jnp.array([[7], [5]])
    return memory, memory_mask


def _cross(dtype=jnp.float32):
    from htgn_jax import CrossGraphAttention
    return CrossGraphAttention(num_heads=HEADS, head_dim=E // HEADS, window=1, num_global=1,
                               out_features=E, dtype=dtype)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
def test_cross_graph_contract(bad):
    x, mask = _inputs()
    memory, memory_mask = _memory()
    lay = _cross()
    params = lay.init(jax.random.PRNGKey(0), x, memory)

    def run(lay, x, memory):
        return lay.apply(params, x, memory, mask=mask, memory_mask=memory_mask)
    y, aux = run(lay, x, memory)
    assert y.shape == (B, T, E) and isinstance(aux, dict)
    assert all(jnp.shape(v) == () for k, v in aux.items() if k.startswith("loss/"))
    assert_forms_agree({"eager": (y, aux), "jit": jax.jit(lambda x, m: run(lay, x, m))(x, memory)},
                       **F32_SIMPLE)
    y_bad, aux_bad = run(lay, jnp.where(mask[..., None], x, bad), jnp.where(memory_mask[..., None], memory, bad))
    valid = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y)[valid])
    for key in aux:
        if key.startswith("loss/"):
            np.testing.assert_array_equal(np.asarray(aux_bad[key]), np.asarray(aux[key]), err_msg=key)
    y16, _ = run(_cross(jnp.bfloat16), x, memory)
    np.testing.assert_allclose(np.asarray(y16, np.float32)[valid], np.asarray(y)[valid], **BF16)


def _chain(**kw):
    from samovar_jax import VARChain
    return VARChain(width=E, num_heads=HEADS, num_layers=2, **kw)


def _chain_forms(x, params, mask=None):
    out = {"parallel": _chain().apply(params, x, mask=mask)[0],
           "chunked(3)": _chain(chunk_size=3).apply(params, x, mask=mask)[0]}
    lay = _chain()
    state = lay.apply(params, B, method="init_state")
    out["scan"] = lay.apply(params, x, state, mask=mask, method="scan")[0]
    if mask is None:
        ys = []
        for t in range(T):
            y_t, state = lay.apply(params, state, x[:, t], method="step")
            ys.append(y_t)
        out["step"] = jnp.stack(ys, axis=2)     # [L, B, T, H, D]
    return out


def test_an_empty_sequence_is_refused_by_every_layer_and_form():
    """T = 0 is one clear ValueError in every form, not an IndexError or ZeroDivisionError from
    inside a kernel (as some forms raised) nor a made-up output (as others returned)."""
    x, mask = _inputs()
    message = "must hold at least one token, got shape (2, 0, 16)"
    for name, causal, options in CASES + [("var_chain", True, {})]:
        lay = _chain() if name == "var_chain" else _layer(name, causal, options)
        params = _init(lay, x)
        forms = {"call": dict(), "chunked": dict(chunk_size=3), "scan": dict(method="scan")} if causal else {"call": {}}
        for form, kw in forms.items():
            layer = lay.clone(chunk_size=kw.pop("chunk_size")) if "chunk_size" in kw else lay
            with pytest.raises(ValueError, match=re.escape(message)):
                layer.apply(params, x[:, :0], mask=mask[:, :0], **kw)
    chain_params = _init(_chain(), x)
    with pytest.raises(ValueError, match=re.escape(message)):
        _chain().apply(chain_params, x[:, :0], method="layer_outputs")


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
def test_var_chain_contract(bad):
    x, mask = _inputs()
    params = _chain().init(jax.random.PRNGKey(0), x)
    y, aux = _chain().apply(params, x)
    assert y.shape == (2, B, T, HEADS, E // HEADS) and isinstance(aux, dict)
    assert_forms_agree({"eager": y, "jit": jax.jit(lambda p, x: _chain().apply(p, x)[0])(params, x)},
                       **F32_SIMPLE)
    clean = _chain_forms(x, params)
    assert_forms_agree(clean, **F32_SIMPLE)
    dirty = _chain_forms(x.at[:, FUTURE].set(bad), params)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(dirty[form])[:, :, :FUTURE],
                                      np.asarray(clean[form])[:, :, :FUTURE], err_msg=form)
    clean = _chain_forms(x, params, mask)
    dirty = _chain_forms(jnp.where(mask[..., None], x, bad), params, mask)
    valid = np.asarray(mask)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(dirty[form])[:, valid], np.asarray(clean[form])[:, valid],
                                      err_msg=form)
    # The chain's sums have no normaliser: here they reach |y| ~ 120 beside entries near 0, and
    # rounding only the inputs to bf16 (float32 compute) already moves such entries by more than
    # BF16's elementwise bound (measured: 34 of 448 entries). So the bf16 run is held to the BF16
    # tolerance relative to the output's scale, the error any bf16 rounding of the inputs implies.
    y16 = np.asarray(_chain(dtype=jnp.bfloat16).apply(params, x)[0], np.float32)
    scale = np.max(np.abs(np.asarray(y)))
    assert np.max(np.abs(y16 - np.asarray(y))) <= BF16["rtol"] * scale, np.max(np.abs(y16 - np.asarray(y))) / scale
