"""Tests of htgn_jax.decoding: cached decoding == recomputation, beam 1 == greedy, beam scores."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax import decoding
from htgn_jax.model import Model
from zoo_core.testing import F32_MODEL

# htgn_jax.validation.check_step's wording (it may still name the keyword by its old name, `step=`).
PASS_FEATURE_STEP, DO_NOT_PASS_FEATURE_STEP = r"pass feature_step=", r"do not pass feature_step"

B, S, MAX_LEN = 2, 7, 7
SRC_V, TGT_V = 11, 9
SEQ = dict(kind="seq2seq", variant="test", num_layers=1, source_vocab_size=SRC_V,
           target_vocab_size=TGT_V, max_target_len=8)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(3, SRC_V, (B, S)).astype(np.int32)
    inputs[0, -1] = 2
    inputs[1, 4], inputs[1, 5:] = 2, 0
    return inputs


def random_params(model, seed=0):
    """Well-scaled random parameters from the abstract init (no compile of model.init)."""
    batch = {"inputs": _inputs(), "targets": np.zeros((B, MAX_LEN), np.int32)}
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), batch)["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        # Larger weights than an init: peaked, seed-dependent distributions make EOS and early
        # stopping likely within MAX_LEN, and near-ties in argmax unlikely.
        noise = rng.normal(0.0, 0.5, leaf.shape).astype(np.float32)
        return jnp.asarray(noise + (1.0 if path[-1].key == "scale" else 0.0))
    return jax.tree_util.tree_map_with_path(draw, shapes)


MODEL = Model(**SEQ)
PARAMS = random_params(MODEL)


def _valid(ids, model):
    """Every row: no PAD/BOS before the first EOS, only PAD after it."""
    for row in np.asarray(ids):
        eos = np.flatnonzero(row == model.eos_id)
        end = eos[0] if eos.size else len(row)
        assert not np.isin(row[:end], [model.pad_id, model.bos_id]).any(), row
        assert np.all(row[end + 1:] == model.pad_id), row


def test_greedy_with_cache_equals_recomputation():
    ids, scores = decoding.greedy_search(MODEL, PARAMS, _inputs(), max_len=MAX_LEN)
    ref_ids, ref_scores = decoding.greedy_search(MODEL, PARAMS, _inputs(), max_len=MAX_LEN,
                                                 use_cache=False)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, **F32_MODEL)
    _valid(ids, MODEL)


def test_beam_size_one_equals_greedy():
    ids, scores = decoding.greedy_search(MODEL, PARAMS, _inputs(), max_len=MAX_LEN)
    beam_ids, beam_scores = decoding.beam_search(MODEL, PARAMS, _inputs(), beam_size=1,
                                                 max_len=MAX_LEN)
    np.testing.assert_array_equal(beam_ids[:, 0], ids)
    np.testing.assert_allclose(beam_scores[:, 0], scores, **F32_MODEL)


def test_beam_scores_match_recomputed_log_probs():
    k = 3
    ids, scores = decoding.beam_search(MODEL, PARAMS, _inputs(), beam_size=k, max_len=MAX_LEN)
    assert ids.shape == (B, k, MAX_LEN) and scores.shape == (B, k)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0), "best first"
    flat = np.asarray(ids).reshape(B * k, MAX_LEN)
    _valid(flat, MODEL)
    assert len({tuple(r) for r in np.asarray(ids)[0]}) == k, "distinct hypotheses"
    recomputed = decoding.sequence_log_probs(MODEL, PARAMS, np.repeat(_inputs(), k, axis=0), flat)
    np.testing.assert_allclose(np.asarray(scores).reshape(-1), recomputed, **F32_MODEL)


def test_cache_equals_recomputation_for_gat_v1_post_norm_relu_without_hrpe():
    model = Model(**SEQ, gat_version="v1", norm="post", feature_map="relu", use_hrpe=False,
                  cross_graph_layers="last")
    params = random_params(model, seed=1)
    ids, scores = decoding.greedy_search(model, params, _inputs(1), max_len=MAX_LEN)
    ref_ids, ref_scores = decoding.greedy_search(model, params, _inputs(1), max_len=MAX_LEN,
                                                 use_cache=False)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, **F32_MODEL)


def test_softmax_baseline_has_no_cache():
    model = Model(**SEQ, attention="softmax")
    assert not model.supports_cache and MODEL.supports_cache


def test_decode_options_and_evaluator_selection():
    import ml_collections

    c = ml_collections.ConfigDict({"task": {"name": "classification"}})
    assert decoding.evaluators_for(c) == []
    c.decode = {"beam_size": 2}
    assert decoding.decode_options(c)["beam_size"] == 2
    c.decode = {"beams": 2}
    with pytest.raises(ValueError, match="unknown keys"):
        decoding.decode_options(c)


def test_redrawn_features_decode_with_the_given_feature_step_cache_equals_recomputation():
    model = Model(**SEQ, redraw_every=2)
    feature_step = jnp.int32(3)          # draw 1
    ids, scores = decoding.greedy_search(model, PARAMS, _inputs(), max_len=MAX_LEN, feature_step=feature_step)
    ref_ids, ref_scores = decoding.greedy_search(model, PARAMS, _inputs(), max_len=MAX_LEN,
                                                 use_cache=False, feature_step=feature_step)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, **F32_MODEL)
    rescored = decoding.sequence_log_probs(model, PARAMS, _inputs(), ids, feature_step=feature_step)
    np.testing.assert_allclose(rescored, scores, **F32_MODEL)
    with pytest.raises(ValueError, match=PASS_FEATURE_STEP):
        decoding.greedy_search(model, PARAMS, _inputs(), max_len=MAX_LEN)
    with pytest.raises(ValueError, match=DO_NOT_PASS_FEATURE_STEP):
        decoding.beam_search(MODEL, PARAMS, _inputs(), beam_size=2, max_len=MAX_LEN, feature_step=3)


def test_decode_step_rejects_a_position_past_the_decoder_table():
    """Position max_target_len would read jnp.take's NaN fill: a concrete one fails clearly."""
    v = {"params": PARAMS}
    inputs = jnp.asarray(_inputs())
    # Shapes only (eval_shape): the check fires while tracing, nothing needs to run.
    memory, memory_mask = jax.eval_shape(lambda: MODEL.apply(v, inputs, inputs != 0, method="encode"))
    static, dynamic = jax.eval_shape(lambda m, mm: MODEL.apply(v, m, mm, method="init_cache"),
                                     memory, memory_mask)
    token = jnp.full((B,), MODEL.bos_id, jnp.int32)
    with pytest.raises(ValueError, match=r"position must be in \[0, max_target_len=8\), got 8"):
        jax.eval_shape(lambda s, d: MODEL.apply(v, s, d, token, 8, method="decode_step"), static, dynamic)
