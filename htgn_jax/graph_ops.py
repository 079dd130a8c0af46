"""HTGN graph-attention kernels (pure `jnp`): windowed GATv2, GAT or dot product with globals;
causal (parallel, `lax.scan` and step forms); Cross-Graph. The Flax layers are `graph_layers`.

HTGN's graph convolution (spec `htgn.md` §3.4, §5.3, §5.5, §5.7) is attention on a *static
stencil graph*: every token i is linked to the tokens i+o for the offsets o in {-w..w} (the window,
self included) and to g global nodes; every global node is linked to every node. Neighbours are
gathered by shifted static slices of a zero-padded copy (an "unfold" to `[B, N, K, ...]`), so
no `[N, N]` buffer is ever built and time and memory are O(B N (2w+1+g) d) (htgn.md §5.11). For
image patches in raster order (`grid_width` W, htgn.md §5.12) the stencil is 2-D instead: the
(2w+1)^2 offsets dr W + dc, |dr|, |dc| <= w, with the slots that would cross a row end masked.

Scoring (htgn.md §3.1):
  * GATv2 (Brody, Alon & Yahav, ICLR 2022, the "dynamic" scoring function):
        e_ij = a_h^T LeakyReLU_0.2(W_t h_i + W_s h_j) + b_h[j - i]
  * GAT v1 (Velickovic et al., ICLR 2018, eqs. (1)-(3)), the ablation `gat=v1` (htgn.md §5.13):
        e_ij = LeakyReLU_0.2(a_t,h^T W h_i + a_s,h^T W h_j) + b_h[j - i]
    It is computed as GATv2 on one-channel score features (a_t^T W h_i, a_s^T W h_j) with a = 1,
    so both versions share one kernel (`neighbour_attention`).
  * Dot product (UniMP / "TransformerConv" scoring, htgn.md §3.4 notes), the ablation `gat=dot`:
        e_ij = <W_t h_i, W_s h_j> / sqrt(D) + b_h[j - i]
    The kernels take it when the attention vector `attn` is None.
  * alpha_i = softmax over the valid neighbours N(i); out_i = sum_j alpha_ij W_s h_j (GAT eq. (4)
    without the nonlinearity: the FFN follows, htgn.md §3.4 step 7).
  * b_h[o] is the in-window learned relative bias of HRPE (htgn.md §5.2 (c)): one scalar per head
    and offset, plus one scalar per head for the token -> global edges.

Global nodes (htgn.md §5.1, §5.3): the encoder sequence is `[globals ; tokens]`, i.e. the model
prepends g learned global vectors, and every function here treats positions `[:num_global]` of
its node axis as the global nodes. A token attends to its window and to all globals; a global
attends to every node (tokens and globals), with no relative bias. Causal (decoder) graphs have
no globals (htgn.md §3.4 "Causal version", §5.10): a global would summarise the future.

Padding: `mask` is True for real nodes. A padded node neither sends nor receives: its row of
alpha is all zeros, its output is zero, and its KL term is left out. The masked softmax never
forms exp(-inf) on a row with no valid entries, so fully masked rows give 0, not NaN, and their
gradients are finite.

Cross-Graph (htgn.md §5.5): decoder node i attends to the encoder tokens c_i-w_x .. c_i+w_x with
    c_i = clip(round(rho * i), 0, N_b - 1)
(rho a scalar hyperparameter, round half to even as Python's `round`, N_b the number of valid
encoder tokens of that example, i.e. right-padded memory), plus the g encoder globals. The
offset bias is b_h[j - c_i]. It never uses the target length, so it is the same at training
and decoding time.

KL smoothness term (htgn.md §5.7): for every valid receiving node i and head h,
    KL(alpha_i || uniform over N(i)) = sum_j alpha_ij log alpha_ij + log |N(i)|,
summed and counted here (`kl_sum`, `kl_count`); `kl = kl_sum / kl_count` is the per-layer mean
the model weights by lambda_KL (mean over layers, heads and valid nodes). The spec's alternative
prior `kl_prior = "distance"` is `kl_tau`: pi_i(j) proportional to exp(-dist(i, j) / tau) over
N(i), with dist = |j - i| in the window (max(|dr|, |dc|) on a grid, |j - c_i| in Cross-Graph) and
1 for a global node, which is one hop from every token; the rows of the global nodes keep the
uniform prior (a global has no position). The spec's other alternative, `kl_mode = "neighbour"`,
is KL(alpha_i || alpha_{i-1}) between consecutive token rows with slots aligned by relative offset
(`neighbour_kl`; on a grid, not across a row end).

NaN-safe masking (the zoo's layer contract): queries, keys and values of padded nodes are replaced
by 0 with `jnp.where` on entry, and logits and weights of non-edges with `where` too, so a padded
node (or a future token of the causal form, which is in no earlier window) holding NaN or 1e30
changes no other output and no KL term. The dense `[L, L]` test oracles live in
`tests/htgn_jax/oracles.py`.
"""
from __future__ import annotations

__all__ = ["window_graph_attention", "cross_graph_attention", "cross_graph_centres"]

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from htgn_jax import graph_packed
from htgn_jax.graph_kl import KL_MODES, attention_kl, check_kl, distance_prior_logits, neighbour_kl  # noqa: F401
from htgn_jax.graph_stencil import (  # noqa: F401
    KERNEL,
    NEGATIVE_SLOPE,
    _masked_softmax,
    bias_row,
    gather_rows,
    neighbour_attention,
    unfold,
)
from zoo_core.checks import check_int, check_rank, check_shape, fail
from zoo_core.ops import masking, packing

Array = jax.Array

VERSIONS = ("v1", "v2", "dot")
# The card's sigma after the graph convolution: h_i = sigma(sum_j alpha_ij W_g h_j).
ACTIVATIONS = ("none", "relu")
# How alpha is formed (the card: "derived from self-attention or learned anew").
ALPHAS = ("learned", "attention")

# ----------------------------------------------------------------------------------------------
# Argument checks (plain Python on static shapes, so they raise before anything is traced).
# ----------------------------------------------------------------------------------------------


def check_rho(rho: Any) -> None:
    """`rho` (Cross-Graph's centre ratio) is a finite Python scalar >= 0."""
    if jnp.ndim(rho) != 0 or not isinstance(rho, (int, float, np.floating, np.integer)) \
            or not (np.isfinite(rho) and rho >= 0):
        fail(f"`rho` must be a finite Python scalar >= 0, got {rho!r}")


# ----------------------------------------------------------------------------------------------
# Pure kernels (the causal window's scan, chunked and step forms are in `graph_causal`).
# ----------------------------------------------------------------------------------------------


def check_skip_offsets(skip_offsets: Any, window: int, name: str = "window") -> tuple[int, ...]:
    """`skip_offsets` is a tuple of distinct ints > `window` (the skip edges lie beyond the window)."""
    if isinstance(skip_offsets, (str, bytes)) or not isinstance(skip_offsets, (tuple, list)) \
            or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                       for s in skip_offsets):
        fail(f"`skip_offsets` must be a tuple of ints, got {skip_offsets!r}")
    if any(s <= window for s in skip_offsets) or len(set(skip_offsets)) != len(skip_offsets):
        fail(f"`skip_offsets` must be distinct ints > {name}={window} (the window already has "
             f"the nearer offsets), got {tuple(skip_offsets)}")
    return tuple(int(s) for s in skip_offsets)


def grid_slots(window: int, skip_offsets: Sequence[int] = ()) -> list[tuple[int, int]]:
    """(dr, dc) of each slot of the 2-D stencil: [-w, w]^2 dr-major, then for each skip s the
    dilated 8-neighbourhood {-s, 0, s}^2 without the centre (dr-major)."""
    r = range(-window, window + 1)
    slots = [(dr, dc) for dr in r for dc in r]
    for s in skip_offsets:
        slots += [(dr, dc) for dr in (-s, 0, s) for dc in (-s, 0, s) if (dr, dc) != (0, 0)]
    return slots


def window_offsets(window: int, causal: bool = False, grid_width: int | None = None,
                   skip_offsets: Sequence[int] = ()) -> tuple[int, ...]:
    """Static stencil offsets: (-w, ..., w), or (-w, ..., 0) when causal (htgn.md §3.4), then the
    multi-scale skip edges: -s, +s for each s of `skip_offsets` (only -s when causal), the HTGN
    card's "global sparse skip-nodes ... across different scales" (docs/htgn_options.md).

    With `grid_width` W (tokens in row-major raster order, rows of W): the 2-D stencil of radius w
    (htgn.md §5.12 image-patch preset), one slot per (dr, dc) in [-w, w]^2, dr-major, at raster
    offset dr * W + dc, then the dilated 8-neighbourhood of each skip (`grid_slots`);
    `grid_column_ok` marks the slots that stay in the token's row band. For W <= 2w two slots can
    share an offset; for any token at most one of them is valid.
    """
    check_int("window", window, 0)
    skips = check_skip_offsets(skip_offsets, window)
    if grid_width is not None:
        check_int("grid_width", grid_width, 1)
        if causal:
            fail("a 2-D stencil (grid_width) has no causal form")
    return _stencil(window, causal, grid_width, skips)


def _stencil(window: int, causal: bool, grid_width: int | None,
             skips: Sequence[int]) -> tuple[int, ...]:
    """`window_offsets` for arguments already checked."""
    if grid_width is None:
        if causal:
            return tuple(range(-window, 1)) + tuple(-s for s in skips)
        return tuple(range(-window, window + 1)) + tuple(o for s in skips for o in (-s, s))
    return tuple(dr * grid_width + dc for dr, dc in grid_slots(window, skips))


def grid_column_ok(num_tokens: int, window: int, grid_width: int,
                   skip_offsets: Sequence[int] = ()) -> np.ndarray:
    """bool `[N, K]`: slot (dr, dc) of token i lands in column col(i) + dc within 0..W-1.

    Row bounds need no mask: with the column in range, i + dr W + dc lies in 0..N-1 exactly when
    row(i) + dr is a row of the grid (`unfold` drops the others). Arguments as checked by
    `window_offsets`.
    """
    col = np.arange(num_tokens) % grid_width
    dc = np.asarray([c for _, c in grid_slots(window, skip_offsets)])
    c = col[:, None] + dc[None, :]
    return (c >= 0) & (c < grid_width)


def window_distances(window: int, causal: bool = False, grid_width: int | None = None,
                     skip_offsets: Sequence[int] = ()) -> np.ndarray:
    """Hop distance of each stencil slot for the distance KL prior: |o|, or max(|dr|, |dc|)
    (arguments as checked by `window_offsets`)."""
    offsets = _stencil(window, causal, grid_width, skip_offsets)
    if grid_width is None:
        return np.abs(np.asarray(offsets, np.float64))
    return np.asarray([max(abs(dr), abs(dc)) for dr, dc in grid_slots(window, skip_offsets)],
                      np.float64)


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


def check_graph_call(query: Any, key: Any, value: Any, attn: Any, *, window: Any, num_global: Any,
                     rel_bias: Any = None, global_bias: Any = None, kl_tau: Any = None,
                     kl_mode: Any = "prior", causal: bool = False, grid_width: Any = None,
                     rho: Any = None, cross: bool = False, skip_offsets: Any = (),
                     negative_slope: Any = None, segment_ids: Any = None,
                     kv_segment_ids: Any = None, positions: Any = None) -> tuple[int, ...]:
    """The arguments of `window_graph_attention` (or, with `cross`, `cross_graph_attention`),
    checked once at the kernel's public entry; returns the stencil offsets.

    Shapes: query `[B, L, H, C]` (`[B, T, H, C]` with `cross`), key `[B, L, H, C]`, value
    `[B, L, H, D]`, attn `[H, C]` or None, rel_bias `[H, K]`, global_bias `[H]`. A window's keys
    and values have the queries' length L (offsets within one sequence); Cross-Graph's have their own.
    """
    check_int("window", window, 0)
    check_int("num_global", num_global, 0)
    if causal and num_global:
        fail(f"`num_global` must be 0 when causal (a global node would see the future), "
             f"got {num_global}")
    if cross:
        check_rho(rho)
    offsets = window_offsets(window, causal, grid_width, skip_offsets)
    check_kl(kl_tau, kl_mode, len(offsets) + num_global)
    check_rank("query", query, 4, "[B, T, H, C]" if cross else "[B, L, H, C]")
    if cross:
        check_rank("key", key, 4, "[B, L, H, C]")
    b, length, heads, ch = query.shape
    length = key.shape[1] if cross else length
    check_shape("key", key, (b, length, heads, ch), "[B, L, H, C]")
    check_rank("value", value, 4, "[B, L, H, D]")
    check_shape("value", value, (b, length, heads, value.shape[-1]), "[B, L, H, D]")
    if attn is not None and not isinstance(attn, str):
        check_shape("attn", attn, (heads, ch), "[H, C]")
    if rel_bias is not None:
        check_shape("rel_bias", rel_bias, (heads, len(offsets)), "[H, K]")
    if global_bias is not None:
        if not num_global:
            fail("`global_bias` was given but `num_global` is 0")
        check_shape("global_bias", global_bias, (heads,), "[H]")
    if length <= num_global:
        fail(f"`{'memory' if cross else 'query'}` has {length} nodes but needs more than "
             f"num_global={num_global}")
    check_negative_slope(attn, negative_slope)
    packing.check_segment_ids(segment_ids, query.shape[:2])
    if cross:
        if positions is not None and jnp.shape(positions) not in ((query.shape[1],), query.shape[:2]):
            fail(f"`positions` must have shape [T] or [B, T] = {query.shape[:2]}, got "
                 f"{jnp.shape(positions)}")
        packing.check_segment_ids(kv_segment_ids, (b, length), "kv_segment_ids")
        if (segment_ids is None) != (kv_segment_ids is None):
            fail("`segment_ids` (queries) and `kv_segment_ids` (memory) are given together or not "
                 "at all: a packed query needs its document in the memory")
    return offsets


def check_negative_slope(attn: Any, negative_slope: Any) -> None:
    """`negative_slope` shapes GAT scores only: None with dot-product (attn None) or kernel scores."""
    if negative_slope is None:
        return
    if attn is None or isinstance(attn, str):
        kind = "dot-product scoring (attn=None)" if attn is None else \
            "kernel scoring (alpha='attention')"
        fail(f"`negative_slope` shapes the GAT scores; {kind} has no LeakyReLU, "
             f"got negative_slope={negative_slope!r}")
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)) \
            or not np.isfinite(negative_slope):
        fail(f"`negative_slope` must be a finite number or None, got {negative_slope!r}")


def packed_arguments(window: int, num_global: int, causal: bool, grid_width: int | None,
                     skip_offsets: Sequence[int], rel_bias: Array | None,
                     global_bias: Array | None, heads: int, kl_tau: float | None) -> dict:
    """The static stencil arguments of `graph_packed.packed_window_attention` from the fields of
    `window_graph_attention` (checked by its caller)."""
    offsets = _stencil(window, causal, grid_width, skip_offsets)
    dc = None if grid_width is None else np.asarray([c for _, c in grid_slots(window, skip_offsets)])
    prior = distance_prior_logits(window_distances(window, causal, grid_width, skip_offsets),
                                  num_global, kl_tau)
    return dict(offsets=offsets, num_global=num_global, grid_dc=dc, grid_width=grid_width,
                bias=bias_row(rel_bias, global_bias, heads, len(offsets), num_global),
                prior_logits=prior)


def window_graph_attention(query: Array, key: Array, value: Array, attn: Array | None, *,
                           window: int,
                           num_global: int = 0, causal: bool = False, mask: Array | None = None,
                           rel_bias: Array | None = None, global_bias: Array | None = None,
                           negative_slope: float | None = None, dropout_rate: float = 0.0,
                           dropout_rng: Array | None = None, kl_tau: float | None = None,
                           kl_mode: str = "prior", grid_width: int | None = None,
                           skip_offsets: Sequence[int] = (),
                           segment_ids: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Windowed GATv2 (or GAT, dot product) with global nodes (htgn.md §3.4), O(B L (K+g) H C).

    Node axis layout: `[globals (num_global) ; tokens (N)]`, L = g + N. Token i attends to tokens
    i+o, o in `window_offsets(window, causal, grid_width)`, and to all globals; each global attends
    to all L nodes (no bias). Edges touching padded nodes are dropped. With `grid_width` the
    tokens are image patches in raster order and the stencil is 2-D (htgn.md §5.12).

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
      skip_offsets: multi-scale skip edges beyond the window (`window_offsets`); cost
        O(B L (K + g) H C) with K = 2w+1+2|skips| (w+1+|skips| causal).
      segment_ids: int `[B, L]` packed documents (0 = padding), or None. Each document is laid out
        `[its g globals ; its tokens]` and every edge stays inside one document, so each document
        gives what it gives alone (`graph_packed`, docs/htgn_packing.md).

    Returns:
      out `[B, L, H, D]` (zero at padded nodes), and a dict with `probs` `[B, N, H, K+g]` (token
      rows; columns = window offsets then globals; packed: `[B, L, H, K+g]`, zero at global and
      padded rows), `global_probs` `[B, g, H, L]` (g > 0, not packed),
      and `kl_sum`, `kl_count` (htgn.md §5.7): over all rows for kl_mode='prior', over pairs of
      consecutive token rows for 'neighbour'.
    """
    offsets = check_graph_call(query, key, value, attn, window=window, num_global=num_global,
                               rel_bias=rel_bias, global_bias=global_bias, kl_tau=kl_tau,
                               kl_mode=kl_mode, causal=causal, grid_width=grid_width,
                               skip_offsets=skip_offsets, negative_slope=negative_slope,
                               segment_ids=segment_ids)
    b, length = query.shape[:2]
    mask = masking.as_bool(mask, (b, length), "mask", "[B, L]")
    if segment_ids is not None:
        return graph_packed.packed_window_attention(
            query, key, value, attn, **packed_arguments(
                window, num_global, causal, grid_width, skip_offsets, rel_bias, global_bias,
                query.shape[2], kl_tau),
            segment_ids=jnp.asarray(segment_ids), mask=mask, negative_slope=negative_slope,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng, kl_mode=kl_mode)
    shared = value is key          # GATv2: one array is both score key and message
    query, key = masking.zero_padding(query, mask), masking.zero_padding(key, mask)
    value = key if shared else masking.zero_padding(value, mask)
    g = num_global
    heads = query.shape[2]
    rng_tok = rng_glb = dropout_rng
    if dropout_rng is not None and g:
        rng_tok, rng_glb = jax.random.split(dropout_rng)

    # Token rows: window neighbours by shifted slices, then the g globals broadcast.
    q_tok, m_tok = query[:, g:], mask[:, g:]
    keys = unfold(key[:, g:], offsets)                                   # [B, N, K, H, C]
    vals = keys if shared else unfold(value[:, g:], offsets)             # [B, N, K, H, D]
    valid = unfold(m_tok, offsets, False) & m_tok[:, :, None]           # [B, N, K]
    if grid_width is not None:
        valid = valid & grid_column_ok(q_tok.shape[1], window, grid_width, skip_offsets)[None]
    if g:
        n = q_tok.shape[1]
        keys = jnp.concatenate(
            [keys, jnp.broadcast_to(key[:, None, :g], (b, n) + key[:, :g].shape[1:])], axis=2)
        vals = keys if shared else jnp.concatenate(
            [vals, jnp.broadcast_to(value[:, None, :g], (b, n) + value[:, :g].shape[1:])], axis=2)
        valid = jnp.concatenate([valid, mask[:, None, :g] & m_tok[:, :, None]], axis=2)
    bias = bias_row(rel_bias, global_bias, heads, len(offsets), g)
    out_tok, st = neighbour_attention(q_tok, keys, vals, valid, attn, bias=bias,
                                      negative_slope=negative_slope, dropout_rate=dropout_rate,
                                      dropout_rng=rng_tok,
                                      prior_logits=distance_prior_logits(
                                          window_distances(window, causal, grid_width,
                                                           skip_offsets), g, kl_tau))
    aux = {"probs": st["probs"], "kl_sum": st["kl_sum"], "kl_count": st["kl_count"]}
    if kl_mode == "neighbour":
        # On a grid, raster neighbours across a row end are not image neighbours.
        pair_ok = None if grid_width is None else np.arange(1, q_tok.shape[1]) % grid_width != 0
        aux["kl_sum"], aux["kl_count"] = neighbour_kl(st["probs"], st["log_probs"], valid, pair_ok)
    if not g:
        return out_tok, aux

    # Global rows: dense over all L nodes, O(g L) (htgn.md §3.4 step 6).
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


def cross_graph_centres(positions: Array, rho: float, memory_lengths: Array) -> Array:
    """Window centres c_i = clip(round(rho * i), 0, N_b - 1) (htgn.md §5.5).

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


def cross_graph_attention(query: Array, key: Array, value: Array, attn: Array | None, *,
                          window: int,
                          num_global: int = 0, rho: float = 1.0, mask: Array | None = None,
                          memory_mask: Array | None = None, positions: Array | None = None,
                          rel_bias: Array | None = None, global_bias: Array | None = None,
                          negative_slope: float | None = None, dropout_rate: float = 0.0,
                          dropout_rng: Array | None = None, kl_tau: float | None = None,
                          kl_mode: str = "prior", skip_offsets: Sequence[int] = (),
                          segment_ids: Array | None = None,
                          kv_segment_ids: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Cross-Graph attention, decoder node i -> encoder window around c_i plus encoder globals.

    Cost O(B T (2w+1+g) H C): neighbours are gathered with `c_i + o` index arrays (clamped, and
    masked when outside the example's valid tokens), never a `[T, N]` matrix (htgn.md §5.5).

    Args:
      query: decoder score features `[B, T, H, C]`.
      key: memory score features `[B, L, H, C]`, L = g + N (`[globals ; tokens]`).
      value: memory messages `[B, L, H, D]`.
      attn: `[H, C]`, or None for dot-product scoring.
      window: w_x >= 0.
      num_global: g encoder globals at the front of the memory.
      rho: centre ratio (hyperparameter, htgn.md §5.5), >= 0.
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
      skip_offsets: skip edges c_i -/+ s beyond the window (`window_offsets`); rel_bias is then
        `[H, 2w+1+2|skips|]`.
      segment_ids, kv_segment_ids: int `[B, T]` and `[B, L]` packed documents (0 = padding), both
        or neither: a query of document d at position i within d (`positions` if given, else
        counted from d's start) attends to the window around c_i in the memory document with
        the same id, offset by that document's start, and to that document's globals
        (`graph_packed.cross_neighbours`).

    Returns:
      out `[B, T, H, D]` (zero at padded decoder rows) and a dict with `probs`
      `[B, T, H, 2w+1+g]`, `centres` `[B, T]` (within the document when packed), `kl_sum`,
      `kl_count`.
    """
    offsets = check_graph_call(query, key, value, attn, window=window, num_global=num_global,
                               rel_bias=rel_bias, global_bias=global_bias, kl_tau=kl_tau,
                               kl_mode=kl_mode, rho=rho, cross=True, skip_offsets=skip_offsets,
                               negative_slope=negative_slope, segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids, positions=positions)
    b, t, heads = query.shape[:3]
    length = key.shape[1]
    mask = masking.as_bool(mask, (b, t), "mask", "[B, T]")
    memory_mask = masking.as_bool(memory_mask, (b, length), "memory_mask", "[B, L]")
    shared = value is key
    query, key = masking.zero_padding(query, mask), masking.zero_padding(key, memory_mask)
    value = key if shared else masking.zero_padding(value, memory_mask)
    if positions is None and segment_ids is None:
        positions = jnp.arange(t)
    g = num_global
    n = length - g
    tok_mask = memory_mask[:, g:]
    if segment_ids is not None:
        idx, valid, centres = graph_packed.cross_neighbours(
            jnp.asarray(segment_ids), jnp.asarray(kv_segment_ids), mask, memory_mask, positions,
            rho, offsets, g)
        keys = gather_rows(key, idx)                                     # [B, T, K+g, H, C]
        vals = keys if shared else gather_rows(value, idx)
    else:
        centres = cross_graph_centres(positions, rho, jnp.sum(tok_mask, axis=1))
        idx = centres[:, :, None] + jnp.asarray(offsets)[None, None]      # [B, T, K]
        in_range = (idx >= 0) & (idx < n)
        idx = jnp.clip(idx, 0, n - 1)
        keys = gather_rows(key[:, g:], idx)                              # [B, T, K, H, C]
        vals = keys if shared else gather_rows(value[:, g:], idx)        # [B, T, K, H, D]
        valid = in_range & gather_rows(tok_mask, idx) & mask[:, :, None]
    if g and segment_ids is None:
        keys = jnp.concatenate(
            [keys, jnp.broadcast_to(key[:, None, :g], (b, t) + key[:, :g].shape[1:])], axis=2)
        vals = keys if shared else jnp.concatenate(
            [vals, jnp.broadcast_to(value[:, None, :g], (b, t) + value[:, :g].shape[1:])], axis=2)
        valid = jnp.concatenate([valid, memory_mask[:, None, :g] & mask[:, :, None]], axis=2)
    bias = bias_row(rel_bias, global_bias, heads, len(offsets), g)
    out, st = neighbour_attention(query, keys, vals, valid, attn, bias=bias,
                                  negative_slope=negative_slope, dropout_rate=dropout_rate,
                                  dropout_rng=dropout_rng,
                                  prior_logits=distance_prior_logits(
                                      window_distances(window, skip_offsets=skip_offsets), g,
                                      kl_tau))
    kl_sum, kl_count = st["kl_sum"], st["kl_count"]
    if kl_mode == "neighbour":
        kl_sum, kl_count = neighbour_kl(st["probs"], st["log_probs"], valid)
    return out, {"probs": st["probs"], "centres": centres, "kl_sum": kl_sum, "kl_count": kl_count}
