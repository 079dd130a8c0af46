"""examples/wmt: a WMT-style encoder-decoder written against MHDPA's call style runs with every
mechanism in every role it fits: it trains on (a tiny in-memory) number-words and its cached greedy
decoding equals the teacher-forced recomputation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.wmt import train
from zoo_core import attention
from zoo_core.testing import F32_MODEL

ENCODER, DECODER, CROSS = attention.names("self"), attention.names("causal", "decode"), attention.names("cross")
# Each mechanism in each role it fits at least once, in len(ENCODER) models.
MODELS = [(ENCODER[i], DECODER[(i + 1) % len(DECODER)], CROSS[i % len(CROSS)]) for i in range(len(ENCODER))]


def test_every_mechanism_appears_in_every_role_it_fits():
    for role, fit in enumerate((ENCODER, DECODER, CROSS)):
        assert {m[role] for m in MODELS} == set(fit)


@functools.lru_cache(maxsize=None)
def _batch():
    batch = train.number_words_batch([7, 21, 99, 110, 345, 1000, 67_890, 777_777])
    return {k: jnp.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize("encoder,decoder,cross", MODELS, ids=["-".join(m) for m in MODELS])
def test_trains_and_cached_decoding_equals_recomputation(encoder, decoder, cross):
    batch = _batch()
    config = train.config_for(encoder, decoder, cross, dropout_rate=0.1)
    params, losses = train.train(config, batch, steps=8, learning_rate=1e-2)
    assert np.isfinite(losses).all() and losses[-1] < 0.75 * losses[0], losses

    length = batch["targets"].shape[1]
    tokens, logits = jax.jit(train.greedy_decode, static_argnums=(2, 3))(params, batch["inputs"], config, length)
    assert tokens.shape == batch["targets"].shape and logits.shape == (*tokens.shape, config.output_vocab_size)
    recomputed = jax.jit(train.recomputed_logits, static_argnums=3)(params, batch["inputs"], tokens, config)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(recomputed), **F32_MODEL)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(recomputed, -1)), np.asarray(tokens))
