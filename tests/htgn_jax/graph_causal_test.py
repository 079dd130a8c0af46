"""Tests of htgn_jax.graph_causal's chunked forms: `causal_window_chunked_scan` (the CPU form) ==
`causal_window_chunked_parallel` (the accelerator form) == the parallel oracle, dropout bits
included; float64 gradients; NaN-safe padding; and the programs exported for cuda and tpu (no
while loop on the training path of the causal window GAT, nor in the HTGN train step)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from htgn_jax import graph_causal as gc
from htgn_jax import graph_ops
from htgn_jax.graph_layers import WindowGraphAttention
from htgn_jax.model import Model
from zoo_core.testing import F32_SIMPLE, F64, assert_forms_agree, exported_program, while_loops

B, T, H, C, W, CHUNK = 2, 11, 2, 4, 3, 4      # C = 4 does not divide T = 11
FORMS = {"scan": gc.causal_window_chunked_scan, "parallel": gc.causal_window_chunked_parallel}


def _normal(seed, shape, dtype=jnp.float32):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), shape, dtype))


def _inputs(version, dtype=jnp.float32):
    """(query, key, value, attn, state, mask, rel_bias): a carried state with one empty slot, the
    second example padded after 8 tokens."""
    q, k, v = (_normal(s, (B, T, H, C), dtype) for s in (1, 2, 3))
    attn = None if version == "dot" else _normal(4, (H, C), dtype)
    key_dim = None
    if version == "v1":     # one-channel score features, messages separate
        q, k, attn = q[..., :1], k[..., :1], np.ones((H, 1), dtype)
        key_dim = 1
    else:
        v = k
    state = gc.init_window_state(B, W, H, C, key_dim=key_dim)
    state = gc.WindowState(_normal(5, state.value.shape),
                           None if key_dim is None else _normal(6, state.key.shape),
                           np.array([[False, True, True], [True, True, True]]))
    mask = np.arange(T)[None, :] < np.array([[T], [8]])
    return q, k, v, attn, state, mask, _normal(7, (H, W + 1), dtype)


@functools.partial(jax.jit, static_argnames=("form", "shared", "rate"))
def _run(form, shared, rate, q, k, v, attn, state, mask, rel_bias, rng):
    return FORMS[form](q, k, k if shared else v, attn, state, chunk_size=CHUNK, mask=mask,
                       rel_bias=rel_bias, dropout_rate=rate, dropout_rng=rng if rate else None)


@pytest.mark.parametrize("rate", [0.0, 0.3], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("version", ["v1", "v2", "dot"])
def test_chunked_forms_agree(version, rate):
    """scan == parallel (outputs, statistics, final state; dropout drawn per chunk in both), and
    without dropout both equal the parallel (unfold) oracle on state ++ tokens."""
    q, k, v, attn, state, mask, rb = _inputs(version)
    rng = jax.random.PRNGKey(9)
    shared = version != "v1"
    out = {f: _run(f, shared, rate, q, k, v, attn, state, mask, rb, rng) for f in FORMS}
    assert_forms_agree(out, rtol=0.0, atol=0.0) if rate else assert_forms_agree(out, **F32_SIMPLE)
    assert out["parallel"][2].value.shape == state.value.shape
    if rate:
        # Dropout did act: the output differs from the deterministic one.
        det = _run("parallel", shared, 0.0, q, k, v, attn, state, mask, rb, rng)[0]
        assert not np.allclose(out["parallel"][0], det)
        return
    # Oracle: the whole-sequence parallel form, the state's slots prepended as earlier tokens.
    prefix_k = state.value if shared else state.key
    full = lambda a, s: np.concatenate([s, a], axis=1)
    full_mask = np.concatenate([state.valid, mask], axis=1)
    ref, _ = graph_ops.window_graph_attention(
        full(q, np.zeros_like(q[:, :W])), full(k, prefix_k),
        full(k, prefix_k) if shared else full(v, state.value), attn, window=W, causal=True,
        mask=full_mask, rel_bias=rb)
    np.testing.assert_allclose(out["parallel"][0], np.asarray(ref)[:, W:], **F32_SIMPLE)


def test_chunked_forms_gradients_float64(x64):
    q, k, _, attn, state, mask, rb = _inputs("v2", jnp.float64)
    state = state._replace(value=state.value.astype(np.float64))

    def loss(form):
        def f(q, k, attn, rb):
            out, st, _ = FORMS[form](q, k, k, attn, state, chunk_size=CHUNK, mask=mask, rel_bias=rb)
            return jnp.sum(out ** 2) + jnp.sum(st["probs"] * st["log_probs"])
        return f

    args = (q, k, attn, rb)
    check_grads(jax.jit(loss("parallel")), args, order=1, modes=("rev",), **F64)
    grads = {f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(*args) for f in FORMS}
    assert_forms_agree(grads, **F64)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
def test_parallel_form_ignores_garbage_in_padding_and_future(bad):
    q, k, _, attn, state, mask, rb = _inputs("v2")
    run = lambda q, k, m: _run("parallel", True, 0.0, q, k, k, attn, state, m, rb, None)
    clean = run(q, k, mask)
    dirty = run(*(np.where(mask[..., None, None], a, np.float32(bad)) for a in (q, k)), mask)
    valid = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(dirty[0])[valid], np.asarray(clean[0])[valid])
    assert_forms_agree({"clean": clean[1], "dirty": dirty[1]}, rtol=0.0, atol=0.0)
    qf, kf = q.copy(), k.copy()
    qf[:, 6], kf[:, 6] = bad, bad
    future = run(qf, kf, None)
    past = run(q, k, None)
    np.testing.assert_array_equal(np.asarray(future[0])[:, :6], np.asarray(past[0])[:, :6])


def _window_layer_grad(chunk_size):
    layer = WindowGraphAttention(num_heads=H, head_dim=C, window=W, causal=True,
                                 chunk_size=chunk_size, dropout_rate=0.1)
    x = np.zeros((B, 64, H * C), np.float32)
    params = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)

    def grad(params, x):
        def loss(p):
            y, aux = layer.apply(p, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
            return jnp.sum(y ** 2) + aux["kl_sum"]
        return jax.grad(loss)(params)
    return grad, params, x


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_causal_window_training_has_no_loop_on_accelerators(platform):
    """The chunked causal window GAT (kernel and layer, forward and backward, with dropout) exports
    for an accelerator with no while loop; the CPU program keeps its scan over chunks."""
    q, k, _, attn, state, mask, rb = _inputs("v2")

    def kernel(q, k):
        out, st, _ = gc.causal_window_chunked(q, k, k, attn, state, chunk_size=CHUNK, mask=mask,
                                              rel_bias=rb)
        return jnp.sum(out ** 2) + jnp.sum(st["probs"])

    grad_kernel = jax.grad(kernel, argnums=(0, 1))
    assert while_loops(exported_program(grad_kernel, q, k, platform=platform)) == 0
    grad_layer, params, x = _window_layer_grad(16)
    assert while_loops(exported_program(grad_layer, params, x, platform=platform)) == 0
    assert while_loops(exported_program(grad_layer, params, x, platform="cpu")) > 0


def test_htgn_train_step_has_no_loop_on_accelerators():
    """The Seq2Seq model's gradient with feature redraw and dropout: no while loop for cuda or tpu
    (the ORF key chain is unrolled). The targets fit one FAVOR+ chunk, as number_words' do: the
    causal FAVOR+ chunked form is `zoo_core.ops.linear_attention`'s, judged by its own tests."""
    model = Model(kind="seq2seq", variant="test", num_layers=1, source_vocab_size=11,
                  target_vocab_size=9, max_source_len=16, max_target_len=16, redraw_every=10,
                  dropout_rate=0.1, chunk_size=8)
    batch = {"inputs": np.ones((B, 7), np.int32), "targets": np.ones((B, 7), np.int32)}
    feature_step = jnp.int32(3)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch, feature_step=feature_step))

    def grad(params, batch, feature_step):
        def loss(p):
            out, aux = model.apply(p, batch, train=True, feature_step=feature_step,
                                   rngs={"dropout": jax.random.PRNGKey(1)})
            return jnp.sum(out["logits"]) + sum(v for n, v in aux.items() if n.startswith("loss"))
        return jax.grad(loss)(params)

    for platform in ("cuda", "tpu"):
        assert while_loops(exported_program(grad, params, batch, feature_step, platform=platform)) == 0
