"""`zoo_core.attention`: every mechanism drops into a foreign pre-LN Transformer block and trains."""
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zoo_core import attention, testing

B, T, E, HEADS = 2, 7, 16, 2

# (name, causal, options): every mode each mechanism has, with small options where the defaults are
# sized for real models.
CASES = [
    ("agf", False, {}),
    ("agf", True, {}),
    ("agf", True, {"chunk_size": 3}),
    ("softmax", False, {}),
    ("softmax", True, {}),
    ("favor", False, {"num_features": 8}),
    ("favor", True, {"num_features": 8, "chunk_size": 3}),
    ("window_graph", False, {"window": 2, "kl_weight": 1e-3}),
    ("window_graph", True, {"window": 2}),
    ("linear", True, {}),
    ("linear", False, {}),
    ("linformer", False, {"max_length": T, "proj_len": 4}),
    ("nystromformer", False, {"num_landmarks": 3}),
]


class ForeignBlock(nn.Module):
    """A pre-LN Transformer block as a user would write it (not the zoo's): LN, attention,
    residual, LN, MLP with dropout, residual, a per-token linear read-out `[B, T]`."""
    name_: str
    causal: bool
    options: tuple

    @nn.compact
    def __call__(self, x, mask=None, train=False):
        attn = attention.make(self.name_, num_heads=HEADS, qkv_features=E, causal=self.causal,
                              **dict(self.options))
        x = x + attn(nn.LayerNorm()(x), mask=mask, deterministic=not train)
        h = nn.Dense(2 * E)(nn.LayerNorm()(x))
        h = nn.Dropout(0.1)(nn.gelu(h), deterministic=not train)
        x = x + nn.Dense(E)(h)
        return nn.Dense(1)(x)[..., 0]


@functools.lru_cache(maxsize=None)
def _data():
    # numpy, drawn once: each eager op on them would compile per shape
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = np.asarray(jax.random.normal(kx, (B, T, E)))
    mask = np.arange(T)[None, :] < np.array([[T], [T - 2]])
    return x, mask, np.asarray(jax.random.normal(ky, (B, T)))


def test_names():
    assert {"agf", "favor", "window_graph", "linear", "softmax"} <= set(attention.names())
    assert attention.names() == tuple(sorted(attention.names()))


@pytest.mark.parametrize("name,causal,options", CASES, ids=[f"{n}-{'causal' if c else 'full'}-{len(o)}"
                                                            for n, c, o in CASES])
def test_foreign_block_jit_eager_dropout_and_optax(name, causal, options):
    x, mask, target = _data()
    model = ForeignBlock(name, causal, tuple(sorted(options.items())))
    variables = jax.jit(model.init)({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x, mask)
    params = variables["params"]

    # eager == jit, with and without dropout keys
    def fwd(p, train, key, x=x):
        out, state = model.apply({"params": p}, x, mask, train=train, rngs={"dropout": key},
                                 mutable=["losses"])
        return out, sum(jax.tree_util.tree_leaves(state.get("losses", {})), jnp.zeros(()))
    key = jax.random.PRNGKey(2)
    # Both modes jitted in one program (one compile instead of two).
    both = jax.jit(lambda p, key: (fwd(p, False, key), fwd(p, True, key)))
    jitted = dict(zip((False, True), both(params, key)))
    eager = {}
    for train in (False, True):
        eager[train] = fwd(params, train, key)
        np.testing.assert_allclose(np.asarray(eager[train][0]), np.asarray(jitted[train][0]),
                                   rtol=1e-5, atol=1e-5)
        assert np.all(np.isfinite(np.asarray(eager[train][0])))
    if name == "agf" or options.get("kl_weight"):   # the orthogonality term, the graph KL
        assert float(eager[False][1]) != 0.0

    # padding holding NaN changes nothing valid (eager, the clean run being the one above)
    dirty = np.where(mask[:, :, None], x, np.float32(np.nan))
    clean_out = eager[False][0]
    dirty_out = fwd(params, False, key, x=dirty)[0]
    np.testing.assert_array_equal(np.asarray(dirty_out)[mask], np.asarray(clean_out)[mask])

    # trains with optax, the collected losses included
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def train_step(p, opt, key):
        def loss_fn(p):
            out, aux = fwd(p, True, key)
            err = jnp.where(mask, (out - target) ** 2, 0.0)
            return jnp.sum(err) / jnp.sum(mask) + aux
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss
    losses = []
    for i in range(15):
        params, opt, loss = train_step(params, opt, jax.random.PRNGKey(10 + i))
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


def test_layer_returns_the_contract_layer():
    lay = attention.layer("agf", num_heads=HEADS, qkv_features=E, causal=True)
    x, mask, _ = _data()
    params = jax.jit(lay.init)(jax.random.PRNGKey(0), x)

    @jax.jit   # every call in one program: eagerly each op compiles on its own
    def calls(params, x, mask):
        state = lay.apply(params, B, method="init_state")
        return lay.apply(params, x, mask=mask), lay.apply(params, x, state, method="scan")[0], lay.apply(params, x)[0]
    (y, aux), y_scan, y_plain = calls(params, x, mask)
    assert y.shape == (B, T, E) and isinstance(aux, dict)
    np.testing.assert_allclose(np.asarray(y_scan), np.asarray(y_plain), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Capabilities, Flax's decode convention, cross-attention in the MHDPA call style.
# ---------------------------------------------------------------------------------------------

S = 5   # memory length of the cross-attention tests
SMALL = {"favor": {"num_features": 8}, "window_graph": {"window": 2}, "cross_graph": {"window": 1}}


def test_capabilities_say_which_mechanism_fits_which_role():
    assert attention.names("cross") == ("cross_graph", "favor", "linear", "softmax")
    assert attention.names("causal", "decode") == ("agf", "favor", "linear", "longformer", "softmax", "window_graph")
    assert "longformer" in attention.names("context_parallel") and "reformer" not in attention.names("decode")
    assert attention.names("self") == ("agf", "favor", "linear", "linformer", "longformer", "nystromformer",
                                       "reformer", "softmax", "window_graph")
    assert attention.names("causal") == ("agf", "favor", "linear", "longformer", "reformer", "softmax",
                                         "window_graph")
    assert attention.names() == attention.names(*())
    for name in attention.names():
        caps = attention.capabilities(name)
        assert tuple(caps) == attention.CAPABILITIES
        for cap, has in caps.items():
            assert (name in attention.names(cap)) == has


def assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _decode_run(name, options, dtype, length):
    """(teacher-forced causal y, token-by-token y, the cache after init) for one mechanism."""
    kw = dict(num_heads=HEADS, qkv_features=E, causal=True, dtype=dtype, **options)
    dec, full = attention.make(name, decode=True, **kw), attention.make(name, **kw)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, length, E)), dtype)
    variables = jax.jit(dec.init)(jax.random.PRNGKey(0), x)
    params, cache = variables["params"], variables["cache"]
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        jax.eval_shape(full.init, jax.random.PRNGKey(0), x)["params"])   # one parameter tree

    def tokens(params, cache, x):
        def body(cache, x_t):
            y_t, state = dec.apply({"params": params, "cache": cache}, x_t[:, None], mutable=["cache"])
            return state["cache"], y_t[:, 0]
        cache, ys = jax.lax.scan(body, cache, jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(ys, 0, 1), cache["cache_index"]
    ys, index = jax.jit(tokens)(params, cache, x)
    assert int(index) == length
    return jax.jit(full.apply)({"params": params}, x), ys, params, cache


DECODE_CASES = [(n, {**SMALL.get(n, {})}) for n in attention.names("causal", "decode")] + [
    ("favor", {"num_features": 8, "use_rotary": True})]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,options", DECODE_CASES, ids=[f"{n}-{len(o)}" for n, o in DECODE_CASES])
def test_decode_token_by_token_equals_the_causal_call(name, options, dtype):
    y, ys, params, cache = _decode_run(name, options, dtype, T)
    assert ys.dtype == y.dtype == dtype and ys.shape == y.shape == (B, T, E)
    tol = testing.F32_SIMPLE if dtype == jnp.float32 else testing.BF16
    np.testing.assert_allclose(np.asarray(ys, np.float32), np.asarray(y, np.float32), **tol)
    # The cache is the layer's own State, as `init_state` makes it: O(1) in the length, except
    # softmax's key/value cache of L slots.
    state = cache["state"]
    lay = attention.layer(name, num_heads=HEADS, qkv_features=E, causal=True, **options,
                          **({"max_length": T} if name == "softmax" else {}))
    own = lay.apply({"params": params["attention"]}, B, method="init_state")
    assert_trees_equal(state, own)
    longer = jax.eval_shape(attention.make(name, num_heads=HEADS, qkv_features=E, causal=True, decode=True,
                                           **options).init, jax.random.PRNGKey(0), jnp.zeros((B, 3 * T, E)))
    shapes = [np.shape(a) for a in jax.tree_util.tree_leaves(state)]
    shapes_3t = [a.shape for a in jax.tree_util.tree_leaves(longer["cache"]["state"])]
    if name == "softmax":
        assert state.key.shape[1] == T and longer["cache"]["state"].key.shape[1] == 3 * T
    else:
        assert shapes == shapes_3t
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.dtype in (jnp.float32, jnp.int32, jnp.bool_)


@functools.lru_cache(maxsize=None)
def _memory():
    rng = np.random.default_rng(7)
    memory = rng.normal(size=(B, S, E)).astype(np.float32)
    memory_mask = np.arange(S)[None, :] < np.array([[S], [S - 2]])
    return memory, memory_mask


CROSS = attention.names("cross")


@pytest.mark.parametrize("name", CROSS)
def test_cross_attention_in_the_mhdpa_call_style(name):
    x, _, _ = _data()
    memory, memory_mask = _memory()
    attn = attention.make(name, num_heads=HEADS, qkv_features=E, out_features=E + 1, **SMALL.get(name, {}))
    params = jax.jit(attn.init)(jax.random.PRNGKey(0), x, memory, mask=memory_mask)
    fn = jax.jit(lambda p, x, m: attn.apply(p, x, m, mask=memory_mask))
    y = fn(params, x, memory)
    assert y.shape == (B, T, E + 1) and np.all(np.isfinite(np.asarray(y)))
    others = jax.jit(lambda p, x, m: (attn.apply(p, x, inputs_kv=m, mask=memory_mask),
                                      attn.apply(p, x, m, m, mask=memory_mask)))(params, x, memory)
    for other in others:
        np.testing.assert_allclose(np.asarray(other), np.asarray(y), **testing.F32_SIMPLE)
    # a memory of another length and width than the queries
    wide = np.concatenate([memory, memory], axis=1)[..., :E - 4]
    y_wide = jax.jit(attn.clone().init_with_output)(jax.random.PRNGKey(0), x, wide,
                                                    mask=np.concatenate([memory_mask, memory_mask], 1))[0]
    assert y_wide.shape == (B, T, E + 1)


@pytest.mark.parametrize("name", CROSS)
def test_cross_decode_step_by_step_equals_the_full_call(name):
    """A decoder's cross-attention with decode=True: the query at step t sits at position t
    (the Cross-Graph layer centres its window there); the others read no position."""
    x, _, _ = _data()
    memory, memory_mask = _memory()
    kw = dict(num_heads=HEADS, qkv_features=E, **SMALL.get(name, {}))
    full, dec = attention.make(name, **kw), attention.make(name, decode=True, **kw)
    variables = jax.jit(lambda: dec.init(jax.random.PRNGKey(0), x, memory, mask=memory_mask))()
    y = jax.jit(lambda p: full.apply({"params": p}, x, memory, mask=memory_mask))(variables["params"])

    def tokens(variables):
        def body(cache, x_t):
            y_t, state = dec.apply({"params": variables["params"], "cache": cache}, x_t[:, None], memory,
                                   mask=memory_mask, mutable=["cache"])
            return state["cache"], y_t[:, 0]
        return jnp.swapaxes(jax.lax.scan(body, variables["cache"], jnp.swapaxes(x, 0, 1))[1], 0, 1)
    np.testing.assert_allclose(np.asarray(jax.jit(tokens)(variables)), np.asarray(y), **testing.F32_SIMPLE)


def test_noncausal_linear_attention_kernel(x64):
    """`linear_attention.noncausal` against the explicit sum over keys, NaN-safe padding, and its
    float64 gradients."""
    from jax.test_util import check_grads

    from zoo_core.ops import linear_attention as la
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(B, t, HEADS, d)) for t, d in ((T, 4), (S, 4), (S, 3)))
    _, memory_mask = _memory()
    query_mask = np.arange(T)[None, :] < np.array([[T], [2]])
    num, den = la.noncausal(q, k, v, mask=memory_mask, query_mask=query_mask, denominator=True)
    scores = np.einsum("bthd,bshd->bhts", q, k) * memory_mask[:, None, None, :]
    want_num = np.einsum("bhts,bshm->bthm", scores, v) * query_mask[..., None, None]
    want_den = np.swapaxes(scores.sum(-1), 1, 2) * query_mask[..., None]
    np.testing.assert_allclose(np.asarray(num), want_num, **testing.F32_SIMPLE)
    np.testing.assert_allclose(np.asarray(den), want_den, **testing.F32_SIMPLE)
    assert num.dtype == jnp.float64 and la.noncausal(q, k, v)[1] is None
    dirty = [np.where(mask[:, :, None, None], a, np.nan) for a, mask in
             ((q, query_mask), (k, memory_mask), (v, memory_mask))]
    num_bad, den_bad = la.noncausal(*dirty, mask=memory_mask, query_mask=query_mask, denominator=True)
    np.testing.assert_array_equal(np.asarray(num_bad), np.asarray(num))
    np.testing.assert_array_equal(np.asarray(den_bad), np.asarray(den))
    with pytest.raises(ValueError, match=r"`mask` must have shape \[B, S\] = \(2, 5\), got \(2, 7\)"):
        la.noncausal(q, k, v, mask=query_mask)
    # float64 (the x64 fixture): gradients against finite differences
    f = jax.jit(lambda q, k, v: la.noncausal(q, k, v, mask=memory_mask, denominator=True))
    check_grads(f, tuple(jnp.asarray(a, jnp.float64) for a in (q, k, v)), order=1, modes=("rev",))


# ---------------------------------------------------------------------------------------------
# A mechanism is one registry row: a toy layer registered in a copy of the registry works
# through `make` and `layer` with nothing else changed.
# ---------------------------------------------------------------------------------------------

class _ToyMeanAttention(nn.Module):
    """Every query reads the mean of the valid values (the contract's fields and call only)."""
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scale: float = 1.0

    @nn.compact
    def __call__(self, x, *, mask=None, deterministic=True):
        v = nn.DenseGeneral((self.num_heads, self.head_dim), name="value")(x)
        valid = jnp.ones(x.shape[:2], bool) if mask is None else mask
        v = jnp.where(valid[..., None, None], v, 0.0)
        mean = jnp.sum(v, axis=1, keepdims=True) / jnp.sum(valid, axis=1)[:, None, None, None]
        o = jnp.broadcast_to(self.scale * mean, v.shape)
        return nn.DenseGeneral(self.out_features or x.shape[-1], axis=(-2, -1), name="out")(o), {}


# ---------------------------------------------------------------------------------------------
# Packed sequences and context parallelism through the drop-in (issue 42).
# ---------------------------------------------------------------------------------------------

def test_the_registry_reads_packing_and_context_parallelism_from_the_layers():
    assert "linear" in attention.names("segment_ids", "context_parallel")
    # The baselines whose definition mixes the whole sequence refuse segment ids, and say so here.
    assert not {"linformer", "nystromformer", "reformer"} & set(attention.names("segment_ids"))
    assert {"longformer", "softmax", "agf", "favor", "window_graph"} <= set(attention.names("segment_ids"))
    assert set(attention.PACKED_ARGS) < set(attention.CAPABILITIES)
    for name in attention.names():
        caps = attention.capabilities(name)
        if not caps["cross"]:
            assert not caps["kv_segment_ids"], name


@pytest.mark.parametrize("causal", [False, True])
def test_the_drop_in_passes_segment_ids_a_packed_row_equals_its_documents_alone(causal):
    x, _, _ = _data()
    lengths = (3, x.shape[1] - 5)
    ids = np.zeros(x.shape[:2], np.int32)
    ids[:, :lengths[0]] = 1
    ids[:, lengths[0]:lengths[0] + lengths[1]] = 2          # the last two tokens are padding
    x = jnp.where(ids[..., None] > 0, x, jnp.nan)            # NaN in the padding changes nothing
    attn = attention.make("linear", num_heads=HEADS, qkv_features=E, causal=causal)
    params = jax.jit(attn.init)(jax.random.PRNGKey(0), x, segment_ids=ids)
    # the packed row and each document alone in one program
    packed, first, second = jax.jit(lambda p, x: (attn.apply(p, x, segment_ids=ids), attn.apply(p, x[:, :lengths[0]]),
                                                  attn.apply(p, x[:, lengths[0]:sum(lengths)])))(params, x)
    np.testing.assert_allclose(np.asarray(packed[:, :lengths[0]]), np.asarray(first), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(packed[:, lengths[0]:sum(lengths)]), np.asarray(second), rtol=1e-5,
                               atol=1e-6)
    assert np.isfinite(np.asarray(packed[:, :sum(lengths)])).all()


def test_a_new_mechanism_is_one_registry_row(monkeypatch):
    from zoo_core.attention import registry

    row = registry._Entry(registry._Form(None, _ToyMeanAttention), (False,), None, "toy: mean of the values")
    monkeypatch.setattr(registry, "_REGISTRY", {**registry._REGISTRY, "toy": row})
    assert "toy" in attention.names("self") and "toy" not in attention.names("causal")
    assert attention.capabilities("toy") == {"self": True, "causal": False, "decode": False, "cross": False,
                                             "segment_ids": False, "kv_segment_ids": False, "positions": False,
                                             "context_parallel": False}
    assert attention.options("toy") == ("scale",)
    x, mask, _ = _data()
    attn = attention.make("toy", num_heads=HEADS, qkv_features=E, scale=2.0)
    params = attn.init(jax.random.PRNGKey(0), x, mask=mask)
    lay = attention.layer("toy", num_heads=HEADS, qkv_features=E, scale=2.0)
    np.testing.assert_array_equal(np.asarray(attn.apply(params, x, mask=mask)),
                                  np.asarray(lay.apply({"params": params["params"]["attention"]}, x, mask=mask)[0]))
    with pytest.raises(ValueError, match=r"attention 'toy' has no causal=True mode \(it is non-causal only\)"):
        attention.make("toy", num_heads=HEADS, qkv_features=E, causal=True)
    with pytest.raises(ValueError, match=r"attention 'toy' has no cross-attention form"):
        attn.apply(params, x, x)


def test_a_registry_row_is_checked_when_written():
    from zoo_core.attention import calls, registry

    form = registry._Form(None, _ToyMeanAttention)
    with pytest.raises(ValueError, match="declares cross_form and cross_call together"):
        registry._Entry(form, (False,), form, "toy")
    with pytest.raises(ValueError, match="global_call is for a causal-only self layer"):
        registry._Entry(form, (False,), None, "toy", global_call=calls.global_self)
