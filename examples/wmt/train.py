"""Training and greedy decoding of `models.Transformer` on number-words (flax's examples/wmt/train.py
and decode.py, shortened to what a drop-in needs).

The data are made in memory by `zoo_core.data.number_words.make_example` (no download, no dataset
build). Decoding follows flax's convention: `initialize_cache` runs `init` of the `decode=True` model
on the full target length, and each step applies the decoder to one token with `mutable=['cache']`.

    python -m examples.wmt.train --encoder favor --decoder linear --cross cross_graph --steps 300
"""
from __future__ import annotations

import argparse
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.wmt.models import Transformer, TransformerConfig, shift_right
from zoo_core.data import number_words

BOS = number_words.BOS_ID

# Small options for the mechanisms whose defaults are sized for long sequences.
SMALL_OPTIONS = {"favor": (("num_features", 16),), "window_graph": (("window", 2),),
                 "cross_graph": (("window", 2),)}


def number_words_batch(numbers: Sequence[int], direction: str = "en_de") -> dict:
    """In-memory number-words examples: {'inputs' `[N, S_max]`, 'targets' `[N, T_max]`} int32."""
    src, tgt = number_words.DIRECTIONS[direction]
    s_max, t_max = number_words.max_lengths(direction, 1)
    examples = [number_words.make_example([n], src, tgt, s_max, t_max, 1) for n in numbers]
    return {key: np.stack([e[key] for e in examples]) for key in ("inputs", "targets")}


def config_for(encoder: str, decoder: str, cross: str, **kwargs) -> TransformerConfig:
    """A number-words config with the three mechanisms (and their small options)."""
    src, tgt = number_words.vocab_sizes("en_de")
    return TransformerConfig(vocab_size=src, output_vocab_size=tgt, encoder_attention=encoder,
                             decoder_attention=decoder, cross_attention=cross,
                             encoder_options=SMALL_OPTIONS.get(encoder, ()),
                             decoder_options=SMALL_OPTIONS.get(decoder, ()),
                             cross_options=SMALL_OPTIONS.get(cross, ()), **kwargs)


def cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean token cross-entropy over the non-padding targets."""
    weights = targets > 0
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(jnp.where(weights, loss, 0.0)) / jnp.maximum(jnp.sum(weights), 1)


def init_params(config: TransformerConfig, batch: dict, seed: int = 0) -> dict:
    model = Transformer(config.replace(deterministic=True))
    init = jax.jit(lambda rng: model.init(rng, batch["inputs"], shift_right(batch["targets"], BOS)))
    return init(jax.random.PRNGKey(seed))["params"]


def make_train_step(config: TransformerConfig, tx: optax.GradientTransformation):
    """Jitted (params, opt_state, batch, rng) -> (params, opt_state, loss); the mechanisms'
    auxiliary losses (collection 'losses') are added to the cross-entropy."""
    model = Transformer(config)

    @jax.jit
    def train_step(params, opt_state, batch, rng):
        def loss_fn(p):
            logits, state = model.apply({"params": p}, batch["inputs"], shift_right(batch["targets"], BOS),
                                        rngs={"dropout": rng}, mutable=["losses"])
            aux = sum(jax.tree_util.tree_leaves(state.get("losses", {})), jnp.zeros(()))
            return cross_entropy(logits, batch["targets"]) + aux
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def initialize_cache(config: TransformerConfig, inputs: jnp.ndarray, max_decode_len: int) -> dict:
    """The 'cache' collection of the decode model, sized by `init` on `[B, max_decode_len]`."""
    model = Transformer(config.replace(decode=True, deterministic=True))
    targets = jnp.full((inputs.shape[0], max_decode_len), BOS, jnp.int32)
    return model.init(jax.random.PRNGKey(0), inputs, targets)["cache"]


def greedy_decode(params: dict, inputs: jnp.ndarray, config: TransformerConfig,
                  max_decode_len: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Greedy decoding through the cache: (tokens `[B, T]`, the step logits `[B, T, V]`)."""
    model = Transformer(config.replace(decode=True, deterministic=True))
    encoded = model.apply({"params": params}, inputs, method=Transformer.encode)

    def step(carry, _):
        cache, token = carry
        logits, state = model.apply({"params": params, "cache": cache}, encoded, inputs, token[:, None],
                                    mutable=["cache"], method=Transformer.decode)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (state["cache"], token), (token, logits[:, 0])

    start = (initialize_cache(config, inputs, max_decode_len), jnp.full(inputs.shape[:1], BOS, jnp.int32))
    _, (tokens, logits) = jax.lax.scan(step, start, None, length=max_decode_len)
    return tokens.T, jnp.swapaxes(logits, 0, 1)


def recomputed_logits(params: dict, inputs: jnp.ndarray, tokens: jnp.ndarray,
                      config: TransformerConfig) -> jnp.ndarray:
    """The teacher-forced logits `[B, T, V]` of the decoded tokens, without any cache."""
    model = Transformer(config.replace(deterministic=True))
    return model.apply({"params": params}, inputs, shift_right(tokens, BOS))


def train(config: TransformerConfig, batch: dict, *, steps: int, learning_rate: float = 3e-3,
          seed: int = 0) -> tuple[dict, list[float]]:
    """`steps` Adam steps on `batch` (the whole batch each step): (params, losses)."""
    params = init_params(config, batch, seed)
    tx = optax.adam(learning_rate)
    opt_state = tx.init(params)
    train_step = make_train_step(config, tx)
    losses = []
    for i in range(steps):
        params, opt_state, loss = train_step(params, opt_state, batch, jax.random.PRNGKey(seed + 1 + i))
        losses.append(float(loss))
    return params, losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="agf")
    parser.add_argument("--decoder", default="favor")
    parser.add_argument("--cross", default="softmax")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--examples", type=int, default=256)
    args = parser.parse_args(argv)
    config = config_for(args.encoder, args.decoder, args.cross, dropout_rate=0.1)
    numbers = np.random.default_rng(0).choice(1000, size=args.examples + 8, replace=False)
    train_batch, test_batch = number_words_batch(numbers[:-8]), number_words_batch(numbers[-8:])
    params, losses = train(config, train_batch, steps=args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    tokens, _ = jax.jit(greedy_decode, static_argnums=(2, 3))(
        params, jnp.asarray(test_batch["inputs"]), config, test_batch["targets"].shape[1])
    for n, ids in zip(numbers[-8:], np.asarray(tokens)):
        print(n, "->", number_words.ids_to_text(ids, "de"))


if __name__ == "__main__":
    main()
