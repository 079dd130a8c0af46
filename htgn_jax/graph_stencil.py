"""The stencil machinery shared by HTGN's graph kernels (spec `htgn.md` §3.4): neighbour stacks by
shifted static slices (`unfold`), the masked softmax, the one scoring-and-aggregation kernel every
form runs (`neighbour_attention`: GATv2, GAT v1 as one-channel GATv2, dot product, or kernel
scores), the logit bias row and row gathers. Pure `jnp`; the forms that use them are
`graph_ops` (window, Cross-Graph), `graph_causal` (scan, chunked, step) and `graph_packed`
(packed documents and context-parallel shards).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from htgn_jax.graph_kl import attention_kl
from zoo_core.ops import masking

Array = jax.Array

# `attn` value of the kernelised scores: query/keys are the attention layer's features phi(q),
# phi(k), and alpha_ij = phi(q_i).phi(k_j) e^{b_ij} / sum over N(i) (graph_alpha='attention').
KERNEL = "kernel"
KERNEL_FLOOR = 1e-30   # a non-positive estimate (trig features) gets weight ~0, never NaN
# Default of the GAT-only LeakyReLU slope; the option defaults to None so that dot-product scoring,
# which has none, can refuse any value given explicitly.
NEGATIVE_SLOPE = 0.2                              # LeakyReLU slope of GAT and GATv2


def unfold(x: Array, offsets: Sequence[int], fill: Any = 0) -> Array:
    """Neighbour stack by static shifted slices: out[:, i, k] = x[:, i + offsets[k]] (else fill).

    Args:
      x: `[B, N, ...]`.
      offsets: static integer offsets, K of them.
      fill: value for neighbours outside 0..N-1.

    Returns:
      `[B, N, K, ...]`. Memory O(B N K ...), never O(N^2).
    """
    lo, hi = max(0, -min(offsets)), max(0, max(offsets))
    n = x.shape[1]
    xp = jnp.pad(x, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.stack([xp[:, lo + o: lo + o + n] for o in offsets], axis=2)


def _masked_softmax(logits: Array, valid: Array) -> tuple[Array, Array]:
    """Softmax over the last axis restricted to `valid`; rows with no valid entry give zeros.

    Args:
      logits: `[..., K]` float32.
      valid: boolean, broadcastable to `logits`.

    Returns:
      (probs, log_probs), both `[..., K]`, exactly 0 at invalid entries. The row max is taken
      over valid entries only and exp() only ever sees finite arguments, so fully masked rows
      stay finite in value and gradient (no -inf, no 0 * inf).
    """
    valid = jnp.broadcast_to(valid, logits.shape)
    row_max = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    z = jnp.where(valid, logits - row_max, 0.0)
    e = jnp.where(valid, jnp.exp(z), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    denom = jnp.where(denom > 0, denom, 1.0)
    return e / denom, jnp.where(valid, z - jnp.log(denom), 0.0)


def neighbour_attention(query: Array, keys: Array, values: Array, valid: Array,
                        attn: Array | None, *,
                        bias: Array | None = None, negative_slope: float | None = None,
                        dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                        prior_logits: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """GATv2 (or dot-product) attention of each receiver over an explicit neighbour list.

    The shared kernel of every form here:
      e_mk = sum_c attn[h, c] LeakyReLU(query[m] + keys[m, k])[h, c] + bias[h, k]    (GATv2, GAT)
      e_mk = <query[m], keys[m, k]>_h / sqrt(C) + bias[h, k]                          (attn None)
      e_mk = log max(<query[m], keys[m, k]>_h, 1e-30) + bias[h, k]               (attn 'kernel')
    The last is graph_alpha='attention': query and keys are the attention layer's kernel
    features phi(q), phi(k), so alpha is its kernelised attention renormalised over N(i).
    alpha = masked softmax over k; out_m = sum_k alpha_mk values[m, k].

    Args:
      query: target-side score features `[B, M, H, C]` (W_t h_i).
      keys: source-side score features of the neighbours `[B, M, K, H, C]` (W_s h_j).
      values: messages `[B, M, K, H, D]` (W_s h_j).
      valid: `[B, M, K]` boolean; an edge exists and both ends are real nodes.
      attn: `[H, C]` attention vectors a_h, None for scaled dot-product scoring, or `KERNEL`.
      bias: additive logit bias broadcastable to `[B, M, H, K]`, or None.
      negative_slope: LeakyReLU slope of GAT/GATv2; None means 0.2. Dot-product scoring has none,
        so it must stay None then.
      dropout_rate: dropout on alpha (htgn.md §5.6), used only when `dropout_rng` is given.
      dropout_rng: PRNG key, or None for no dropout.
      prior_logits: `[K]` KL prior logits (see `attention_kl`), or None for the uniform prior.

    Returns:
      out `[B, M, H, D]` and a dict with `probs` and `log_probs` `[B, M, H, K]` (float32 or
      wider, before dropout), `kl_sum`, `kl_count` (scalars, see `attention_kl`).
    """
    # A non-edge may hold another document's node (packing) or an old state slot: NaN there must
    # reach neither the scores nor, through a zero weight, the sum.
    shared = values is keys
    keys = masking.zero_padding(keys, valid)
    values = keys if shared else masking.zero_padding(values, valid)
    slope = NEGATIVE_SLOPE if negative_slope is None else negative_slope
    # Logits, softmax and KL in at least float32 (float64 stays float64).
    acc = jnp.promote_types(jnp.result_type(query, keys), jnp.float32)
    if isinstance(attn, str):
        assert attn == KERNEL, attn
        scores = jnp.einsum("bmhc,bmkhc->bmhk", query, keys, preferred_element_type=acc)
        logits = jnp.log(jnp.maximum(scores, KERNEL_FLOOR))
    elif attn is None:
        logits = jnp.einsum("bmhc,bmkhc->bmhk", query, keys, preferred_element_type=acc)
        logits = logits * (query.shape[-1] ** -0.5)
    else:
        pre = jax.nn.leaky_relu(query[:, :, None] + keys, slope)             # [B, M, K, H, C]
        logits = jnp.einsum("bmkhc,hc->bmhk", pre, attn.astype(pre.dtype),
                            preferred_element_type=acc)
    if bias is not None:
        logits = logits + bias.astype(acc)
    probs, log_probs = _masked_softmax(logits, valid[:, :, None, :])
    kl_sum, kl_count = attention_kl(probs, log_probs, valid, prior_logits)
    weights = probs
    if dropout_rng is not None and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        weights = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bmhk,bmkhd->bmhd", weights.astype(values.dtype), values)
    return out, {"probs": probs, "log_probs": log_probs, "kl_sum": kl_sum, "kl_count": kl_count}


def bias_row(rel_bias: Array | None, global_bias: Array | None, heads: int, num_window: int,
              num_global: int) -> Array | None:
    """[H, K+g] logit bias: rel_bias for the window columns, global_bias for the global ones."""
    if rel_bias is None and global_bias is None:
        return None
    dtype = (rel_bias if rel_bias is not None else global_bias).dtype
    rb = rel_bias if rel_bias is not None else jnp.zeros((heads, num_window), dtype)
    if not num_global:
        return rb
    gb = global_bias if global_bias is not None else jnp.zeros((heads,), dtype)
    return jnp.concatenate([rb, jnp.broadcast_to(gb[:, None], (heads, num_global))], axis=1)


def gather_rows(x: Array, idx: Array) -> Array:
    """x `[B, N, ...]`, idx `[B, T, K]` in 0..N-1 -> `[B, T, K, ...]`, memory O(B T K ...)."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, idx)
