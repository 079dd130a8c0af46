"""Tests of htgn_jax.layers.FavorAttention (htgn.md §5.4, §5.14 items 2, 9, 10)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax import LinearState, ops
from htgn_jax.layers import FavorAttention
from zoo_core.testing import BF16, F32_SIMPLE, assert_forms_agree, param_shapes

B, T, H, D, M = 2, 7, 2, 4, 8
E = H * D


def _x(seed=0, length=T, width=E):
    return _x_cached(seed, length, width).copy()


@functools.lru_cache(maxsize=None)
def _x_cached(seed, length, width):
    # numpy: slicing and editing the inputs then compiles nothing
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (B, length, width)))


def _layer(**kw):
    kw = {"num_heads": H, "head_dim": D, "use_rotary": True, **kw}
    if kw.get("feature_map", "softmax") == "softmax":
        kw.setdefault("num_features", M)
    return FavorAttention(**kw)


@functools.lru_cache(maxsize=None)
def _init(**kw):
    layer = _layer(**kw)
    return layer, jax.jit(layer.init)(jax.random.PRNGKey(1), _x())


@functools.lru_cache(maxsize=None)
def _jitted_apply(layer):
    # Layers are hashable by value, so equal layers share one jitted apply (and its compiles).
    return jax.jit(lambda *a, **k: layer.apply(*a, **k),
                   static_argnames=("method", "mutable", "deterministic"))


def _apply(layer, *args, **kwargs):
    """layer.apply under jit: one compile per shape instead of op-by-op dispatch."""
    return _jitted_apply(layer)(*args, **kwargs)


def _y(layer, *args, **kwargs):
    """The output of `__call__` (its aux is {} for FAVOR+)."""
    y, aux = _apply(layer, *args, **kwargs)
    assert aux == {}
    return y


# ------------------------------------------------------------------------------------------
# Memory linearity (reusable helper)
# ------------------------------------------------------------------------------------------


def compiled_temp_bytes(fn, *args) -> int:
    """Temporary buffer bytes of `jax.jit(fn)` compiled for `args` (arrays or ShapeDtypeStructs).

    Nothing is executed or allocated, so long sequences are cheap to check.
    """
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def assert_memory_at_most_linear(make_args, fn, *, n_small=1024, n_large=8192, slack=1.5):
    """Asserts temp memory grows at most ~linearly from n_small to n_large (ratio < r * slack).

    Args:
      make_args: n -> tuple of arguments (use `jax.ShapeDtypeStruct` for the inputs).
      fn: the function to compile.
      n_small, n_large: the two sequence lengths.
      slack: allowance for constant-size buffers and padding.

    Returns:
      The measured ratio (for negative controls).
    """
    small = compiled_temp_bytes(fn, *make_args(n_small))
    large = compiled_temp_bytes(fn, *make_args(n_large))
    ratio = large / max(small, 1)
    assert ratio < (n_large / n_small) * slack, (small, large, ratio)
    return ratio


@pytest.mark.parametrize("causal", [False, True])
def test_memory_grows_linearly(causal):
    layer, variables = _init(causal=causal, chunk_size=64 if causal else None)
    abstract = jax.eval_shape(lambda: variables)
    make_args = lambda n: (abstract, jax.ShapeDtypeStruct((1, n, E), jnp.float32))
    assert_memory_at_most_linear(make_args, layer.apply)
    if not causal:  # negative control: the quadratic oracle must fail the same check
        exact = _layer(feature_map="exact")
        with pytest.raises(AssertionError):
            assert_memory_at_most_linear(
                lambda n: ({"params": abstract["params"]},
                           jax.ShapeDtypeStruct((1, n, E), jnp.float32)), exact.apply)


# ------------------------------------------------------------------------------------------
# Parameters, dtypes
# ------------------------------------------------------------------------------------------


def test_param_snapshot():
    _, variables = _init()
    proj = {"kernel": (E, H, D), "bias": (H, D)}
    want = {f"{n}/{p}": s for n in ("query", "key", "value") for p, s in proj.items()}
    want.update({"out/kernel": (H, D, E), "out/bias": (E,)})
    assert param_shapes(variables["params"]) == want
    assert param_shapes(variables["random_features"]) == {"projection": (M, D)}
    assert set(variables) == {"params", "random_features"}
    relu = jax.eval_shape(_layer(feature_map="relu", out_features=5).init,
                          jax.random.PRNGKey(1), _x())
    assert set(relu) == {"params"}
    assert param_shapes(relu["params"])["out/kernel"] == (H, D, 5)


def test_dtype_policy():
    layer, variables = _init(causal=True, chunk_size=3)
    half = _layer(causal=True, chunk_size=3, dtype=jnp.bfloat16)
    x = _x()
    y32 = _y(layer, variables, x)
    y16 = _y(half, variables, x)
    assert y32.dtype == jnp.float32 and y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, **BF16)
    bf_vars = jax.eval_shape(half.init, jax.random.PRNGKey(1), x)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(bf_vars))
    ys, state = jax.eval_shape(functools.partial(half.apply, method="scan"), variables, x)
    assert ys.dtype == jnp.bfloat16
    assert isinstance(state, LinearState) and state.num.dtype == state.den.dtype == jnp.float32
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({**variables, "params": p}, x)[0] ** 2)))(
        variables["params"])
    assert all(bool(np.all(np.isfinite(g))) and float(np.max(np.abs(g))) > 0
               for g in map(np.asarray, jax.tree.leaves(grads)))


# ------------------------------------------------------------------------------------------
# Forms agree on one parameter tree; causality; padding
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_causal_forms_agree(feature_map):
    """parallel (chunk_size None) == chunked (C = 3, not dividing T) == scan == step loop."""
    layer, variables = _init(causal=True, feature_map=feature_map)
    x = _x(seed=2)
    ys, final = _apply(layer, variables, x, method="scan")

    @jax.jit
    def decode(variables, x):
        state = layer.apply(variables, B, method="init_state")
        outs = []
        for t in range(T):
            y_t, state = layer.apply(variables, state, x[:, t], position=t, method="step")
            outs.append(y_t)
        return jnp.stack(outs, 1), state

    yd, state = decode(variables, x)
    chunked = _layer(causal=True, chunk_size=3, feature_map=feature_map)
    assert_forms_agree({"parallel": _y(layer, variables, x), "chunked(3)": _y(chunked, variables, x),
                        "scan": ys, "step": yd}, **F32_SIMPLE)
    assert_forms_agree({"scan": final, "step": state}, **F32_SIMPLE)
    # Continuing a scan from a carried state (positions continue too).
    y1, s1 = _apply(layer, variables, x[:, :3], method="scan")
    y2, s2 = _apply(layer, variables, x[:, 3:], s1, positions=np.arange(3, T), method="scan")
    assert_forms_agree({"parallel": _y(layer, variables, x),
                        "scan+scan": np.concatenate([y1, y2], 1)}, **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("causal", [False, True])
def test_garbage_in_padding_or_future_changes_nothing(causal, bad):
    """NaN-safe masking: padded positions and (causal) future positions holding NaN or 1e30."""
    layer, variables = _init(causal=causal, chunk_size=3 if causal else None)
    x = _x(seed=12)
    mask = np.arange(T)[None, :] < np.array([[T], [4]])
    dirty = np.where(mask[..., None], x, np.float32(bad))
    valid = mask
    forms = {"call": lambda x, m: _y(layer, variables, x, mask=m)}
    if causal:
        forms["parallel"] = lambda x, m: _y(_layer(causal=True), variables, x, mask=m)
        forms["scan"] = lambda x, m: _apply(layer, variables, x, mask=m, method="scan")[0]
    for name, run in forms.items():
        np.testing.assert_array_equal(np.asarray(run(dirty, mask))[valid],
                                      np.asarray(run(x, mask))[valid], err_msg=name)
        if causal:
            future = x.copy()
            future[:, 4] = bad
            np.testing.assert_array_equal(np.asarray(run(future, None))[:, :4],
                                          np.asarray(run(x, None))[:, :4], err_msg=name)
    if not causal:   # cross-attention: garbage in padded memory
        cross, cv = _init(use_rotary=False)
        y, _ = _apply(cross, cv, x, x, memory_mask=mask, method="cross")
        y_bad, _ = _apply(cross, cv, x, dirty, memory_mask=mask, method="cross")
        np.testing.assert_array_equal(np.asarray(y_bad), np.asarray(y))


def test_causal_layer_is_exactly_causal():
    layer, variables = _init(causal=True, chunk_size=3)
    x = _x(seed=3)
    cut = 4
    x2 = x.copy()
    x2[:, cut:] = np.float32(5.0) * _x(seed=4)[:, cut:]
    y1, y2 = np.asarray(_y(layer, variables, x)), np.asarray(_y(layer, variables, x2))
    np.testing.assert_array_equal(y1[:, :cut], y2[:, :cut])
    assert not np.allclose(y1[:, cut:], y2[:, cut:])


@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(causal):
    # Spec §5.14 item 9: appending pads does not change the outputs for real tokens.
    layer, variables = _init(causal=causal, chunk_size=3 if causal else None)
    x = _x(seed=5)
    lengths = np.array([7, 4])
    mask = np.arange(T)[None, :] < lengths[:, None]
    y = np.asarray(_y(layer, variables, x, mask=mask))
    padded = np.concatenate([x, np.float32(9.0) * _x(seed=6, length=16 - T)], axis=1)
    mask16 = np.arange(16)[None, :] < lengths[:, None]
    y16 = np.asarray(_y(layer, variables, padded, mask=mask16))
    for b, n in enumerate((7, 4)):
        np.testing.assert_allclose(y16[b, :n], y[b, :n], **F32_SIMPLE)


def test_cross_attention_and_cache():
    layer, variables = _init(use_rotary=False)
    x, memory = _x(seed=7), _x(seed=8, length=16)
    memory_mask = np.arange(16)[None, :] < np.array([[16], [5]])
    y, aux = _apply(layer, variables, x, memory, memory_mask=memory_mask, method="cross")
    y = np.asarray(y)
    assert y.shape == (B, T, E) and aux == {}
    cache = _apply(layer, variables, memory, memory_mask=memory_mask, method="cross_cache")
    step = jax.jit(functools.partial(layer.apply, method="cross_step"))
    steps = np.stack([np.asarray(step(variables, cache, x[:, t])) for t in range(T)], 1)
    np.testing.assert_allclose(steps, y, **F32_SIMPLE)
    # Masked memory equals truncated memory.
    short, _ = _apply(layer, variables, x[1:], memory[1:, :5], method="cross")
    np.testing.assert_allclose(y[1:], short, **F32_SIMPLE)


# ------------------------------------------------------------------------------------------
# Random-feature redraw
# ------------------------------------------------------------------------------------------


def test_feature_redraw_schedule():
    layer, variables = _init(redraw_every=5, projection_seed=3)
    x = _x(seed=9)
    params_only = {"params": variables["params"]}
    frozen = _y(layer, variables, x)
    np.testing.assert_array_equal(_y(layer, variables, x, feature_step=0), frozen)
    np.testing.assert_array_equal(_y(layer, variables, x, feature_step=4, deterministic=False),
                                  frozen)
    np.testing.assert_array_equal(_y(layer, params_only, x), frozen)
    redrawn = _y(layer, variables, x, feature_step=5, deterministic=False)
    assert not np.allclose(redrawn, frozen)
    # With a mutable collection the draw in force is written back, and evaluation without a
    # step then reuses it (frozen at evaluation).
    (y, _), updated = _apply(layer, variables, x, feature_step=7, deterministic=False,
                             mutable="random_features")
    np.testing.assert_array_equal(y, redrawn)
    want = jax.jit(ops.draw_projection, static_argnames=("num_features", "dim", "redraw_every"))(
        jax.random.PRNGKey(3), 7, num_features=M, dim=D, redraw_every=5)
    np.testing.assert_array_equal(updated["random_features"]["projection"], want)
    np.testing.assert_array_equal(_y(layer, {**variables, **updated}, x), redrawn)
