"""The KL smoothness term of HTGN's graph attention (htgn.md §5.7), as pure `jnp` functions.

For every valid receiving node i and head h, KL(alpha_i || pi_i) with pi uniform over N(i) (or the
distance prior `kl_tau`), or with kl_mode='neighbour' KL(alpha_i || alpha_{i-1}) between
consecutive rows, slots aligned by relative offset. Every function returns (kl_sum, kl_count), so
that the means over layers, heads and nodes can be formed once, by the model.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core.checks import fail

Array = jax.Array


def attention_kl(probs: Array, log_probs: Array, valid: Array,
                 prior_logits: Array | None = None) -> tuple[Array, Array]:
    """KL(alpha_i || pi_i) over the valid neighbours of i, summed over rows (htgn.md §5.7).

    Uniform prior (`prior_logits` None): KL = sum_j alpha_ij log alpha_ij + log |N(i)|. Otherwise
    pi_i = softmax of `prior_logits` over N(i) and KL = sum_j alpha_ij (log alpha_ij - log pi_ij).
    Rows with |N(i)| = 0 (padded receivers) are left out of both the sum and the count.

    Args:
      probs: alpha, `[B, M, H, K]`.
      log_probs: log alpha, `[B, M, H, K]` (0 where invalid).
      valid: `[B, M, K]` boolean neighbour mask.
      prior_logits: log of the unnormalised prior per neighbour slot, `[K]`, or None (uniform).

    Returns:
      (kl_sum, kl_count): float32 scalars; the number of (row, head) terms is `kl_count`.
    """
    n = jnp.sum(valid, axis=-1).astype(jnp.float32)                      # [B, M]
    if prior_logits is None:
        kl = jnp.sum(probs * log_probs, axis=-1) + jnp.log(jnp.maximum(n, 1.0))[..., None]
    else:
        prior = jnp.where(valid, prior_logits.astype(probs.dtype), -jnp.inf)   # [B, M, K]
        lse = jax.scipy.special.logsumexp(prior, axis=-1, keepdims=True)
        log_prior = jnp.where(valid, prior - jnp.where(jnp.isfinite(lse), lse, 0.0), 0.0)
        kl = jnp.sum(probs * (log_probs - log_prior[:, :, None]), axis=-1)
    has = (n > 0)[..., None]                                              # [B, M, 1]
    kl_sum = jnp.sum(jnp.where(has, kl, 0.0))
    kl_count = jnp.sum(has).astype(jnp.float32) * probs.shape[-2]
    return kl_sum, kl_count


KL_MODES = ("prior", "neighbour")


def check_kl(kl_tau: Any, kl_mode: Any, num_slots: int | None = None) -> None:
    """Checks the KL options (htgn.md §5.7); the models call it too, before any layer is built.

    `num_slots`: neighbours per token row (K + g); with one, both alternatives are constant.
    """
    if kl_mode not in KL_MODES:
        fail(f"`kl_mode` must be one of {KL_MODES}, got {kl_mode!r}")
    if num_slots == 1 and (kl_tau is not None or kl_mode != "prior"):
        fail("`kl_tau` and kl_mode='neighbour' need at least two neighbour slots per row, but "
              "window=0 with no global nodes leaves one (the KL term is then 0 whatever they are)")
    if kl_tau is None:
        return
    if isinstance(kl_tau, bool) or not isinstance(kl_tau, (int, float)) or not 0 < kl_tau < math.inf:
        fail(f"`kl_tau` must be None (uniform KL prior) or a finite number > 0, got {kl_tau!r}")
    if kl_mode != "prior":
        fail(f"`kl_tau` sets the prior of kl_mode='prior', but kl_mode={kl_mode!r}")


def neighbour_kl(probs: Array, log_probs: Array, valid: Array,
                 pair_ok: np.ndarray | None = None) -> tuple[Array, Array]:
    """KL(alpha_i || alpha_{i-1}) of consecutive rows, slots aligned (htgn.md §5.7 `kl_mode`).

    Slot k of row i and of row i-1 is the same relative offset (or the same global node), so the
    term pulls the attention pattern to change slowly along the sequence. The two rows are
    restricted to the slots valid in both and renormalised there, which keeps the KL finite at
    sequence ends and padding. Only pairs with at least two common slots count: with one the KL is
    0 whatever alpha is, and counting it would only dilute the mean (row 0 and padded rows have
    none).

    Args:
      probs, log_probs: alpha and log alpha, `[B, M, H, K]` (0 where invalid).
      valid: `[B, M, K]` boolean.
      pair_ok: bool `[M - 1]` (static) or `[B, M - 1]`, False for pairs (i-1, i) that are not
        neighbours (a grid's row ends, two packed documents), or None for all.

    Returns:
      (kl_sum, kl_count): float32 scalars over (pair, head) terms.
    """
    common = (valid[:, 1:] & valid[:, :-1])[:, :, None]                  # [B, M-1, 1, K]
    if pair_ok is not None:
        pair_ok = jnp.asarray(pair_ok)
        common = common & (pair_ok[None] if pair_ok.ndim == 1 else pair_ok)[:, :, None, None]

    def restricted(p, lp):
        mass = jnp.sum(jnp.where(common, p, 0.0), axis=-1, keepdims=True)
        mass = jnp.where(mass > 0, mass, 1.0)
        return jnp.where(common, p, 0.0) / mass, jnp.where(common, lp - jnp.log(mass), 0.0)

    p, log_p = restricted(probs[:, 1:], log_probs[:, 1:])
    _, log_q = restricted(probs[:, :-1], log_probs[:, :-1])
    kl = jnp.sum(p * (log_p - log_q), axis=-1)                           # [B, M-1, H]
    has = jnp.broadcast_to(jnp.sum(common, axis=-1) >= 2, kl.shape)
    return jnp.sum(jnp.where(has, kl, 0.0)), jnp.sum(has).astype(jnp.float32)


def distance_prior_logits(distances: np.ndarray, num_global: int,
                          kl_tau: float | None) -> Array | None:
    """`[K + g]` logits -dist/tau of the distance KL prior: `distances` per stencil slot (see
    `window_distances`), then 1 per global node. None when `kl_tau` is None (uniform prior)."""
    if kl_tau is None:
        return None
    dist = np.concatenate([np.asarray(distances, np.float64), np.ones(num_global)])
    return jnp.asarray(-dist / kl_tau, jnp.float32)
