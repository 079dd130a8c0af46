"""Greedy and beam-search decoding for `htgn_jax.model.Seq2Seq`, and a BLEU evaluator.

Two step functions share one search loop (a jitted `jax.lax.while_loop` over at most `max_len`
tokens that stops as soon as every sequence has emitted EOS):

* cached (`use_cache=True`, htgn.md §5.4 "Decoding"): per decoder layer the FAVOR+ causal state
  (S `[B, H, M, d_h]`, z `[B, H, M]`), the rolling cache of the last w projected states of the
  causal window GAT, and the cross-attention cache Z_M = phi(K_M)^T V_M, t_M = phi(K_M)^T 1 and
  Cross-Graph memory projections, computed once per source. Every generated token costs O(1)
  attention work (O(M d_h) + O(w d_h) + O((2 w_x + 1 + g) d_h) per head and layer), whatever the
  length;
* recomputation (`use_cache=False`): the full teacher-forced decoder over a fixed `[B, max_len]`
  buffer at every step, reading row t (causality makes the rest irrelevant). O(t) per token; the
  reference for the tests, and the path of the exact-softmax baseline (no constant-size state).

Conventions (`zoo_core.data.number_words`, `zoo_core.data.wmt`): decoding starts from BOS; the
outputs are `[B, max_len]` ids = generated tokens up to and including EOS, then PAD. PAD and BOS
are never generated (their log-probabilities are set to a large negative number, without
renormalising, so beam scores stay the model's log-probabilities).

Random features: a model trained with `redraw_every > 0` (`model.uses_feature_step`) needs
`feature_step=`, the training-step index whose FAVOR+ features the parameters go with
(`zoo_core.trainer.eval_feature_step` of the checkpoint's step); encoding, the caches and every
decoding step use that one draw. The model's methods check it (required with redraws, refused
without) when the search is traced.

Beam search keeps `beam_size` hypotheses per example. A finished hypothesis (EOS emitted) can only
be extended by PAD at no cost, so it keeps its score and competes with the open ones. Scores are
sums of log p(token | prefix, source) over the emitted tokens (EOS included); with
`length_penalty = alpha > 0` the final ranking divides them by ((5 + length) / 6)^alpha (GNMT,
Wu et al. 2016). With beam_size = 1 and alpha = 0 beam search is greedy search.
"""
from __future__ import annotations

__all__ = ["greedy_search", "beam_search", "sequence_log_probs", "length_normaliser", "make_bleu_evaluator"]

import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core import checks, extras

Array = jax.Array

NEG = -1.0e9   # "minus infinity" for banned tokens and dead beams (keeps sums finite)


def _check(model, inputs, max_len: int, use_cache: bool) -> None:
    if not hasattr(model, "decode_step"):
        raise ValueError(f"model must be an htgn_jax Seq2Seq, got {type(model).__name__}")
    if jnp.ndim(inputs) != 2:
        raise ValueError(f"inputs must have rank 2 [B, S], got shape {jnp.shape(inputs)}")
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    if max_len > model.max_target_len:
        raise ValueError(f"max_len={max_len} exceeds the model's max_target_len="
                         f"{model.max_target_len}")
    if use_cache and not model.supports_cache:
        raise ValueError("use_cache=True needs attention='favor' with a kernel feature_map; the "
                         "exact-softmax model decodes with use_cache=False")


def _resolve_cache(model, use_cache: Optional[bool]) -> bool:
    return model.supports_cache if use_cache is None else bool(use_cache)


def _log_probs(model, logits: Array) -> Array:
    """log_softmax over the whole vocabulary, PAD and BOS banned (set to NEG, no renormalising)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return logp.at[..., model.pad_id].set(NEG).at[..., model.bos_id].set(NEG)


def _feature_step_kw(feature_step) -> dict[str, Any]:
    return {} if feature_step is None else {"feature_step": feature_step}


def _make_stepper(model, params, inputs, inputs_mask, max_len: int, use_cache: bool,
                  repeat: int = 1, feature_step=None) -> tuple[Callable, Any]:
    """Encodes once; returns (step(state, token [N], t) -> (log-probs [N, V], state), state0).

    N = B * repeat (beam search repeats every example `repeat` times, beams adjacent). Every leaf
    of the state has N as its leading axis, so beam search can reorder it.
    """
    variables = {"params": params}
    kw = _feature_step_kw(feature_step)
    memory, memory_mask = model.apply(variables, inputs, inputs_mask, method="encode", **kw)
    if repeat > 1:
        memory = jnp.repeat(memory, repeat, axis=0)
        memory_mask = jnp.repeat(memory_mask, repeat, axis=0)
    n = memory.shape[0]
    if use_cache:
        static, dynamic = model.apply(variables, memory, memory_mask, method="init_cache", **kw)

        def step_cached(state, token, t):
            logits, state = model.apply(variables, static, state, token, t, method="decode_step",
                                        **kw)
            return _log_probs(model, logits), state
        return step_cached, dynamic

    def step_recompute(buffer, token, t):
        buffer = jax.lax.dynamic_update_slice_in_dim(buffer, token[:, None].astype(buffer.dtype),
                                                     t, axis=1)
        logits = model.apply(variables, buffer, memory, memory_mask, method="decode", **kw)
        row = jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)
        return _log_probs(model, row), buffer
    return step_recompute, jnp.full((n, max_len), model.pad_id, jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_len", "use_cache"))
def _greedy(model, params, inputs, inputs_mask, max_len: int, use_cache: bool, feature_step):
    advance, state = _make_stepper(model, params, inputs, inputs_mask, max_len, use_cache,
                                   feature_step=feature_step)
    b = inputs.shape[0]
    out = jnp.full((b, max_len), model.pad_id, jnp.int32)
    scores = jnp.zeros((b,), jnp.float32)
    carry = (jnp.zeros((), jnp.int32), jnp.full((b,), model.bos_id, jnp.int32), state, out,
             scores, jnp.zeros((b,), bool))

    def cond(c):
        return (c[0] < max_len) & ~jnp.all(c[5])

    def body(c):
        t, token, state, out, scores, done = c
        logp, state = advance(state, token, t)
        nxt = jnp.argmax(logp, axis=-1).astype(jnp.int32)
        gain = jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0]
        nxt = jnp.where(done, model.pad_id, nxt)
        scores = scores + jnp.where(done, 0.0, gain)
        out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], t, axis=1)
        return t + 1, nxt, state, out, scores, done | (nxt == model.eos_id)

    _, _, _, out, scores, _ = jax.lax.while_loop(cond, body, carry)
    return out, scores


def greedy_search(model, params, inputs, *, max_len: int, inputs_mask=None,
                  use_cache: Optional[bool] = None, feature_step=None) -> tuple[Array, Array]:
    """Greedy decoding.

    Args:
      model: a `Seq2Seq` (unbound module).
      params: its parameters.
      inputs: int `[B, S]` source ids (+ EOS, PAD-padded).
      max_len: decoded length (<= model.max_target_len).
      inputs_mask: optional bool `[B, S]` (default inputs != pad_id).
      use_cache: recurrent state (True), recomputation (False), or None = whatever the model
        supports (cache unless exact softmax).
      feature_step: training-step index selecting the random features; required iff the model
        has redraw_every > 0 (see the module docstring).

    Returns:
      (ids int32 `[B, max_len]` ending with EOS then PAD, scores float32 `[B]` = sum of the
      emitted tokens' log-probabilities).
    """
    use_cache = _resolve_cache(model, use_cache)
    _check(model, inputs, max_len, use_cache)
    return _greedy(model, params, jnp.asarray(inputs), inputs_mask, max_len, use_cache, feature_step)


def length_normaliser(lengths: Array, alpha: float) -> Array:
    """GNMT length penalty ((5 + |y|) / 6)^alpha (1 for alpha = 0)."""
    return ((5.0 + lengths.astype(jnp.float32)) / 6.0) ** alpha


@functools.partial(jax.jit, static_argnames=("model", "max_len", "use_cache", "beam_size",
                                             "length_penalty"))
def _beam(model, params, inputs, inputs_mask, max_len: int, use_cache: bool, beam_size: int,
          length_penalty: float, feature_step):
    k = beam_size
    b = inputs.shape[0]
    advance, state = _make_stepper(model, params, inputs, inputs_mask, max_len, use_cache,
                                   repeat=k, feature_step=feature_step)
    vocab = model.target_vocab_size
    # Only beam 0 is alive at the start, so the first expansion has no duplicates.
    scores = jnp.tile(jnp.asarray([0.0] + [NEG] * (k - 1), jnp.float32), (b, 1))
    seqs = jnp.full((b, k, max_len), model.pad_id, jnp.int32)
    lengths = jnp.zeros((b, k), jnp.int32)
    done = jnp.zeros((b, k), bool)
    token = jnp.full((b * k,), model.bos_id, jnp.int32)
    finished_row = jnp.full((vocab,), NEG, jnp.float32).at[model.pad_id].set(0.0)

    def cond(c):
        return (c[0] < max_len) & ~jnp.all(c[6])

    def body(c):
        t, token, state, seqs, scores, lengths, done = c
        logp, state = advance(state, token, t)
        logp = logp.reshape(b, k, vocab)
        logp = jnp.where(done[..., None], finished_row, logp)
        cand = (scores[..., None] + logp).reshape(b, k * vocab)
        scores, idx = jax.lax.top_k(cand, k)                                # [B, K]
        beam, tok = idx // vocab, (idx % vocab).astype(jnp.int32)
        seqs = jnp.take_along_axis(seqs, beam[..., None], axis=1)
        seqs = jax.lax.dynamic_update_slice_in_dim(seqs, tok[..., None], t, axis=2)
        was_done = jnp.take_along_axis(done, beam, axis=1)
        lengths = jnp.take_along_axis(lengths, beam, axis=1) + (~was_done).astype(jnp.int32)
        done = was_done | (tok == model.eos_id)
        flat = (jnp.arange(b)[:, None] * k + beam).reshape(-1)
        state = jax.tree_util.tree_map(lambda x: jnp.take(x, flat, axis=0), state)
        return t + 1, tok.reshape(-1), state, seqs, scores, lengths, done

    carry = (jnp.zeros((), jnp.int32), token, state, seqs, scores, lengths, done)
    _, _, _, seqs, scores, lengths, _ = jax.lax.while_loop(cond, body, carry)
    rank = scores / length_normaliser(lengths, length_penalty) if length_penalty else scores
    order = jnp.argsort(-rank, axis=1)
    return (jnp.take_along_axis(seqs, order[..., None], axis=1),
            jnp.take_along_axis(scores, order, axis=1))


def beam_search(model, params, inputs, *, beam_size: int, max_len: int, inputs_mask=None,
                length_penalty: float = 0.0,
                use_cache: Optional[bool] = None, feature_step=None) -> tuple[Array, Array]:
    """Beam search (see the module docstring).

    Args:
      model, params, inputs, max_len, inputs_mask, use_cache, feature_step: as in `greedy_search`.
      beam_size: K >= 1 (at most target_vocab_size - 2: PAD and BOS are never generated).
      length_penalty: GNMT alpha >= 0 for the final ranking (0 = raw log-probability).

    Returns:
      (ids int32 `[B, K, max_len]` best first, scores float32 `[B, K]`: the summed log-probs of
      each hypothesis, not length-normalised).
    """
    use_cache = _resolve_cache(model, use_cache)
    _check(model, inputs, max_len, use_cache)
    if not isinstance(beam_size, int) or not 1 <= beam_size <= model.target_vocab_size - 2:
        raise ValueError(f"beam_size must be an int in [1, target_vocab_size - 2 = "
                         f"{model.target_vocab_size - 2}], got {beam_size!r}")
    if not isinstance(length_penalty, (int, float)) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a number >= 0, got {length_penalty!r}")
    return _beam(model, params, jnp.asarray(inputs), inputs_mask, max_len, use_cache, beam_size,
                 float(length_penalty), feature_step)


def sequence_log_probs(model, params, inputs, targets, *, inputs_mask=None, feature_step=None) -> Array:
    """Teacher-forced sum of log p(target token) up to and including the first EOS, `[B]`.

    PAD and BOS are scored as during search (banned, not renormalised), so this recomputes the
    beam scores. targets int `[B, T]` (T <= max_target_len); `feature_step` as in `greedy_search`.
    """
    return _sequence_log_probs(model, params, jnp.asarray(inputs), jnp.asarray(targets),
                               inputs_mask, feature_step)


@functools.partial(jax.jit, static_argnames=("model",))
def _sequence_log_probs(model, params, inputs, targets, inputs_mask, feature_step):
    variables = {"params": params}
    kw = _feature_step_kw(feature_step)
    memory, memory_mask = model.apply(variables, inputs, inputs_mask, method="encode", **kw)
    targets = jnp.asarray(targets, jnp.int32)
    bos = jnp.full(targets.shape[:1] + (1,), model.bos_id, jnp.int32)
    decoder_inputs = jnp.concatenate([bos, targets[:, :-1]], axis=1)
    logits = model.apply(variables, decoder_inputs, memory, memory_mask, method="decode", **kw)
    logp = jnp.take_along_axis(_log_probs(model, logits), targets[..., None], axis=-1)[..., 0]
    before_eos = jnp.cumsum(targets == model.eos_id, axis=1) - (targets == model.eos_id)
    return jnp.sum(jnp.where(before_eos == 0, logp, 0.0), axis=1)


# ---------------------------------------------------------------------------------------------
# Evaluator for the shared trainer.
# ---------------------------------------------------------------------------------------------

DECODE_DEFAULTS = {"beam_size": 1, "length_penalty": 0.0, "max_examples": 0, "max_len": 0,
                   "use_cache": "auto"}
# config.decode.use_cache -> the `use_cache` argument of the searches.
CACHE_MODES = {"auto": None, "cache": True, "recompute": False}


def decode_options(config) -> dict[str, Any]:
    """`config.decode` merged with `DECODE_DEFAULTS`, every value checked (a ValueError naming the key).

    Checked before any training, so that a bad decoding option does not surface only at the first
    evaluation: the value ranges, and against the seq2seq model's fields when `config.model` has them
    (beam_size <= target_vocab_size - 2, max_len <= max_target_len, use_cache='cache' only for a model
    that has a decoding cache). A length penalty with greedy decoding (beam_size 1) would be ignored,
    so it is refused.
    """
    given = dict(config.get("decode", {}) or {})
    unknown = sorted(set(given) - set(DECODE_DEFAULTS))
    if unknown:
        raise ValueError(f"config.decode has unknown keys {unknown}; valid: "
                         f"{sorted(DECODE_DEFAULTS)}")
    out = dict(DECODE_DEFAULTS, **given)
    if out["use_cache"] not in CACHE_MODES:
        raise ValueError(f"config.decode.use_cache must be one of {tuple(CACHE_MODES)}, got "
                         f"{out['use_cache']!r}")
    beam, penalty = out["beam_size"], out["length_penalty"]
    checks.check_int("config.decode.beam_size", beam, 1)
    checks.check_nonnegative("config.decode.length_penalty", penalty)
    if penalty and beam == 1:
        raise ValueError(f"config.decode.length_penalty={penalty} ranks beam hypotheses, and greedy "
                         "decoding (beam_size=1) has none: set beam_size > 1 or length_penalty=0")
    for key in ("max_examples", "max_len"):   # 0: eval_max_examples / the targets' width
        checks.check_int(f"config.decode.{key}", out[key], 0)
    model = config.get("model", None) or {}
    vocab, max_target = model.get("target_vocab_size", None), model.get("max_target_len", None)
    if vocab is not None and beam > vocab - 2:
        raise ValueError(f"config.decode.beam_size={beam} exceeds model.target_vocab_size - 2 = {vocab - 2} "
                         "(PAD and BOS are never generated)")
    if max_target is not None and out["max_len"] > max_target:
        raise ValueError(f"config.decode.max_len={out['max_len']} exceeds model.max_target_len={max_target}")
    if out["use_cache"] == "cache" and model.get("kind", None) == "seq2seq":
        from htgn_jax.model import Model  # pylint: disable=import-outside-toplevel

        if not Model(**dict(model)).supports_cache:
            raise ValueError("config.decode.use_cache='cache' needs model.attention='favor' with a kernel "
                             "feature_map; the exact-softmax model decodes with 'recompute' (or 'auto')")
    return out


def _text_fns(config, builder):
    """(ids -> hypothesis text, BLEU tokenize) for the dataset of `config.data.name`."""
    name = config.data.name
    if name == "number_words":
        from zoo_core.data import number_words  # pylint: disable=import-outside-toplevel

        tgt = number_words.DIRECTIONS[builder.builder_config.direction][1]
        return (lambda ids: number_words.ids_to_text(ids, tgt)), "none"
    if name == "wmt14_en_de":
        from zoo_core.data import wmt  # pylint: disable=import-outside-toplevel

        tokenizer = wmt.load_tokenizer(builder)
        size = tokenizer.get_piece_size()
        # A small corpus can end with fewer pieces than the model's vocabulary (the vocabulary
        # trainer's hard_vocab_limit=False); ids beyond it read as UNK.
        return (lambda ids: wmt.decode(tokenizer, np.where(np.asarray(ids) < size, ids,
                                                           wmt.UNK_ID))), "13a"
    raise ValueError(f"the BLEU evaluator supports data.name 'number_words' and 'wmt14_en_de', "
                     f"got {name!r}")


def make_bleu_evaluator(config) -> Callable[..., Mapping[str, float]]:
    """Evaluator `fn(params, model, config, *, feature_step=None) -> {'bleu', 'chrf', 'exact_match'}`.

    The trainer passes `feature_step` (the last update's index) for a model that `uses_feature_step`.

    Decodes `config.data.eval_split` (the first `config.decode.max_examples` examples, else the
    first `config.eval_max_examples`, else all) in batches of `config.eval_batch_size` with greedy
    search (beam_size 1) or beam search, and scores the texts against 'target_text' with
    `zoo_core.tasks.textmetrics.translation_metrics` (sacrebleu BLEU and chrF, exact match).
    config.decode fields: beam_size (1), length_penalty (0.0), max_examples (0), max_len (0 = the
    targets' width), use_cache ('auto' | 'cache' | 'recompute').
    """
    options = decode_options(config)
    extras.require("text", "the seq2seq evaluation (BLEU, chrF)", ("sacrebleu",))
    cache: dict[str, Any] = {}

    def load():
        if not cache:
            from zoo_core import data as data_lib  # pylint: disable=import-outside-toplevel
            from zoo_core.data import pipeline  # pylint: disable=import-outside-toplevel

            builder = data_lib.make_builder(config.data.name,
                                            pipeline.resolve_data_dir(config.data.data_dir),
                                            **config.data.options.to_dict())
            builder.download_and_prepare()
            source = builder.as_data_source(config.data.eval_split)
            cap = options["max_examples"] or config.get("eval_max_examples", 0) or len(source)
            records = [source[i] for i in range(min(cap, len(source)))]
            cache["inputs"] = np.stack([np.asarray(r["inputs"], np.int32) for r in records])
            cache["targets_width"] = int(np.asarray(records[0]["targets"]).shape[-1])
            cache["refs"] = [r["target_text"] for r in records]
            cache["to_text"], cache["tokenize"] = _text_fns(config, builder)
        return cache

    def evaluate(params, model, cfg, *, feature_step=None) -> dict[str, float]:
        from zoo_core.tasks import textmetrics  # pylint: disable=import-outside-toplevel

        data = load()
        inputs = data["inputs"]
        max_len = options["max_len"] or data["targets_width"]
        use_cache = CACHE_MODES[options["use_cache"]]
        batch = int(cfg.eval_batch_size)
        hyps = []
        for start in range(0, len(inputs), batch):
            chunk = inputs[start:start + batch]
            real = len(chunk)
            if real < batch:   # pad to one shape: one compile
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
            if options["beam_size"] == 1:
                ids, _ = greedy_search(model, params, chunk, max_len=max_len, use_cache=use_cache,
                                       feature_step=feature_step)
            else:
                ids, _ = beam_search(model, params, chunk, beam_size=options["beam_size"],
                                     max_len=max_len, length_penalty=options["length_penalty"],
                                     use_cache=use_cache, feature_step=feature_step)
                ids = ids[:, 0]
            hyps.extend(data["to_text"](row) for row in np.asarray(ids)[:real])
        return textmetrics.translation_metrics(hyps, data["refs"], tokenize=data["tokenize"])

    return evaluate


def evaluators_for(config) -> list:
    """The trainer's extra evaluators: BLEU decoding for seq2seq tasks, none otherwise."""
    if config.task.name == "seq2seq":
        return [make_bleu_evaluator(config)]
    return []
