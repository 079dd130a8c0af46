"""Dense O(L^2) references of the HTGN graph attention: test oracles only (htgn.md §3.4 "Oracles for
tests"). The adjacency builders live in `htgn_jax.analysis` (its pictures use them too)."""
import jax
import jax.numpy as jnp
import numpy as np

from htgn_jax.analysis import cross_graph_adjacency, window_adjacency  # noqa: F401
from htgn_jax.graph_ops import NEGATIVE_SLOPE

Array = jax.Array


def dense_graph_attention(query, key, value, attn,
                          adjacency,
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
