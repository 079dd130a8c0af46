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
    # One program (one compile) for both: the cached decoding and the recomputation of its tokens.
    def decode_and_recompute(params, inputs):
        tokens, logits = train.greedy_decode(params, inputs, config, length)
        return tokens, logits, train.recomputed_logits(params, inputs, tokens, config)

    tokens, logits, recomputed = jax.jit(decode_and_recompute)(params, batch["inputs"])
    assert tokens.shape == batch["targets"].shape and logits.shape == (*tokens.shape, config.output_vocab_size)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(recomputed), **F32_MODEL)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(recomputed, -1)), np.asarray(tokens))


@pytest.mark.parametrize("argv,message", [
    (["--encoder", "cross_graph"], "--encoder 'cross_graph' cannot be the encoder self-attention; choose one of"),
    (["--decoder", "nope"], "--decoder 'nope' is not a mechanism; choose one of"),
    (["--cross", "window_graph"], "--cross 'window_graph' cannot be the cross-attention; choose one of"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--examples", "0"], "--examples must be 1 to 992"),
    (["--examples", "993"], "--examples must be 1 to 992"),
])
def test_bad_arguments_are_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: " + message), err


def test_the_command_runs_by_path_from_any_folder(tmp_path):
    # Without the repository on PYTHONPATH and from another folder: the script finds its own packages
    # (the bad --steps shows it got as far as its argument checks, after every import).
    import os
    import subprocess
    import sys

    from tests.environment import ROOT, command_env

    env = {k: v for k, v in command_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "wmt" / "train.py"), "--steps", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --steps must be >= 1, got 0"), proc.stderr
    assert os.listdir(tmp_path) == []
    assert "`python -m examples.wmt.train` from the repository root only" in train.__doc__
