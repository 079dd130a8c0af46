"""Task heads of the trainer: how model outputs and a batch become per-example losses and metrics.

A task maps `(outputs, batch)` to `{metric: (values [B], weights [B])}`. The trainer takes
sum(values * weights * example_mask) / sum(weights * example_mask) for every metric, so padded eval
batches are exact and token-level metrics (weights = tokens per example) average over tokens, not
sentences. The metric named 'loss' is the one that is optimised; the model's `aux['loss/*']` terms are
added to it by the trainer.

The weights are a function of the batch alone, never of the outputs: the trainer reads a batch's loss
weight before running the model on its micro-batches (`trainer.batch_loss_weight`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

Metrics = dict[str, tuple[jnp.ndarray, jnp.ndarray]]


def _ones(x):
    return jnp.ones(x.shape[:1], jnp.float32)


def classification(label_smoothing: float = 0.0) -> Callable[[dict, dict], Metrics]:
    """Cross-entropy on outputs['logits'] [B, K] against batch['label'] [B]; accuracy."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"task.label_smoothing must be in [0, 1), got {label_smoothing}")

    def metrics(outputs, batch):
        logits = outputs["logits"].astype(jnp.float32)
        labels = batch["label"].astype(jnp.int32)
        k = logits.shape[-1]
        target = optax.smooth_labels(jax_one_hot(labels, k), label_smoothing)
        w = _ones(labels)
        return {
            "loss": (_nan_outside(optax.softmax_cross_entropy(logits, target), labels, k), w),
            "nll": (optax.softmax_cross_entropy_with_integer_labels(logits, labels), w),
            "accuracy": ((jnp.argmax(logits, -1) == labels).astype(jnp.float32), w),
        }
    return metrics


def forecast(key: str = "forecast") -> Callable[[dict, dict], Metrics]:
    """MSE (the loss) and MAE of outputs[key] [B, ...] against batch['target'] [B, ...].

    A model that augments its target returns `outputs[key + '_keep']`, a bool mask broadcastable to the
    target (SAMoVAR's channel drop: `[C]`): the target is zero where it is False, as the model's inputs were.
    """

    def metrics(outputs, batch):
        pred = outputs[key].astype(jnp.float32)
        target = batch["target"].astype(jnp.float32)
        if key + "_keep" in outputs:
            target = jnp.where(outputs[key + "_keep"], target, 0.0)
        if pred.shape != target.shape:
            raise ValueError(f"outputs[{key!r}] has shape {pred.shape} but batch['target'] has {target.shape}")
        axes = tuple(range(1, pred.ndim))
        err = pred - target
        w = _ones(pred)
        mse = jnp.mean(err ** 2, axis=axes)
        return {"loss": (mse, w), "mse": (mse, w), "mae": (jnp.mean(jnp.abs(err), axis=axes), w)}
    return metrics


def seq2seq(label_smoothing: float = 0.0, pad_id: int = 0) -> Callable[[dict, dict], Metrics]:
    """Token cross-entropy of outputs['logits'] [B, T, V] against batch['targets'] [B, T] (pad_id ignored).

    Metrics: loss (smoothed), nll, token accuracy (token-weighted) and teacher-forced sequence accuracy.
    A packed batch (`data.packing`, zoo_core/data/packing.py) carries 'targets_segmentation' int [B, T]
    (1, 2, ... per example, 0 = padding): tokens are weighted by it (padding excluded), and the sequence
    accuracy counts each packed example (segment) of a row, weighted by the number of examples.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"task.label_smoothing must be in [0, 1), got {label_smoothing}")

    def metrics(outputs, batch):
        logits = outputs["logits"].astype(jnp.float32)
        targets = batch["targets"].astype(jnp.int32)
        segments = batch.get("targets_segmentation")
        real = (targets != pad_id) if segments is None else (segments > 0)
        valid = real.astype(jnp.float32)
        tokens = jnp.maximum(valid.sum(-1), 1.0)
        soft = optax.smooth_labels(jax_one_hot(targets, logits.shape[-1]), label_smoothing)
        # jnp.where, not a product: a NaN logit at padding must not reach the sums
        per_token = jnp.where(real, _nan_outside(optax.softmax_cross_entropy(logits, soft), targets,
                                                 logits.shape[-1]), 0.0)
        nll = jnp.where(real, optax.softmax_cross_entropy_with_integer_labels(logits, targets), 0.0)
        correct = jnp.where(real, (jnp.argmax(logits, -1) == targets).astype(jnp.float32), 0.0)
        if segments is None:
            sequence = ((correct.sum(-1) == valid.sum(-1)).astype(jnp.float32), _ones(targets))
        else:
            sequence = _segment_accuracy(correct, real, segments.astype(jnp.int32))
        return {
            "loss": (per_token.sum(-1) / tokens, tokens),
            "nll": (nll.sum(-1) / tokens, tokens),
            "token_accuracy": (correct.sum(-1) / tokens, tokens),
            "sequence_accuracy": sequence,
        }
    return metrics


def _segment_accuracy(correct, real, segments):
    """(share of a row's segments with every token correct [B], number of segments [B]) for packed rows:
    one `segment_sum` over (row, segment) ids, O(B T)."""
    b, t = segments.shape
    ids = (jnp.arange(b)[:, None] * (t + 1) + jnp.where(real, segments, 0)).reshape(-1)
    wrong = jax.ops.segment_sum((real & (correct == 0)).astype(jnp.float32).reshape(-1), ids, b * (t + 1))
    present = jax.ops.segment_sum(real.astype(jnp.float32).reshape(-1), ids, b * (t + 1))
    # segment 0 of each row is the padding
    present = present.reshape(b, t + 1)[:, 1:] > 0
    right = present & (wrong.reshape(b, t + 1)[:, 1:] == 0)
    count = present.sum(-1).astype(jnp.float32)
    return right.sum(-1) / jnp.maximum(count, 1.0), count


# The sequence features each task can pack (`data.packing`); a task not named here cannot.
PACKED_FEATURES = {"seq2seq": ("inputs", "targets")}


def packed_features(config: Any) -> tuple[str, ...]:
    """The features `data.packing` packs for `config.task` (raises one line for a task that cannot pack)."""
    name = config.task.name
    if name not in PACKED_FEATURES:
        raise ValueError(f"data.packing=True packs sequence-to-sequence examples; task {name!r} has one "
                         f"label per example and cannot pack (packable tasks: {', '.join(PACKED_FEATURES)})")
    return PACKED_FEATURES[name]


def _nan_outside(loss, labels, k):
    """`loss` where 0 <= label < k, else NaN: a label the logits cannot express would otherwise give a
    zero one-hot target and a zero loss, training silently; NaN stops the run at that step."""
    return jnp.where((labels >= 0) & (labels < k), loss, jnp.nan)


def jax_one_hot(labels, k):
    return (labels[..., None] == jnp.arange(k)).astype(jnp.float32)


TASKS = {"classification": classification, "forecast": forecast, "seq2seq": seq2seq}


def make_task(config: Any) -> Callable[[dict, dict], Metrics]:
    """Builds the task named `config.task.name` with the remaining `config.task` fields as options."""
    options = dict(config.task)
    name = options.pop("name")
    if name not in TASKS:
        raise ValueError(f"unknown task.name {name!r}; choose one of {', '.join(TASKS)}")
    try:
        return TASKS[name](**options)
    except TypeError as e:
        raise ValueError(f"task {name!r} got an option it does not have: {e}") from None


def reduce_metrics(metrics: Metrics, example_mask: jnp.ndarray | None) -> dict[str, tuple[jnp.ndarray, jnp.ndarray]]:
    """{name: (sum of values * weights * mask, sum of weights * mask)}: additive over batches/devices."""
    out = {}
    for name, (values, weights) in metrics.items():
        w = weights if example_mask is None else weights * example_mask
        out[name] = (jnp.sum(values * w), jnp.sum(w))
    return out
