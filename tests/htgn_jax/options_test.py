"""Tests of the HTGN card's options (issue 40; docs/htgn_options.md): trig features, low-rank q/k,
the graph activation and the DropPath start rate, in every form they have."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax import ops
from htgn_jax.blocks import BlockConfig, DecoderBlock, drop_path_rate
from htgn_jax.layers import FavorAttention
from htgn_jax.model import Model
from zoo_core.testing import F32_MODEL, F32_SIMPLE, assert_forms_agree

B, T, H, D = 2, 7, 2, 4
E = H * D
SEQ = dict(kind="seq2seq", variant="test", num_layers=2, source_vocab_size=11, target_vocab_size=9,
           max_source_len=16, max_target_len=16)
CONFIG = BlockConfig(d_model=16, num_heads=2, mlp_dim=32, num_features=8, window=2, num_global=2,
                     cross_window=1, rho=1.0, chunk_size=3)


def _x(seed, length=T, width=E):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (B, length, width)))


@functools.lru_cache(maxsize=None)
def _init(**kw):
    layer = FavorAttention(**{"num_heads": H, "head_dim": D, "use_rotary": True, **kw})
    return layer, jax.jit(layer.init)(jax.random.PRNGKey(1), _x(0))


def _params(module, *args, **kwargs):
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs))
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda p, l: rng.normal(0.0, 0.2, l.shape).astype(np.float32)
        + np.float32(p[-1].key == "scale"), shapes)


# --- item 1: trig features ------------------------------------------------------------------


TRIG_LAYERS = [dict(feature_map="trig", num_features=8),
               dict(feature_map="trig", num_features=8, qk_rank=2),
               dict(feature_map="softmax", num_features=8, qk_rank=2)]


@pytest.mark.parametrize("kw", TRIG_LAYERS, ids=["trig", "trig-r2", "softmax-r2"])
def test_trig_and_low_rank_causal_forms_agree(kw):
    """parallel == chunked(3) == scan == step loop, one parameter tree; q/k kernels `[E, H, r]`."""
    layer, variables = _init(causal=True, **kw)
    r = kw.get("qk_rank", D)
    assert variables["params"]["query"]["kernel"].shape == (E, H, r)
    assert variables["params"]["value"]["kernel"].shape == (E, H, D)
    x = _x(2)
    chunked = FavorAttention(num_heads=H, head_dim=D, use_rotary=True, causal=True, chunk_size=3,
                             **kw)

    @jax.jit
    def run(variables):
        ys, final = layer.apply(variables, x, method="scan")
        state = layer.apply(variables, B, method="init_state")
        outs = []
        for t in range(T):
            y_t, state = layer.apply(variables, state, x[:, t], position=t, method="step")
            outs.append(y_t)
        return (layer.apply(variables, x)[0], chunked.apply(variables, x)[0], ys,
                jnp.stack(outs, 1), final, state)

    par, chk, ys, steps, final, state = run(variables)
    assert_forms_agree({"parallel": par, "chunked(3)": chk, "scan": ys, "step": steps}, **F32_SIMPLE)
    assert_forms_agree({"scan": final, "step": state}, **F32_SIMPLE)
    if kw["feature_map"] == "trig":
        assert final.den.shape == (B, H, 16)      # 2M features: sines and cosines


def test_trig_cross_attention_and_cache_agree():
    layer, variables = _init(use_rotary=False, feature_map="trig", num_features=8)
    # Moderate norms keep every row's denominator estimate away from the floor (at full scale one
    # row's estimate is ~0 and its floored output ~5e5, where the two programs' rounding differs
    # by 2e-5 relative); the floor itself is tested with adversarial inputs below.
    x, memory = np.float32(0.5) * _x(7), np.float32(0.5) * _x(8, length=9)
    memory_mask = np.arange(9)[None, :] < np.array([[9], [5]])
    cross = jax.jit(lambda m: layer.apply(variables, x, m, memory_mask=memory_mask, method="cross")[0])

    @jax.jit
    def steps(variables):
        cache = layer.apply(variables, memory, memory_mask=memory_mask, method="cross_cache")
        return jnp.stack([layer.apply(variables, cache, x[:, t], method="cross_step")
                          for t in range(T)], 1)

    y = cross(memory)
    assert_forms_agree({"cross": y, "cross_step": steps(variables)}, **F32_SIMPLE)
    y_bad = cross(np.where(memory_mask[..., None], memory, np.float32(np.nan)))
    np.testing.assert_array_equal(np.asarray(y_bad), np.asarray(y))


@pytest.mark.parametrize("causal", [False, True])
def test_trig_nan_in_padding_or_future_changes_nothing(causal):
    layer, variables = _init(causal=causal, chunk_size=3 if causal else None, feature_map="trig",
                             num_features=8)
    x = _x(12)
    mask = np.arange(T)[None, :] < np.array([[T], [4]])
    dirty = np.where(mask[..., None], x, np.float32(np.nan))
    run = jax.jit(lambda x, m: layer.apply(variables, x, mask=m)[0])
    np.testing.assert_array_equal(np.asarray(run(dirty, mask))[mask], np.asarray(run(x, mask))[mask])
    if causal:
        future = x.copy()
        future[:, 4] = np.nan
        ones = np.ones_like(mask)
        np.testing.assert_array_equal(np.asarray(run(future, ones))[:, :4],
                                      np.asarray(run(x, ones))[:, :4])


@pytest.mark.parametrize("causal", [False, True])
def test_trig_adversarial_inputs_stay_finite(causal):
    """Huge, opposed and cancelling queries/keys: the estimated denominator is 0 or negative for
    some rows (checked), the floored output stays finite (values, and gradients)."""
    omega = ops.draw_projection(jax.random.PRNGKey(0), None, num_features=4, dim=D)
    rng = np.random.default_rng(0)
    k = rng.normal(size=(B, T, H, D)).astype(np.float32) * np.float32(30.0)
    k[:, 1::2] = -k[:, ::2][:, :k[:, 1::2].shape[1]]        # opposed keys cancel
    q = np.float32(1e3) * rng.normal(size=(B, T, H, D)).astype(np.float32)
    v = rng.normal(size=(B, T, H, D)).astype(np.float32)
    phi_q, phi_k, guard = ops.favor_features(q, k, feature_map="trig", projection=omega,
                                             key_stabiliser="constant" if causal else "max")
    _, den = ops.favor_parallel(phi_q, phi_k, v)
    assert np.any(np.asarray(den) <= 0)
    f = lambda q, k: ops.favor_attention(q, k, v, feature_map="trig", projection=omega,
                                         causal=causal, chunk_size=3)
    out = f(q, k)
    grads = jax.grad(lambda q, k: jnp.sum(f(q, k)), argnums=(0, 1))(q, k)
    assert np.all(np.isfinite(np.asarray(out)))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_trig_estimate_converges_as_one_over_sqrt_m():
    """Mean abs error vs exact softmax attention over M in {16..4096}, 16 seeds each: the log-log
    slope is about -1/2. The 'max' key scale cancels exactly and the floor never binds here
    (checked), so the error is the estimator's alone."""
    rng = np.random.default_rng(1)
    q, k, v = (np.float32(0.5) * rng.normal(size=(1, 8, 2, D)).astype(np.float32) for _ in range(3))
    exact = ops.exact_softmax_attention(q, k, v)
    ms = (16, 64, 256, 1024, 4096)

    @functools.partial(jax.jit, static_argnums=1)
    def errors(seeds, m):
        def one(seed):
            omega = ops.draw_projection(jax.random.PRNGKey(seed), None, num_features=m, dim=D,
                                        orthogonal=False)
            phi_q, phi_k, guard = ops.favor_features(q, k, feature_map="trig", projection=omega)
            num, den = ops.favor_parallel(phi_q, phi_k, v)
            return jnp.mean(jnp.abs(num / den[..., None] - exact)), jnp.min(den) > guard
        return jax.vmap(one)(seeds)

    errs = []
    for m in ms:
        err, unfloored = errors(jnp.arange(16), m)
        assert np.all(np.asarray(unfloored))
        errs.append(float(np.mean(np.asarray(err))))
    slope = np.polyfit(np.log(ms), np.log(errs), 1)[0]
    assert -0.7 <= slope <= -0.3, (slope, errs)


# --- items 1-5 in the decoder block: parallel == step decoding -------------------------------


@pytest.mark.parametrize("options", [
    dict(feature_map="trig", qk_rank=4, graph_activation="relu"),
    dict(qk_rank=2, gat_version="v1", graph_activation="relu", drop_path_start=0.1,
         skip_offsets=(3, 5)),
    dict(graph_alpha="attention", skip_offsets=(3,)),
    dict(graph_alpha="attention", feature_map="trig", qk_rank=4, use_hrpe=False),
], ids=["trig-r4-relu", "r2-v1-relu-skips", "alpha-attention-skips", "alpha-attention-trig"])
def test_decoder_block_options_parallel_equals_step(options):
    block = DecoderBlock(dataclasses.replace(CONFIG, **options))
    t, s = 6, 5
    rng = np.random.default_rng(3)
    y = rng.normal(size=(B, t, 16)).astype(np.float32)
    memory = rng.normal(size=(B, 2 + s, 16)).astype(np.float32)
    memory_mask = np.arange(2 + s)[None, :] < np.array([[2 + s], [2 + s - 2]])
    variables = _params(block, y, memory, memory_mask=memory_mask)

    @jax.jit
    def run(variables):
        out, _ = block.apply(variables, y, memory, memory_mask=memory_mask)
        static, state = block.apply(variables, memory, memory_mask, method="init_cache")

        def step(state, inputs):
            y_t, i = inputs
            y_t, state = block.apply(variables, state, y_t, static, position=i, method="step")
            return state, y_t
        _, steps = jax.lax.scan(step, state, (jnp.swapaxes(y, 0, 1), jnp.arange(t, dtype=jnp.int32)))
        return out, jnp.swapaxes(steps, 0, 1)

    out, steps = run(variables)
    assert_forms_agree({"parallel": out, "step": steps}, **F32_MODEL)


def test_graph_activation_relu_changes_only_the_output():
    """sigma = ReLU acts on the aggregated messages: same parameters, different output."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, 2 + 5, 16)).astype(np.float32)
    mask = np.ones((B, 7), bool)
    from htgn_jax.blocks import EncoderBlock
    plain, relu = EncoderBlock(CONFIG), EncoderBlock(dataclasses.replace(CONFIG, graph_activation="relu"))
    variables = _params(plain, x, mask=mask)
    a, b = (jax.jit(m.apply)(variables, x, mask=mask)[0] for m in (plain, relu))
    assert np.all(np.isfinite(np.asarray(b))) and not np.allclose(a, b)


def test_drop_path_start_schedule():
    assert [drop_path_rate(0.3, i, 3, 0.1) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert drop_path_rate(0.3, 0, 1, 0.1) == 0.1
    assert [drop_path_rate(0.3, i, 3) for i in range(3)] == pytest.approx([0.0, 0.15, 0.3])
    model = Model(**{**SEQ, "num_layers": 3}, drop_path=0.3, drop_path_start=0.1)
    batch = {"inputs": np.ones((1, 4), np.int32), "targets": np.ones((1, 4), np.int32)}
    bound = model.bind(jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch)))
    want = pytest.approx([0.1, 0.2, 0.3])
    assert [b.drop_path for b in bound.decoder_blocks] == want
    assert [b.drop_path for b in bound.encoder.blocks] == want


# --- item 6: skip offsets ---------------------------------------------------------------------


def _qkv(length, seed=0, heads=2, ch=3):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(B, length, heads, ch)).astype(np.float32) for _ in range(3))


@pytest.mark.parametrize("causal, num_global, grid_width", [
    (False, 2, None), (True, 0, None), (False, 1, 4)], ids=["window", "causal", "grid"])
def test_skip_offsets_equal_the_dense_graph(causal, num_global, grid_width):
    """The stencil with skip edges == dense masked GATv2 on the adjacency with those edges."""
    from htgn_jax import graph_ops
    from htgn_jax.analysis import window_adjacency
    from tests.htgn_jax.oracles import dense_graph_attention
    length = num_global + (16 if grid_width else 13)
    q, k, v = _qkv(length)
    attn = np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32)
    mask = np.arange(length)[None, :] < np.array([[length], [length - (4 if grid_width else 3)]])
    skips = (2,) if grid_width else (3, 5)
    out, _ = graph_ops.window_graph_attention(q, k, v, attn, window=1, num_global=num_global,
                                              causal=causal, mask=mask, grid_width=grid_width,
                                              skip_offsets=skips)
    adj = window_adjacency(mask, window=1, num_global=num_global, causal=causal,
                           grid_width=grid_width, skip_offsets=skips)
    want, _ = dense_graph_attention(q, k, v, attn, adj)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want) * mask[..., None, None],
                               **F32_SIMPLE)


def test_cross_graph_skip_offsets_equal_the_dense_graph():
    from htgn_jax import graph_ops
    from htgn_jax.analysis import cross_graph_adjacency
    from tests.htgn_jax.oracles import dense_graph_attention
    q, _, _ = _qkv(6, seed=2)
    _, k, v = _qkv(2 + 11, seed=3)
    attn = np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32)
    memory_mask = np.arange(13)[None, :] < np.array([[13], [9]])
    out, st = graph_ops.cross_graph_attention(q, k, v, attn, window=1, num_global=2, rho=1.5,
                                              memory_mask=memory_mask, skip_offsets=(2, 4))
    adj = cross_graph_adjacency(np.ones((B, 6), bool), memory_mask, st["centres"], window=1,
                                num_global=2, skip_offsets=(2, 4))
    want, _ = dense_graph_attention(q, k, v, attn, adj)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **F32_SIMPLE)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_causal_skip_offsets_forms_agree_and_ignore_nan_future(version):
    from htgn_jax.graph_layers import WindowGraphAttention
    kw = dict(num_heads=2, window=1, causal=True, skip_offsets=(3, 5), version=version)
    layer, chunked = WindowGraphAttention(**kw), WindowGraphAttention(chunk_size=4, **kw)
    x = _x(4, length=11)
    variables = jax.jit(layer.init)(jax.random.PRNGKey(1), x)
    assert variables["params"]["rel_bias"].shape == (2, 4)          # offsets -1, 0, -3, -5

    @jax.jit
    def run(variables, x):
        state = layer.apply(variables, B, method="init_state")
        outs = []
        for t in range(x.shape[1]):
            y_t, state = layer.apply(variables, state, x[:, t], method="step")
            outs.append(y_t)
        return (layer.apply(variables, x)[0], chunked.apply(variables, x)[0],
                layer.apply(variables, x, method="scan")[0], jnp.stack(outs, 1))

    par, chk, scan, steps = run(variables, x)
    assert_forms_agree({"parallel": par, "chunked(4)": chk, "scan": scan, "step": steps},
                       **F32_SIMPLE)
    future = x.copy()
    future[:, 7:] = np.nan
    for a, b in zip(run(variables, future), (par, chk, scan, steps)):
        np.testing.assert_array_equal(np.asarray(a)[:, :7], np.asarray(b)[:, :7])


# --- item 8: registry self-attentions in the encoder ------------------------------------------


def test_encoder_accepts_registry_self_attentions():
    """'agf' (registered today) drives the encoder through zoo_core.attention.layer; its own aux
    loss reaches the model's aux; the decoder keeps exact softmax; other names are refused."""
    from htgn_jax.model import encoder_attentions
    assert {"favor", "softmax", "agf"} <= set(encoder_attentions())
    assert "linear" not in encoder_attentions()          # causal-only contract layer
    model = Model(**{**SEQ, "num_layers": 1}, attention="agf")
    batch = {"inputs": np.full((B, 5), 3, np.int32), "targets": np.full((B, 4), 3, np.int32)}
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), batch)
    params = variables["params"]
    assert "theta" in params["encoder"]["block_00"]["self_attention"]       # AGF's own parameters
    assert "query" in params["decoder_block_00"]["self_attention"]
    out, aux = jax.jit(model.apply)(variables, batch)
    assert out["logits"].shape == (B, 4, 9) and "loss/orthogonality" in aux
    assert np.all(np.isfinite(np.asarray(out["logits"])))


def test_configs_take_the_card_preset_and_sweeps():
    from zoo_core.configs.htgn import digits, number_words, wmt14_en_de
    c = number_words.get_config("smoke,card")
    assert (c.model.feature_map, c.model.qk_rank, c.model.graph_activation) == ("trig", 8, "relu")
    assert c.model.graph_alpha == "attention"
    assert number_words.get_config("card,ablation=gat_v1").model.graph_alpha == "learned"
    assert (c.model.drop_path_start, c.model.drop_path) == (0.1, 0.3)
    assert tuple(c.model.skip_offsets) == (8, 16)
    assert tuple(digits.get_config("card").model.skip_offsets) == (2,)
    assert wmt14_en_de.get_config("card").model.qk_rank == 32
    c = number_words.get_config("qk_rank=4,heads=2")
    assert (c.model.qk_rank, c.model.num_heads) == (4, 2)
    assert number_words.get_config("attention=agf").model.attention == "agf"
    base = number_words.get_config("")
    assert (base.model.feature_map, base.model.qk_rank, base.model.skip_offsets) == ("softmax", None, ())
    with pytest.raises(ValueError, match="card sets HTGN's own choices, so it needs attention=favor"):
        number_words.get_config("card,attention=softmax")


# --- item 4: alpha from the attention's kernel scores -------------------------------------------


def test_alpha_attention_renormalises_the_kernel_scores_over_the_neighbourhood():
    """alpha_ij = phi(q_i).phi(k_j) / sum over N(i) (window, skips, globals), checked densely."""
    from htgn_jax.analysis import window_adjacency
    from htgn_jax.graph_layers import WindowGraphAttention
    layer = WindowGraphAttention(num_heads=2, window=1, num_global=1, skip_offsets=(3,),
                                 alpha="attention", use_relative_bias=False)
    length, m = 10, 5
    rng = np.random.default_rng(7)
    x = rng.normal(size=(B, length, 8)).astype(np.float32)
    phi_q, phi_k = (rng.random(size=(B, length, 2, m)).astype(np.float32) for _ in range(2))
    mask = np.arange(length)[None, :] < np.array([[length], [7]])
    variables = layer.init(jax.random.PRNGKey(0), x, mask=mask, features=(phi_q, phi_k))
    assert set(variables["params"]) == {"source", "output"}          # no learned score params
    y, _ = jax.jit(lambda v: layer.apply(v, x, mask=mask, features=(phi_q, phi_k)))(variables)
    adj = np.asarray(window_adjacency(mask, window=1, num_global=1, skip_offsets=(3,)))
    scores = np.einsum("bihm,bjhm->bhij", phi_q, phi_k) * adj[:, None]
    alpha = scores / np.maximum(scores.sum(-1, keepdims=True), 1e-30)
    u = np.einsum("bld,dhk->blhk", x * mask[..., None], variables["params"]["source"]["kernel"])
    agg = np.einsum("bhij,bjhk->bihk", alpha, u)
    out = variables["params"]["output"]
    want = np.einsum("bihk,hkf->bif", agg, out["kernel"]) + out["bias"]
    np.testing.assert_allclose(np.asarray(y), want * mask[..., None], rtol=1e-4, atol=1e-5)


def test_card_model_encoder_ignores_padding_and_alpha_attention_has_no_gat_params():
    kw = dict(feature_map="trig", qk_rank=4, graph_activation="relu", graph_alpha="attention",
              skip_offsets=(3,), drop_path_start=0.1, drop_path=0.3)
    model = Model(**{**SEQ, "num_layers": 1}, **kw)
    inputs = np.random.default_rng(2).integers(3, 11, (B, 6)).astype(np.int32)
    inputs[1, 4:] = 0
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), {"inputs": inputs, "targets": inputs[:, :4]})
    graph = variables["params"]["encoder"]["block_00"]["graph"]
    assert "attn" not in graph and "target" not in graph and graph["rel_bias"].shape == (2, 5 + 2)
    enc = jax.jit(lambda v, i, m: model.apply(v, i, m, method="encode"))
    mem, mmask = enc(variables, inputs, inputs != 0)
    longer = np.concatenate([inputs, np.zeros((B, 3), np.int32)], 1)
    mem2, _ = enc(variables, longer, longer != 0)
    valid = np.asarray(mmask)
    np.testing.assert_allclose(np.asarray(mem2)[:, :mem.shape[1]][valid], np.asarray(mem)[valid],
                               **F32_MODEL)


def test_hrpe_spectral_encodings_follow_the_skip_graph():
    """HRPE (b) on the path plus skip edges: eigh on no skips gives the closed form; the masked
    (per-length) table gives each example the encodings of its own length; skips change them."""
    from htgn_jax import hrpe
    np.testing.assert_allclose(np.asarray(hrpe.skip_path_graph_pe(9, 4, ())),
                               np.asarray(hrpe.path_graph_pe(9, 4)), atol=1e-6)
    mask = np.arange(9)[None, :] < np.array([[9], [6]])
    pe = np.asarray(hrpe.masked_skip_path_graph_pe(mask, 4, (3,)))
    np.testing.assert_allclose(pe[1, :6], np.asarray(hrpe.skip_path_graph_pe(6, 4, (3,))), atol=1e-6)
    np.testing.assert_allclose(pe[0], np.asarray(hrpe.skip_path_graph_pe(9, 4, (3,))), atol=1e-6)
    assert np.all(pe[1, 6:] == 0)
    assert not np.allclose(pe[0], np.asarray(hrpe.path_graph_pe(9, 4)), atol=1e-3)
    adj = hrpe.skip_path_adjacency(6, (3,))
    assert adj[0, 3] == 1 and adj[0, 2] == 0 and adj[0, 1] == 1
