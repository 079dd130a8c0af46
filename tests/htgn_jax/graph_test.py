"""Tests of htgn_jax.graph_ops / graph_causal / graph_layers: windowed, causal and Cross-Graph GAT
against dense masked oracles (tests/htgn_jax/oracles.py), every causal form, NaN-safe masking."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from htgn_jax import CrossGraphCache, WindowState
from htgn_jax import graph_ops as G
from htgn_jax.graph_layers import CrossGraphAttention, WindowGraphAttention
from tests.htgn_jax import oracles as O
from zoo_core.testing import BF16, F32_SIMPLE, F64, assert_forms_agree, param_shapes

B, N, H, D, W, NG = 2, 7, 2, 4, 2, 2      # batch, tokens, heads, head dim, window, globals
WIDTH = H * D

# One compile per call site instead of one per primitive (eager mode compiles every op shape).
window_attention = jax.jit(G.window_graph_attention,
                           static_argnames=("window", "num_global", "causal", "kl_tau",
                                            "kl_mode", "grid_width"))
cross_attention = jax.jit(G.cross_graph_attention,
                          static_argnames=("window", "num_global", "rho", "kl_tau", "kl_mode"))
dense_attention = jax.jit(O.dense_graph_attention)
window_adjacency = jax.jit(O.window_adjacency,
                           static_argnames=("window", "num_global", "causal", "grid_width"))
cross_graph_adjacency = jax.jit(O.cross_graph_adjacency, static_argnames=("window", "num_global"))
window_bias_matrix = jax.jit(O.window_bias_matrix, static_argnames=("length", "window", "num_global",
                                                                    "causal", "grid_width"))
cross_graph_bias_matrix = jax.jit(O.cross_graph_bias_matrix,
                                  static_argnames=("memory_length", "window", "num_global"))


def _normal(seed, shape, dtype=jnp.float32):
    # numpy: slicing and editing test inputs then compiles nothing
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), shape, dtype))


def _lengths_mask(lengths, total):
    return np.arange(total)[None, :] < np.asarray(lengths)[:, None]


def _features(version, seed, length, dtype=jnp.float32):
    """(query, key, value, attn) for the pure kernels; attn is None for the dot product."""
    if version in ("v2", "dot"):
        q, k = _normal(seed, (B, length, H, D), dtype), _normal(seed + 1, (B, length, H, D), dtype)
        return q, k, k, (_normal(seed + 2, (H, D), dtype) if version == "v2" else None)
    z = _normal(seed, (B, length, H, D), dtype)
    q, k, ones = jax.jit(G.gat_v1_features)(z, _normal(seed + 1, (H, D), dtype),
                                   _normal(seed + 2, (H, D), dtype))
    return np.asarray(q), np.asarray(k), z, np.asarray(ones)


def _edge_list_attention(q, k, v, attn, adj, bias=None, negative_slope=0.2):
    """The second oracle of htgn.md §3.4: GAT over an explicit edge list with segment_max/segment_sum.

    q `[B, Lq, H, C]`, k `[B, Lk, H, C]`, v `[B, Lk, H, D]`, adj `[B, Lq, Lk]` (numpy), bias
    `[H, Lq, Lk]` or `[B, H, Lq, Lk]` or None; attn None means dot-product scoring.
    Returns out `[B, Lq, H, D]` (0 for receivers without edges). In numpy (float32 inputs).
    """
    q, k, v = (np.asarray(a) for a in (q, k, v))
    b_idx, i_idx, j_idx = np.nonzero(np.asarray(adj))
    qe, ke = q[b_idx, i_idx], k[b_idx, j_idx]                                # [E, H, C]
    if attn is None:
        logits = np.sum(qe * ke, -1) / np.sqrt(q.shape[-1])
    else:
        pre = qe + ke
        logits = np.einsum("ehc,hc->eh", np.where(pre >= 0, pre, negative_slope * pre), np.asarray(attn))
    if bias is not None:
        bias = np.asarray(bias)
        bias = np.broadcast_to(bias, (q.shape[0],) + bias.shape[-3:])
        logits = logits + bias[b_idx, :, i_idx, j_idx]
    seg, n_seg = b_idx * q.shape[1] + i_idx, q.shape[0] * q.shape[1]
    seg_max = np.full((n_seg,) + logits.shape[1:], -np.inf, logits.dtype)
    np.maximum.at(seg_max, seg, logits)
    e = np.exp(logits - seg_max[seg])
    seg_sum = np.zeros((n_seg,) + e.shape[1:], e.dtype)
    np.add.at(seg_sum, seg, e)
    w = e / seg_sum[seg]                                                   # [E, H]
    out = np.zeros((n_seg,) + w.shape[1:] + v.shape[-1:], w.dtype)
    np.add.at(out, seg, w[..., None] * v[b_idx, j_idx])
    return out.reshape(q.shape[:3] + v.shape[-1:])


def _window_edges(mask, rel_bias, global_bias, *, window, num_global, causal=False, grid=None):
    """Adjacency `[B, L, L]` and bias `[H, L, L]` of the window graph from first principles: token i
    links token j when j - i is within the window (on a grid: rows and columns each within w),
    with bias rel_bias[h, slot]; tokens link every global with global_bias; globals link all."""
    mask = np.asarray(mask)
    b, length = mask.shape
    heads, w, g = rel_bias.shape[0], window, num_global
    adj = np.zeros((b, length, length), bool)
    bias = np.zeros((heads, length, length), np.float32)
    rb, gb = np.asarray(rel_bias), None if global_bias is None else np.asarray(global_bias)
    for i in range(length):
        for j in range(length):
            if i < g:
                edge, value = True, 0.0
            elif j < g:
                edge, value = True, gb[:]
            elif grid:
                (ri, ci), (rj, cj) = divmod(i - g, grid), divmod(j - g, grid)
                edge = abs(ri - rj) <= w and abs(ci - cj) <= w
                value = rb[:, (rj - ri + w) * (2 * w + 1) + (cj - ci + w)] if edge else 0.0
            else:
                edge = -w <= j - i <= (0 if causal else w)
                value = rb[:, j - i + w] if edge else 0.0
            adj[:, i, j] = edge & mask[:, i] & mask[:, j]
            bias[:, i, j] = value
    return adj, bias


def _cross_edges(mask, memory_mask, rel_bias, global_bias, *, window, num_global, rho):
    """Cross-Graph adjacency `[B, T, L]` and bias `[B, H, T, L]` from first principles, with the
    centres c_i = min(round(rho i), N_b - 1) by Python's round."""
    mask, memory_mask = np.asarray(mask), np.asarray(memory_mask)
    b, t = mask.shape
    length, g = memory_mask.shape[1], num_global
    adj = np.zeros((b, t, length), bool)
    bias = np.zeros((b, rel_bias.shape[0], t, length), np.float32)
    for e in range(b):
        n_b = int(memory_mask[e, g:].sum())
        for i in range(t):
            c = min(round(rho * i), n_b - 1)
            for j in range(length):
                if j < g:
                    edge, value = True, np.asarray(global_bias)
                else:
                    edge = abs(j - g - c) <= window
                    value = np.asarray(rel_bias)[:, j - g - c + window] if edge else 0.0
                adj[e, i, j] = edge and mask[e, i] and memory_mask[e, j]
                bias[e, :, i, j] = value
    return adj, bias


@pytest.mark.parametrize("case", ["v1", "v2", "dot", "causal", "grid", "cross"])
def test_kernels_match_the_edge_list_oracle(case):
    """Window, causal, grid and Cross-Graph kernels against segment ops on an edge list built from
    first principles (htgn.md §3.4's second oracle)."""
    version = case if case in ("v1", "dot") else "v2"
    if case == "cross":
        t, wx, length = 6, 1, N + NG
        q, _, _, attn = _features(version, 70, t)
        _, k, v, _ = _features(version, 71, length)
        mask, memory_mask = _lengths_mask([t, t - 2], t), _lengths_mask([length, length - 3], length)
        rel_bias, global_bias = _normal(72, (H, 2 * wx + 1)), _normal(73, (H,))
        out, _ = cross_attention(q, k, v, attn, window=wx, num_global=NG, rho=0.75, mask=mask,
                                 memory_mask=memory_mask, rel_bias=rel_bias, global_bias=global_bias)
        adj, bias = _cross_edges(mask, memory_mask, rel_bias, global_bias, window=wx,
                                 num_global=NG, rho=0.75)
    else:
        g = 0 if case == "causal" else NG
        grid = {"grid_width": 3} if case == "grid" else {}
        wg = 1 if grid else W
        length = (9 if grid else N) + g
        q, k, v, attn = _features(version, 74, length)
        mask = _lengths_mask([length, length - 2], length)
        rel_bias = _normal(75, (H, len(G.window_offsets(wg, case == "causal", grid.get("grid_width")))))
        global_bias = _normal(76, (H,)) if g else None
        out, _ = window_attention(q, k, v, attn, window=wg, num_global=g, causal=case == "causal",
                                  mask=mask, rel_bias=rel_bias, global_bias=global_bias, **grid)
        adj, bias = _window_edges(mask, rel_bias, global_bias, window=wg, num_global=g,
                                  causal=case == "causal", grid=grid.get("grid_width"))
    want = _edge_list_attention(q, k, v, attn, adj, bias)
    np.testing.assert_allclose(out, want, **F32_SIMPLE)


def test_dot_product_scoring_by_hand():
    """gat=dot: alpha_ij = softmax_j(<q_i, k_j> / sqrt(C) + b), written out in numpy."""
    q, k, v, attn = _features("dot", 50, N)
    assert attn is None
    mask = _lengths_mask([N, N - 2], N)
    rel_bias = _normal(53, (H, 2 * W + 1))
    out, aux = window_attention(q, k, v, None, window=W, mask=mask, rel_bias=rel_bias)
    qn, kn, vn, rb = (np.asarray(a, np.float64) for a in (q, k, v, rel_bias))
    b, i, h = 1, 4, 1                                  # one receiver of the padded example
    js = [j for j in range(i - W, i + W + 1) if 0 <= j < N - 2]
    logits = np.array([qn[b, i, h] @ kn[b, j, h] / np.sqrt(D) + rb[h, j - i + W] for j in js])
    alpha = np.exp(logits - logits.max())
    alpha /= alpha.sum()
    np.testing.assert_allclose(np.asarray(out)[b, i, h], alpha @ vn[b, js, h], **F32_SIMPLE)
    np.testing.assert_allclose(np.asarray(aux["probs"])[b, i, h, [j - i + W for j in js]], alpha,
                               **F32_SIMPLE)


def _dense_kl(probs, adj, dist=None, tau=None):
    """Reference KL sum/count from dense probs `[B, H, Lq, Lk]` and adjacency `[B, Lq, Lk]`.

    Uniform prior over each row's edges, or with `dist` `[B, Lq, Lk]` (NaN = uniform row) the
    prior pi_ij = exp(-dist_ij / tau) normalised over the edges of row i.
    """
    p = np.asarray(probs, np.float64)
    adj = np.asarray(adj)
    n = adj.sum(-1)                                                        # [B, Lq]
    if dist is None:
        dist = np.full(adj.shape, np.nan)
    logit = np.where(np.isnan(dist), 0.0, -np.nan_to_num(dist) / (tau or 1.0))
    prior = np.where(adj, np.exp(logit), 0.0)
    prior /= np.maximum(prior.sum(-1, keepdims=True), 1e-300)              # [B, Lq, Lk]
    ratio = np.where(p > 0, p / np.where(prior[:, None] > 0, prior[:, None], 1.0), 1.0)
    kl = (p * np.log(ratio)).sum(-1)                                       # [B, H, Lq]
    has = np.broadcast_to((n > 0)[:, None], kl.shape)
    return kl[has].sum(), has.sum()


@pytest.mark.parametrize("causal", [False, True])
def test_window_kl_distance_prior_matches_dense(causal):
    """kl_tau: pi_i(j) ~ exp(-|j - i| / tau) on token rows, distance 1 to a global node, global
    rows uniform (htgn.md §5.7 `kl_prior = "distance"`)."""
    g = 0 if causal else NG
    length, tau = N + g, 1.5
    q, k, v, attn = _features("v2", 60, length)
    mask = _lengths_mask([length, length - 3], length)
    out, aux = window_attention(q, k, v, attn, window=W, num_global=g, causal=causal, mask=mask,
                                kl_tau=tau)
    uniform, aux_u = window_attention(q, k, v, attn, window=W, num_global=g, causal=causal,
                                      mask=mask)
    np.testing.assert_array_equal(out, uniform)          # the prior only changes the KL term
    adj = window_adjacency(mask, window=W, num_global=g, causal=causal)
    _, probs = dense_attention(q, k, v, attn, adj)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    dist = np.where(j < g, 1.0, np.abs(j - i).astype(float))
    dist = np.broadcast_to(np.where(i < g, np.nan, dist), adj.shape)
    kl_sum, kl_count = _dense_kl(probs, adj, dist, tau)
    assert float(aux["kl_count"]) == kl_count == float(aux_u["kl_count"])
    np.testing.assert_allclose(aux["kl_sum"], kl_sum, **F32_SIMPLE)
    assert abs(float(aux["kl_sum"]) - float(aux_u["kl_sum"])) > 1e-2


def _dense_neighbour_kl(probs, adj, rows, first, offsets, columns_of, pair_ok=lambda i: True):
    """KL(alpha_i || alpha_{i-1}) written from dense probs `[B, H, Lq, Lk]`: for each pair of
    consecutive real rows (i-1, i) in `rows` with `pair_ok(i)`, slot o of row r is column
    `columns_of(b, r, o)` (None if off the memory), global slots are the columns < `first`; both
    rows renormalised on the slots that are edges of both; pairs with fewer than 2 such slots
    are left out (their KL is 0 whatever alpha is)."""
    p, adj = np.asarray(probs, np.float64), np.asarray(adj)
    total, count = 0.0, 0
    for b in range(adj.shape[0]):
        for i in rows:
            if i - 1 not in rows or not pair_ok(i) or not adj[b, i].any() or not adj[b, i - 1].any():
                continue
            pairs = [(columns_of(b, i, o), columns_of(b, i - 1, o)) for o in offsets]
            pairs += [(j, j) for j in range(first)]
            pairs = [(a, c) for a, c in pairs if a is not None and c is not None
                     and adj[b, i, a] and adj[b, i - 1, c]]
            if len(pairs) < 2:
                continue
            for h in range(p.shape[1]):
                cur = np.array([p[b, h, i, a] for a, _ in pairs])
                prev = np.array([p[b, h, i - 1, c] for _, c in pairs])
                cur, prev = cur / cur.sum(), prev / prev.sum()
                total += float(np.sum(cur * np.log(cur / prev)))
                count += 1
    return total, count


@pytest.mark.parametrize("causal", [False, True])
def test_window_kl_neighbour_mode_matches_dense(causal):
    g = 0 if causal else NG
    length = N + g
    q, k, v, attn = _features("v2", 62, length)
    mask = _lengths_mask([length, length - 3], length)
    out, aux = window_attention(q, k, v, attn, window=W, num_global=g, causal=causal, mask=mask,
                                kl_mode="neighbour")
    adj = window_adjacency(mask, window=W, num_global=g, causal=causal)
    _, probs = dense_attention(q, k, v, attn, adj)

    def column(b, i, o):
        return i + o if g <= i + o < length else None

    want = _dense_neighbour_kl(probs, adj, range(g, length), g,
                               G.window_offsets(W, causal), column)
    assert float(aux["kl_count"]) == want[1] > 0
    np.testing.assert_allclose(aux["kl_sum"], want[0], **F32_SIMPLE)


def test_grid_kl_neighbour_mode_skips_row_ends():
    """On the grid, raster pairs (r, W-1) -> (r+1, 0) are not image neighbours: no KL term."""
    wd, rows_, g = 4, 3, 1
    length = wd * rows_ + g
    q, k, v, attn = _features("v2", 68, length)
    mask = _lengths_mask([length, length - 2], length)
    _, aux = window_attention(q, k, v, attn, window=1, num_global=g, mask=mask,
                              kl_mode="neighbour", grid_width=wd)
    adj = window_adjacency(mask, window=1, num_global=g, grid_width=wd)
    _, probs = dense_attention(q, k, v, attn, adj)

    def column(b, i, o):
        j = i + o
        dr, dc = divmod(o + wd + 1, wd)           # o = (dr - 1) W + (dc - 1) for |dr|, |dc| <= 1
        ok = g <= j < length and 0 <= (i - g) % wd + dc - 1 < wd
        return j if ok else None

    want = _dense_neighbour_kl(probs, adj, range(g, length), g, G.window_offsets(1, grid_width=wd),
                               column, pair_ok=lambda i: (i - g) % wd != 0)
    # Example 0: 12 tokens in 3 rows -> 9 pairs; example 1 (10 real) -> 7 pairs; 2 heads each.
    assert float(aux["kl_count"]) == want[1] == (9 + 7) * H
    np.testing.assert_allclose(aux["kl_sum"], want[0], **F32_SIMPLE)


def test_cross_graph_kl_neighbour_mode_matches_dense():
    t, rho, wx, length = 6, 0.75, 1, N + NG
    q, _, _, attn = _features("v2", 63, t)
    _, k, v, _ = _features("v2", 64, length)
    mask = _lengths_mask([t, t - 2], t)
    memory_mask = _lengths_mask([N + NG, N - 3 + NG], length)
    _, aux = cross_attention(q, k, v, attn, window=wx, num_global=NG, rho=rho, mask=mask,
                             memory_mask=memory_mask, kl_mode="neighbour")
    centres = np.asarray(aux["centres"])
    adj = cross_graph_adjacency(mask, memory_mask, jnp.asarray(centres), window=wx,
                                  num_global=NG)
    _, probs = dense_attention(q, k, v, attn, adj)

    def column(b, i, o):
        j = centres[b, i] + o
        return NG + j if 0 <= j < N else None

    want = _dense_neighbour_kl(probs, adj, range(t), NG, G.window_offsets(wx), column)
    assert float(aux["kl_count"]) == want[1] > 0
    np.testing.assert_allclose(aux["kl_sum"], want[0], **F32_SIMPLE)


def test_kl_prior_zero_logits_is_the_uniform_prior():
    @jax.jit   # one program: eagerly every op of the softmax and KL compiles on its own
    def both(logits, mask):
        probs, log_probs = G._masked_softmax(logits, mask[:, None, None])
        valid = jnp.broadcast_to(mask[:, None], (B, N, 5))
        return (G.attention_kl(probs, log_probs, valid, jnp.zeros((5,))),
                G.attention_kl(probs, log_probs, valid))

    zero, uniform = both(_normal(61, (B, N, H, 5)), _lengths_mask([3, 5], 5))
    np.testing.assert_allclose(zero, uniform, **F32_SIMPLE)


# ---------------------------------------------------------------------------------------------
# Pure kernels against the dense masked oracle.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v2", "dot"])
@pytest.mark.parametrize("num_global", [0, NG])
@pytest.mark.parametrize("padded", [False, True])
def test_window_matches_dense(version, num_global, padded):
    length = N + num_global
    q, k, v, attn = _features(version, 0, length)
    mask = _lengths_mask([length, length - 3] if padded else [length, length], length)
    rel_bias = _normal(5, (H, 2 * W + 1))
    global_bias = _normal(6, (H,)) if num_global else None
    out, aux = window_attention(q, k, v, attn, window=W, num_global=num_global, mask=mask,
                                        rel_bias=rel_bias, global_bias=global_bias)
    adj = window_adjacency(mask, window=W, num_global=num_global)
    bias = window_bias_matrix(rel_bias, global_bias, length=length, window=W,
                                num_global=num_global)
    ref, probs = dense_attention(q, k, v, attn, adj, bias=bias)
    np.testing.assert_allclose(out, ref, **F32_SIMPLE)
    kl_sum, kl_count = _dense_kl(probs, adj)
    assert float(aux["kl_count"]) == kl_count
    np.testing.assert_allclose(aux["kl_sum"], kl_sum, **F32_SIMPLE)
    if padded:   # padded nodes neither send nor receive
        assert np.all(np.asarray(out)[1, length - 3:] == 0)


@pytest.mark.parametrize("grid_width, num_global, wg, tokens, pad", [
    (3, NG, 1, 9, 0), (2, 0, 1, 8, 0), (4, 1, 2, 10, 3)])
def test_grid_stencil_matches_dense(grid_width, num_global, wg, tokens, pad):
    """grid_width (htgn.md §5.12): the 2-D stencil of radius w over raster-ordered patches, against
    the dense oracle whose adjacency compares rows and columns. W = 2 < 2w + 1 makes two slots
    share an offset (only one is valid for any token); the last case has w = 2, a partial last
    row and 3 padded tokens in example 1."""
    length = tokens + num_global
    q, k, v, attn = _features("v2", 65, length)
    rel_bias = _normal(66, (H, (2 * wg + 1) ** 2))
    global_bias = _normal(67, (H,)) if num_global else None
    mask = _lengths_mask([length, length - pad], length)
    out, aux = window_attention(q, k, v, attn, window=wg, num_global=num_global, mask=mask,
                                rel_bias=rel_bias, global_bias=global_bias, kl_tau=0.5,
                                grid_width=grid_width)
    adj = window_adjacency(mask, window=wg, num_global=num_global, grid_width=grid_width)
    bias = window_bias_matrix(rel_bias, global_bias, length=length, window=wg,
                                num_global=num_global, grid_width=grid_width)
    ref, probs = dense_attention(q, k, v, attn, adj, bias=bias)
    np.testing.assert_allclose(out, ref, **F32_SIMPLE)
    # Distance prior on the grid: Chebyshev hops max(|dr|, |dc|), 1 to a global.
    node = np.arange(length) - num_global
    (r, c) = np.divmod(node, grid_width)
    hops = np.maximum(np.abs(r[:, None] - r[None]), np.abs(c[:, None] - c[None])).astype(float)
    dist = np.where(node[None] < 0, 1.0, hops)
    dist = np.broadcast_to(np.where(node[:, None] < 0, np.nan, dist), adj.shape)
    kl_sum, kl_count = _dense_kl(probs, adj, dist, 0.5)
    assert float(aux["kl_count"]) == kl_count
    np.testing.assert_allclose(aux["kl_sum"], kl_sum, **F32_SIMPLE)


@pytest.mark.parametrize("version", ["v1", "v2", "dot"])
def test_causal_window_matches_dense(version):
    q, k, v, attn = _features(version, 10, N)
    mask = _lengths_mask([N, N - 2], N)
    rel_bias = _normal(13, (H, W + 1))
    out, _ = window_attention(q, k, v, attn, window=W, causal=True, mask=mask,
                                      rel_bias=rel_bias)
    adj = window_adjacency(mask, window=W, causal=True)
    bias = window_bias_matrix(rel_bias, None, length=N, window=W, causal=True)
    ref, _ = dense_attention(q, k, v, attn, adj, bias=bias)
    np.testing.assert_allclose(out, ref, **F32_SIMPLE)
    # Causality: changing future inputs leaves the past bit-identical.
    k2 = k.copy()
    k2[:, 4:] += np.float32(3.0)
    if version == "v1":
        v2 = v.copy()
        v2[:, 4:] += np.float32(3.0)
    else:
        v2 = k2
    out2, _ = window_attention(q, k2, v2, attn, window=W, causal=True, mask=mask,
                                       rel_bias=rel_bias)
    np.testing.assert_array_equal(np.asarray(out2)[:, :4], np.asarray(out)[:, :4])


@pytest.mark.parametrize("version,kl_tau", [("v1", None), ("v2", None), ("dot", None),
                                            ("v2", 0.7)])
def test_cross_graph_matches_dense(version, kl_tau):
    t, rho, wx = 6, 0.75, 1
    length = N + NG
    q, _, _, attn = _features(version, 20, t)
    _, k, v, _ = _features(version, 30, length)
    if version == "v1":
        q = q[..., :1]
        attn = np.ones((H, 1), np.float32)
    mask = _lengths_mask([t, t - 2], t)
    memory_lengths = [N, N - 3]
    memory_mask = _lengths_mask([n + NG for n in memory_lengths], length)
    rel_bias, global_bias = _normal(23, (H, 2 * wx + 1)), _normal(24, (H,))
    out, aux = cross_attention(q, k, v, attn, window=wx, num_global=NG, rho=rho,
                                       mask=mask, memory_mask=memory_mask, rel_bias=rel_bias,
                                       global_bias=global_bias, kl_tau=kl_tau)
    # Centres by hand: clip(round(rho * i), 0, N_b - 1), Python's round (half to even).
    want = np.array([[min(round(rho * i), n - 1) for i in range(t)] for n in memory_lengths])
    np.testing.assert_array_equal(aux["centres"], want)
    adj = cross_graph_adjacency(mask, memory_mask, want, window=wx, num_global=NG)
    bias = cross_graph_bias_matrix(rel_bias, global_bias, want,
                                     memory_length=length, window=wx, num_global=NG)
    ref, probs = dense_attention(q, k, v, attn, adj, bias=bias)
    np.testing.assert_allclose(out, ref, **F32_SIMPLE)
    # Distance prior: |j_tok - c_i| to encoder tokens, 1 to the encoder globals.
    j = np.arange(length)[None, None, :]
    dist = np.where(j < NG, 1.0, np.abs(j - NG - want[:, :, None]).astype(float))
    kl_sum, kl_count = _dense_kl(probs, adj, None if kl_tau is None else dist, kl_tau)
    assert float(aux["kl_count"]) == kl_count
    np.testing.assert_allclose(aux["kl_sum"], kl_sum, **F32_SIMPLE)


@pytest.mark.parametrize("kl", [{}, {"kl_tau": 1.0}, {"kl_mode": "neighbour"}])
def test_fully_masked_rows_finite(kl):
    q, k, v, attn = _features("v2", 40, N + NG)
    mask = _lengths_mask([0, N + NG], N + NG)           # example 0 is all padding

    def loss(q, k, attn):
        out, aux = window_attention(q, k, k, attn, window=W, num_global=NG, mask=mask, **kl)
        return jnp.sum(out ** 2) + aux["kl_sum"]

    out, _ = window_attention(q, k, k, attn, window=W, num_global=NG, mask=mask)
    assert np.all(np.asarray(out)[0] == 0)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, attn)
    assert all(np.all(np.isfinite(g_)) for g_ in grads)
    assert np.all(np.asarray(grads[0])[0] == 0)


def test_relative_bias_effect():
    # With a = 0 the logits are the bias alone; a large bias on offset -1 copies the left
    # neighbour, and the first token (no left neighbour) falls back to its remaining window.
    _, _, v, _ = _features("v2", 50, N)
    rel_bias = np.zeros((H, 2 * W + 1), np.float32)
    rel_bias[:, W - 1] = 40.0
    out, aux = window_attention(v, v, v, np.zeros((H, D), np.float32), window=W,
                                        rel_bias=rel_bias)
    out = np.asarray(out)
    np.testing.assert_allclose(out[:, 1:], v[:, :-1], **F32_SIMPLE)
    np.testing.assert_allclose(out[:, 0], v[:, :W + 1].mean(axis=1), **F32_SIMPLE)
    out0, aux0 = window_attention(v, v, v, np.zeros((H, D), np.float32), window=W)
    assert float(aux0["kl_sum"]) < 1e-6 < float(aux["kl_sum"])   # uniform alpha: KL = 0


def test_kl_hand_value():
    # w=1, 3 tokens, 1 head, a = 0, biases (b_-1, b_0, b_+1) = (0, 1, 2):
    # row 0 sees offsets {0,+1}: logits (1, 2); row 1 all three: (0, 1, 2); row 2 {-1,0}: (0, 1).
    def kl(logits):
        z = sum(math.exp(l) for l in logits)
        return sum(math.exp(l) / z * (l - math.log(z)) for l in logits) + math.log(len(logits))

    expected = (kl([1, 2]) + kl([0, 1, 2]) + kl([0, 1])) / 3
    x = np.ones((1, 3, 1, 2), np.float32)
    out, aux = window_attention(x, x, x, np.zeros((1, 2), np.float32), window=1,
                                        rel_bias=np.array([[0.0, 1.0, 2.0]], np.float32))
    assert float(aux["kl_count"]) == 3
    np.testing.assert_allclose(np.asarray(aux["kl_sum"]) / np.asarray(aux["kl_count"]), expected,
                               **F32_SIMPLE)
    np.testing.assert_allclose(expected, 0.16270162, rtol=1e-7)  # (2 * 0.1109441 + 0.2662167) / 3


def test_check_grads_float64(x64):
    f64 = jnp.float64
    length = N + NG
    q, k, _, attn = _features("v2", 60, length, f64)
    mask = _lengths_mask([length, length - 2], length)
    rb, gb = _normal(63, (H, 2 * W + 1), f64), _normal(64, (H,), f64)
    memory_mask = _lengths_mask([length, length - 3], length)

    @jax.jit   # one compile for window + cross together
    def f(q, k, attn, rb, gb):
        out, aux = G.window_graph_attention(q, k, k, attn, window=W, num_global=NG, mask=mask,
                                            rel_bias=rb, global_bias=gb)
        out_x, aux_x = G.cross_graph_attention(q[:, :5], k, k, attn, window=1, num_global=NG,
                                               rho=0.8, memory_mask=memory_mask,
                                               rel_bias=rb[:, 1:4], global_bias=gb)
        return out, aux["kl_sum"], out_x, aux_x["kl_sum"]

    check_grads(f, (q, k, attn, rb, gb), order=1, modes=("rev",), **F64)


# ---------------------------------------------------------------------------------------------
# Flax layers.
# ---------------------------------------------------------------------------------------------


def _init(layer, *args, **kwargs):
    return jax.jit(layer.init)(jax.random.PRNGKey(0), *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _jitted(layer, method=None):
    """One jitted apply per (layer, method): layers compare by their fields, so a test that runs one
    layer on several inputs of one shape (clean, padded, poisoned) compiles it once."""
    fn = layer.apply if method is None else functools.partial(layer.apply, method=method)
    return jax.jit(fn, static_argnames=("deterministic",))


def _apply(layer, variables, *args, method=None, **kwargs):
    return _jitted(layer, method)(variables, *args, **kwargs)


def _randomise(variables, seed=7):
    """Non-zero values for every parameter (bias inits are zero), so every path is exercised."""
    leaves, tree = jax.tree_util.tree_flatten(variables)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        tree, [0.5 * jax.random.normal(k_, l.shape, l.dtype) for k_, l in zip(keys, leaves)])


def _project(x, kernel):
    return jnp.einsum("bld,dhk->blhk", x, kernel)


@functools.partial(jax.jit, static_argnames="version")
def _layer_reference(p, x, version, adj, bias):
    """The layer's maths written out from its parameter tree with the dense oracle."""
    if version != "v1":
        s, u = _project(x, p["target"]["kernel"]), _project(x, p["source"]["kernel"])
        out, _ = dense_attention(s, u, u, p["attn"]["vector"] if version == "v2" else None, adj,
                                 bias=bias)
    else:
        z = _project(x, p["source"]["kernel"])
        st = jnp.einsum("blhd,hd->blh", z, p["attn_target"]["vector"])[..., None]
        ss = jnp.einsum("blhd,hd->blh", z, p["attn_source"]["vector"])[..., None]
        out, _ = dense_attention(st, ss, z, jnp.ones((H, 1)), adj, bias=bias)
    y = jnp.einsum("blhd,hdf->blf", out, p["output"]["kernel"]) + p["output"]["bias"]
    return jnp.where(adj.any(-1)[..., None], y, 0)


@pytest.mark.parametrize("version", ["v1", "v2", "dot"])
def test_window_layer_matches_dense(version):
    length = N + NG
    x = _normal(70, (B, length, WIDTH))
    mask = _lengths_mask([length, length - 3], length)
    layer = WindowGraphAttention(num_heads=H, window=W, num_global=NG, version=version)
    variables = _randomise(_init(layer, x, mask=mask))
    y, aux = _apply(layer, variables, x, mask=mask)
    p = variables["params"]
    adj = window_adjacency(mask, window=W, num_global=NG)
    bias = window_bias_matrix(p["rel_bias"], p["global_bias"], length=length, window=W,
                                num_global=NG)
    np.testing.assert_allclose(y, _layer_reference(p, x, version, adj, bias), **F32_SIMPLE)
    assert set(aux) == {"kl_sum", "kl_count"} and aux["kl_sum"].shape == ()
    assert float(aux["kl_sum"]) > 0 and float(aux["kl_count"]) > 0
    if version == "v1":
        return
    # Padding invariance: appending pads changes nothing for the real nodes.
    xp = np.concatenate([x, _normal(71, (B, 3, WIDTH))], axis=1)
    mp = np.concatenate([mask, np.zeros((B, 3), bool)], axis=1)
    yp, auxp = _apply(layer, variables, xp, mask=mp)
    assert_forms_agree({"unpadded": (y, aux), "padded": (np.asarray(yp)[:, :length], auxp)}, **F32_SIMPLE)


@functools.lru_cache(maxsize=None)
def _causal_forms_fn(layer, masked):
    """Jitted (variables, x, mask) -> every causal form, one program per layer and mask use."""
    chunked = layer.clone(chunk_size=3)

    def fn(variables, x, mask):
        mask = mask if masked else None
        out = {"parallel": layer.apply(variables, x, mask=mask),
               "chunked(3)": chunked.apply(variables, x, mask=mask)}
        state = layer.apply(variables, x.shape[0], method=layer.init_state)
        out["scan"] = layer.apply(variables, x, state, mask=mask, method=layer.scan)
        ys = []
        for t in range(x.shape[1]):
            y_t, state = layer.apply(variables, state, x[:, t], method=layer.step)
            ys.append(y_t)
        out["step"] = (jnp.stack(ys, axis=1), state)
        return out
    return jax.jit(fn)


def _causal_forms(layer, variables, x, mask=None):
    """{form: (y, aux or final state)} of a causal window layer: parallel, chunked(3), scan, step."""
    dummy = np.ones(x.shape[:2], bool)
    return _causal_forms_fn(layer, mask is not None)(variables, x, dummy if mask is None else mask)


@pytest.mark.parametrize("version,window,kl", [("v1", W, {}), ("v2", W, {"kl_tau": 1.5}),
                                               ("v2", 0, {}), ("dot", W, {"kl_mode": "neighbour"})])
def test_causal_forms_agree(version, window, kl):
    """parallel == chunked (C = 3, not dividing T) == scan == step loop, outputs and KL aux."""
    x = _normal(80, (B, N, WIDTH))
    layer = WindowGraphAttention(num_heads=H, window=window, causal=True, version=version, **kl)
    variables = _randomise(_init(layer, x))
    forms = _causal_forms(layer, variables, x)
    assert_forms_agree({k: v[0] for k, v in forms.items()}, **F32_SIMPLE)
    assert_forms_agree({k: forms[k][1] for k in ("parallel", "chunked(3)")}, **F32_SIMPLE)
    assert_forms_agree({k: forms[k][1] for k in ("scan", "step")}, **F32_SIMPLE)
    state = forms["step"][1]
    assert isinstance(state, WindowState) and state.value.shape[1] == window
    assert state.value.dtype == jnp.float32 and (state.key is not None) == (version == "v1")
    # Continuing a scan from a carried state.
    y1, s1 = _apply(layer, variables, x[:, :3], method=layer.scan)
    y2, _ = _apply(layer, variables, x[:, 3:], s1, method=layer.scan)
    assert_forms_agree({"parallel": forms["parallel"][0],
                        "scan+scan": np.concatenate([y1, y2], 1)}, **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("version", ["v1", "v2", "dot"])
def test_garbage_in_padding_or_future_changes_nothing(version, bad):
    """NaN-safe masking in every form: padded nodes (and, causal, future tokens) holding NaN or
    1e30 change no valid / past output and no KL term."""
    length = N + NG
    x = _normal(130, (B, length, WIDTH))
    mask = _lengths_mask([length, length - 3], length)
    valid = np.asarray(mask)
    dirty = np.where(mask[..., None], x, np.float32(bad))
    layer = WindowGraphAttention(num_heads=H, window=W, num_global=NG, version=version)
    variables = _randomise(_init(layer, x))
    (y, aux), (y_bad, aux_bad) = (_apply(layer, variables, a, mask=mask) for a in (x, dirty))
    np.testing.assert_array_equal(np.asarray(y_bad)[valid], np.asarray(y)[valid])
    assert_forms_agree({"clean": aux, "dirty": aux_bad}, rtol=0.0, atol=0.0)
    causal = WindowGraphAttention(num_heads=H, window=W, causal=True, version=version)
    cv = _randomise(_init(causal, x))
    clean, padded = (_causal_forms(causal, cv, a, mask) for a in (x, dirty))
    x_future = x.copy()
    x_future[:, 4] = bad
    future = _causal_forms(causal, cv, x_future)
    unmasked = _causal_forms(causal, cv, x)
    for form in clean:
        np.testing.assert_array_equal(np.asarray(padded[form][0])[valid],
                                      np.asarray(clean[form][0])[valid], err_msg=form)
        np.testing.assert_array_equal(np.asarray(future[form][0])[:, :4],
                                      np.asarray(unmasked[form][0])[:, :4], err_msg=form)
    for form in ("parallel", "chunked(3)"):
        assert_forms_agree({"clean": clean[form][1], "dirty": padded[form][1]}, rtol=0.0, atol=0.0)
    # Cross-Graph: garbage in padded memory and in padded decoder rows.
    cross = CrossGraphAttention(num_heads=H, window=1, num_global=NG, rho=0.8, version=version)
    t = 5
    dmask = _lengths_mask([t, t - 2], t)
    xv = _randomise(_init(cross, x[:, :t], x))
    y, aux = _apply(cross, xv, x[:, :t], x, mask=dmask, memory_mask=mask)
    y_bad, aux_bad = _apply(cross, xv, np.where(dmask[..., None], x[:, :t], np.float32(bad)), dirty,
                            mask=dmask, memory_mask=mask)
    np.testing.assert_array_equal(np.asarray(y_bad), np.asarray(y))
    assert_forms_agree({"clean": aux, "dirty": aux_bad}, rtol=0.0, atol=0.0)


@functools.partial(jax.jit, static_argnames="version")
def _cross_layer_reference(p, x, memory, mask, version, adj, bias):
    """The Cross-Graph layer's maths written out from its parameter tree with the dense oracle."""
    if version != "v1":
        s, u = _project(x, p["target"]["kernel"]), _project(memory, p["source"]["kernel"])
        ref, _ = dense_attention(s, u, u, p["attn"]["vector"] if version == "v2" else None, adj,
                                 bias=bias)
    else:
        zx, zm = _project(x, p["source"]["kernel"]), _project(memory, p["source"]["kernel"])
        st = jnp.einsum("blhd,hd->blh", zx, p["attn_target"]["vector"])[..., None]
        ss = jnp.einsum("blhd,hd->blh", zm, p["attn_source"]["vector"])[..., None]
        ref, _ = dense_attention(st, ss, zm, jnp.ones((H, 1)), adj, bias=bias)
    ref = jnp.einsum("blhd,hdf->blf", ref, p["output"]["kernel"]) + p["output"]["bias"]
    return jnp.where(mask[..., None], ref, 0)


@pytest.mark.parametrize("version", ["v1", "v2", "dot"])
def test_cross_layer_matches_dense_and_step(version):
    t, rho, wx, length = 6, 1.5, 1, N + NG
    x = _normal(90, (B, t, WIDTH))
    memory = _normal(91, (B, length, WIDTH))
    mask = _lengths_mask([t, t - 1], t)
    memory_lengths = [N, N - 4]
    memory_mask = _lengths_mask([n + NG for n in memory_lengths], length)
    layer = CrossGraphAttention(num_heads=H, window=wx, num_global=NG, rho=rho,
                                  version=version)
    variables = _randomise(_init(layer, x, memory, mask=mask, memory_mask=memory_mask))
    y, aux = _apply(layer, variables, x, memory, mask=mask, memory_mask=memory_mask)
    p = variables["params"]
    centres = np.asarray([[min(round(rho * i), n - 1) for i in range(t)]
                          for n in memory_lengths])
    adj = cross_graph_adjacency(mask, memory_mask, centres, window=wx, num_global=NG)
    bias = cross_graph_bias_matrix(p["rel_bias"], p["global_bias"], centres,
                                     memory_length=length, window=wx, num_global=NG)
    ref = _cross_layer_reference(p, x, memory, mask, version, adj, bias)
    np.testing.assert_allclose(y, ref, **F32_SIMPLE)
    assert float(aux["kl_sum"]) > 0 and float(aux["kl_count"]) > 0
    # Decoding: project the memory once, then one step per token.
    cache = _apply(layer, variables, memory, memory_mask=memory_mask, method=layer.prepare_memory)
    assert isinstance(cache, CrossGraphCache) and (cache.key is not None) == (version == "v1")
    step = _jitted(layer, layer.step)
    ys = np.stack([np.asarray(step(variables, cache, x[:, i], position=i)[0]) for i in range(t)], axis=1)
    assert_forms_agree({"parallel": y, "step": np.where(mask[..., None], ys, 0)}, **F32_SIMPLE)


def test_layer_relative_bias_and_dropout():
    x = _normal(100, (B, N + NG, WIDTH))
    layer = WindowGraphAttention(num_heads=H, window=W, num_global=NG, dropout_rate=0.5)
    variables = _randomise(_init(layer, x))
    y, _ = _apply(layer, variables, x)
    shifted = jax.tree_util.tree_map(lambda a: a, variables)
    rel_bias = np.array(variables["params"]["rel_bias"])
    rel_bias[:, 0] += np.float32(5.0)
    shifted["params"]["rel_bias"] = rel_bias
    assert np.abs(np.asarray(_apply(layer, shifted, x)[0]) - np.asarray(y)).max() > 1e-3
    no_bias = WindowGraphAttention(num_heads=H, window=W, num_global=NG,
                                     use_relative_bias=False)
    assert "rel_bias" not in _init(no_bias, x)["params"]
    y_drop, _ = _apply(layer, variables, x, deterministic=False,
                            rngs={"dropout": jax.random.PRNGKey(3)})
    assert np.all(np.isfinite(y_drop)) and np.abs(np.asarray(y_drop) - np.asarray(y)).max() > 1e-3


def test_layer_dtype():
    x = _normal(110, (B, N + NG, WIDTH))
    layer = WindowGraphAttention(num_heads=H, window=W, num_global=NG, dtype=jnp.bfloat16)
    variables = _init(layer, x)
    y, aux = _apply(layer, variables, x)
    assert y.dtype == jnp.bfloat16 and aux["kl_sum"].dtype == jnp.float32
    assert all(l.dtype == jnp.float32 for l in jax.tree_util.tree_leaves(variables))
    y32, aux32 = _apply(layer.clone(dtype=None), variables, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, **BF16)
    aux, aux32 = ({k: np.asarray(v) for k, v in a.items()} for a in (aux, aux32))
    np.testing.assert_allclose(aux["kl_sum"] / aux["kl_count"], aux32["kl_sum"] / aux32["kl_count"],
                               **BF16)


def test_param_snapshot():
    x = _normal(120, (B, N + NG, WIDTH))
    v2 = WindowGraphAttention(num_heads=H, window=W, num_global=NG, out_features=6)
    assert param_shapes(_init(v2, x)["params"]) == {
        "attn/vector": (H, D), "global_bias": (H,), "output/bias": (6,),
        "output/kernel": (H, D, 6), "rel_bias": (H, 2 * W + 1), "source/kernel": (WIDTH, H, D),
        "target/kernel": (WIDTH, H, D)}
    v1 = WindowGraphAttention(num_heads=H, head_dim=3, window=W, causal=True, version="v1")
    assert param_shapes(_init(v1, x)["params"]) == {
        "attn_source/vector": (H, 3), "attn_target/vector": (H, 3), "output/bias": (WIDTH,),
        "output/kernel": (H, 3, WIDTH), "rel_bias": (H, W + 1), "source/kernel": (WIDTH, H, 3)}
    # head_dim=None follows the memory width (12 // 2 = 6) on both sides.
    cross = CrossGraphAttention(num_heads=H, window=1, num_global=NG)
    memory = _normal(121, (B, N + NG, 12))
    assert param_shapes(_init(cross, x[:, :5], memory)["params"]) == {
        "attn/vector": (H, 6), "global_bias": (H,), "output/bias": (WIDTH,),
        "output/kernel": (H, 6, WIDTH), "rel_bias": (H, 3), "source/kernel": (12, H, 6),
        "target/kernel": (WIDTH, H, 6)}


def test_memory_linear_in_length():
    layer = WindowGraphAttention(num_heads=H, window=4, num_global=NG)
    variables = _init(layer, np.ones((1, 16 + NG, 16), np.float32))
    fwd = jax.jit(lambda v, x: layer.apply(v, x)[0])

    def temp_bytes(n):
        x = jax.ShapeDtypeStruct((1, n + NG, 16), jnp.float32)
        return fwd.lower(variables, x).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(8192)
    assert small > 0 and large / small < 8 * 1.5, (small, large)
