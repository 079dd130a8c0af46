"""Analysis helpers for HTGN: graph pictures, learned graph-attention maps, FAVOR+ error.

Used by `notebooks/htgn_graphs.ipynb`; nothing here changes the model. (Test-split BLEU of a finished
run: `python -m htgn_jax.train --config ... --workdir W --eval_only --eval_split=test`.)

* `window_graph_adjacency` / `cross_graph_adjacency_matrix`: the static stencil graphs of spec
  §5.3 (window +-w plus g global nodes; causal window -w..0) and §5.5 (Cross-Graph: decoder node i
  -> encoder tokens within w_x of c_i = round(rho i), plus the encoder globals) as dense boolean
  matrices, for pictures only (the model never builds them).
* `graph_attention_maps`: the attention coefficients alpha of every graph layer of a trained model
  on a batch (GATv2/GAT, htgn.md §3.1), as dense `[B, H, rows, cols]` maps. The layers return only
  their KL terms, so the coefficients are recomputed from each layer's own inputs by
  intercepting its `__call__` (`flax.linen.intercept_methods`) and calling the layer's public
  `attention_weights`, which runs the same code path as `__call__`.
* `favor_error_curve`: mean absolute error of FAVOR+ (Performer Lemma 1 positive orthogonal
  features, htgn.md §2.2-2.3) against exact softmax attention as the number of features m grows
  (htgn.md §5.14 test 3 as a curve).
"""
from __future__ import annotations

__all__ = ["window_graph_adjacency", "cross_graph_adjacency_matrix", "window_probs_to_dense", "cross_probs_to_dense",
           "graph_attention_maps", "favor_error_curve"]

from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from htgn_jax import graph_ops, ops
from htgn_jax.graph_layers import CrossGraphAttention, WindowGraphAttention

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Static graphs (pictures).
# ----------------------------------------------------------------------------------------------


def window_adjacency(mask: Array, *, window: int, num_global: int = 0,
                     causal: bool = False, grid_width: int | None = None,
                     skip_offsets: tuple[int, ...] = ()) -> Array:
    """`[B, L, L]` adjacency of the window + global graph over `[globals ; tokens]` nodes (with
    `grid_width`: tokens within w rows and w columns of each other on the raster grid), plus the
    skip edges j - i = -/+s (causal: -s; grid: row and column offsets in {-s, 0, s})."""
    b, length = mask.shape
    g = num_global
    node = jnp.arange(length)
    i, j = node[:, None], node[None, :]
    rel = j - i
    tok_i, tok_j = i >= g, j >= g
    if grid_width is None:
        band = (rel >= -window) & (rel <= (0 if causal else window))
        for s in skip_offsets:
            band = band | (rel == -s) | (~causal & (rel == s))
    else:
        (ri, ci), (rj, cj) = divmod(i - g, grid_width), divmod(j - g, grid_width)
        band = (jnp.abs(ri - rj) <= window) & (jnp.abs(ci - cj) <= window)
        for s in skip_offsets:
            dr, dc = jnp.abs(rj - ri), jnp.abs(cj - ci)
            band = band | (((dr == 0) | (dr == s)) & ((dc == 0) | (dc == s)) & (dr + dc > 0))
    adj = (tok_i & tok_j & band) | (tok_i & ~tok_j) | ~tok_i
    mask = mask.astype(bool)
    return adj[None] & mask[:, :, None] & mask[:, None, :]


def cross_graph_adjacency(mask: Array, memory_mask: Array, centres: Array, *, window: int,
                          num_global: int = 0, skip_offsets: tuple[int, ...] = ()) -> Array:
    """`[B, T, L]` Cross-Graph adjacency: |j_tok - c_i| <= w or = s (a skip), plus all encoder
    globals."""
    length = memory_mask.shape[1]
    j = jnp.arange(length)[None, None, :]
    tok = j >= num_global
    dist = jnp.abs((j - num_global) - centres[:, :, None])
    near = dist <= window
    for s in skip_offsets:
        near = near | (dist == s)
    adj = (tok & near) | ~tok
    return adj & mask.astype(bool)[:, :, None] & memory_mask.astype(bool)[:, None, :]


def window_graph_adjacency(length: int, *, window: int, num_global: int = 0,
                           causal: bool = False, grid_width: int | None = None) -> np.ndarray:
    """Dense adjacency of the window + global graph over `[globals ; tokens]` (htgn.md §5.3).

    Args:
      length: N tokens.
      window: radius w.
      num_global: g global nodes (0 when causal).
      causal: offsets -w..0 (decoder).
      grid_width: None, or W for the 2-D stencil over a raster grid of patches (htgn.md §5.12).

    Returns:
      bool `[g + N, g + N]`: entry (i, j) is True when node i attends to node j.
    """
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if causal and num_global:
        raise ValueError(f"num_global must be 0 when causal, got {num_global}")
    mask = jnp.ones((1, num_global + length), bool)
    graph_ops.window_offsets(window, causal, grid_width)       # checks window, grid_width, causal
    return np.asarray(window_adjacency(mask, window=window, num_global=num_global,
                                             causal=causal, grid_width=grid_width)[0])


def cross_graph_adjacency_matrix(target_length: int, source_length: int, *, window: int,
                                 num_global: int = 0, rho: float = 1.0) -> np.ndarray:
    """Dense Cross-Graph adjacency (htgn.md §5.5): decoder i -> encoder `[globals ; tokens]`.

    Args:
      target_length: T decoder nodes.
      source_length: N valid encoder tokens.
      window: w_x.
      num_global: g encoder globals.
      rho: centre ratio, c_i = clip(round(rho i), 0, N - 1).

    Returns:
      bool `[T, g + N]`.
    """
    for name, value in (("target_length", target_length), ("source_length", source_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    centres = graph_ops.cross_graph_centres(jnp.arange(target_length), rho,
                                        jnp.asarray([source_length]))
    return np.asarray(cross_graph_adjacency(
        jnp.ones((1, target_length), bool), jnp.ones((1, num_global + source_length), bool),
        centres, window=window, num_global=num_global)[0])


# ----------------------------------------------------------------------------------------------
# Learned graph-attention maps.
# ----------------------------------------------------------------------------------------------


def window_probs_to_dense(probs: Array, global_probs: Array | None, *, window: int,
                          num_global: int = 0, causal: bool = False,
                          grid_width: int | None = None) -> np.ndarray:
    """Scatters the stencil coefficients of `graph_ops.window_graph_attention` into dense maps.

    Args:
      probs: token rows `[B, N, H, K + g]` (columns: window offsets, then the globals).
      global_probs: global rows `[B, g, H, g + N]`, or None when g = 0.
      window, num_global, causal, grid_width: the layer's graph.

    Returns:
      float `[B, H, g + N, g + N]`: alpha_ij at (i, j), 0 off the graph.
    """
    probs = np.asarray(probs)
    b, n, h, _ = probs.shape
    g = num_global
    offsets = graph_ops.window_offsets(window, causal, grid_width)
    column_ok = (np.ones((n, len(offsets)), bool) if grid_width is None
                 else graph_ops.grid_column_ok(n, window, grid_width))
    dense = np.zeros((b, h, g + n, g + n), probs.dtype)
    rows = np.arange(n)
    for k, o in enumerate(offsets):
        cols = rows + o
        ok = (cols >= 0) & (cols < n) & column_ok[:, k]
        dense[:, :, g + rows[ok], g + cols[ok]] = probs[:, ok][..., k].transpose(0, 2, 1)
    for j in range(g):
        dense[:, :, g:, j] = probs[:, :, :, len(offsets) + j].transpose(0, 2, 1)
    if g:
        dense[:, :, :g, :] = np.asarray(global_probs).transpose(0, 2, 1, 3)
    return dense


def cross_probs_to_dense(probs: Array, centres: Array, *, window: int, num_global: int,
                         memory_length: int) -> np.ndarray:
    """Scatters Cross-Graph coefficients `[B, T, H, 2w+1+g]` into `[B, H, T, g + N]` maps.

    Args:
      probs: from `graph_ops.cross_graph_attention` (columns: offsets -w..w around c_i, then globals).
      centres: int `[B, T]` window centres c_i (encoder token index).
      window: w_x.
      num_global: g.
      memory_length: g + N (the memory's node count).
    """
    probs, centres = np.asarray(probs), np.asarray(centres)
    b, t, h, _ = probs.shape
    g, n = num_global, memory_length - num_global
    dense = np.zeros((b, h, t, memory_length), probs.dtype)
    for k, o in enumerate(range(-window, window + 1)):
        cols = centres + o                                                 # [B, T]
        for bi in range(b):
            ok = (cols[bi] >= 0) & (cols[bi] < n)
            rows = np.nonzero(ok)[0]
            dense[bi][:, rows, g + cols[bi, ok]] = probs[bi][rows][:, :, k].T
    for j in range(g):
        dense[:, :, :, j] = probs[:, :, :, 2 * window + 1 + j].transpose(0, 2, 1)
    return dense


def _module_path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.scope.path)


def _window_probe(module: WindowGraphAttention, x: Array, mask: Array | None) -> dict:
    weights = module.attention_weights(x, mask=mask)
    return {"kind": "causal_window" if module.causal else "window", "window": module.window,
            "num_global": module.num_global, "grid_width": module.grid_width,
            "probs": weights["probs"],
            "global_probs": weights.get("global_probs"), "mask": weights["mask"]}


def _cross_probe(module: CrossGraphAttention, x: Array, memory: Array,
                 mask: Array | None, memory_mask: Array | None) -> dict:
    weights = module.attention_weights(x, memory, mask=mask, memory_mask=memory_mask)
    return {"kind": "cross", "window": module.window, "num_global": module.num_global,
            "probs": weights["probs"], "centres": weights["centres"],
            "memory_mask": weights["memory_mask"], "memory_length": memory.shape[1]}


def graph_attention_maps(model: nn.Module, params: Any, batch: Mapping[str, Any], *,
                         feature_step: Any = None) -> dict[str, dict[str, Any]]:
    """Attention coefficients of every graph layer of `model` on `batch` (eval mode).

    Args:
      model: an htgn_jax `Seq2Seq` or `Classifier` (unbound).
      params: its parameters.
      batch: the model's batch (Seq2Seq: 'inputs' `[B, S]`, 'targets' `[B, T]`, teacher forced;
        Classifier: 'image').
      feature_step: the training-step index of the random features, for a model with
        redraw_every > 0 (`zoo_core.trainer.eval_feature_step` of the checkpoint's step).

    Returns:
      {layer path (e.g. 'encoder/block_00/graph'): {'kind': 'window' | 'causal_window' |
      'cross', 'map': float `[B, H, rows, cols]` dense alpha (rows: `[globals ; tokens]` or
      decoder positions; cols: the sender nodes, encoder memory for 'cross'), plus 'window',
      'num_global', for the window kinds 'grid_width' and for 'cross' 'centres' `[B, T]`}}, in
      call order. Every row of a map
      over valid nodes sums to 1.
    """
    static: dict[str, dict[str, Any]] = {}

    def run(params, batch, feature_step):
        records: dict[str, dict[str, Any]] = {}

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            module = context.module
            if context.method_name != "__call__":
                return out
            if isinstance(module, WindowGraphAttention):
                records[_module_path(module)] = _window_probe(module, args[0],
                                                              kwargs.get("mask"))
            elif isinstance(module, CrossGraphAttention):
                records[_module_path(module)] = _cross_probe(module, args[0], args[1],
                                                             kwargs.get("mask"),
                                                             kwargs.get("memory_mask"))
            return out

        with nn.intercept_methods(interceptor):
            model.apply({"params": params}, batch, train=False,
                        **({} if feature_step is None else {"feature_step": feature_step}))
        # Python facts (kind, window, g) leave the trace through `static`; arrays are returned.
        for path, r in records.items():
            static[path] = {k: v for k, v in r.items() if not isinstance(v, jax.Array)}
        return {path: {k: v for k, v in r.items() if isinstance(v, jax.Array)}
                for path, r in records.items()}

    # A fresh jit per call (one trace, so `static` is always filled); eager would dispatch
    # hundreds of small ops.
    arrays = jax.jit(run)(params, dict(batch), feature_step)
    records = {path: dict(static[path], **jax.device_get(arrays[path])) for path in static}
    out = {}
    for path, r in records.items():
        if r["kind"] == "cross":
            dense = cross_probs_to_dense(r["probs"], r["centres"], window=r["window"],
                                         num_global=r["num_global"],
                                         memory_length=r["memory_length"])
            out[path] = dict(kind="cross", map=dense, window=r["window"],
                             num_global=r["num_global"], centres=np.asarray(r["centres"]))
        else:
            dense = window_probs_to_dense(r["probs"], r["global_probs"], window=r["window"],
                                          num_global=r["num_global"],
                                          causal=r["kind"] == "causal_window",
                                          grid_width=r["grid_width"])
            out[path] = dict(kind=r["kind"], map=dense, window=r["window"],
                             num_global=r["num_global"], grid_width=r["grid_width"])
    return out


# ----------------------------------------------------------------------------------------------
# FAVOR+ approximation error.
# ----------------------------------------------------------------------------------------------


def favor_error_curve(num_features: Sequence[int], *, length: int = 256, head_dim: int = 16,
                      num_heads: int = 1, causal: bool = False, num_draws: int = 4,
                      input_scale: float = 1.0, seed: int = 0) -> dict[str, np.ndarray]:
    """FAVOR+ (positive orthogonal random features) against exact softmax attention.

    q, k, v are i.i.d. N(0, input_scale^2) `[1, length, num_heads, head_dim]`; for every m in
    `num_features` and every draw of Omega (`ops.draw_projection`, ORF with chi row norms) the
    error is |FAVOR+(q, k, v) - softmax(q k^T / sqrt(D)) v| averaged over all outputs.

    Args:
      num_features: the m values.
      length: T (= S).
      head_dim: D.
      num_heads: H.
      causal: unidirectional attention (constant key stabiliser, chunked form).
      num_draws: independent projections per m.
      input_scale: standard deviation of q and k (larger = peakier softmax, harder to estimate).
      seed: PRNG seed of the inputs and projections.

    Returns:
      {'num_features': int `[M]`, 'mean_abs_error': `[M, num_draws]`, 'relative_error':
      `[M, num_draws]` (||err||_F / ||exact||_F), 'exact_mean_abs': scalar mean |exact output|}.
    """
    if not num_features or any(not isinstance(m, int) or m < 1 for m in num_features):
        raise ValueError(f"num_features must be positive ints, got {num_features!r}")
    if num_draws < 1:
        raise ValueError(f"num_draws must be >= 1, got {num_draws}")
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (1, length, num_heads, head_dim)
    q = input_scale * jax.random.normal(kq, shape)
    k = input_scale * jax.random.normal(kk, shape)
    v = jax.random.normal(kv, shape)
    exact = ops.exact_softmax_attention(q, k, v, causal=causal)

    @jax.jit
    def errors(projection):
        approx = ops.favor_attention(q, k, v, feature_map="softmax", projection=projection,
                                     causal=causal, chunk_size=min(64, length))
        diff = approx - exact
        return jnp.mean(jnp.abs(diff)), jnp.linalg.norm(diff) / jnp.linalg.norm(exact)

    mae = np.zeros((len(num_features), num_draws))
    rel = np.zeros_like(mae)
    for i, m in enumerate(num_features):
        for d in range(num_draws):
            proj = ops.draw_projection(jax.random.fold_in(kp, d), None, num_features=m,
                                       dim=head_dim)
            a, r = errors(proj)
            mae[i, d], rel[i, d] = float(a), float(r)
    return {"num_features": np.asarray(num_features), "mean_abs_error": mae,
            "relative_error": rel, "exact_mean_abs": float(jnp.mean(jnp.abs(exact)))}
