"""HTGN graph attention: windowed GATv2, GAT or dot product with globals; causal; Cross-Graph.

HTGN's graph convolution (spec `htgn.md` §3.4, §5.3, §5.5, §5.7) is attention on a *static
stencil graph*: every token i is linked to the tokens i+o for the offsets o in {-w..w} (the window,
self included) and to g global nodes; every global node is linked to every node. Neighbours are
gathered by shifted static slices of a zero-padded copy (an "unfold" to `[B, N, K, ...]`), so
no `[N, N]` buffer is ever built and time and memory are O(B N (2w+1+g) d) (spec §5.11). For
image patches in raster order (`grid_width` W, spec §5.12) the stencil is 2-D instead: the
(2w+1)^2 offsets dr W + dc, |dr|, |dc| <= w, with the slots that would cross a row end masked.

Scoring (spec §3.1):
  * GATv2 (Brody, Alon & Yahav, ICLR 2022, the "dynamic" scoring function):
        e_ij = a_h^T LeakyReLU_0.2(W_t h_i + W_s h_j) + b_h[j - i]
  * GAT v1 (Velickovic et al., ICLR 2018, eqs. (1)-(3)), the ablation `gat=v1` (spec §5.13):
        e_ij = LeakyReLU_0.2(a_t,h^T W h_i + a_s,h^T W h_j) + b_h[j - i]
    It is computed as GATv2 on one-channel score features (a_t^T W h_i, a_s^T W h_j) with a = 1,
    so both versions share one kernel (`neighbour_attention`).
  * Dot product (UniMP / "TransformerConv" scoring, spec §3.4 notes), the ablation `gat=dot`:
        e_ij = <W_t h_i, W_s h_j> / sqrt(D) + b_h[j - i]
    The kernels take it when the attention vector `attn` is None.
  * alpha_i = softmax over the valid neighbours N(i); out_i = sum_j alpha_ij W_s h_j (GAT eq. (4)
    without the nonlinearity: the FFN follows, spec §3.4 step 7).
  * b_h[o] is the in-window learned relative bias of HRPE (spec §5.2 (c)): one scalar per head
    and offset, plus one scalar per head for the token -> global edges.

Global nodes (spec §5.1, §5.3): the encoder sequence is `[globals ; tokens]`, i.e. the model
prepends g learned global vectors, and every function here treats positions `[:num_global]` of
its node axis as the global nodes. A token attends to its window and to all globals; a global
attends to every node (tokens and globals), with no relative bias. Causal (decoder) graphs have
no globals (spec §3.4 "Causal version", §5.10): a global would summarise the future.

Padding: `mask` is True for real nodes. A padded node neither sends nor receives: its row of
alpha is all zeros, its output is zero, and its KL term is left out. The masked softmax never
forms exp(-inf) on a row with no valid entries, so fully masked rows give 0, not NaN, and their
gradients are finite.

Cross-Graph (spec §5.5): decoder node i attends to the encoder tokens c_i-w_x .. c_i+w_x with
    c_i = clip(round(rho * i), 0, N_b - 1)
(rho a scalar hyperparameter, round half to even as Python's `round`, N_b the number of valid
encoder tokens of that example, i.e. right-padded memory), plus the g encoder globals. The
offset bias is b_h[j - c_i]. It never uses the target length, so it is the same at training
and decoding time.

KL smoothness term (spec §5.7): for every valid receiving node i and head h,
    KL(alpha_i || uniform over N(i)) = sum_j alpha_ij log alpha_ij + log |N(i)|,
summed and counted here (`kl_sum`, `kl_count`); `kl = kl_sum / kl_count` is the per-layer mean
the model weights by lambda_KL (mean over layers, heads and valid nodes). The spec's alternative
prior `kl_prior = "distance"` is `kl_tau`: pi_i(j) proportional to exp(-dist(i, j) / tau) over
N(i), with dist = |j - i| in the window (max(|dr|, |dc|) on a grid, |j - c_i| in Cross-Graph) and
1 for a global node, which is one hop from every token; the rows of the global nodes keep the
uniform prior (a global has no position). The spec's other alternative, `kl_mode = "neighbour"`,
is KL(alpha_i || alpha_{i-1}) between consecutive token rows with slots aligned by relative offset
(`neighbour_kl`; on a grid, not across a row end).

The dense `[L, L]` references at the end of the file (`dense_graph_attention` and the adjacency /
bias builders) are test oracles only.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

Array = jax.Array
Initializer = Callable[..., Array]

VERSIONS = ("v1", "v2", "dot")
# Defaults of the GAT-only options; their fields default to None so that version='dot', which has
# neither, can refuse any value given explicitly.
NEGATIVE_SLOPE = 0.2                              # LeakyReLU slope of GAT and GATv2
ATTN_INIT = nn.initializers.glorot_uniform()      # GAT attention vectors a_h

# ----------------------------------------------------------------------------------------------
# Argument checks (plain Python on static shapes, so they raise before anything is traced).
# ----------------------------------------------------------------------------------------------


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        _fail(f"`{name}` must be an integer >= {minimum}, got {value!r}")


def _check_version(version: Any) -> None:
    if version not in VERSIONS:
        _fail(f"`version` must be one of {VERSIONS}, got {version!r}")


def _check_rank(name: str, x: Any, rank: int, shape_doc: str) -> None:
    if jnp.ndim(x) != rank:
        _fail(f"`{name}` must have rank {rank} {shape_doc}, got shape {jnp.shape(x)}")


def _check_shape(name: str, x: Any, shape: Sequence[int], shape_doc: str) -> None:
    if tuple(jnp.shape(x)) != tuple(shape):
        _fail(f"`{name}` must have shape {shape_doc} = {tuple(shape)}, got {jnp.shape(x)}")


def _check_dropout(rate: Any) -> None:
    if not 0.0 <= float(rate) < 1.0:
        _fail(f"`dropout_rate` must be in [0, 1), got {rate!r}")


def _check_rho(rho: Any) -> None:
    if jnp.ndim(rho) != 0 or not isinstance(rho, (int, float, np.floating, np.integer)) \
            or not (np.isfinite(rho) and rho >= 0):
        _fail(f"`rho` must be a finite Python scalar >= 0, got {rho!r}")


def _as_mask(name: str, mask: Any, shape: Sequence[int], shape_doc: str) -> Array:
    """Returns a boolean mask of `shape` (all True when `mask` is None), checking its shape."""
    if mask is None:
        return jnp.ones(shape, bool)
    _check_shape(name, mask, shape, shape_doc)
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def _check_position(position: Any, batch: int) -> None:
    if jnp.ndim(position) not in (0, 1) or (jnp.ndim(position) == 1
                                            and jnp.shape(position)[0] != batch):
        _fail(f"`position` must be a scalar or have shape [B] = ({batch},), "
              f"got {jnp.shape(position)}")


# ----------------------------------------------------------------------------------------------
# Pure kernels.
# ----------------------------------------------------------------------------------------------


def window_offsets(window: int, causal: bool = False,
                   grid_width: int | None = None) -> tuple[int, ...]:
    """Static stencil offsets: (-w, ..., w), or (-w, ..., 0) when causal (spec §3.4).

    With `grid_width` W (tokens in row-major raster order, rows of W): the 2-D stencil of radius w
    (spec §5.12 image-patch preset), one slot per (dr, dc) in [-w, w]^2, dr-major, at raster
    offset dr * W + dc; `grid_column_ok` marks the slots that stay in the token's row band. For
    W <= 2w two slots can share an offset; for any token at most one of them is valid.
    """
    _check_int("window", window, 0)
    if grid_width is None:
        return tuple(range(-window, 1 if causal else window + 1))
    _check_int("grid_width", grid_width, 1)
    if causal:
        _fail("a 2-D stencil (grid_width) has no causal form")
    r = range(-window, window + 1)
    return tuple(dr * grid_width + dc for dr in r for dc in r)


def grid_column_ok(num_tokens: int, window: int, grid_width: int) -> np.ndarray:
    """bool `[N, K]`: slot (dr, dc) of token i lands in column col(i) + dc within 0..W-1.

    Row bounds need no mask: with the column in range, i + dr W + dc lies in 0..N-1 exactly when
    row(i) + dr is a row of the grid (`_unfold` drops the others).
    """
    window_offsets(window, grid_width=grid_width)        # checks window and grid_width
    col = np.arange(num_tokens) % grid_width
    dc = np.tile(np.arange(-window, window + 1), 2 * window + 1)
    c = col[:, None] + dc[None, :]
    return (c >= 0) & (c < grid_width)


def window_distances(window: int, causal: bool = False,
                     grid_width: int | None = None) -> np.ndarray:
    """Hop distance of each stencil slot for the distance KL prior: |o|, or max(|dr|, |dc|)."""
    offsets = window_offsets(window, causal, grid_width)   # also checks the arguments
    if grid_width is None:
        return np.abs(np.asarray(offsets, np.float64))
    r = np.arange(-window, window + 1)
    return np.maximum(np.abs(r)[:, None], np.abs(r)[None, :]).reshape(-1).astype(np.float64)


def _unfold(x: Array, offsets: Sequence[int], fill: Any = 0) -> Array:
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


def attention_kl(probs: Array, log_probs: Array, valid: Array,
                 prior_logits: Array | None = None) -> tuple[Array, Array]:
    """KL(alpha_i || pi_i) over the valid neighbours of i, summed over rows (spec §5.7).

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


def neighbour_attention(query: Array, keys: Array, values: Array, valid: Array,
                        attn: Array | None, *,
                        bias: Array | None = None, negative_slope: float | None = None,
                        dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                        prior_logits: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """GATv2 (or dot-product) attention of each receiver over an explicit neighbour list.

    The shared kernel of every form here:
      e_mk = sum_c attn[h, c] LeakyReLU(query[m] + keys[m, k])[h, c] + bias[h, k]    (GATv2, GAT)
      e_mk = <query[m], keys[m, k]>_h / sqrt(C) + bias[h, k]                          (attn None)
    alpha = masked softmax over k; out_m = sum_k alpha_mk values[m, k].

    Args:
      query: target-side score features `[B, M, H, C]` (W_t h_i).
      keys: source-side score features of the neighbours `[B, M, K, H, C]` (W_s h_j).
      values: messages `[B, M, K, H, D]` (W_s h_j).
      valid: `[B, M, K]` boolean; an edge exists and both ends are real nodes.
      attn: `[H, C]` attention vectors a_h, or None for scaled dot-product scoring.
      bias: additive logit bias broadcastable to `[B, M, H, K]`, or None.
      negative_slope: LeakyReLU slope of GAT/GATv2; None means 0.2. Dot-product scoring has none,
        so it must stay None then.
      dropout_rate: dropout on alpha (spec §5.6), used only when `dropout_rng` is given.
      dropout_rng: PRNG key, or None for no dropout.
      prior_logits: `[K]` KL prior logits (see `attention_kl`), or None for the uniform prior.

    Returns:
      out `[B, M, H, D]` and a dict with `probs` and `log_probs` `[B, M, H, K]` (float32 or
      wider, before dropout), `kl_sum`, `kl_count` (scalars, see `attention_kl`).
    """
    if attn is None and negative_slope is not None:
        _fail(f"`negative_slope` shapes the GAT scores; dot-product scoring (attn=None) has no "
              f"LeakyReLU, got negative_slope={negative_slope!r}")
    slope = NEGATIVE_SLOPE if negative_slope is None else negative_slope
    # Logits, softmax and KL in at least float32 (float64 stays float64).
    acc = jnp.promote_types(jnp.result_type(query, keys), jnp.float32)
    if attn is None:
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


def gat_v1_features(source: Array, attn_target: Array, attn_source: Array
                    ) -> tuple[Array, Array, Array]:
    """GAT v1 as one-channel GATv2: LeakyReLU(a_t.z_i + a_s.z_j) = 1 * LeakyReLU(q_i + k_j).

    Args:
      source: z = W h, `[..., H, D]` (v1 uses one projection for both ends, GAT eq. (1)).
      attn_target: a_t, `[H, D]`.
      attn_source: a_s, `[H, D]`.

    Returns:
      (query `[..., H, 1]`, key `[..., H, 1]`, attn = ones `[H, 1]`) for the kernels here.
    """
    q = jnp.einsum("...hd,hd->...h", source, attn_target.astype(source.dtype))[..., None]
    k = jnp.einsum("...hd,hd->...h", source, attn_source.astype(source.dtype))[..., None]
    return q, k, jnp.ones((attn_target.shape[0], 1), source.dtype)


KL_MODES = ("prior", "neighbour")


def check_kl(kl_tau: Any, kl_mode: Any, num_slots: int | None = None) -> None:
    """Checks the KL options (spec §5.7); the models call it too, before any layer is built.

    `num_slots`: neighbours per token row (K + g); with one, both alternatives are constant.
    """
    if kl_mode not in KL_MODES:
        _fail(f"`kl_mode` must be one of {KL_MODES}, got {kl_mode!r}")
    if num_slots == 1 and (kl_tau is not None or kl_mode != "prior"):
        _fail("`kl_tau` and kl_mode='neighbour' need at least two neighbour slots per row, but "
              "window=0 with no global nodes leaves one (the KL term is then 0 whatever they are)")
    if kl_tau is None:
        return
    if isinstance(kl_tau, bool) or not isinstance(kl_tau, (int, float)) or not kl_tau > 0:
        _fail(f"`kl_tau` must be None (uniform KL prior) or a number > 0, got {kl_tau!r}")
    if kl_mode != "prior":
        _fail(f"`kl_tau` sets the prior of kl_mode='prior', but kl_mode={kl_mode!r}")


def neighbour_kl(probs: Array, log_probs: Array, valid: Array,
                 pair_ok: np.ndarray | None = None) -> tuple[Array, Array]:
    """KL(alpha_i || alpha_{i-1}) of consecutive rows, slots aligned (spec §5.7 `kl_mode`).

    Slot k of row i and of row i-1 is the same relative offset (or the same global node), so the
    term pulls the attention pattern to change slowly along the sequence. The two rows are
    restricted to the slots valid in both and renormalised there, which keeps the KL finite at
    sequence ends and padding. Only pairs with at least two common slots count: with one the KL is
    0 whatever alpha is, and counting it would only dilute the mean (row 0 and padded rows have
    none).

    Args:
      probs, log_probs: alpha and log alpha, `[B, M, H, K]` (0 where invalid).
      valid: `[B, M, K]` boolean.
      pair_ok: static bool `[M - 1]`, False for pairs (i-1, i) that are not neighbours (a grid's
        row ends), or None for all.

    Returns:
      (kl_sum, kl_count): float32 scalars over (pair, head) terms.
    """
    common = (valid[:, 1:] & valid[:, :-1])[:, :, None]                  # [B, M-1, 1, K]
    if pair_ok is not None:
        common = common & jnp.asarray(pair_ok)[None, :, None, None]

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


def _bias_row(rel_bias: Array | None, global_bias: Array | None, heads: int, num_window: int,
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


def _check_attn(attn: Array | None, heads: int, ch: int) -> None:
    if attn is not None:
        _check_shape("attn", attn, (heads, ch), "[H, C]")


def _check_kernel_args(query, key, value, attn, rel_bias, global_bias, num_window, num_global):
    _check_rank("query", query, 4, "[B, L, H, C]")
    b, length, heads, ch = query.shape
    # Windows are offsets within one sequence: keys and values have the queries' length L.
    _check_shape("key", key, (b, length, heads, ch), "[B, L, H, C]")
    _check_rank("value", value, 4, "[B, L, H, D]")
    _check_shape("value", value, (b, length, heads, value.shape[-1]), "[B, L, H, D]")
    _check_attn(attn, heads, ch)
    if rel_bias is not None:
        _check_shape("rel_bias", rel_bias, (heads, num_window), "[H, K]")
    if global_bias is not None:
        if not num_global:
            _fail("`global_bias` was given but `num_global` is 0")
        _check_shape("global_bias", global_bias, (heads,), "[H]")


def window_graph_attention(query: Array, key: Array, value: Array, attn: Array | None, *,
                           window: int,
                           num_global: int = 0, causal: bool = False, mask: Array | None = None,
                           rel_bias: Array | None = None, global_bias: Array | None = None,
                           negative_slope: float | None = None, dropout_rate: float = 0.0,
                           dropout_rng: Array | None = None, kl_tau: float | None = None,
                           kl_mode: str = "prior",
                           grid_width: int | None = None) -> tuple[Array, dict[str, Array]]:
    """Windowed GATv2 (or GAT, dot product) with global nodes (spec §3.4), O(B L (K+g) H C).

    Node axis layout: `[globals (num_global) ; tokens (N)]`, L = g + N. Token i attends to tokens
    i+o, o in `window_offsets(window, causal, grid_width)`, and to all globals; each global attends
    to all L nodes (no bias). Edges touching padded nodes are dropped. With `grid_width` the
    tokens are image patches in raster order and the stencil is 2-D (spec §5.12).

    Args:
      query: target-side score features `[B, L, H, C]`.
      key: source-side score features `[B, L, H, C]`.
      value: messages `[B, L, H, D]` (GATv2, dot: the same array as `key`).
      attn: `[H, C]`, or None for dot-product scoring.
      window: radius w >= 0.
      num_global: g >= 0 leading global nodes (must be 0 when causal).
      causal: offsets -w..0 (decoder).
      mask: `[B, L]`, True for real nodes; None means all real.
      rel_bias: `[H, K]` learned bias per head and stencil slot (K = 2w+1, or w+1 causal, or
        (2w+1)^2 on a grid), in `window_offsets` order; None for no bias.
      global_bias: `[H]` bias on token -> global edges, or None.
      negative_slope: LeakyReLU slope (None: 0.2; must be None with dot-product scoring).
      dropout_rate: attention dropout, applied only when `dropout_rng` is given.
      dropout_rng: PRNG key or None.
      kl_tau: None for the uniform KL prior, or tau of the distance prior on the token rows.
      kl_mode: 'prior' (KL(alpha_i || pi_i) on every row) or 'neighbour' (`neighbour_kl` over
        consecutive token rows; the global rows have no order and add nothing).
      grid_width: None (1-D window), or W: tokens are a row-major grid with rows of W and the
        stencil is the 2-D (2w+1)^2 neighbourhood (w = 1: the 8-neighbourhood and self).

    Returns:
      out `[B, L, H, D]` (zero at padded nodes), and a dict with `probs` `[B, N, H, K+g]` (token
      rows; columns = window offsets then globals), `global_probs` `[B, g, H, L]` (g > 0 only),
      and `kl_sum`, `kl_count` (spec §5.7): over all rows for kl_mode='prior', over pairs of
      consecutive token rows for 'neighbour'.
    """
    _check_int("window", window, 0)
    _check_int("num_global", num_global, 0)
    if causal and num_global:
        _fail(f"`num_global` must be 0 when causal (a global node would see the future), "
              f"got {num_global}")
    offsets = window_offsets(window, causal, grid_width)
    check_kl(kl_tau, kl_mode, len(offsets) + num_global)
    _check_kernel_args(query, key, value, attn, rel_bias, global_bias, len(offsets), num_global)
    b, length = query.shape[:2]
    if length <= num_global:
        _fail(f"`query` has {length} nodes but needs more than num_global={num_global}")
    mask = _as_mask("mask", mask, (b, length), "[B, L]")
    g = num_global
    heads = query.shape[2]
    rng_tok = rng_glb = dropout_rng
    if dropout_rng is not None and g:
        rng_tok, rng_glb = jax.random.split(dropout_rng)

    # Token rows: window neighbours by shifted slices, then the g globals broadcast.
    q_tok, m_tok = query[:, g:], mask[:, g:]
    shared = value is key          # GATv2: one array is both score key and message
    keys = _unfold(key[:, g:], offsets)                                   # [B, N, K, H, C]
    vals = keys if shared else _unfold(value[:, g:], offsets)             # [B, N, K, H, D]
    valid = _unfold(m_tok, offsets, False) & m_tok[:, :, None]           # [B, N, K]
    if grid_width is not None:
        valid = valid & grid_column_ok(q_tok.shape[1], window, grid_width)[None]
    if g:
        n = q_tok.shape[1]
        keys = jnp.concatenate(
            [keys, jnp.broadcast_to(key[:, None, :g], (b, n) + key[:, :g].shape[1:])], axis=2)
        vals = keys if shared else jnp.concatenate(
            [vals, jnp.broadcast_to(value[:, None, :g], (b, n) + value[:, :g].shape[1:])], axis=2)
        valid = jnp.concatenate([valid, mask[:, None, :g] & m_tok[:, :, None]], axis=2)
    bias = _bias_row(rel_bias, global_bias, heads, len(offsets), g)
    out_tok, st = neighbour_attention(q_tok, keys, vals, valid, attn, bias=bias,
                                      negative_slope=negative_slope, dropout_rate=dropout_rate,
                                      dropout_rng=rng_tok,
                                      prior_logits=distance_prior_logits(
                                          window_distances(window, causal, grid_width), g, kl_tau))
    aux = {"probs": st["probs"], "kl_sum": st["kl_sum"], "kl_count": st["kl_count"]}
    if kl_mode == "neighbour":
        # On a grid, raster neighbours across a row end are not image neighbours.
        pair_ok = None if grid_width is None else np.arange(1, q_tok.shape[1]) % grid_width != 0
        aux["kl_sum"], aux["kl_count"] = neighbour_kl(st["probs"], st["log_probs"], valid, pair_ok)
    if not g:
        return out_tok, aux

    # Global rows: dense over all L nodes, O(g L) (spec §3.4 step 6).
    keys_g = jnp.broadcast_to(key[:, None], (b, g) + key.shape[1:])
    vals_g = jnp.broadcast_to(value[:, None], (b, g) + value.shape[1:])
    valid_g = mask[:, None, :] & mask[:, :g, None]
    out_glb, st_g = neighbour_attention(query[:, :g], keys_g, vals_g, valid_g, attn,
                                        negative_slope=negative_slope,
                                        dropout_rate=dropout_rate, dropout_rng=rng_glb)
    aux["global_probs"] = st_g["probs"]
    if kl_mode == "prior":
        aux["kl_sum"] = aux["kl_sum"] + st_g["kl_sum"]
        aux["kl_count"] = aux["kl_count"] + st_g["kl_count"]
    return jnp.concatenate([out_glb, out_tok], axis=1), aux


def causal_window_step(query_t: Array, key_t: Array, value_t: Array, cache: dict[str, Array],
                       attn: Array | None, position: Array | int, *,
                       rel_bias: Array | None = None,
                       negative_slope: float | None = None) -> tuple[Array, dict[str, Array]]:
    """One decoding step of the causal window GAT with a rolling cache: O(w H C) per token.

    Args:
      query_t: `[B, H, C]` score features of the new token.
      key_t: `[B, H, C]`.
      value_t: `[B, H, D]`.
      cache: {'key': `[B, w, H, C]`, 'value': `[B, w, H, D]`}: the last w tokens, oldest first
        (slot j holds offset j - w); slots before position 0 are ignored.
      attn: `[H, C]`, or None for dot-product scoring.
      position: index t of the new token, scalar or `[B]` int.
      rel_bias: `[H, w+1]` or None.
      negative_slope: LeakyReLU slope (None: 0.2; must be None with dot-product scoring).

    Returns:
      out_t `[B, H, D]` and the updated cache (same shapes and dtypes as `cache`).
    """
    _check_rank("query_t", query_t, 3, "[B, H, C]")
    b, heads, ch = query_t.shape
    _check_shape("key_t", key_t, (b, heads, ch), "[B, H, C]")
    _check_rank("value_t", value_t, 3, "[B, H, D]")
    _check_rank("cache['key']", cache["key"], 4, "[B, w, H, C]")
    w = cache["key"].shape[1]
    _check_shape("cache['key']", cache["key"], (b, w, heads, ch), "[B, w, H, C]")
    _check_shape("cache['value']", cache["value"], (b, w) + value_t.shape[1:], "[B, w, H, D]")
    _check_attn(attn, heads, ch)
    if rel_bias is not None:
        _check_shape("rel_bias", rel_bias, (heads, w + 1), "[H, w+1]")
    _check_position(position, b)
    keys = jnp.concatenate([cache["key"].astype(key_t.dtype), key_t[:, None]], axis=1)
    vals = jnp.concatenate([cache["value"].astype(value_t.dtype), value_t[:, None]], axis=1)
    pos = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (b,))
    valid = pos[:, None] + jnp.arange(-w, 1)[None, :] >= 0                 # [B, w+1]
    bias = None if rel_bias is None else rel_bias[None, None]
    out, _ = neighbour_attention(query_t[:, None], keys[:, None], vals[:, None], valid[:, None],
                                 attn, bias=bias, negative_slope=negative_slope)
    new_cache = {"key": keys[:, 1:].astype(cache["key"].dtype),
                 "value": vals[:, 1:].astype(cache["value"].dtype)}
    return out[:, 0], new_cache


def cross_graph_centres(positions: Array, rho: float, memory_lengths: Array) -> Array:
    """Window centres c_i = clip(round(rho * i), 0, N_b - 1) (spec §5.5).

    Args:
      positions: decoder indices i, `[T]` or `[B, T]` int.
      rho: scalar ratio (mean source length / mean target length, a hyperparameter).
      memory_lengths: `[B]` number of valid encoder tokens N_b (right-padded memory).

    Returns:
      `[B, T]` int32. round() is half-to-even in float32, like Python's `round`.
    """
    positions = jnp.asarray(positions)
    lengths = jnp.asarray(memory_lengths, jnp.int32)
    if positions.ndim == 1:
        positions = jnp.broadcast_to(positions[None], (lengths.shape[0], positions.shape[0]))
    c = jnp.round(jnp.float32(rho) * positions.astype(jnp.float32)).astype(jnp.int32)
    return jnp.clip(c, 0, jnp.maximum(lengths - 1, 0)[:, None])


def _gather_rows(x: Array, idx: Array) -> Array:
    """x `[B, N, ...]`, idx `[B, T, K]` in 0..N-1 -> `[B, T, K, ...]`, memory O(B T K ...)."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def cross_graph_attention(query: Array, key: Array, value: Array, attn: Array | None, *,
                          window: int,
                          num_global: int = 0, rho: float = 1.0, mask: Array | None = None,
                          memory_mask: Array | None = None, positions: Array | None = None,
                          rel_bias: Array | None = None, global_bias: Array | None = None,
                          negative_slope: float | None = None, dropout_rate: float = 0.0,
                          dropout_rng: Array | None = None, kl_tau: float | None = None,
                          kl_mode: str = "prior") -> tuple[Array, dict[str, Array]]:
    """Cross-Graph attention, decoder node i -> encoder window around c_i plus encoder globals.

    Cost O(B T (2w+1+g) H C): neighbours are gathered with `c_i + o` index arrays (clamped, and
    masked when outside the example's valid tokens), never a `[T, N]` matrix (spec §5.5).

    Args:
      query: decoder score features `[B, T, H, C]`.
      key: memory score features `[B, L, H, C]`, L = g + N (`[globals ; tokens]`).
      value: memory messages `[B, L, H, D]`.
      attn: `[H, C]`, or None for dot-product scoring.
      window: w_x >= 0.
      num_global: g encoder globals at the front of the memory.
      rho: centre ratio (hyperparameter, spec §5.5), >= 0.
      mask: `[B, T]` decoder mask (True = real); None means all real.
      memory_mask: `[B, L]` memory mask; tokens must be right-padded (N_b = its token count).
      positions: decoder indices i, `[T]` or `[B, T]`; None means 0..T-1. Decoding passes the
        current step's index.
      rel_bias: `[H, 2w+1]` bias b_h[j - c_i], indexed by `j - c_i + w`, or None.
      global_bias: `[H]` bias on decoder -> encoder-global edges, or None.
      negative_slope, dropout_rate, dropout_rng: as in `neighbour_attention`.
      kl_tau: None for the uniform KL prior, or tau of the distance prior (dist = |j - c_i|).
      kl_mode: 'prior' or 'neighbour' (`neighbour_kl` over consecutive decoder rows, slots
        aligned by offset from the centre).

    Returns:
      out `[B, T, H, D]` (zero at padded decoder rows) and a dict with `probs`
      `[B, T, H, 2w+1+g]`, `centres` `[B, T]`, `kl_sum`, `kl_count`.
    """
    _check_int("window", window, 0)
    _check_int("num_global", num_global, 0)
    _check_rho(rho)
    offsets = window_offsets(window)
    check_kl(kl_tau, kl_mode, len(offsets) + num_global)
    _check_rank("query", query, 4, "[B, T, H, C]")
    _check_rank("key", key, 4, "[B, L, H, C]")
    b, t, heads, ch = query.shape
    length = key.shape[1]
    _check_shape("key", key, (b, length, heads, ch), "[B, L, H, C]")
    _check_rank("value", value, 4, "[B, L, H, D]")
    _check_shape("value", value, (b, length, heads, value.shape[-1]), "[B, L, H, D]")
    _check_attn(attn, heads, ch)
    if rel_bias is not None:
        _check_shape("rel_bias", rel_bias, (heads, len(offsets)), "[H, 2w+1]")
    if global_bias is not None:
        if not num_global:
            _fail("`global_bias` was given but `num_global` is 0")
        _check_shape("global_bias", global_bias, (heads,), "[H]")
    if length <= num_global:
        _fail(f"`memory` has {length} nodes but needs more than num_global={num_global}")
    mask = _as_mask("mask", mask, (b, t), "[B, T]")
    memory_mask = _as_mask("memory_mask", memory_mask, (b, length), "[B, L]")
    if positions is None:
        positions = jnp.arange(t)
    elif jnp.shape(positions) not in ((t,), (b, t)):
        _fail(f"`positions` must have shape [T] or [B, T], got {jnp.shape(positions)}")
    g = num_global
    n = length - g
    tok_mask = memory_mask[:, g:]
    centres = cross_graph_centres(positions, rho, jnp.sum(tok_mask, axis=1))
    idx = centres[:, :, None] + jnp.asarray(offsets)[None, None]          # [B, T, K]
    in_range = (idx >= 0) & (idx < n)
    idx = jnp.clip(idx, 0, n - 1)
    shared = value is key
    keys = _gather_rows(key[:, g:], idx)                                  # [B, T, K, H, C]
    vals = keys if shared else _gather_rows(value[:, g:], idx)            # [B, T, K, H, D]
    valid = in_range & _gather_rows(tok_mask, idx) & mask[:, :, None]
    if g:
        keys = jnp.concatenate(
            [keys, jnp.broadcast_to(key[:, None, :g], (b, t) + key[:, :g].shape[1:])], axis=2)
        vals = keys if shared else jnp.concatenate(
            [vals, jnp.broadcast_to(value[:, None, :g], (b, t) + value[:, :g].shape[1:])], axis=2)
        valid = jnp.concatenate([valid, memory_mask[:, None, :g] & mask[:, :, None]], axis=2)
    bias = _bias_row(rel_bias, global_bias, heads, len(offsets), g)
    out, st = neighbour_attention(query, keys, vals, valid, attn, bias=bias,
                                  negative_slope=negative_slope, dropout_rate=dropout_rate,
                                  dropout_rng=dropout_rng,
                                  prior_logits=distance_prior_logits(
                                      window_distances(window), g, kl_tau))
    kl_sum, kl_count = st["kl_sum"], st["kl_count"]
    if kl_mode == "neighbour":
        kl_sum, kl_count = neighbour_kl(st["probs"], st["log_probs"], valid)
    return out, {"probs": st["probs"], "centres": centres, "kl_sum": kl_sum, "kl_count": kl_count}


# ----------------------------------------------------------------------------------------------
# Flax layers (own parameters only; the maths is above).
# ----------------------------------------------------------------------------------------------


def _resolve_head_dim(width: int, num_heads: int, head_dim: int | None, arg: str) -> int:
    if head_dim is not None:
        return head_dim
    if width % num_heads:
        _fail(f"width of `{arg}` ({width}) is not divisible by num_heads={num_heads}; "
              f"set head_dim explicitly")
    return width // num_heads


def _flat_init(init: Initializer, n_in: int) -> Initializer:
    """Initialises a `[*in, *out]` kernel as the flat `[prod(in), prod(out)]` one (Dense fans)."""
    def f(rng, shape, dtype=jnp.float32):
        return init(rng, (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))), dtype
                    ).reshape(shape)
    return f


class _HeadProjection(nn.Module):
    """x `[..., d]` -> `[..., H, D]` without bias; D = head_dim, or d // H when head_dim is None.

    Compact on purpose: the kernel shape may follow the input width, which setup() cannot see.
    """
    num_heads: int
    head_dim: int | None
    arg: str
    dtype: Any
    param_dtype: Any
    kernel_init: Initializer

    @nn.compact
    def __call__(self, x: Array, head_dim: int | None = None) -> Array:
        d = x.shape[-1]
        hd = head_dim or _resolve_head_dim(d, self.num_heads, self.head_dim, self.arg)
        kernel = self.param("kernel", _flat_init(self.kernel_init, 1), (d, self.num_heads, hd),
                            self.param_dtype)
        x, kernel = promote_dtype(x, kernel, dtype=self.dtype)
        return jnp.einsum("...d,dhk->...hk", x, kernel)


class _HeadVector(nn.Module):
    """A per-head vector `[H, D]` (GAT attention vector a_h); D is given at call time."""
    num_heads: int
    param_dtype: Any
    init: Initializer

    @nn.compact
    def __call__(self, head_dim: int) -> Array:
        return self.param("vector", self.init, (self.num_heads, head_dim), self.param_dtype)


class _OutputProjection(nn.Module):
    """Concatenated heads `[..., H, D]` -> `[..., F]` with bias (W_o); F = features or `width`."""
    features: int | None
    dtype: Any
    param_dtype: Any
    kernel_init: Initializer
    bias_init: Initializer

    @nn.compact
    def __call__(self, y: Array, width: int) -> Array:
        f = self.features or width
        kernel = self.param("kernel", _flat_init(self.kernel_init, 2), y.shape[-2:] + (f,),
                            self.param_dtype)
        bias = self.param("bias", self.bias_init, (f,), self.param_dtype)
        y, kernel, bias = promote_dtype(y, kernel, bias, dtype=self.dtype)
        return jnp.einsum("...hd,hdf->...f", y, kernel) + bias


class _GraphAttentionBase(nn.Module):
    """Shared setup/feature code of the two graph layers (fields are declared by subclasses)."""

    def _check_common_fields(self) -> None:
        _check_int("num_heads", self.num_heads, 1)
        if self.head_dim is not None:
            _check_int("head_dim", self.head_dim, 1)
        _check_int("window", self.window, 0)
        _check_int("num_global", self.num_global, 0)
        _check_version(self.version)
        _check_dropout(self.dropout_rate)
        if self.version == "dot" and self.negative_slope is not None:
            _fail(f"`negative_slope` shapes the GAT scores; version='dot' has no LeakyReLU, got "
                  f"negative_slope={self.negative_slope!r}")
        if self.version == "dot" and self.attn_init is not None:
            _fail("`attn_init` initialises the GAT attention vectors; version='dot' has none")
        if self.out_features is not None:
            _check_int("out_features", self.out_features, 1)

    def _setup_common(self, num_offsets: int, with_global_bias: bool) -> None:
        check_kl(self.kl_tau, self.kl_mode, num_offsets + self.num_global)
        h = self.num_heads
        proj = dict(num_heads=h, head_dim=self.head_dim, dtype=self.dtype,
                    param_dtype=self.param_dtype, kernel_init=self.kernel_init)
        if self.version in ("v2", "dot"):
            self.target = _HeadProjection(arg="x", **proj)
            self.source = _HeadProjection(arg=self._source_arg, **proj)
            if self.version == "v2":
                self.attn = _HeadVector(h, self.param_dtype, self.attn_init or ATTN_INIT)
        else:
            # v1 (GAT): one projection W for both ends, two attention halves a = [a_t ; a_s].
            self.source = _HeadProjection(arg=self._source_arg, **proj)
            self.attn_target = _HeadVector(h, self.param_dtype, self.attn_init or ATTN_INIT)
            self.attn_source = _HeadVector(h, self.param_dtype, self.attn_init or ATTN_INIT)
        if self.use_relative_bias:
            self.rel_bias = self.param("rel_bias", self.bias_init, (h, num_offsets),
                                       self.param_dtype)
            if with_global_bias:
                self.global_bias = self.param("global_bias", self.bias_init, (h,),
                                              self.param_dtype)
        self.output = _OutputProjection(self.out_features, self.dtype, self.param_dtype,
                                        self.kernel_init, self.bias_init)

    def _self_features(self, x: Array) -> tuple[Array, Array, Array]:
        """(query `[..., H, C]`, key `[..., H, C]`, message `[..., H, D]`) of nodes x."""
        if self.version != "v1":
            u = self.source(x)
            return self.target(x), u, u
        z = self.source(x)
        q, k, _ = gat_v1_features(z, self._head_vector("attn_target", z),
                                  self._head_vector("attn_source", z))
        return q, k, z

    def _query_features(self, x: Array, head_dim: int) -> Array:
        """Receiver-side score features `[..., H, C]` (v1: a_t . W x, the same W as the senders).

        `head_dim` is the senders' D, so an unset head_dim follows the memory width.
        """
        if self.version != "v1":
            return self.target(x, head_dim)
        z = self.source(x)
        return jnp.einsum("...hd,hd->...h", z, self._head_vector("attn_target", z))[..., None]

    def _source_features(self, m: Array) -> tuple[Array, Array]:
        """(score key `[..., H, C]`, message `[..., H, D]`) of sender nodes m."""
        u = self.source(m)
        if self.version != "v1":
            return u, u
        return jnp.einsum("...hd,hd->...h", u, self._head_vector("attn_source", u))[..., None], u

    def _head_vector(self, name: str, z: Array) -> Array:
        return getattr(self, name)(z.shape[-1]).astype(z.dtype)

    def _attn_vector(self, value: Array) -> Array | None:
        """a_h for GATv2, ones `[H, 1]` for GAT's one-channel form, None (dot product) for 'dot'."""
        if self.version == "v2":
            return self._head_vector("attn", value)
        if self.version == "dot":
            return None
        return jnp.ones((self.num_heads, 1), value.dtype)

    def _biases(self) -> tuple[Array | None, Array | None]:
        if not self.use_relative_bias:
            return None, None
        return self.rel_bias, (self.global_bias if self._has_global_bias else None)

    def _dropout_rng(self, deterministic: bool) -> Array | None:
        if deterministic or self.dropout_rate == 0.0:
            return None
        return self.make_rng("dropout")

    def _head_dims(self) -> tuple[int, int]:
        """(C, D) from head_dim, or from the initialised `source` kernel when head_dim is None."""
        d = self.head_dim
        if d is None:
            params = self.variables.get("params", {})
            if "source" not in params:
                _fail("`head_dim` is None and the layer has no parameters yet, so the state shape "
                      "is unknown: set head_dim or call init_state with initialised params")
            d = params["source"]["kernel"].shape[-1]
        return (1 if self.version == "v1" else d), d


def _kl_aux(st: dict[str, Array]) -> dict[str, Array]:
    return {"kl": st["kl_sum"] / jnp.maximum(st["kl_count"], 1.0), "kl_sum": st["kl_sum"],
            "kl_count": st["kl_count"]}


class WindowGraphAttention(_GraphAttentionBase):
    """Windowed GATv2 (or GAT, dot-product) graph attention with global nodes; causal variant.

    Node layout of `x`: `[B, L, d]` = `[globals (num_global) ; tokens (N)]`; the model prepends the
    g learned global vectors (spec §5.1). Parameters (stable names): `target/kernel` `[d, H, D]`
    (W_t, v2 and dot), `source/kernel` `[d, H, D]` (W_s, also the message projection),
    `attn/vector` `[H, D]` (v2) or `attn_target/vector`, `attn_source/vector` `[H, D]` (v1; dot
    has no attention vector), `rel_bias`
    `[H, K]` and `global_bias` `[H]` (if use_relative_bias; global_bias only with globals),
    `output/kernel` `[H, D, F]`, `output/bias` `[F]`.

    Attributes:
      num_heads: H.
      head_dim: D per head; None means d // H (d must then be divisible by H).
      window: radius w >= 0; offsets -w..w, or -w..0 when causal.
      num_global: g leading global nodes (0 when causal).
      causal: decoder form (offsets -w..0) with `step` / `init_state`.
      grid_width: None, or W for image patches in raster order: the window is then the 2-D
        stencil of radius w (`window_offsets`); not with causal.
      version: 'v2' (GATv2, default), 'v1' (GAT, static attention) or 'dot' (scaled dot
        product, UniMP style); the last two are ablations (spec §5.13).
      use_relative_bias: learned per-head per-offset logit bias (HRPE (c), spec §5.2).
      negative_slope: LeakyReLU slope (None: 0.2; must be None with dot-product scoring).
      dropout_rate: dropout on alpha (active when deterministic=False, rng 'dropout').
      kl_tau: None (the KL term's uniform prior, spec §5.7) or tau > 0 of the distance prior
        pi_i(j) proportional to exp(-dist / tau) (spec `kl_prior = "distance"`; dist = |j - i|,
        or max(|dr|, |dc|) on a grid, 1 to a global node).
      kl_mode: 'prior' (KL to the prior above) or 'neighbour' (KL(alpha_i || alpha_{i-1}),
        `neighbour_kl`).
      out_features: F; None means d.
      dtype: compute dtype (None: promote inputs and params). Softmax and KL are float32.
      param_dtype: parameter dtype.
      kernel_init, attn_init, bias_init: initialisers for projections, attention vectors (None:
        glorot_uniform; GAT only), and
        biases (output bias, rel_bias, global_bias).
    """
    num_heads: int
    head_dim: int | None = None
    window: int = 4
    num_global: int = 0
    causal: bool = False
    grid_width: int | None = None
    version: str = "v2"
    use_relative_bias: bool = True
    negative_slope: float | None = None
    dropout_rate: float = 0.0
    kl_tau: float | None = None
    kl_mode: str = "prior"
    out_features: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    attn_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()

    _source_arg = "x"

    def setup(self):
        self._check_common_fields()
        if self.causal and self.num_global:
            _fail(f"`num_global` must be 0 when causal=True (a global node would summarise the "
                  f"future), got {self.num_global}")
        self._has_global_bias = self.num_global > 0
        num_slots = len(window_offsets(self.window, self.causal, self.grid_width))
        self._setup_common(num_slots, self._has_global_bias)

    def __call__(self, x: Array, *, mask: Array | None = None,
                 deterministic: bool = True) -> tuple[Array, dict[str, Array]]:
        """Graph attention over the whole sequence.

        Args:
          x: `[B, L, d]`, L = num_global + N.
          mask: `[B, L]` (True = real node), or None.
          deterministic: no attention dropout when True.

        Returns:
          y `[B, L, F]` (zero at padded nodes) and aux {'kl': the scalar mean KL term (to the
          prior over heads and valid nodes, or between consecutive rows, per kl_mode), 'kl_sum',
          'kl_count'} (spec §5.7; unweighted).
        """
        mask, out, st = self._attend(x, mask, deterministic)
        y = self.output(out, x.shape[-1])
        return jnp.where(mask[..., None], y, 0).astype(y.dtype), _kl_aux(st)

    def attention_weights(self, x: Array, *, mask: Array | None = None) -> dict[str, Array]:
        """The coefficients alpha that `__call__` uses (deterministic), for analysis.

        Args:
          x, mask: as in `__call__`.

        Returns:
          {'probs': `[B, N, H, K + g]` of the N token nodes over the K window offsets
          (`window_offsets`) and then the g global nodes, 'global_probs': `[B, g, H, L]` of each
          global node over all L = g + N nodes (absent when g = 0), 'mask': `[B, L]` bool}.
        """
        mask, _, st = self._attend(x, mask, True)
        out = {"probs": st["probs"], "mask": mask}
        if st.get("global_probs") is not None:
            out["global_probs"] = st["global_probs"]
        return out

    def _attend(self, x: Array, mask: Array | None, deterministic: bool):
        self._check_x(x)
        mask = _as_mask("mask", mask, x.shape[:2], "[B, L]")
        q, k, v = self._self_features(x)
        rel_bias, global_bias = self._biases()
        out, st = window_graph_attention(
            q, k, v, self._attn_vector(v), window=self.window, num_global=self.num_global,
            causal=self.causal, grid_width=self.grid_width, mask=mask, rel_bias=rel_bias,
            global_bias=global_bias,
            negative_slope=self.negative_slope, dropout_rate=self.dropout_rate,
            dropout_rng=self._dropout_rng(deterministic), kl_tau=self.kl_tau,
            kl_mode=self.kl_mode)
        return mask, out, st

    def init_state(self, batch_size: int) -> dict[str, Array]:
        """Empty rolling cache for `step` (causal only): the last w projected tokens.

        Returns:
          {'value': `[B, w, H, D]`} float32 zeros (W_s x of the last w tokens, oldest first; for
          GATv2 and dot also the score key), plus for v1 'key' `[B, w, H, 1]` (a_s . W x).
        """
        self._check_causal("init_state")
        _check_int("batch_size", batch_size, 1)
        c, d = self._head_dims()
        h, w = self.num_heads, self.window
        state = {"value": jnp.zeros((batch_size, w, h, d), jnp.float32)}
        if self.version == "v1":
            state["key"] = jnp.zeros((batch_size, w, h, c), jnp.float32)
        return state

    def step(self, state: dict[str, Array], x_t: Array, position: Array | int
             ) -> tuple[Array, dict[str, Array]]:
        """One decoding step (causal only), O(w H D) attention work per token.

        Args:
          state: the cache from `init_state` or the previous `step`.
          x_t: `[B, d]` the new token's features.
          position: its index t (scalar or `[B]`); cache slots before index 0 are ignored.

        Returns:
          (y_t `[B, F]`, new state). Equal to row t of `__call__` on the unpadded prefix.
        """
        self._check_causal("step")
        _check_rank("x_t", x_t, 2, "[B, d]")
        q, k, v = self._self_features(x_t)
        rel_bias, _ = self._biases()
        if "value" not in state:
            _fail(f"`state` must come from init_state, got keys {sorted(state)}")
        cache = {"key": state.get("key", state["value"]), "value": state["value"]}
        out, cache = causal_window_step(q, k, v, cache, self._attn_vector(v), position,
                                        rel_bias=rel_bias, negative_slope=self.negative_slope)
        new_state = {"value": cache["value"]}
        if self.version == "v1":
            new_state["key"] = cache["key"]
        return self.output(out, x_t.shape[-1]), new_state

    def _check_x(self, x: Array) -> None:
        _check_rank("x", x, 3, "[B, L, d]")
        if x.shape[1] <= self.num_global:
            _fail(f"`x` has {x.shape[1]} nodes but needs more than num_global={self.num_global}")

    def _check_causal(self, method: str) -> None:
        if not self.causal:
            _fail(f"`{method}` needs causal=True (a non-causal window looks ahead)")


class CrossGraphAttention(_GraphAttentionBase):
    """Cross-Graph attention (spec §5.5): decoder node i -> encoder window at c_i + globals.

    c_i = clip(round(rho * i), 0, N_b - 1), with N_b the valid encoder token count per example.
    `memory` is the encoder output `[B, g + N, d_m]` = `[globals ; tokens]` (right-padded tokens).
    Scoring is GATv2: e_ij = a_h^T LeakyReLU(W_t y_i + W_s M_j) + b_h[j - c_i] (or GAT, or the
    dot product <W_t y_i, W_s M_j> / sqrt(D), per `version`); messages W_s M_j.
    Parameter names as in `WindowGraphAttention` (`rel_bias` `[H, 2w+1]`, `global_bias` `[H]`).

    Decoding: `prepare_memory` projects the memory once; `step` then costs O((2w+1+g) H D) per
    token and uses no target length, so it equals the parallel form row by row.

    Attributes:
      num_heads, version, use_relative_bias, negative_slope, dropout_rate, kl_tau, kl_mode,
      out_features, dtype, param_dtype, kernel_init, attn_init, bias_init: as in
      `WindowGraphAttention` (the distance prior measures |j - c_i|).
      window: w_x >= 0, the encoder window radius.
      head_dim: D per head; None means d_m // H (memory width d_m divisible by H); the decoder
        side uses the same D.
      num_global: g, the encoder globals at the front of `memory`.
      rho: centre ratio (mean source / mean target length, a hyperparameter; 1.0 by default).
    """
    num_heads: int
    head_dim: int | None = None
    window: int = 4
    num_global: int = 0
    rho: float = 1.0
    version: str = "v2"
    use_relative_bias: bool = True
    negative_slope: float | None = None
    dropout_rate: float = 0.0
    kl_tau: float | None = None
    kl_mode: str = "prior"
    out_features: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    attn_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()

    _source_arg = "memory"

    def setup(self):
        self._check_common_fields()
        _check_rho(self.rho)
        self._has_global_bias = self.num_global > 0
        self._setup_common(2 * self.window + 1, self._has_global_bias)

    def __call__(self, x: Array, memory: Array, *, mask: Array | None = None,
                 memory_mask: Array | None = None,
                 deterministic: bool = True) -> tuple[Array, dict[str, Array]]:
        """Cross-Graph attention for a whole (teacher-forced) target sequence.

        Args:
          x: decoder states `[B, T, d]`; row t has decoder index t.
          memory: encoder output `[B, g + N, d_m]`.
          mask: `[B, T]` decoder mask or None.
          memory_mask: `[B, g + N]` encoder mask or None.
          deterministic: no attention dropout when True.

        Returns:
          y `[B, T, F]` (zero at padded rows) and aux {'kl', 'kl_sum', 'kl_count'}.
        """
        cache = self._checked_cache(x, memory, memory_mask)
        return self._attend(cache, x, None, mask, deterministic)

    def attention_weights(self, x: Array, memory: Array, *, mask: Array | None = None,
                          memory_mask: Array | None = None) -> dict[str, Array]:
        """The coefficients alpha that `__call__` uses (deterministic), for analysis.

        Args:
          x, memory, mask, memory_mask: as in `__call__`.

        Returns:
          {'probs': `[B, T, H, 2 w_x + 1 + g]` (window slots around the centre, then the globals),
          'centres': `[B, T]` c_i = round(rho i) clipped to the valid tokens, 'memory_mask':
          `[B, g + N]` bool}.
        """
        cache = self._checked_cache(x, memory, memory_mask)
        st = self._attend(cache, x, None, mask, True, stats_only=True)
        return {"probs": st["probs"], "centres": st["centres"], "memory_mask": cache["mask"]}

    def _checked_cache(self, x: Array, memory: Array, memory_mask: Array | None) -> dict:
        _check_rank("x", x, 3, "[B, T, d]")
        cache = self.prepare_memory(memory, memory_mask=memory_mask)
        if self.version == "v1" and x.shape[-1] != memory.shape[-1]:
            _fail(f"version='v1' projects `x` and `memory` with one W, so their widths must match, "
                  f"got {x.shape[-1]} and {memory.shape[-1]}")
        if cache["mask"].shape[0] != x.shape[0]:
            _fail(f"`memory` batch {cache['mask'].shape[0]} != `x` batch {x.shape[0]}")
        return cache

    def prepare_memory(self, memory: Array, *, memory_mask: Array | None = None
                       ) -> dict[str, Array]:
        """Projects the encoder memory once for decoding.

        Args:
          memory: `[B, g + N, d_m]`.
          memory_mask: `[B, g + N]` or None.

        Returns:
          {'value': `[B, L, H, D]` (W_s M), 'mask': `[B, L]` bool}, plus for v1 'key'
          `[B, L, H, 1]` (a_s . W M); for v2 and dot the score key is 'value' itself.
        """
        _check_rank("memory", memory, 3, "[B, L, d_m]")
        if memory.shape[1] <= self.num_global:
            _fail(f"`memory` has {memory.shape[1]} nodes but needs more than "
                  f"num_global={self.num_global}")
        memory_mask = _as_mask("memory_mask", memory_mask, memory.shape[:2], "[B, L]")
        k, v = self._source_features(memory)
        cache = {"value": v, "mask": memory_mask}
        if self.version == "v1":
            cache["key"] = k
        return cache

    def step(self, cache: dict[str, Array], x_t: Array, position: Array | int) -> Array:
        """One decoding step from a `prepare_memory` cache.

        Args:
          cache: from `prepare_memory`.
          x_t: `[B, d]` decoder state of the token at index `position`.
          position: its index i, scalar or `[B]` int.

        Returns:
          y_t `[B, F]`.
        """
        _check_rank("x_t", x_t, 2, "[B, d]")
        b = x_t.shape[0]
        _check_position(position, b)
        pos = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (b,))[:, None]
        y, _ = self._attend(cache, x_t[:, None], pos, None, True)
        return y[:, 0]

    def _attend(self, cache, x, positions, mask, deterministic, stats_only: bool = False):
        mask = _as_mask("mask", mask, x.shape[:2], "[B, T]")
        v = cache["value"]
        q = self._query_features(x, v.shape[-1])
        rel_bias, global_bias = self._biases()
        out, st = cross_graph_attention(
            q, cache.get("key", v), v, self._attn_vector(v), window=self.window,
            num_global=self.num_global, rho=self.rho, mask=mask, memory_mask=cache["mask"],
            positions=positions, rel_bias=rel_bias, global_bias=global_bias,
            negative_slope=self.negative_slope, dropout_rate=self.dropout_rate,
            dropout_rng=self._dropout_rng(deterministic), kl_tau=self.kl_tau,
            kl_mode=self.kl_mode)
        if stats_only:
            return st
        y = self.output(out, x.shape[-1])
        return jnp.where(mask[..., None], y, 0).astype(y.dtype), _kl_aux(st)


# ----------------------------------------------------------------------------------------------
# Dense O(L^2) references (test oracles only; spec §3.4 "Oracles for tests").
# ----------------------------------------------------------------------------------------------


def dense_graph_attention(query: Array, key: Array, value: Array, attn: Array | None,
                          adjacency: Array,
                          *, bias: Array | None = None, negative_slope: float | None = None
                          ) -> tuple[Array, Array]:
    """Dense masked GATv2 on an explicit adjacency: e_ij for all pairs, softmax over edges.

    Args:
      query: `[B, Lq, H, C]`; key: `[B, Lk, H, C]`; value: `[B, Lk, H, D]`; attn: `[H, C]`, or
        None for the dot product <q_i, k_j> / sqrt(C).
      adjacency: `[B, Lq, Lk]` boolean, True where j is a neighbour of i.
      bias: `[H, Lq, Lk]` or `[B, H, Lq, Lk]` or None.

    Returns:
      out `[B, Lq, H, D]` (0 for rows with no edge) and probs `[B, H, Lq, Lk]`.
    """
    if attn is None:
        logits = jnp.einsum("bihc,bjhc->bhij", query, key) / np.sqrt(query.shape[-1])
    else:
        slope = NEGATIVE_SLOPE if negative_slope is None else negative_slope
        pre = jax.nn.leaky_relu(query[:, :, None] + key[:, None], slope)   # [B, Lq, Lk, H, C]
        logits = jnp.einsum("bijhc,hc->bhij", pre, attn)
    if bias is not None:
        logits = logits + bias
    adj = adjacency[:, None]
    logits = jnp.where(adj, logits, jnp.finfo(logits.dtype).min / 2)
    probs = jax.nn.softmax(logits, axis=-1) * adj
    return jnp.einsum("bhij,bjhd->bihd", probs, value), probs


def window_adjacency(mask: Array, *, window: int, num_global: int = 0,
                     causal: bool = False, grid_width: int | None = None) -> Array:
    """`[B, L, L]` adjacency of the window + global graph over `[globals ; tokens]` nodes (with
    `grid_width`: tokens within w rows and w columns of each other on the raster grid)."""
    b, length = mask.shape
    g = num_global
    node = jnp.arange(length)
    i, j = node[:, None], node[None, :]
    rel = j - i
    tok_i, tok_j = i >= g, j >= g
    if grid_width is None:
        band = (rel >= -window) & (rel <= (0 if causal else window))
    else:
        (ri, ci), (rj, cj) = divmod(i - g, grid_width), divmod(j - g, grid_width)
        band = (jnp.abs(ri - rj) <= window) & (jnp.abs(ci - cj) <= window)
    adj = (tok_i & tok_j & band) | (tok_i & ~tok_j) | ~tok_i
    mask = mask.astype(bool)
    return adj[None] & mask[:, :, None] & mask[:, None, :]


def window_bias_matrix(rel_bias: Array | None, global_bias: Array | None, *, length: int,
                       window: int, num_global: int = 0, causal: bool = False,
                       grid_width: int | None = None) -> Array:
    """`[H, L, L]` dense logit bias: rel_bias[h, (j - i) + w] on token edges (on a grid:
    rel_bias[h, (dr + w)(2w + 1) + dc + w]), global_bias[h] on token -> global edges, 0 on global
    rows (and wherever the adjacency has no edge)."""
    src = rel_bias if rel_bias is not None else global_bias
    heads = src.shape[0]
    g = num_global
    node = jnp.arange(length)
    i, j = node[:, None], node[None, :]
    hi = 0 if causal else window
    col = jnp.clip(j - i + window, 0, window + hi)
    in_band = (j - i >= -window) & (j - i <= hi)
    if grid_width is not None:
        (ri, ci), (rj, cj) = divmod(i - g, grid_width), divmod(j - g, grid_width)
        dr, dc = rj - ri, cj - ci
        in_band = (jnp.abs(dr) <= window) & (jnp.abs(dc) <= window)
        col = jnp.clip((dr + window) * (2 * window + 1) + dc + window, 0, (2 * window + 1) ** 2 - 1)
    out = jnp.zeros((heads, length, length), src.dtype)
    if rel_bias is not None:
        band = (i >= g) & (j >= g) & in_band
        out = jnp.where(band[None], rel_bias[:, col], out)
    if global_bias is not None:
        out = jnp.where(((i >= g) & (j < g))[None], global_bias[:, None, None], out)
    return out


def cross_graph_adjacency(mask: Array, memory_mask: Array, centres: Array, *, window: int,
                          num_global: int = 0) -> Array:
    """`[B, T, L]` Cross-Graph adjacency: |j_tok - c_i| <= w, plus all encoder globals."""
    length = memory_mask.shape[1]
    j = jnp.arange(length)[None, None, :]
    tok = j >= num_global
    near = jnp.abs((j - num_global) - centres[:, :, None]) <= window
    adj = (tok & near) | ~tok
    return adj & mask.astype(bool)[:, :, None] & memory_mask.astype(bool)[:, None, :]


def cross_graph_bias_matrix(rel_bias: Array | None, global_bias: Array | None, centres: Array,
                            *, memory_length: int, window: int, num_global: int = 0) -> Array:
    """`[B, H, T, L]` dense bias: rel_bias[h, j_tok - c_i + w] in the window, global_bias[h] on
    encoder-global columns."""
    src = rel_bias if rel_bias is not None else global_bias
    heads = src.shape[0]
    j = jnp.arange(memory_length)[None, None, :]
    tok = j >= num_global
    rel = (j - num_global) - centres[:, :, None]                           # [B, T, L]
    out = jnp.zeros((centres.shape[0], heads) + rel.shape[1:], src.dtype)
    if rel_bias is not None:
        near = tok & (jnp.abs(rel) <= window)
        vals = jnp.moveaxis(rel_bias[:, jnp.clip(rel + window, 0, 2 * window)], 0, 1)
        out = jnp.where(near[:, None], vals, out)
    if global_bias is not None:
        out = jnp.where(~tok[:, None], global_bias[None, :, None, None], out)
    return out
