"""Longformer's decoding cache (zoo_core/baselines/longformer_cache.py): the last w and the first g keys and
values. `scan` and `step` give the causal `__call__`'s numbers (a padding mask, packed documents); the
drop-in's `decode=True` cache has the same shapes whatever length `init` saw, and one made on L tokens
decodes 4 L; in a Flax encoder-decoder (examples/wmt) cached greedy decoding equals recomputation with a
cache of O(w + g) memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.wmt import train
from zoo_core import attention
from zoo_core.baselines.longformer import LongformerAttention
from zoo_core.testing import F32_MODEL, F32_SIMPLE, assert_trees_close

B, T, E = 2, 23, 16
MASK = np.arange(T)[None] < np.array([[T], [T - 4]])
MASK[1, 5] = False
IDS = np.array([[1] * 7 + [2] * 10 + [3] * 6, [1] * 3 + [0] * 2 + [4] * 12 + [5] * 6], np.int32)


def _x(t=T, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, t, E))


@pytest.mark.parametrize("window,num_global", [(4, 1), (3, 2), (2, 9)])
def test_scan_and_step_equal_the_causal_call(window, num_global):
    """`scan` with a padding mask and with packed documents, and a `step` loop, against `__call__`."""
    lay = LongformerAttention(num_heads=2, head_dim=8, causal=True, window=window, num_global=num_global)
    params = jax.jit(lay.init)(jax.random.PRNGKey(1), _x())

    def forms(p, x):
        out = {"masked": (lay.apply(p, x, mask=MASK)[0], lay.apply(p, x, mask=MASK, method="scan")[0]),
               "packed": (lay.apply(p, x, segment_ids=IDS)[0], lay.apply(p, x, segment_ids=IDS, method="scan")[0])}
        step = lambda state, x_t: lay.apply(p, state, x_t, method="step")[::-1]
        ys = jax.lax.scan(step, lay.apply(p, B, method="init_state"), jnp.swapaxes(x, 0, 1))[1]
        out["step"] = (lay.apply(p, x)[0], jnp.swapaxes(ys, 0, 1))
        return out

    out = jax.jit(forms)(params, _x())
    valid = {"masked": MASK, "packed": np.ones((B, T), bool), "step": np.ones((B, T), bool)}
    for name, (call, recurrent) in out.items():
        np.testing.assert_allclose(np.asarray(recurrent)[valid[name]], np.asarray(call)[valid[name]],
                                   err_msg=name, **F32_SIMPLE)


def test_the_cache_holds_w_plus_g_tokens_whatever_the_length():
    """The drop-in's 'cache' from `init` on L and on 4 L tokens has the same shapes (w ring slots, g global
    slots); the one made on L decodes 4 L tokens, equal to the causal call on all of them."""
    dec = attention.make("longformer", num_heads=2, qkv_features=E, causal=True, decode=True, window=3,
                         num_global=2)
    short, long = _x(8), _x(32, seed=1)
    cache = jax.jit(dec.init)(jax.random.PRNGKey(0), short)
    shapes = jax.tree_util.tree_map(jnp.shape, cache["cache"])
    assert shapes == jax.tree_util.tree_map(jnp.shape, jax.jit(dec.init)(jax.random.PRNGKey(0), long)["cache"])
    state = cache["cache"]["state"]
    assert state.key.shape == (B, 3, 2, E // 2) and state.global_key.shape == (B, 2, 2, E // 2)
    params = {"params": cache["params"]}

    def decode(params, cache, x):
        def step(cache, x_t):
            y, new = dec.apply({**params, "cache": cache}, x_t[:, None], mutable=["cache"])
            return new["cache"], y[:, 0]
        return jnp.swapaxes(jax.lax.scan(step, cache, jnp.swapaxes(x, 0, 1))[1], 0, 1)

    got = jax.jit(decode)(params, cache["cache"], long)
    plain = attention.make("longformer", num_heads=2, qkv_features=E, causal=True, window=3, num_global=2)
    want = jax.jit(plain.apply)(params, long)
    assert_trees_close(got, want, **F32_SIMPLE)


def test_encoder_decoder_decodes_with_the_cache_as_by_recomputation():
    """examples/wmt with a Longformer decoder (w = 3 < the 12 target tokens): greedy decoding through
    the cache equals the teacher-forced recomputation of the decoded tokens, and the whole 'cache'
    collection has the same shapes for 12 and 48 decoding steps (a softmax decoder's grows with them)."""
    batch = {k: jnp.asarray(v) for k, v in train.number_words_batch([7, 21, 345, 777_777]).items()}
    config = train.config_for("linear", "longformer", "softmax")
    assert dict(config.decoder_options) == {"window": 3, "num_global": 1}
    params = train.init_params(config, batch)
    length = batch["targets"].shape[1]
    tokens, logits = jax.jit(train.greedy_decode, static_argnums=(2, 3))(params, batch["inputs"], config, length)
    recomputed = jax.jit(train.recomputed_logits, static_argnums=3)(params, batch["inputs"], tokens, config)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(recomputed), **F32_MODEL)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(recomputed, -1)), np.asarray(tokens))

    def cache_shapes(cfg, steps):
        cache = jax.eval_shape(lambda i: train.initialize_cache(cfg, i, steps), batch["inputs"])
        return jax.tree_util.tree_map(lambda a: a.shape, cache)
    assert cache_shapes(config, length) == cache_shapes(config, 4 * length)
    softmax = train.config_for("linear", "softmax", "softmax")
    assert cache_shapes(softmax, length) != cache_shapes(softmax, 4 * length)
