"""Training and greedy decoding of `models.Transformer` on number-words (flax's examples/wmt/train.py
and decode.py, shortened to what a drop-in needs).

The data are made in memory by `zoo_core.data.number_words.make_example` (no download, no dataset
build). Decoding follows flax's convention: `initialize_cache` runs `init` of the `decode=True` model
on the full target length, and each step applies the decoder to one token with `mutable=['cache']`.

    python examples/wmt/train.py --encoder favor --decoder linear --cross cross_graph --steps 300

Run it by its path from any folder (it puts its repository first on `sys.path`), or as
`python -m examples.wmt.train` from the repository root only: `examples` is not an installed package.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:   # run by path: `examples` and this checkout's packages importable
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from examples.wmt.models import Transformer, TransformerConfig, shift_right  # noqa: E402  (after the path)
from zoo_core import attention, checks  # noqa: E402
from zoo_core.data import number_words  # noqa: E402

BOS = number_words.BOS_ID
NUMBERS = 1000   # the numbers the command draws its training and test examples from
TEST_EXAMPLES = 8

# Small options for the mechanisms whose defaults are sized for long sequences.
SMALL_OPTIONS = {"favor": (("num_features", 16),), "window_graph": (("window", 2),),
                 "cross_graph": (("window", 2),), "longformer": (("window", 3), ("num_global", 1))}


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


def parse_args(argv=None) -> argparse.Namespace:
    """The command's arguments; a mechanism outside its role, or a count out of range, is a usage error
    (exit 2, one `error:` line) before anything is built."""
    parser = checks.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="agf", help=f"encoder self-attention: {', '.join(attention.names('self'))}")
    parser.add_argument("--decoder", default="favor",
                        help=f"decoder causal self-attention: {', '.join(attention.names('causal', 'decode'))}")
    parser.add_argument("--cross", default="softmax", help=f"cross-attention: {', '.join(attention.names('cross'))}")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps (>= 1)")
    parser.add_argument("--examples", type=int, default=256,
                        help=f"training examples (1 to {NUMBERS - TEST_EXAMPLES}; {TEST_EXAMPLES} more are decoded)")
    args = parser.parse_args(argv)
    roles = (("--encoder", args.encoder, ("self",), "encoder self-attention"),
             ("--decoder", args.decoder, ("causal", "decode"), "decoder (causal self-attention with a decode cache)"),
             ("--cross", args.cross, ("cross",), "cross-attention"))
    for flag, name, needs, role in roles:
        if name not in attention.names(*needs):
            what = "is not a mechanism" if name not in attention.names() else f"cannot be the {role}"
            parser.error(f"{flag} {name!r} {what}; choose one of {', '.join(attention.names(*needs))}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not 1 <= args.examples <= NUMBERS - TEST_EXAMPLES:
        parser.error(f"--examples must be 1 to {NUMBERS - TEST_EXAMPLES} (numbers below {NUMBERS}, "
                     f"{TEST_EXAMPLES} kept for decoding), got {args.examples}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    config = config_for(args.encoder, args.decoder, args.cross, dropout_rate=0.1)
    numbers = np.random.default_rng(0).choice(NUMBERS, size=args.examples + TEST_EXAMPLES, replace=False)
    train_batch = number_words_batch(numbers[:-TEST_EXAMPLES])
    test_batch = number_words_batch(numbers[-TEST_EXAMPLES:])
    params, losses = train(config, train_batch, steps=args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    tokens, _ = jax.jit(greedy_decode, static_argnums=(2, 3))(
        params, jnp.asarray(test_batch["inputs"]), config, test_batch["targets"].shape[1])
    for n, ids in zip(numbers[-TEST_EXAMPLES:], np.asarray(tokens)):
        print(n, "->", number_words.ids_to_text(ids, "de"))


if __name__ == "__main__":
    main()
