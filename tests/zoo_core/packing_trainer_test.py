"""`data.packing=True`: the trainer packs sequence-to-sequence examples as flax's wmt pipeline does
(zoo_core/data/packing.py), deterministically and resumably, weights the loss by the target segmentation,
and reports its padding share."""
import json
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core import tasks, trainer
from zoo_core.data import arrays, packing, pipeline
from zoo_core.run.setup_checks import validate_config

VOCAB = 40


class DocSeq2Seq(nn.Module):
    """A tiny seq2seq model that honours packing: each target token reads the previous target token of its
    own document (BOS at a document's start), its position, and the mean of its document's source
    embeddings. Unpacked, every row is one document."""
    width: int = 8

    @nn.compact
    def __call__(self, batch, *, train=False):
        inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
        src_seg = batch.get("inputs_segmentation", (inputs != 0).astype(jnp.int32))
        tgt_seg = batch.get("targets_segmentation", (targets != 0).astype(jnp.int32))
        pos = batch.get("targets_position", jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape))
        prev = jnp.concatenate([jnp.zeros_like(targets[:, :1]), targets[:, :-1]], axis=1)
        decoder_inputs = jnp.where(pos == 0, 1, prev)
        src = nn.Embed(VOCAB, self.width, name="source_embed")(inputs)                 # [B, S, W]
        same = (tgt_seg[:, :, None] == src_seg[:, None, :]) & (src_seg[:, None, :] > 0)   # [B, T, S]
        context = jnp.einsum("bts,bsw->btw", same.astype(src.dtype), src) / jnp.maximum(
            same.sum(-1, keepdims=True), 1)
        h = (nn.Embed(VOCAB, self.width, name="target_embed")(decoder_inputs) + context
             + nn.Embed(64, self.width, name="position_embed")(pos))
        return {"logits": nn.Dense(VOCAB, name="out")(jnp.tanh(h))}, {}


def _examples(n=23, s=6, t=5, seed=0):
    rng = np.random.default_rng(seed)
    inputs, targets = np.zeros((n, s), np.int32), np.zeros((n, t), np.int32)
    for i in range(n):
        ls, lt = rng.integers(1, s + 1), rng.integers(1, t + 1)
        inputs[i, :ls] = rng.integers(3, VOCAB, ls)
        targets[i, :lt] = rng.integers(3, VOCAB, lt)
    return {"inputs": inputs, "targets": targets, "id": np.arange(n)}


def test_packing_follows_flax_greedy_rows_with_segmentation_and_positions():
    x = np.array([[5, 6, 0, 0], [7, 0, 0, 0], [1, 2, 3, 4], [9, 9, 0, 0]])
    y = np.array([[1, 0, 0], [2, 2, 0], [3, 3, 3], [4, 0, 0]])
    lens = np.stack([packing.lengths(x), packing.lengths(y)], 1)
    starts = packing.assign_rows(lens, (4, 3))
    out = packing.pack_rows({"inputs": x, "targets": y}, lens, starts, (4, 3), ("inputs", "targets"))
    np.testing.assert_array_equal(starts, [0, 2, 3, 4])   # example 2 does not fit row 0: a new row
    np.testing.assert_array_equal(out["inputs"], [[5, 6, 7, 0], [1, 2, 3, 4], [9, 9, 0, 0]])
    np.testing.assert_array_equal(out["inputs_segmentation"], [[1, 1, 2, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(out["inputs_position"], [[0, 1, 0, 0], [0, 1, 2, 3], [0, 1, 0, 0]])
    np.testing.assert_array_equal(out["targets"], [[1, 2, 2], [3, 3, 3], [4, 0, 0]])
    np.testing.assert_array_equal(out["targets_segmentation"], [[1, 2, 2], [1, 1, 1], [1, 0, 0]])
    np.testing.assert_array_equal(out["targets_position"], [[0, 0, 1], [0, 1, 2], [0, 0, 0]])


def _packer(data, seed=3, factor=2):
    source = arrays.ArraySource(data, {})
    return pipeline.make_packer(source, keys=("inputs", "targets"), seed=seed, factor=factor)


def test_the_packed_stream_is_a_function_of_the_step_and_holds_every_example_once_per_epoch():
    data = _examples()
    packer = _packer(data)
    per_epoch = len(packer._starts(0)) - 1
    stream = packer.rows(0, 3 * per_epoch + 2)
    # any window of rows equals the same rows read by a fresh packer (a resumed run), across epochs
    for start, stop in ((0, 4), (per_epoch - 1, per_epoch + 3), (2 * per_epoch + 1, 3 * per_epoch + 2)):
        window = _packer(data).rows(start, stop)
        for k, v in window.items():
            np.testing.assert_array_equal(v, stream[k][start:stop], err_msg=k)
    # epoch 0's rows hold every example once: its tokens, in order within each document
    rows = {k: v[:per_epoch] for k, v in stream.items()}
    got = sorted(tuple(rows["inputs"][r][rows["inputs_segmentation"][r] == s])
                 for r in range(per_epoch) for s in range(1, rows["inputs_segmentation"][r].max() + 1))
    want = sorted(tuple(row[row != 0]) for row in data["inputs"])
    assert got == want
    # the order follows the unpacked pipeline's shuffle (the same seed)
    first = next(pipeline.train_batches(arrays.ArraySource(data, {}), global_batch_size=1, seed=3))["inputs"][0]
    np.testing.assert_array_equal(stream["inputs"][0][stream["inputs_segmentation"][0] == 1], first[first != 0])
    # a resumed pipeline's first batch is the uninterrupted one's batch at that step
    whole = pipeline.packed_train_batches(packer, global_batch_size=2)
    batches = [next(whole) for _ in range(4)]
    resumed = next(pipeline.packed_train_batches(_packer(data), global_batch_size=2, start_step=3))
    for k in resumed:
        np.testing.assert_array_equal(resumed[k], batches[3][k])
    assert packer.stats().padding_packed < packer.stats().padding_unpacked
    assert packer.stats().line().startswith("packing: ")


def test_a_packed_batch_gives_each_examples_unpacked_loss():
    data = _examples(n=7)
    lens = np.stack([packing.lengths(data["inputs"]), packing.lengths(data["targets"])], 1)
    widths = (12, 10)
    starts = packing.assign_rows(lens, widths)
    packed = packing.pack_rows(data, lens, starts, widths, ("inputs", "targets"))
    assert len(starts) - 1 < 7   # several examples share a row
    unpacked = {"inputs": data["inputs"], "targets": data["targets"]}
    model = DocSeq2Seq()
    params = model.init(jax.random.PRNGKey(0), packed)["params"]
    task = tasks.seq2seq(label_smoothing=0.1)

    @jax.jit
    def sums(batch):
        outputs, _ = model.apply({"params": params}, batch)
        return tasks.reduce_metrics(task(outputs, batch), None)

    got, want = sums(packed), sums(unpacked)
    for name in ("loss", "nll", "token_accuracy", "sequence_accuracy"):
        np.testing.assert_allclose(got[name][0], want[name][0], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(got[name][1], want[name][1], rtol=1e-6, err_msg=name)
    # NaN in the padding of a packed row changes nothing
    @jax.jit
    def poisoned_sums(batch):
        logits = model.apply({"params": params}, batch)[0]["logits"]
        logits = jnp.where((batch["targets_segmentation"] > 0)[..., None], logits, jnp.nan)
        return tasks.reduce_metrics(task({"logits": logits}, batch), None)

    again = poisoned_sums(packed)
    np.testing.assert_allclose(again["loss"][0], got["loss"][0], rtol=1e-6)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(packing=True, task="classification"), "task 'classification' has one label per example and cannot pack"),
    (dict(packing=True, packing_factor=0), "data.packing_factor must be an int >= 1"),
    (dict(packing_factor=2), "data.packing_factor=2 sizes packed rows: it needs data.packing=True"),
])
def test_bad_packing_options_are_one_line(overrides, fragment):
    from zoo_core.configs.htgn import number_words
    c = number_words.get_config("smoke")
    c.unlock()
    c.data.packing = overrides.get("packing", False)
    c.data.packing_factor = overrides.get("packing_factor", 1)
    if "task" in overrides:
        c.task = {"name": overrides["task"]}
    with pytest.raises(ValueError) as e:
        validate_config(c)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_packing_trains_a_seq2seq_config_and_reports_its_padding(tmp_path, caplog):
    from zoo_core.configs.htgn import number_words
    c = number_words.get_config("smoke")
    c.unlock()
    c.data.data_dir = str(tmp_path / "data")
    c.data.packing = True
    c.data.packing_factor = 2
    c.total_steps = 3
    c.eval_every_steps = 3
    c.checkpoint.best_metric = ""
    c.model = {}
    with caplog.at_level(logging.INFO):
        result = trainer.train_and_evaluate(c, str(tmp_path / "run"), lambda **kw: DocSeq2Seq(**kw))
    assert np.isfinite(result["eval/loss"])
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("packing: ")]
    assert len(line) == 1 and "padding unpacked ->" in line[0] and "examples per row" in line[0], line
    logged = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    train = [m for m in logged if "train/padding" in m]
    assert train and all(0 <= m["train/padding"] < 1 and m["train/tokens_per_second"] > 0 for m in train)


def test_htgn_refuses_a_packed_batch_where_an_encoder_attention_cannot_pack():
    """Linformer's sequence-wide projection cannot hold per document (issue 42): one line naming it."""
    from htgn_jax import model as htgn_model
    m = htgn_model.Model(kind="seq2seq", variant="test", source_vocab_size=VOCAB, target_vocab_size=VOCAB,
                         max_source_len=12, max_target_len=10, attention="linformer")
    data = _examples(n=4)
    lens = np.stack([packing.lengths(data["inputs"]), packing.lengths(data["targets"])], 1)
    packed = packing.pack_rows(data, lens, packing.assign_rows(lens, (12, 10)), (12, 10), ("inputs", "targets"))
    with pytest.raises(ValueError) as e:
        m.init(jax.random.PRNGKey(0), packed)
    assert "take no segment_ids: the encoder attention 'linformer'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_htgn_trains_number_words_packed_and_reports_its_padding(tmp_path, caplog):
    """The brief's command, in process: `python -m htgn_jax.train --config configs/htgn/number_words.py:smoke
    --config.data.packing=True` (rows of two examples' widths)."""
    from htgn_jax import model as htgn_model
    from zoo_core.configs.htgn import number_words
    c = number_words.get_config("smoke")
    c.unlock()
    c.data.data_dir = str(tmp_path / "data")
    c.data.packing = True
    c.data.packing_factor = 2
    c.checkpoint.best_metric = ""
    with caplog.at_level(logging.INFO):
        result = trainer.train_and_evaluate(c, str(tmp_path / "run"), htgn_model.Model)
    assert np.isfinite(result["eval/loss"])
    assert any(r.getMessage().startswith("packing: ") for r in caplog.records)
    logged = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert any("train/padding" in m for m in logged)


def test_a_packed_run_resumes_bit_identically(tmp_path):
    from zoo_core.configs.htgn import number_words
    from zoo_core.run import checkpoint as ckpt_lib

    def config(steps):
        c = number_words.get_config("smoke")
        c.unlock()
        c.data.data_dir = str(tmp_path / "data")
        c.data.packing = True
        c.data.packing_factor = 2
        c.total_steps = steps
        c.eval_every_steps = 0
        c.checkpoint_every_steps = 2
        c.checkpoint.best_metric = ""
        c.model = {}
        return c

    build = lambda **kw: DocSeq2Seq(**kw)   # noqa: E731
    trainer.train_and_evaluate(config(4), str(tmp_path / "straight"), build)
    trainer.train_and_evaluate(config(2), str(tmp_path / "resumed"), build)
    trainer.train_and_evaluate(config(4), str(tmp_path / "resumed"), build)
    straight, resumed = (ckpt_lib.restore_params(str(tmp_path / w))[0] for w in ("straight", "resumed"))
    for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
