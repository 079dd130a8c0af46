"""The shared trainer: metrics, sharded == single == pmap, accumulation, retracing, NaN stop, configs."""
import functools
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from tests.environment import command_env
from zoo_core import mlp_classifier, tasks, trainer
from zoo_core.configs.core import synthetic
from zoo_core.data import pipeline
from zoo_core.run import guard as run_guard
from zoo_core.run import log as run_log
from zoo_core.run import loop, optim, sharding
from zoo_core.run import metrics as metrics_lib
from zoo_core.testing import assert_trees_close


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def _config(data_dir, **overrides):
    c = synthetic.get_config("smoke")
    c.unlock()
    c.data.data_dir = data_dir
    for k, v in overrides.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c


class FixedLogits(nn.Module):
    """Ignores its parameter-free input and returns logits given by the batch (scenic's FakeModel)."""

    @nn.compact
    def __call__(self, batch, *, train=False):
        bias = self.param("bias", nn.initializers.zeros, (1,))
        return {"logits": batch["logits"] + bias}, {"loss/const": jnp.float32(0.25)}


def test_eval_step_metrics_match_numpy():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [1.0, 1.0, 0.0], [0.0, 0.0, 9.0]], np.float32)
    labels = np.array([0, 1, 1, 2])
    mask = np.array([1, 1, 1, 0], np.float32)   # the last row is eval padding
    batch = {"logits": logits, "label": labels, "example_mask": mask}
    model = FixedLogits()
    params = model.init(jax.random.PRNGKey(0), batch)["params"]
    sums = trainer.eval_step(params, batch, model=model, task=tasks.classification())
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -logp[np.arange(4), labels]
    np.testing.assert_allclose(sums["nll"][0] / sums["nll"][1], nll[:3].mean(), rtol=1e-6)
    np.testing.assert_allclose(sums["accuracy"][0] / sums["accuracy"][1], 1 / 3, rtol=1e-6)   # only row 0 right
    np.testing.assert_allclose(sums["loss/const"][0] / sums["loss/const"][1], 0.25, rtol=1e-6)


def test_a_label_the_logits_cannot_express_makes_the_loss_nan():
    """Label 7 with 4 logits: a zero one-hot target would give loss 0 and train silently."""
    logits = {"logits": jnp.zeros((2, 4))}
    loss, _ = tasks.classification()(logits, {"label": jnp.array([1, 7])})["loss"]
    assert np.isfinite(loss[0]) and np.isnan(loss[1])
    tokens = tasks.seq2seq()({"logits": jnp.zeros((1, 3, 4))}, {"targets": jnp.array([[1, 9, 0]])})
    assert np.isnan(tokens["loss"][0][0])


def test_seq2seq_task_weights_tokens_not_sentences():
    logits = jnp.log(jnp.array([[[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], [[0.9, 0.1], [0.5, 0.5], [0.5, 0.5]]]))
    targets = jnp.array([[1, 1, 1], [0, 0, 0]])   # pad_id 0: the second sentence is all padding
    targets = targets.at[1, 0].set(1)             # ... except one token
    out = tasks.reduce_metrics(tasks.seq2seq()({"logits": logits}, {"targets": targets}), None)
    expected = (3 * np.log(2) + -np.log(0.1)) / 4
    np.testing.assert_allclose(out["nll"][0] / out["nll"][1], expected, rtol=1e-5)


def _setup(c, batch):
    model = mlp_classifier.Model(**c.model)
    tx, schedule = optim.make_optimizer(c)
    init = functools.partial(trainer.init_state, model=model, tx=tx)
    state = init(jax.random.PRNGKey(0), jax.tree_util.tree_map(lambda x: x[:1], batch))
    step = functools.partial(trainer.train_step, model=model, tx=tx, task=tasks.classification(),
                             schedule=schedule, accum_steps=int(c.optim.grad_accum_steps))
    return state, step


def _batches(n=3, b=8, f=8):
    rng = np.random.default_rng(0)
    return [{"inputs": rng.normal(size=(b, f)).astype(np.float32),
             "label": rng.integers(0, 4, size=b)} for _ in range(n)]


def test_sharded_equals_single_device_equals_pmap(data_dir):
    assert jax.device_count() == 2, "conftest forces two CPU devices"
    c = _config(data_dir, **{"optim.name": "adamw", "optim.weight_decay": 0.01})
    batches = _batches()
    state0, step = _setup(c, batches[0])

    single = state0
    f = jax.jit(step)
    for b in batches:
        single, _ = f(single, b)

    mesh = sharding.make_mesh()
    sharded = jax.device_put(state0, sharding.replicated(mesh))
    f = jax.jit(step, out_shardings=(sharding.replicated(mesh), sharding.replicated(mesh)))
    for b in batches:
        gb = sharding.global_batch(b, mesh)
        assert gb["inputs"].sharding.spec == P("data")
        sharded, _ = f(sharded, gb)

    pm = sharding.replicate_for_pmap(state0)
    f = jax.pmap(functools.partial(step, axis_name="batch"), axis_name="batch")
    for b in batches:
        pm, _ = f(pm, sharding.pmap_batch(b))
    pm = sharding.unreplicate(pm)

    assert_trees_close(sharded.params, single.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(pm.params, single.params, rtol=1e-5, atol=1e-6)
    assert int(single.step) == int(sharded.step) == int(pm.step) == 3


def test_gradient_accumulation_equals_full_batch(data_dir):
    batches = _batches(n=2)
    full_state, full_step = _setup(_config(data_dir), batches[0])
    acc_state, acc_step = _setup(_config(data_dir, **{"optim.grad_accum_steps": 4}), batches[0])
    for b in batches:
        full_state, full_metrics = jax.jit(full_step)(full_state, b)
        acc_state, acc_metrics = jax.jit(acc_step)(acc_state, b)
    assert_trees_close(acc_state.params, full_state.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc_metrics["train/total_loss"], full_metrics["train/total_loss"], rtol=1e-5)


class TokenLogits(nn.Module):
    """Logits [B, T, V] from a learned table of the input tokens, and a constant aux loss."""

    @nn.compact
    def __call__(self, batch, *, train=False):
        return {"logits": nn.Embed(7, 7, name="table")(batch["inputs"])}, {"loss/const": jnp.float32(0.25)}


def _token_batches(n=2):
    """Even rows have 5 target tokens, odd rows 1: strided micro-batches of 2 get 20 and 4 tokens."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        targets = rng.integers(1, 7, size=(8, 5))
        targets[1::2, 1:] = 0
        out.append({"inputs": rng.integers(1, 7, size=(8, 5)), "targets": targets})
    return out


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_gradient_accumulation_weighs_tokens_as_the_whole_batch(data_dir, mode):
    """A token-weighted loss: micro-batches with different token counts give the whole batch's step."""
    model, task = TokenLogits(), tasks.seq2seq()
    batches = _token_batches()
    tx, schedule = optim.make_optimizer(_config(data_dir, **{"optim.learning_rate": 0.1}))
    init = trainer.init_state(jax.random.PRNGKey(0), jax.tree_util.tree_map(lambda x: x[:1], batches[0]),
                              model=model, tx=tx)
    results = []
    for accum in (1, 2):
        step = functools.partial(trainer.train_step, model=model, tx=tx, task=task, schedule=schedule,
                                 accum_steps=accum)
        state = init
        if mode == "jit":
            for b in batches:
                state, metrics = jax.jit(step)(state, b)
        else:
            state = sharding.replicate_for_pmap(state)
            for b in batches:
                state, metrics = jax.pmap(functools.partial(step, axis_name="batch"), axis_name="batch")(
                    state, sharding.pmap_batch(b))
            state, metrics = sharding.unreplicate(state), sharding.unreplicate(metrics)
        results.append((state, metrics))
    (full, full_metrics), (acc, acc_metrics) = results
    assert_trees_close(acc.params, full.params, rtol=1e-5, atol=1e-6)
    for key in ("train/total_loss", "train/loss", "train/loss/const"):
        np.testing.assert_allclose(acc_metrics[key], full_metrics[key], rtol=1e-5)


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_task_weights_do_not_depend_on_the_outputs(name):
    """The trainer reads a batch's loss weight from zero outputs (trainer.batch_loss_weight)."""
    rng = np.random.default_rng(0)
    batch = {"label": rng.integers(0, 3, size=4), "target": rng.normal(size=(4, 2)),
             "targets": np.array([[1, 2, 0], [3, 0, 0], [1, 1, 1], [2, 0, 0]])}
    outputs = {"logits": rng.normal(size=(4, 3)), "forecast": rng.normal(size=(4, 2))}
    if name == "seq2seq":
        outputs["logits"] = rng.normal(size=(4, 3, 4))
    task = tasks.TASKS[name]()
    zeros = jax.tree_util.tree_map(np.zeros_like, outputs)
    for (_, w), (_, w0) in zip(task(outputs, batch).values(), task(zeros, batch).values()):
        np.testing.assert_array_equal(w, w0)


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_step_flops_count_every_micro_batch(data_dir, tmp_path, mode):
    """XLA's cost analysis counts a loop body once; the logged FLOPs of a step with micro-batches
    are those of the same step on the whole batch."""
    def flops_per_step(accum, workdir):
        c = _config(data_dir, total_steps=2, batch_size=8, log_every_steps=1, eval_every_steps=0,
                    **{"optim.grad_accum_steps": accum, "parallel.mode": mode})
        trainer.train_and_evaluate(c, str(workdir), mlp_classifier.Model)
        train = [r for r in metrics_lib.read_jsonl(str(workdir / "metrics.jsonl")) if "train/total_loss" in r]
        return {round(r["train/gflops_per_second"] / r["train/steps_per_second"], 9) for r in train}

    whole = flops_per_step(1, tmp_path / "whole")
    assert len(whole) == 1 and min(whole) > 0
    assert flops_per_step(4, tmp_path / "micro") == whole


def test_gradient_accumulation_stays_data_parallel(data_dir):
    """With the batch sharded over the devices, every micro-batch is split over them too: the
    compiled step all-reduces gradients and never gathers the batch."""
    batch = _batches(n=1)[0]
    state, step = _setup(_config(data_dir, **{"optim.grad_accum_steps": 2}), batch)
    mesh = sharding.make_mesh()
    f = jax.jit(step, out_shardings=(sharding.replicated(mesh), sharding.replicated(mesh)))
    hlo = f.lower(jax.device_put(state, sharding.replicated(mesh)),
                  sharding.global_batch(batch, mesh)).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo


def test_train_step_does_not_retrace(data_dir):
    batches = _batches(n=4)
    state, step = _setup(_config(data_dir), batches[0])
    @chex.assert_max_traces(n=1)
    def traced(state, batch):
        return step(state, batch)

    f = jax.jit(traced, donate_argnums=(0,))
    for b in batches:
        state, _ = f(state, b)
    chex.clear_trace_counter()


def test_train_and_evaluate_learns_and_writes_artifacts(data_dir, tmp_path):
    c = _config(data_dir, total_steps=60, batch_size=16, eval_batch_size=16, eval_max_examples=0,
                log_every_steps=20, eval_every_steps=30, checkpoint_every_steps=20, **{"optim.learning_rate": 1e-2})
    result = trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert result["eval/accuracy"] > 0.8
    records = metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))
    losses = [r["train/total_loss"] for r in records if "train/total_loss" in r]
    assert losses[-1] < 0.6 * losses[0]
    # Achieved GFLOP/s = the step's FLOPs (XLA's count, the same every interval) x steps/s.
    train = [r for r in records if "train/total_loss" in r]
    per_step = {round(r["train/gflops_per_second"] / r["train/steps_per_second"], 9) for r in train}
    assert len(train) == 3 and len(per_step) == 1 and per_step.pop() > 0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["20", "40", "60"]
    assert os.listdir(tmp_path / "best")               # best by eval/accuracy
    assert json.load(open(tmp_path / "config.json"))["total_steps"] == 60
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    # Running again finds the final checkpoint and trains no further.
    again = trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert again == {}


def test_pmap_mode_trains(data_dir, tmp_path):
    c = _config(data_dir, **{"parallel.mode": "pmap"})
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert os.listdir(tmp_path / "checkpoints") == ["2"]


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
    c = _config(data_dir, total_steps=6, checkpoint_every_steps=2, log_every_steps=1, eval_every_steps=0)
    class Poisoned(nn.Module):
        """Its aux loss is NaN once the learning rate schedule has passed step 3 (via params drift)."""

        @nn.compact
        def __call__(self, batch, *, train=False):
            out, aux = mlp_classifier.MLPClassifier(hidden=8, num_classes=4, name="mlp")(batch, train=train)
            counter = self.param("counter", nn.initializers.zeros, ())
            # counter moves by -lr * d(loss)/d(counter) = -lr * 1 per step: crosses -3.5e-3 at step 4.
            nan = jnp.where(counter < -3.5e-3, jnp.nan, 0.0)
            return out, {**aux, "loss/counter": counter + nan}

    c.optim.name = "adam"
    c.optim.learning_rate = 1e-3
    with pytest.raises(trainer.NonFiniteError, match=r"at step 5 .* the last good checkpoint \(step 4\)"):
        trainer.train_and_evaluate(c, str(tmp_path), lambda **kw: Poisoned())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    # Without a checkpoint before the bad step, the message says so instead of promising one.
    c.checkpoint_every_steps = 0
    with pytest.raises(trainer.NonFiniteError, match="at step 5 .* no checkpoint had been saved"):
        trainer.train_and_evaluate(c, str(tmp_path / "none"), lambda **kw: Poisoned())


@pytest.mark.parametrize("field,value,message", [
    ("optim.name", "sgdd", "unknown optim.name"),
    ("batch_size", 3, "divisible"),
    ("parallel.mode", "spmd", "unknown parallel.mode"),
    ("data.name", "nope", "unknown dataset"),
    ("model.hidden", -1, "hidden"),
    ("eval_also_at_step", -1, "eval_also_at_step must be >= 0"),
    ("optim.grad_clip_norm", -1.0, "grad_clip_norm must be >= 0"),
    ("eval_every_steps", -5, "eval_every_steps must be >= 0"),
    ("checkpoint.best_metric", "eval/acuracy", "best_metric 'eval/acuracy' is not an eval metric"),
    ("checkpoint.best_metric", "accuracy", "must name an eval metric 'eval/<name>'"),
    ("data.eval_split", "dev", "data.eval_split 'dev' is not a split of"),
    ("batch_size", 4096, "batch_size 4096 exceeds the"),
    ("data.eval_split", "dev[:50%]", "data.eval_split 'dev\\[:50%\\]' is not a split of"),
    ("checkpoint.patience", -1, "checkpoint.patience must be an int >= 0"),
])
def test_config_mistakes_fail_before_compiling(data_dir, tmp_path, field, value, message):
    c = _config(data_dir, **{field: value})
    with pytest.raises(trainer.ConfigError, match=message):
        trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert not os.path.exists(tmp_path / "checkpoints" / "2")


class StepProbe(nn.Module):
    """An MLP classifier whose forward pass depends on the training-step index (`uses_feature_step`),
    reporting it.

    aux['loss/step'] = feature_step with zero gradient, so the logged train and eval metrics show which
    index the trainer passed in each call.
    """
    uses_feature_step = True

    @nn.compact
    def __call__(self, batch, *, train=False, feature_step=None):
        assert feature_step is not None, "the trainer must pass feature_step to a model that uses_feature_step"
        out, aux = mlp_classifier.MLPClassifier(hidden=8, num_classes=4, name="mlp")(batch, train=train)
        return out, {**aux, "loss/step": jax.lax.stop_gradient(jnp.asarray(feature_step, jnp.float32))}


def test_a_model_that_uses_the_feature_step_gets_the_update_index_and_the_last_one_at_eval(data_dir, tmp_path):
    c = _config(data_dir, total_steps=4, log_every_steps=1, eval_every_steps=2, checkpoint_every_steps=0)
    seen = []

    def evaluator(params, model, config, *, feature_step):
        seen.append(feature_step)
        return {"probe": float(feature_step)}

    trainer.train_and_evaluate(c, str(tmp_path), lambda **kw: StepProbe(), evaluators=[evaluator])
    records = metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))
    train = [(r["step"], r["train/loss/step"]) for r in records if "train/loss/step" in r]
    evals = [(r["step"], r["eval/loss/step"], r["eval/probe"]) for r in records if "eval/loss/step" in r]
    assert train == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0)]     # update index = state.step
    assert evals == [(2, 1.0, 1.0), (4, 3.0, 3.0)]               # the last update's index
    assert seen == [1, 3]
    assert trainer.eval_feature_step(0) == 0 and trainer.eval_feature_step(5) == 4
    with pytest.raises(ValueError, match="uses_feature_step"):
        trainer.eval_step({}, {"inputs": np.zeros((1, 8), np.float32)}, model=StepProbe(),
                          task=tasks.classification())


def test_eval_steps_are_every_n_the_last_and_the_extra_one(data_dir):
    c = _config(data_dir, total_steps=10, eval_every_steps=4, eval_also_at_step=3)
    assert [s for s in range(1, 11) if trainer.is_eval_step(c, s)] == [3, 4, 8, 10]
    c.eval_every_steps = 0
    assert not any(trainer.is_eval_step(c, s) for s in range(1, 11))


def test_evals_between_counts_the_eval_steps(data_dir):
    c = _config(data_dir, total_steps=10, eval_every_steps=4, eval_also_at_step=3)
    for after in range(11):
        for upto in range(after, 11):
            want = sum(trainer.is_eval_step(c, s) for s in range(after + 1, upto + 1))
            assert trainer.evals_between(c, after, upto) == want, (after, upto)


def test_a_run_at_total_steps_says_so_and_compiles_nothing(data_dir, tmp_path, caplog, monkeypatch):
    c = _config(data_dir)
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    monkeypatch.setattr(loop, "compile_steps", lambda *a: pytest.fail("compiled a finished run"))
    caplog.set_level(logging.INFO)
    assert trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model) == {}
    assert f"has reached total_steps={c.total_steps}: nothing to train" in caplog.text
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before


def test_a_workdir_in_use_by_another_run_is_refused(data_dir, tmp_path):
    """Two runs on one workdir would interleave their checkpoints and metrics.jsonl lines: while one
    holds the workdir's lock, the other is refused naming it; the lock goes with its holder."""
    c = _config(data_dir, total_steps=4)
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    held = run_guard.lock_workdir(str(tmp_path))      # stands for a second process (flock: per open file)
    try:
        with pytest.raises(trainer.ConfigError, match=rf"is in use by a run still going \(pid {os.getpid()} on "):
            trainer.train_and_evaluate(_config(data_dir, total_steps=6), str(tmp_path), mlp_classifier.Model)
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    finally:
        held.close()
    trainer.train_and_evaluate(_config(data_dir, total_steps=6), str(tmp_path), mlp_classifier.Model)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4", "6"]


def test_patience_stops_early_and_a_finished_run_stays_finished(data_dir, tmp_path):
    """lr 1e-30 (no change in float32): the first eval is the best forever, so patience 2 with evals
    every 2 steps stops at 6."""
    c = _config(data_dir, total_steps=20, log_every_steps=2, eval_every_steps=2, checkpoint_every_steps=0,
                **{"optim.learning_rate": 1e-30, "checkpoint.best_metric": "eval/loss",
                   "checkpoint.best_mode": "min", "checkpoint.patience": 2})
    result = trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert result and sorted(os.listdir(tmp_path / "best")) == ["2"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6"]
    records = metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records if "eval/loss" in r] == [2, 4, 6]
    assert trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model) == {}
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6"]
    c.checkpoint.patience = 3                      # more patience: the run goes on from step 6
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6", "8"]
    # Checkpoints gone, best/ left: the old best's step (2) is no reason to stop before training.
    shutil.rmtree(tmp_path / "checkpoints")
    c.checkpoint.patience = 2
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6"]
    # Another best metric on resume: the stored best cannot be compared, so the run trains on; the
    # first eval after resuming (step 8) is the new best and two more without one stop it at 12.
    c.checkpoint.best_metric, c.checkpoint.best_mode = "eval/accuracy", "max"
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "6"]
    assert sorted(os.listdir(tmp_path / "best")) == ["8"]
    c.checkpoint.best_metric = ""
    with pytest.raises(trainer.ConfigError, match="checkpoint.patience stops on evaluations without"):
        trainer.train_and_evaluate(c, str(tmp_path / "other"), mlp_classifier.Model)


_LOAD_ON_ONE_DEVICE = """
import sys, jax, numpy as np
from zoo_core.configs.core import synthetic
from zoo_core import mlp_classifier, trainer
c = synthetic.get_config("smoke")
_, params, step = trainer.load_params(sys.argv[1], mlp_classifier.Model, c)
assert jax.device_count() == 1 and step == 2
np.savez(sys.argv[2], **{"/".join(map(str, k)): np.asarray(v) for k, v in
                         jax.tree_util.tree_flatten_with_path(params)[0]})
"""


def test_load_params_reads_a_checkpoint_of_another_topology(data_dir, tmp_path):
    """Saved replicated over 2 devices here, read back in a 1-device process (a notebook)."""
    c = _config(data_dir)
    trainer.train_and_evaluate(c, str(tmp_path / "run"), mlp_classifier.Model)
    _, params, step = trainer.load_params(str(tmp_path / "run"), mlp_classifier.Model, c)
    root = pathlib.Path(__file__).resolve().parents[2]
    env = command_env()
    subprocess.run([sys.executable, "-c", _LOAD_ON_ONE_DEVICE, str(tmp_path / "run"),
                    str(tmp_path / "one.npz")], cwd=root, env=env, check=True, capture_output=True)
    one = np.load(tmp_path / "one.npz")
    flat = {"/".join(map(str, k)): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert step == 2 and sorted(one.files) == sorted(flat)
    for name, value in flat.items():
        np.testing.assert_array_equal(one[name], value)


def test_models_without_uses_feature_step_get_no_feature_step_argument(data_dir, tmp_path):
    assert trainer.feature_step_kwargs(mlp_classifier.MLPClassifier(hidden=4, num_classes=2), 3) == {}
    assert trainer.feature_step_kwargs(StepProbe(), 3) == {"feature_step": 3}


def test_the_old_step_names_warn_and_a_model_with_the_old_attribute_is_refused():
    for old, new in [("uses_step", "uses_feature_step"), ("step_kwargs", "feature_step_kwargs"),
                     ("eval_step_index", "eval_feature_step")]:
        with pytest.warns(DeprecationWarning, match=new):
            assert getattr(trainer, old) is getattr(trainer, new)
        assert old not in trainer.__all__

    class OldProbe(nn.Module):
        uses_step = True

    with pytest.raises(ValueError, match="now `uses_feature_step`"):
        trainer.feature_step_kwargs(OldProbe(), 3)


def test_evaluate_checkpoint_scores_the_best_checkpoint_on_another_split(data_dir, tmp_path):
    c = _config(data_dir, total_steps=40, batch_size=16, eval_batch_size=16, eval_max_examples=0,
                log_every_steps=20, eval_every_steps=20, checkpoint_every_steps=20, **{"optim.learning_rate": 1e-2})
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    evals = [r for r in metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl")) if "eval/accuracy" in r]
    best = max(evals, key=lambda r: r["eval/accuracy"])
    # The same split again reproduces the logged eval of the best step exactly.
    again = trainer.evaluate_checkpoint(c, str(tmp_path), mlp_classifier.Model, which="best")
    assert again["step"] == best["step"]
    np.testing.assert_allclose(again["eval/accuracy"], best["eval/accuracy"], rtol=1e-6)
    np.testing.assert_allclose(again["eval/loss"], best["eval/loss"], rtol=1e-5)
    assert json.load(open(tmp_path / f"eval_best_{c.data.eval_split}.json"))["step"] == best["step"]
    other = "train" if c.data.eval_split != "train" else "validation"
    latest = trainer.evaluate_checkpoint(c, str(tmp_path), mlp_classifier.Model, which="latest", split=other)
    assert latest["step"] == 40 and 0.0 <= latest["eval/accuracy"] <= 1.0
    assert os.path.exists(tmp_path / f"eval_latest_{other}.json")
    with pytest.raises(trainer.ConfigError, match="which"):
        trainer.evaluate_checkpoint(c, str(tmp_path), mlp_classifier.Model, which="newest")
    with pytest.raises(FileNotFoundError):
        trainer.evaluate_checkpoint(c, str(tmp_path / "empty"), mlp_classifier.Model)


def test_resume_with_torch_one_cycle_and_cycled_beta1_is_exact(data_dir, tmp_path):
    """The inject_hyperparams optimiser state (scheduled lr and beta1) checkpoints and resumes exactly."""
    c = _config(data_dir, total_steps=40, checkpoint_every_steps=20, eval_every_steps=0,
                **{"schedule.name": "one_cycle", "schedule.anneal": "linear", "schedule.pct_start": 0.25,
                   "schedule.cycle_momentum": True})
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    trainer.train_and_evaluate(c, str(full), mlp_classifier.Model)
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "40")
    trainer.train_and_evaluate(c, str(resumed), mlp_classifier.Model)
    assert (resumed / "checkpoints" / "40").exists()    # trained steps 21..40 again after the restore
    logged = [r["step"] for r in metrics_lib.read_jsonl(str(resumed / "metrics.jsonl")) if "train/loss" in r]
    assert logged == sorted(set(logged)) and logged[-1] == 40   # steps 21..40 once, not twice

    def final(workdir):
        mngr = ocp.CheckpointManager(str(workdir / "checkpoints"))
        state = mngr.restore(40, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
        mngr.close()
        return state
    a, b = final(full), final(resumed)
    assert_trees_close(b["params"], a["params"], atol=0.0, rtol=0.0)
    assert_trees_close(b["opt_state"], a["opt_state"], atol=0.0, rtol=0.0)


class SlowStep(nn.Module):
    """An MLP classifier whose training step also runs ~50 chained 256x256 matmuls.

    That makes a step much slower than dispatching one, the situation in which async dispatch lets
    a loop run ahead of the device. (A host callback would not do: it makes execution synchronous.)
    """

    @nn.compact
    def __call__(self, batch, *, train=False):
        out, aux = mlp_classifier.MLPClassifier(hidden=8, num_classes=4, name="mlp")(batch, train=train)
        if train:
            m = jnp.eye(256) + 1e-3 * jnp.mean(out["logits"])
            m = jax.lax.fori_loop(0, 50, lambda _, a: jnp.tanh(a @ a), m)
            aux = {**aux, "loss/busy": 0.0 * jnp.mean(m)}
        return out, aux


def test_at_most_one_training_step_is_in_flight(data_dir, tmp_path, monkeypatch):
    """When the loop asks for the batch of step s, at most step s - 1 is still computing.

    Without the wait the loop would queue all steps up to the next blocking log, and a SIGTERM would
    be answered only after they had run (a real run: 35 steps, 3.4 min). With the wait removed, this
    test saw up to 6 steps pending out of 12.
    """
    c = _config(data_dir, total_steps=12, log_every_steps=100, eval_every_steps=0, checkpoint_every_steps=0)
    step_metrics, pending = [], []
    real_jit, real_batches = jax.jit, pipeline.train_batches

    def recording_jit(fun, *args, **kwargs):
        compiled = real_jit(fun, *args, **kwargs)
        if getattr(fun, "func", None) is not trainer.train_step:
            return compiled

        def call(*a, **k):
            state, metrics = compiled(*a, **k)
            step_metrics.append(metrics)
            return state, metrics
        call.lower = compiled.lower   # the trainer reads the step's FLOPs from its lowering
        return call

    def watched(*args, **kwargs):
        for batch in real_batches(*args, **kwargs):
            pending.append(sum(not all(x.is_ready() for x in jax.tree_util.tree_leaves(m))
                               for m in step_metrics))
            yield batch

    monkeypatch.setattr(jax, "jit", recording_jit)
    monkeypatch.setattr(pipeline, "train_batches", watched)
    trainer.train_and_evaluate(c, str(tmp_path), lambda **kw: SlowStep())
    assert len(step_metrics) == 12 and len(pending) >= 12
    assert max(pending) <= 1, pending


def test_a_checkpoint_with_per_parameter_optimiser_state_is_refused_and_kept(data_dir, tmp_path):
    """A checkpoint written when the optimiser kept one state array per parameter (the same model and
    config) is neither restored into the vector layout nor moved aside as damage."""
    import optax

    from zoo_core.run import checkpoint as ckpt_lib
    c = _config(data_dir, total_steps=2, eval_every_steps=0, checkpoint_every_steps=2)
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    ckpts = ckpt_lib.Checkpoints(str(tmp_path), keep=3)
    saved = ckpts.last.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                          config=ocp.args.JsonRestore()))
    state = dict(saved.state, opt_state=optax.adamw(1e-3).init(saved.state["params"]))   # the per-leaf layout
    shutil.rmtree(tmp_path / "checkpoints" / "2")
    ckpts.last.reload()
    ckpts.save(2, state, saved.config)
    ckpts.close()
    c.total_steps = 4
    with pytest.raises(trainer.ConfigError, match=r"step 2 .* optimiser state in another layout"):
        trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert os.listdir(tmp_path / "checkpoints") == ["2"] and not (tmp_path / "damaged").exists()
    _, params, step = trainer.load_params(str(tmp_path), mlp_classifier.Model, c)
    assert step == 2 and jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(saved.state["params"])


def test_a_workdir_of_another_model_is_refused_and_left_intact(data_dir, tmp_path):
    """A config change that reshapes the state must not count as damage (which would move the run's
    checkpoints aside and restart it from step 0)."""
    c = _config(data_dir, total_steps=2, eval_every_steps=0, checkpoint_every_steps=2)
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    before = json.load(open(tmp_path / "config.json"))
    shutil.rmtree(tmp_path / "best")   # an empty best/ (no eval yet): a refused run must not make it again
    listing = sorted(os.listdir(tmp_path))
    wider = _config(data_dir, total_steps=4, eval_every_steps=0, checkpoint_every_steps=2,
                    **{"model.hidden": c.model.hidden * 2})
    with pytest.raises(trainer.ConfigError, match=r"another config: model.hidden: 32 -> 64") as refused:
        trainer.train_and_evaluate(wider, str(tmp_path), mlp_classifier.Model)
    # Python is told the argument, the command line (main.py) the flag.
    assert "train_and_evaluate(allow_config_change=True)" in str(refused.value)
    command_line = refused.value.command_line
    assert "--allow_config_change" in command_line and "train_and_evaluate" not in command_line
    # Allowed, the change still cannot restore the checkpoint: refused, and no empty best/ is left.
    with pytest.raises(trainer.ConfigError, match=r"step 2 .* another model or config \(params/.* is"):
        trainer.train_and_evaluate(wider, str(tmp_path), mlp_classifier.Model, allow_config_change=True)
    assert os.listdir(tmp_path / "checkpoints") == ["2"] and not (tmp_path / "damaged").exists()
    assert sorted(os.listdir(tmp_path)) == listing
    assert json.load(open(tmp_path / "config.json")) == before
    # The same config still resumes from it.
    c.total_steps = 4
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def test_a_split_slice_is_a_valid_eval_split(data_dir, tmp_path):
    c = _config(data_dir, eval_max_examples=0)
    c.data.eval_split = f"{c.data.eval_split}[:50%]"
    result = trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert 0.0 <= result["eval/accuracy"] <= 1.0


class TinySeq(nn.Module):
    """Token logits from the input token alone: enough for a seq2seq loss with real gradients."""

    @nn.compact
    def __call__(self, batch, *, train=False):
        return {"logits": nn.Dense(5, name="out")(jax.nn.one_hot(batch["inputs"], 5))}, {}


def test_pmap_weighs_tokens_like_jit_when_devices_hold_different_token_counts(data_dir):
    """Device 0 holds 16 target tokens, device 1 only 4: the loss and gradient are the global token
    means either way (a mean of per-device means would weigh device 1's tokens four times as much)."""
    rng = np.random.default_rng(0)
    targets = rng.integers(1, 5, (8, 4)).astype(np.int32)
    targets[4:, 1:] = 0                                              # pad_id 0
    batch = {"inputs": rng.integers(0, 5, (8, 4)).astype(np.int32), "targets": targets}
    c = _config(data_dir, **{"optim.name": "adam"})
    tx, schedule = optim.make_optimizer(c)
    model = TinySeq()
    state = trainer.init_state(jax.random.PRNGKey(0), jax.tree_util.tree_map(lambda x: x[:1], batch),
                               model=model, tx=tx)
    step = functools.partial(trainer.train_step, model=model, tx=tx, task=tasks.seq2seq(), schedule=schedule)
    _, single = jax.jit(step)(state, batch)
    f = jax.pmap(functools.partial(step, axis_name="batch"), axis_name="batch")
    _, per_device = f(sharding.replicate_for_pmap(state), sharding.pmap_batch(batch))
    pm = sharding.unreplicate(per_device)
    for key in ("train/loss", "train/l2_grads"):
        np.testing.assert_allclose(pm[key], single[key], rtol=1e-5, err_msg=key)


def test_logged_train_metrics_are_weighted_by_examples_or_tokens():
    """Two steps with 3 and 1 target tokens: the logged token accuracy is 3/4, not the mean 1/2."""
    history = [{"train/token_accuracy": jnp.float32(1.0), "weight/train/token_accuracy": jnp.float32(3.0),
                "train/learning_rate": jnp.float32(1.0)},
               {"train/token_accuracy": jnp.float32(0.0), "weight/train/token_accuracy": jnp.float32(1.0),
                "train/learning_rate": jnp.float32(0.0)}]
    assert run_log.mean_metrics(history) == {"train/token_accuracy": 0.75, "train/learning_rate": 0.5}


def test_a_model_whose_outputs_do_not_fit_the_task_fails_at_setup(data_dir, tmp_path):
    """Traced before any compile (a one-line ConfigError), not at the first train step."""
    class WrongRank(nn.Module):
        @nn.compact
        def __call__(self, batch, *, train=False):
            w = self.param("w", nn.initializers.zeros, (1,))
            return {"logits": jnp.zeros(batch["inputs"].shape[:1] + (3, 4)) + w}, {}

    c = _config(data_dir, **{"checkpoint.best_metric": ""})
    with pytest.raises(trainer.ConfigError):
        trainer.train_and_evaluate(c, str(tmp_path), lambda **kw: WrongRank())
    assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


def test_a_run_builds_its_model_task_optimiser_and_data_builder_once(data_dir, tmp_path, monkeypatch):
    """The setup checks what it builds and keeps it: nothing is built for a check and built again."""
    from zoo_core import data as data_lib
    calls = {"model": 0, "task": 0, "optimizer": 0, "builder": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tasks, "make_task", counted("task", tasks.make_task))
    monkeypatch.setattr(optim, "make_optimizer", counted("optimizer", optim.make_optimizer))
    monkeypatch.setattr(data_lib, "make_builder", counted("builder", data_lib.make_builder))
    trainer.train_and_evaluate(_config(data_dir, total_steps=2), str(tmp_path), counted("model", mlp_classifier.Model))
    assert calls == {"model": 1, "task": 1, "optimizer": 1, "builder": 1}


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_evaluate_checkpoint_builds_through_the_run_setup_once(data_dir, tmp_path, monkeypatch, mode):
    """--eval_only takes the training run's path: `check_setup` then `compile_steps` (jit or pmap), each
    piece built once, and scores the checkpoint as the run's own evaluation did."""
    from zoo_core import data as data_lib
    from zoo_core.run import evaluation
    c = _config(data_dir, total_steps=2, eval_every_steps=2, eval_max_examples=0, **{"parallel.mode": mode})
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    logged = [r for r in metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl")) if "eval/loss" in r][-1]
    calls = {"model": 0, "task": 0, "optimizer": 0, "builder": 0, "check_setup": 0, "compile_steps": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tasks, "make_task", counted("task", tasks.make_task))
    monkeypatch.setattr(optim, "make_optimizer", counted("optimizer", optim.make_optimizer))
    monkeypatch.setattr(data_lib, "make_builder", counted("builder", data_lib.make_builder))
    monkeypatch.setattr(evaluation, "check_setup", counted("check_setup", evaluation.check_setup))
    monkeypatch.setattr(evaluation, "compile_steps", counted("compile_steps", evaluation.compile_steps))
    result = trainer.evaluate_checkpoint(c, str(tmp_path), counted("model", mlp_classifier.Model), which="latest")
    assert result["step"] == logged["step"] == 2
    np.testing.assert_allclose(result["eval/loss"], logged["eval/loss"], rtol=1e-5)
    assert calls == {"model": 1, "task": 1, "optimizer": 1, "builder": 1, "check_setup": 1, "compile_steps": 1}


def test_a_run_ends_with_one_summary_line_naming_steps_best_metric_and_checkpoints(data_dir, tmp_path, capsys,
                                                                                    caplog):
    c = _config(data_dir, total_steps=4, eval_every_steps=2, checkpoint_every_steps=2)
    caplog.set_level(logging.INFO)
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model, print_summary=True)
    printed = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = [(r[c.checkpoint.best_metric], -r["step"]) for r in rows if c.checkpoint.best_metric in r]
    metric, step = max(evals)   # best_mode 'max'; the first of equal values is kept
    step = -step
    want = (f"end of run: 4 of 4 steps; best {c.checkpoint.best_metric}={metric:.6g} at step {step} in "
            f"{tmp_path / 'best'}; latest checkpoint (step 4) in {tmp_path / 'checkpoints'}")
    assert printed == [want]
    # Printed once: the log (stderr on the command line) does not repeat it; without printing, it is logged.
    assert "end of run" not in caplog.text
    # A finished run says the same when called again, with nothing left to train.
    caplog.clear()
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model)
    assert capsys.readouterr().out == "" and caplog.text.count(want) == 1


def test_a_shorter_total_steps_needs_no_other_step_field_changed():
    """`--config.total_steps=1` on the UEA config (eval_also_at_step = one epoch = 17) runs: an extra
    evaluation past the end is none, as an eval_every_steps past the end is."""
    from zoo_core.configs.agf import uea
    from zoo_core.run import setup_checks
    c = uea.get_config("dataset=JapaneseVowels")
    assert c.eval_also_at_step == 17 and c.eval_every_steps == 34
    c.total_steps = 1
    setup_checks.validate_config(c)
    assert [s for s in range(1, 2) if trainer.is_eval_step(c, s)] == [1]
    assert trainer.evals_between(c, 0, 1) == 1
    c.total_steps = 40   # a longer run evaluates there again
    assert [s for s in range(1, 41) if trainer.is_eval_step(c, s)] == [17, 34, 40]


def test_a_setup_checked_for_another_config_is_refused(data_dir, tmp_path):
    c = _config(data_dir, total_steps=2)
    setup = trainer.check_setup(c, mlp_classifier.Model)
    with pytest.raises(ValueError, match="setup must be check_setup"):
        trainer.train_and_evaluate(_config(data_dir, total_steps=2), str(tmp_path), mlp_classifier.Model, setup=setup)
    with pytest.raises(ValueError, match="setup must be check_setup"):
        trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model, setup=setup, evaluators=[lambda *a, **k: {}])
    assert not os.path.exists(tmp_path / "checkpoints")
    trainer.train_and_evaluate(c, str(tmp_path), mlp_classifier.Model, setup=setup)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
