"""The pure steps of training: `TrainState`, `init_state`, `train_step` and `eval_step`.

Functions of arrays only, jitted (or pmapped) by `zoo_core.run.setup.compile_steps`; the model, optimiser, task and
schedule are static and bound with functools.partial. A model that `uses_feature_step` receives the
training-step index as `feature_step=` in every call (`feature_step_kwargs`); `step` alone means the
one-token method of a layer or model.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from zoo_core import tasks


@flax.struct.dataclass
class TrainState:
    """Everything a step changes. The model, optimiser and task are static and live outside.

    Attributes:
      step: int32 [], optimiser steps taken.
      params: the model's parameter tree.
      opt_state: the optimiser's state (over the raveled parameter vector, `zoo_core.run.optim`).
      rng: uint32 [2], the run's dropout key; step `s` uses fold_in(rng, s), so a resumed run draws the
        same masks as an uninterrupted one.
      bad_step: int32 [], the first step whose loss or gradient was non-finite, or -1. A non-finite step
        leaves params and opt_state untouched, and the host stops the run when it sees bad_step >= 0.
    """
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    bad_step: jax.Array


def init_state(rng: jax.Array, batch: Mapping[str, jax.Array], *, model, tx) -> TrainState:
    """Initialises parameters on `batch` and the optimiser state; pure, so it can be eval_shape'd/jitted."""
    param_rng, dropout_rng = jax.random.split(rng)
    params = model.init({"params": param_rng, "dropout": dropout_rng}, batch, train=False,
                        **feature_step_kwargs(model, jnp.zeros([], jnp.int32)))["params"]
    return TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.fold_in(rng, 1), bad_step=jnp.full([], -1, jnp.int32))


def uses_feature_step(model) -> bool:
    """Whether `model`'s forward pass depends on the training-step index (a true `uses_feature_step`
    attribute, e.g. HTGN's FAVOR+ features redrawn every k steps)."""
    if getattr(model, "uses_step", False) and not hasattr(model, "uses_feature_step"):
        # A model written for the old name would otherwise silently lose its index.
        raise ValueError(f"{type(model).__name__} has `uses_step`, which is now `uses_feature_step`: rename the "
                         "attribute and take the index as `feature_step=`")
    return bool(getattr(model, "uses_feature_step", False))


def feature_step_kwargs(model, feature_step) -> dict[str, Any]:
    """{'feature_step': feature_step} for a model that `uses_feature_step`, else {}: what every model call
    here passes along.

    While training, `feature_step` is the index of the update being computed (state.step); at evaluation
    it is `eval_feature_step(steps_done)`, the index of the last update, so evaluation and decoding use the
    random features the parameters were last trained with (frozen between redraws).
    """
    return {"feature_step": feature_step} if uses_feature_step(model) else {}


def eval_feature_step(steps_done):
    """The training-step index whose step-dependent state (e.g. random features) evaluation uses.

    After `steps_done` updates the last one had index steps_done - 1 (0 before any update).
    """
    if isinstance(steps_done, (int, np.integer)):
        return max(int(steps_done) - 1, 0)
    return jnp.maximum(jnp.asarray(steps_done) - 1, 0)


WEIGHT_PREFIX = "weight/"   # train_step metrics under it are weights, not logged (see mean_metrics)


def _loss_and_metrics(params, batch, rng, feature_step, *, model, task, train: bool, axis_name: str | None = None,
                      loss_weight: jax.Array | None = None):
    """(loss, (metric sums, aux losses)) of one batch: the task's weighted mean loss plus the aux losses.

    `loss_weight`, when given, divides the loss sum instead of this batch's own weight: a micro-batch's
    share of its whole batch's weight (`train_step`).
    """
    outputs, aux = model.apply({"params": params}, batch, train=train, rngs={"dropout": rng} if train else {},
                               **feature_step_kwargs(model, feature_step))
    sums = tasks.reduce_metrics(task(outputs, batch), batch.get("example_mask"))
    aux_losses = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items() if k.startswith("loss/")}
    for k, v in aux_losses.items():
        if v.ndim:
            raise ValueError(f"aux[{k!r}] must be a scalar, got shape {v.shape}")
    total, weight = sums["loss"]
    weight = _device_share(weight, axis_name) if loss_weight is None else loss_weight
    loss = total / weight + sum(aux_losses.values(), jnp.zeros([], jnp.float32))
    return loss, (sums, aux_losses)


def _device_share(weight: jax.Array, axis_name: str | None) -> jax.Array:
    """The loss weight one device divides by: its own without pmap; under pmap the global weight over
    the device count. Each device holds part of the batch, and its loss is then its share of the global
    weighted mean (times the device count, which the caller's pmean divides out), so that tokens weigh
    the same on every device, as in the jit step over the whole batch."""
    if axis_name is None:
        return weight
    return jax.lax.psum(jax.lax.stop_gradient(weight), axis_name) / jax.lax.psum(1, axis_name)


def batch_loss_weight(params, batch, rng, feature_step, *, model, task) -> jax.Array:
    """The weight of `batch`'s loss (examples or tokens, times its example mask), without running the model.

    A task's weights are a function of the batch alone (`zoo_core.tasks`), so the task is evaluated on
    zero outputs of the model's output shapes (`jax.eval_shape`, no compute); XLA drops everything but
    the weights' sum.
    """
    shapes = jax.eval_shape(lambda p, b: model.apply({"params": p}, b, train=True, rngs={"dropout": rng},
                                                     **feature_step_kwargs(model, feature_step))[0],
                            params, batch)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.stop_gradient(tasks.reduce_metrics(task(zeros, batch), batch.get("example_mask"))["loss"][1])


def train_step(state: TrainState, batch: Mapping[str, jax.Array], *, model, tx, task, schedule,
               accum_steps: int = 1, axis_name: str | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimiser step on a global batch.

    With `accum_steps > 1` the batch is split into that many micro-batches whose gradients are summed
    (a lax.scan, so only one micro-batch's activations are live) before one optimiser update. The loss
    is the whole batch's weighted mean: each micro-batch's loss sum is divided by its share of the whole
    batch's weight (`batch_loss_weight`), so its examples or tokens weigh what they weigh in the whole
    batch; aux losses are averaged over the micro-batches, and each micro-batch draws its own dropout.

    Args:
      state: the train state (donated by the caller's jit).
      batch: dict of [B, ...] arrays (B the global batch; under pmap the per-device batch).
      model, tx, task, schedule: static pieces bound with functools.partial.
      accum_steps: micro-batches per step.
      axis_name: the pmap axis; gradients and metrics are averaged over it.

    Returns:
      (new state, metrics): scalar train metrics (loss, task metrics, aux losses, l2 norms, lr).
    """
    rng = jax.random.fold_in(state.rng, state.step)
    if axis_name is not None:
        rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
    grad_fn = jax.value_and_grad(functools.partial(_loss_and_metrics, model=model, task=task, train=True,
                                                   axis_name=axis_name), has_aux=True)
    if accum_steps == 1:
        (loss, (sums, aux_losses)), grads = grad_fn(state.params, batch, rng, state.step)
    else:
        # Strided micro-batches (rows i, i + accum, ...): each device's shard of the batch then holds
        # its part of every micro-batch, so the scan stays data-parallel. Contiguous blocks would put
        # a whole micro-batch on one device and make XLA gather the batch onto every device.
        micro = jax.tree_util.tree_map(
            lambda x: jnp.swapaxes(x.reshape(-1, accum_steps, *x.shape[1:]), 0, 1), batch)

        share = _device_share(batch_loss_weight(state.params, batch, rng, state.step, model=model, task=task),
                              axis_name) / accum_steps

        def accumulate(carry, inputs):
            i, mb = inputs
            out, g = grad_fn(state.params, mb, jax.random.fold_in(rng, i), state.step, loss_weight=share)
            return jax.tree_util.tree_map(jnp.add, carry, (out, g)), None

        zero_out = jax.eval_shape(functools.partial(grad_fn, loss_weight=share), state.params,
                                  jax.tree_util.tree_map(lambda x: x[0], micro), rng, state.step)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zero_out)
        total, _ = jax.lax.scan(accumulate, zeros, (jnp.arange(accum_steps), micro))
        (loss, (sums, aux_losses)), grads = total
        loss = loss / accum_steps
        aux_losses = {k: v / accum_steps for k, v in aux_losses.items()}
        grads = jax.tree_util.tree_map(lambda g: g / accum_steps, grads)
    if axis_name is not None:
        grads, loss, aux_losses = jax.lax.pmean((grads, loss, aux_losses), axis_name)
        sums = jax.lax.psum(sums, axis_name)
    # The update runs on one vector of all parameters (zoo_core.run.optim says why).
    params, unravel = ravel_pytree(state.params)
    grads = ravel_pytree(grads)[0]
    updates, opt_state = tx.update_vector(grads, state.opt_state, params, tx.layout(state.params))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(
        step=state.step + 1,
        params=unravel(jnp.where(finite, optax.apply_updates(params, updates), params)),
        opt_state=keep(opt_state, state.opt_state),
        bad_step=jnp.where(finite | (state.bad_step >= 0), state.bad_step, state.step))
    metrics = {f"train/{k}": s / jnp.maximum(n, 1e-12) for k, (s, n) in sums.items()}
    # The weights (examples or tokens) too, so that the logged average over steps is weighted like an eval.
    metrics.update({f"{WEIGHT_PREFIX}train/{k}": n for k, (s, n) in sums.items()})
    metrics.update({f"train/{k}": v for k, v in aux_losses.items()})
    metrics.update({
        "train/total_loss": loss,
        "train/l2_grads": grad_norm,
        "train/l2_params": optax.tree.norm(params),
        "train/l2_updates": optax.tree.norm(updates),
        "train/learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
    })
    return new_state, metrics


def eval_step(params, batch: Mapping[str, jax.Array], feature_step=None, *, model, task,
              axis_name: str | None = None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Weighted metric sums {name: (sum, weight)} of one eval batch (additive over batches).

    `feature_step` (int32 []) is required for a model that `uses_feature_step`:
    `eval_feature_step(steps_done)`.
    """
    if feature_step is None and uses_feature_step(model):
        raise ValueError(f"eval_step: {type(model).__name__} depends on the training-step index "
                         "(uses_feature_step); pass feature_step=eval_feature_step(steps_done)")
    _, (sums, aux_losses) = _loss_and_metrics(params, batch, None, feature_step, model=model, task=task, train=False)
    count = sums["loss"][1]
    sums = dict(sums, **{k: (v * count, count) for k, v in aux_losses.items()})
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    return sums
