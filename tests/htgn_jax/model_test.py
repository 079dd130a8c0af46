"""Tests of htgn_jax.model (htgn.md §5.1, §5.7, §5.8, §5.13, §5.14 items 2, 9, 10)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax.blocks import BlockConfig, DecoderBlock, Encoder, EncoderBlock, drop_path_rate
from htgn_jax.model import Model
from zoo_core.testing import F32_MODEL, assert_forms_agree, param_shapes

# htgn_jax.validation.check_step's wording (it may still name the keyword by its old name, `step=`).
PASS_FEATURE_STEP, DO_NOT_PASS_FEATURE_STEP = r"pass feature_step=", r"do not pass feature_step"

B, S, T = 2, 7, 7
SRC_V, TGT_V = 11, 9
# One block each way: the forward tests compile half the program of the variant's two (the tests that
# need two blocks, layer-wise options and the drop-path schedule, ask for them).
SEQ = dict(kind="seq2seq", variant="test", num_layers=1, source_vocab_size=SRC_V, target_vocab_size=TGT_V,
           max_source_len=16, max_target_len=16)
CLS = dict(kind="classifier", variant="digits", num_classes=10, d_model=16, num_heads=2,
           mlp_dim=32, num_features=8)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(3, SRC_V, (B, S)).astype(np.int32)
    inputs[0, -1] = 2
    inputs[1, 4], inputs[1, 5:] = 2, 0           # a padded example
    targets = rng.integers(3, TGT_V, (B, T)).astype(np.int32)
    targets[1, 5], targets[1, 6:] = 2, 0
    return {"inputs": inputs, "targets": targets}


def _image(seed=0):
    return {"image": np.random.default_rng(seed).random((B, 8, 8, 1)).astype(np.float32)}


def _shapes(model, batch):
    """Variables shapes without running anything (jax.eval_shape traces only)."""
    return jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b), batch)


def _params(model, batch):
    return param_shapes(_shapes(model, batch)["params"])


def random_params(model, batch, seed=0):
    """Parameters from the model's abstract init (eval_shape, nothing compiled): LayerNorm
    scales 1 + noise, everything else N(0, 0.2^2). Compiling `model.init` costs as much as a
    forward pass, and these tests only need some well-scaled parameters of the right shapes."""
    return _draw_params(_shapes(model, batch)["params"], seed)


def _module_params(module, *args, **kwargs):
    """`random_params` for a block: its init's shapes (the random-feature projection is left out:
    the layers draw the same one from their seed in every apply)."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs))
    return {"params": _draw_params(shapes["params"], 0)}


def _draw_params(shapes, seed):
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.normal(0.0, 0.2, leaf.shape).astype(np.float32)
        # numpy: jnp.asarray would compile a conversion per shape
        return noise + np.float32(1.0 if path[-1].key == "scale" else 0.0)
    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.lru_cache(maxsize=None)
def _init(**kw):
    model = Model(**{**SEQ, **kw})
    return model, random_params(model, _batch())


@functools.lru_cache(maxsize=None)
def _forward(model):
    """One jitted forward per model, compared by its fields (a test calls it on several inputs)."""
    return jax.jit(lambda p, b: model.apply({"params": p}, b))


@functools.lru_cache(maxsize=None)
def _logits(model):
    """The logits alone: a program without the KL terms, so two models that differ only in their KL
    compile to one program and must agree bit for bit (programs with different KL work may fuse the
    shared attention differently, and then round differently)."""
    return jax.jit(lambda p, b: model.apply({"params": p}, b)[0]["logits"])


# ------------------------------------------------------------------------------------------
# Forward pass, aux losses, causality, padding
# ------------------------------------------------------------------------------------------


def test_seq2seq_shapes_finite_and_weighted_kl():
    model, params = _init()
    out, aux = _forward(model)(params, _batch())
    assert out["logits"].shape == (B, T, TGT_V) and out["logits"].dtype == jnp.float32
    assert np.all(np.isfinite(out["logits"]))
    assert set(aux) == {"loss/kl", "graph/kl"} and aux["loss/kl"].shape == ()
    assert float(aux["graph/kl"]) > 0.0
    np.testing.assert_allclose(aux["loss/kl"], model.kl_weight * np.asarray(aux["graph/kl"]),
                               rtol=1e-6)


def test_distance_kl_prior_changes_only_the_kl_term():
    """kl_tau (htgn.md §5.7 kl_prior='distance'): same parameters and logits, another KL; as tau grows
    the prior tends to the uniform one."""
    model, params = _init()
    _, aux = _forward(model)(params, _batch())
    near = Model(**SEQ, kl_tau=1.0)
    far = Model(**SEQ, kl_tau=1e9)
    assert _params(near, _batch()) == _params(model, _batch())
    # Both KL terms in one program (the logits are compared through `_logits` below).
    aux_n, aux_f = jax.jit(lambda p, b: tuple(m.apply({"params": p}, b)[1] for m in (near, far)))(
        params, _batch())
    np.testing.assert_array_equal(_logits(near)(params, _batch()), _logits(model)(params, _batch()))
    assert abs(float(aux_n["graph/kl"]) - float(aux["graph/kl"])) > 1e-3
    np.testing.assert_allclose(aux_f["graph/kl"], aux["graph/kl"], rtol=1e-5)
    np.testing.assert_allclose(aux_n["loss/kl"], near.kl_weight * np.asarray(aux_n["graph/kl"]),
                               rtol=1e-6)


def test_neighbour_kl_mode_changes_only_the_kl_term():
    """kl_mode='neighbour' (htgn.md §5.7): same parameters and logits, KL between consecutive rows."""
    model, params = _init()
    _, aux = _forward(model)(params, _batch())
    rows = Model(**SEQ, kl_mode="neighbour")
    assert _params(rows, _batch()) == _params(model, _batch())
    _, aux_r = _forward(rows)(params, _batch())
    np.testing.assert_array_equal(_logits(rows)(params, _batch()), _logits(model)(params, _batch()))
    assert float(aux_r["graph/kl"]) > 0
    assert abs(float(aux_r["graph/kl"]) - float(aux["graph/kl"])) > 1e-3


def test_kl_alternatives_skip_a_one_slot_cross_graph():
    """cross_window=0 without globals leaves the Cross-Graph one neighbour (KL 0 in every mode): the
    model keeps the plain prior there instead of refusing an option its self-graphs use."""
    model = Model(**SEQ, num_global=0, cross_window=0, kl_mode="neighbour")
    out, aux = _forward(model)(random_params(model, _batch()), _batch())
    assert np.all(np.isfinite(out["logits"])) and float(aux["graph/kl"]) > 0


def test_decoder_is_causal_bit_for_bit():
    """Perturbing future target tokens leaves earlier logits identical (htgn.md §5.14 item 2)."""
    model, params = _init()
    batch = _batch()
    changed = dict(batch, targets=batch["targets"].copy())
    cut = 3   # decoder inputs are [BOS] + targets[:-1]: targets[3:] feed positions 4.. only
    changed["targets"][:, cut:] = np.where(changed["targets"][:, cut:] == 5, 6, 5)
    changed["targets"][1, -1] = 0
    a = np.asarray(_forward(model)(params, batch)[0]["logits"])
    b = np.asarray(_forward(model)(params, changed)[0]["logits"])
    np.testing.assert_array_equal(np.asarray(a[:, :cut + 1]), np.asarray(b[:, :cut + 1]))
    assert not np.allclose(a[:, cut + 1:], b[:, cut + 1:])


def test_encoder_is_invariant_to_appended_padding():
    """Real tokens' memory does not change when pads are appended (htgn.md §5.14 item 9)."""
    model, params = _init()
    inputs = _batch()["inputs"][:, :5]
    inputs[1, 4] = 2
    padded = np.pad(inputs, ((0, 0), (0, 3)))
    encode = jax.jit(lambda p, x: model.apply({"params": p}, x, method="encode"))
    m5, mask5 = encode(params, inputs)
    m8, mask8 = encode(params, padded)
    real = model.num_global + 5
    np.testing.assert_array_equal(np.asarray(mask8[:, :real]), np.asarray(mask5))
    np.testing.assert_allclose(np.asarray(m8)[:, :real], m5, **F32_MODEL)


def test_train_mode_dropout_drop_path_and_zero_kl_weight():
    assert [drop_path_rate(0.2, i, 3) for i in range(3)] == [0.0, 0.1, 0.2]
    assert drop_path_rate(0.2, 0, 1) == 0.0
    _, params = _init()
    # Same parameter tree as the default model: only rates and the KL weight differ.
    model = Model(**SEQ, drop_path=0.2, dropout_rate=0.1, kl_weight=0.0)
    run = jax.jit(lambda p, b, r: model.apply({"params": p}, b, train=True, rngs={"dropout": r}))
    (a, aux), (b, _) = (run(params, _batch(), jax.random.PRNGKey(i)) for i in (1, 2))
    a, b = np.asarray(a["logits"]), np.asarray(b["logits"])
    assert np.all(np.isfinite(a)) and not np.allclose(a, b)
    assert float(aux["loss/kl"]) == 0.0 and float(aux["graph/kl"]) > 0.0


def test_feature_redraw_follows_the_step_and_is_required_exactly_when_used():
    """redraw_every=k: the draw is Omega(feature_step // k) (htgn.md §2.4); draw 0 is the fixed model's."""
    # Two blocks: the step-0 program and the fixed model's are two programs, compared bit for bit; at
    # this size they round alike.
    fixed, params = _init(num_layers=2)
    model = Model(**{**SEQ, "num_layers": 2}, redraw_every=2)
    assert model.uses_feature_step and not fixed.uses_feature_step
    run = jax.jit(lambda p, b, s: model.apply({"params": p}, b, feature_step=s))
    batch = _batch()
    by_step = [np.asarray(run(params, batch, jnp.int32(s))[0]["logits"]) for s in range(4)]
    np.testing.assert_array_equal(by_step[0], by_step[1])                # one draw per window
    np.testing.assert_array_equal(by_step[2], by_step[3])
    assert not np.allclose(by_step[1], by_step[2], atol=1e-4)             # redrawn at step 2
    np.testing.assert_array_equal(by_step[0], np.asarray(_forward(fixed)(params, batch)[0]["logits"]))
    with pytest.raises(ValueError, match=PASS_FEATURE_STEP):
        model.apply({"params": params}, batch)
    with pytest.raises(ValueError, match=DO_NOT_PASS_FEATURE_STEP):
        fixed.apply({"params": params}, batch, feature_step=3)
    cls = Model(**CLS, redraw_every=5)
    assert cls.uses_feature_step
    out = jax.eval_shape(lambda: cls.init_with_output(jax.random.PRNGKey(0), _image(), feature_step=7))[0]
    assert out[0]["logits"].shape == (B, 10)
    with pytest.raises(ValueError, match=PASS_FEATURE_STEP):
        jax.eval_shape(lambda: cls.init(jax.random.PRNGKey(0), _image()))


def test_classifier_shapes_and_aux():
    model = Model(**CLS)
    params = random_params(model, _image())
    out, aux = jax.jit(lambda p, b: model.apply({"params": p}, b))(params, _image(1))
    assert out["logits"].shape == (B, 10) and np.all(np.isfinite(out["logits"]))
    np.testing.assert_allclose(aux["loss/kl"], model.kl_weight * np.asarray(aux["graph/kl"]),
                               rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Parameter trees: snapshot and ablation switches (htgn.md §5.13)
# ------------------------------------------------------------------------------------------

SNAPSHOT = {
    "decoder_block_00/cross_attention/key/bias": (2, 8),
    "decoder_block_00/cross_attention/key/kernel": (16, 2, 8),
    "decoder_block_00/cross_attention/out/bias": (16,),
    "decoder_block_00/cross_attention/out/kernel": (2, 8, 16),
    "decoder_block_00/cross_attention/query/bias": (2, 8),
    "decoder_block_00/cross_attention/query/kernel": (16, 2, 8),
    "decoder_block_00/cross_attention/value/bias": (2, 8),
    "decoder_block_00/cross_attention/value/kernel": (16, 2, 8),
    "decoder_block_00/cross_attention_norm/bias": (16,),
    "decoder_block_00/cross_attention_norm/scale": (16,),
    "decoder_block_00/cross_graph/attn/vector": (2, 8),
    "decoder_block_00/cross_graph/global_bias": (2,),
    "decoder_block_00/cross_graph/output/bias": (16,),
    "decoder_block_00/cross_graph/output/kernel": (2, 8, 16),
    "decoder_block_00/cross_graph/rel_bias": (2, 5),
    "decoder_block_00/cross_graph/source/kernel": (16, 2, 8),
    "decoder_block_00/cross_graph/target/kernel": (16, 2, 8),
    "decoder_block_00/cross_graph_norm/bias": (16,),
    "decoder_block_00/cross_graph_norm/scale": (16,),
    "decoder_block_00/graph/attn/vector": (2, 8),
    "decoder_block_00/graph/output/bias": (16,),
    "decoder_block_00/graph/output/kernel": (2, 8, 16),
    "decoder_block_00/graph/rel_bias": (2, 3),
    "decoder_block_00/graph/source/kernel": (16, 2, 8),
    "decoder_block_00/graph/target/kernel": (16, 2, 8),
    "decoder_block_00/graph_norm/bias": (16,),
    "decoder_block_00/graph_norm/scale": (16,),
    "decoder_block_00/mlp_in/bias": (32,),
    "decoder_block_00/mlp_in/kernel": (16, 32),
    "decoder_block_00/mlp_norm/bias": (16,),
    "decoder_block_00/mlp_norm/scale": (16,),
    "decoder_block_00/mlp_out/bias": (16,),
    "decoder_block_00/mlp_out/kernel": (32, 16),
    "decoder_block_00/self_attention/key/bias": (2, 8),
    "decoder_block_00/self_attention/key/kernel": (16, 2, 8),
    "decoder_block_00/self_attention/out/bias": (16,),
    "decoder_block_00/self_attention/out/kernel": (2, 8, 16),
    "decoder_block_00/self_attention/query/bias": (2, 8),
    "decoder_block_00/self_attention/query/kernel": (16, 2, 8),
    "decoder_block_00/self_attention/value/bias": (2, 8),
    "decoder_block_00/self_attention/value/kernel": (16, 2, 8),
    "decoder_block_00/self_attention_norm/bias": (16,),
    "decoder_block_00/self_attention_norm/scale": (16,),
    "decoder_input/bias": (16,),
    "decoder_input/kernel": (20, 16),
    "decoder_norm/bias": (16,),
    "decoder_norm/scale": (16,),
    "encoder/block_00/graph/attn/vector": (2, 8),
    "encoder/block_00/graph/global_bias": (2,),
    "encoder/block_00/graph/output/bias": (16,),
    "encoder/block_00/graph/output/kernel": (2, 8, 16),
    "encoder/block_00/graph/rel_bias": (2, 5),
    "encoder/block_00/graph/source/kernel": (16, 2, 8),
    "encoder/block_00/graph/target/kernel": (16, 2, 8),
    "encoder/block_00/graph_norm/bias": (16,),
    "encoder/block_00/graph_norm/scale": (16,),
    "encoder/block_00/mlp_in/bias": (32,),
    "encoder/block_00/mlp_in/kernel": (16, 32),
    "encoder/block_00/mlp_norm/bias": (16,),
    "encoder/block_00/mlp_norm/scale": (16,),
    "encoder/block_00/mlp_out/bias": (16,),
    "encoder/block_00/mlp_out/kernel": (32, 16),
    "encoder/block_00/self_attention/key/bias": (2, 8),
    "encoder/block_00/self_attention/key/kernel": (16, 2, 8),
    "encoder/block_00/self_attention/out/bias": (16,),
    "encoder/block_00/self_attention/out/kernel": (2, 8, 16),
    "encoder/block_00/self_attention/query/bias": (2, 8),
    "encoder/block_00/self_attention/query/kernel": (16, 2, 8),
    "encoder/block_00/self_attention/value/bias": (2, 8),
    "encoder/block_00/self_attention/value/kernel": (16, 2, 8),
    "encoder/block_00/self_attention_norm/bias": (16,),
    "encoder/block_00/self_attention_norm/scale": (16,),
    "encoder/final_norm/bias": (16,),
    "encoder/final_norm/scale": (16,),
    "encoder/global_tokens": (2, 16),
    "encoder_input/bias": (16,),
    "encoder_input/kernel": (20, 16),
    "source_embed/embedding": (11, 16),
    "target_embed/embedding": (9, 16),
}


def test_param_name_snapshot():
    assert _params(Model(**SEQ), _batch()) == SNAPSHOT


def test_classifier_param_names():
    shapes = _params(Model(**CLS, num_layers=1), _image())
    top = {k: v for k, v in shapes.items() if not k.startswith("encoder/block_00/")}
    assert top == {"encoder/final_norm/bias": (16,), "encoder/final_norm/scale": (16,),
                   "encoder/global_tokens": (1, 16), "head/bias": (10,), "head/kernel": (16, 10),
                   "patch_embed/bias": (16,), "patch_embed/kernel": (2 * 2 + 8, 16)}
    assert shapes["encoder/block_00/graph/rel_bias"] == (2, 3 * 3)   # 2-D stencil, radius 1


def _has(shapes, part):
    return any(part in k.split("/") for k in shapes)


def test_ablation_switches_change_the_param_tree():
    base = _params(Model(**SEQ), _batch())
    no_graph = _params(Model(**SEQ, use_graph_conv=False), _batch())
    assert not _has(no_graph, "graph") and not _has(no_graph, "cross_graph")
    assert set(no_graph) < set(base)

    no_hrpe = _params(Model(**SEQ, use_hrpe=False), _batch())
    assert not _has(no_hrpe, "rel_bias") and not _has(no_hrpe, "encoder_input")
    assert no_hrpe["source_pos_embed"] == (16, 16) and no_hrpe["target_pos_embed"] == (16, 16)
    assert _has(no_hrpe, "graph")

    no_global = _params(Model(**SEQ, num_global=0), _batch())
    assert not _has(no_global, "global_tokens") and not _has(no_global, "global_bias")

    v1 = _params(Model(**SEQ, gat_version="v1"), _batch())
    assert _has(v1, "attn_target") and not _has(v1, "target")

    dot = _params(Model(**SEQ, gat_version="dot"), _batch())    # GATv2's tree without `attn`
    assert dot == {k: v for k, v in base.items() if "/attn/" not in k} and len(dot) < len(base)

    assert _params(Model(**SEQ, kl_weight=0.0), _batch()) == base

    last = _params(Model(**{**SEQ, "num_layers": 2}, cross_graph_layers="last"), _batch())
    assert not any(k.startswith("decoder_block_00/cross_graph") for k in last)
    assert any(k.startswith("decoder_block_01/cross_graph") for k in last)

    post = _params(Model(**SEQ, norm="post"), _batch())
    assert not _has(post, "final_norm") and not _has(post, "decoder_norm")

    shared = _params(Model(**{**SEQ, "target_vocab_size": SRC_V}, share_embeddings=True),
                     _batch())
    assert shared["shared_embed/embedding"] == (SRC_V, 16) and not _has(shared, "target_embed")


def test_softmax_baseline_has_the_same_attention_and_no_graph():
    favor = _shapes(Model(**SEQ), _batch())
    soft = _shapes(Model(**SEQ, attention="softmax"), _batch())
    assert "random_features" in favor and "random_features" not in soft   # exact softmax
    fp, sp = param_shapes(favor["params"]), param_shapes(soft["params"])
    assert not _has(sp, "graph") and not _has(sp, "cross_graph")
    assert _has(fp, "global_tokens") and not _has(sp, "global_tokens")   # a vanilla encoder-decoder
    assert {k: v for k, v in fp.items() if "attention/" in k} == \
        {k: v for k, v in sp.items() if "attention/" in k}


# ------------------------------------------------------------------------------------------
# No O(N^2) memory (htgn.md §5.11)
# ------------------------------------------------------------------------------------------


CONFIG = BlockConfig(d_model=16, num_heads=2, mlp_dim=32, num_features=8, window=2, num_global=2,
                     cross_window=2, chunk_size=3)


def test_encoder_block_memory_is_linear_in_length():
    block = EncoderBlock(CONFIG)

    def temp_bytes(n):
        x = jax.ShapeDtypeStruct((1, n, 16), jnp.float32)
        mask = jax.ShapeDtypeStruct((1, n), jnp.bool_)
        pos = jax.ShapeDtypeStruct((n,), jnp.int32)
        fn = lambda v, x, m, p: block.apply(v, x, mask=m, positions=p)[0]
        variables = jax.eval_shape(lambda x, m, p: block.init(jax.random.PRNGKey(0), x, mask=m,
                                                              positions=p), x, mask, pos)
        compiled = jax.jit(fn).lower(variables, x, mask, pos).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(8192)
    assert large / small < 12, (small, large)


@pytest.mark.parametrize("options", [{}, {"gat_version": "v1", "norm": "post", "use_hrpe": False},
                                     {"use_graph_conv": False}])
def test_decoder_block_parallel_equals_step_decoding(options):
    """One wiring, two paths: the block over a sequence == token by token from its cache."""
    config = dataclasses.replace(CONFIG, **options)
    block = DecoderBlock(config)
    t, s = 6, 5
    rng = np.random.default_rng(3)
    y = rng.normal(size=(B, t, 16)).astype(np.float32)
    memory = rng.normal(size=(B, 2 + s, 16)).astype(np.float32)
    memory_mask = np.arange(2 + s)[None, :] < np.array([[2 + s], [2 + s - 2]])
    variables = _module_params(block, y, memory, memory_mask=memory_mask)

    @jax.jit
    def run(variables):
        out, aux = block.apply(variables, y, memory, memory_mask=memory_mask)
        static, state = block.apply(variables, memory, memory_mask, method="init_cache")

        def step(state, inputs):   # the block's step as a pure function: one traced step, not t
            y_t, i = inputs
            y_t, state = block.apply(variables, state, y_t, static, position=i,
                                     method="step")
            return state, y_t
        _, steps = jax.lax.scan(step, state, (jnp.swapaxes(y, 0, 1), jnp.arange(t, dtype=jnp.int32)))
        return out, aux, jnp.swapaxes(steps, 0, 1)

    out, aux, steps = run(variables)
    assert_forms_agree({"parallel": out, "step": steps}, **F32_MODEL)
    assert set(aux) == ({"kl_sum", "kl_count"} if config.use_graph_conv else set())


def test_encoder_aux_sums_the_blocks_kl():
    encoder = Encoder(CONFIG, num_layers=2)
    x = np.random.default_rng(4).normal(size=(B, 5, 16)).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array([[5], [3]])
    memory, aux = jax.jit(encoder.apply)(_module_params(encoder, x, mask), x, mask)
    assert memory.shape == (B, 2 + 5, 16) and set(aux) == {"kl_sum", "kl_count"}
    # Per (head, valid row) terms of both blocks: 2 blocks * 2 heads * (2 + 5 / 2 + 3 rows).
    assert float(aux["kl_count"]) == 2 * 2 * (7 + 5)


def test_the_no_graph_ablation_sets_kl_weight_zero_without_complaint():
    """Its own setting is accepted; the fields of a switched-off part are refused (tests/htgn_jax/bad_arguments_test.py)."""
    model = Model(**SEQ, use_graph_conv=False, kl_weight=0.0)
    assert model.use_graph_conv is False and model.kl_weight == 0.0


def test_the_encoder_checks_the_grid_layout():
    x, mask = np.ones((2, 5, 16), np.float32), np.ones((2, 5), bool)
    encoder = Encoder(dataclasses.replace(CONFIG, window=1, grid_width=2), num_layers=1)
    with pytest.raises(ValueError, match="grid_width=2 lays the tokens out in rows, but there are 5"):
        encoder.init(jax.random.PRNGKey(0), x, mask)


# ------------------------------------------------------------------------------------------
# Packed batches (data.packing; issue 42)
# ------------------------------------------------------------------------------------------

def _packed_examples():
    """Four examples of different lengths, unpacked ([4, 16] / [4, 16]) and packed into rows of the model's
    widths (flax's wmt keys, zoo_core/data/packing.py): several per row."""
    from zoo_core.data import packing
    rng = np.random.default_rng(3)
    src_len, tgt_len = (5, 3, 7, 4), (4, 5, 3, 6)
    inputs, targets = np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)
    for i, (ls, lt) in enumerate(zip(src_len, tgt_len)):
        inputs[i, :ls - 1], inputs[i, ls - 1] = rng.integers(3, SRC_V, ls - 1), 2
        targets[i, :lt - 1], targets[i, lt - 1] = rng.integers(3, TGT_V, lt - 1), 2
    unpacked = {"inputs": inputs, "targets": targets}
    lens = np.stack([packing.lengths(inputs), packing.lengths(targets)], 1)
    starts = packing.assign_rows(lens, (16, 16))
    packed = packing.pack_rows(unpacked, lens, starts, (16, 16), ("inputs", "targets"))
    return unpacked, packed, lens


@pytest.mark.parametrize("kw", [{}, dict(attention="softmax"), dict(use_hrpe=False, skip_offsets=(3,))],
                         ids=["htgn", "softmax", "no_hrpe_skip"])
def test_a_packed_batch_gives_each_example_its_unpacked_logits(kw):
    unpacked, packed, lens = _packed_examples()
    assert packed["inputs"].shape[0] < 4   # several examples share a row
    model, params = _init(**kw)
    got = np.asarray(_logits(model)(params, packed))
    want = np.asarray(_logits(model)(params, unpacked))
    example = 0
    for row in range(packed["targets"].shape[0]):
        for seg in range(1, packed["targets_segmentation"][row].max() + 1):
            where = packed["targets_segmentation"][row] == seg
            np.testing.assert_allclose(got[row][where], want[example, :lens[example, 1]], **F32_MODEL,
                                       err_msg=f"example {example}")
            example += 1
    assert example == 4
    # NaN-free: a packed row's padding holds no NaN in the real logits
    assert np.isfinite(got[packed["targets_segmentation"] > 0]).all()
