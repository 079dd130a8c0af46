"""HRPE at linear cost: rotary encodings and closed-form spectral node encodings (htgn.md §5.2).

The HTGN card's HRPE builds a pairwise P_ij, an O(N^2 d) tensor that no kernel feature map can
factorise. The spec replaces it with (a) rotary position encodings applied to q and k *before*
the FAVOR+ feature map, and (b) spectral node encodings of the token graph, concatenated with the
embeddings and projected by the model. Part (c), the in-window relative bias, lives with the
graph attention (`graph_ops.py`); the optional ALiBi-as-decay (d) is not implemented here.

(a) Rotary (RoFormer, Su et al. 2021, §3.2-3.4): the pairs (x_{2i}, x_{2i+1}) of each head are
rotated by the angle p * theta_i, theta_i = base^(-2i/D). Rotations keep norms, so the
-||x||^2/2 term of the positive features is unchanged, and (R_m q)^T (R_n k) = q^T R_{n-m} k,
hence the FAVOR+ estimate of exp((R_m q)^T (R_n k) / sqrt(D)) is relative in expectation.

(b) Spectral (Laplacian eigenvector PE, Dwivedi et al. "Benchmarking GNNs"): for the path graph
on N nodes the combinatorial Laplacian L = D - A has eigenpairs
lambda_k = 2 - 2 cos(pi k / N), u_k(n) = cos(pi k (n + 1/2) / N) (DCT-II), and the adjacency has
mu_k = 2 cos(pi k / (N + 1)), v_k(n) = sin(pi k (n + 1) / (N + 1)) (DST-I). Both are closed forms
with canonical signs and no eigendecomposition. The H x W grid (image patches) has the product
eigenvectors u_a(r) u_b(c), lambda = lambda_a + lambda_b. An arbitrary small graph uses `eigh`.

Normalisation: for the path the encodings are exactly the cosines/sines above, entries in
[-1, 1] whatever N (so the PE scale does not depend on the sequence length): squared norm N/2
for the Laplacian cosines, (N + 1)/2 for the adjacency sines; `adjacency_graph_pe` (eigh of an
arbitrary graph) scales its columns to N/2; modes that do not exist for a short path (k >= N for the
Laplacian, k > N for the adjacency) are zero columns. The constant Laplacian mode k = 0 is
dropped. Global nodes get no spectral PE (htgn.md §5.2: they only shift the token eigenvalues).
"""
from __future__ import annotations

__all__ = ["rotary_frequencies", "apply_rotary", "path_graph_pe", "masked_path_graph_pe", "grid_graph_pe",
           "adjacency_graph_pe", "skip_path_graph_pe", "masked_skip_path_graph_pe", "skip_grid_graph_pe"]

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core.checks import check_choice, check_int, check_rank, fail
from zoo_core.ops import packing

Array = Any

BASES = ("laplacian", "adjacency")


# --------------------------------------------------------------------------------------------
# (a) Rotary position encoding
# --------------------------------------------------------------------------------------------


def rotary_frequencies(head_dim: int, *, base: float = 10000.0) -> np.ndarray:
    """theta_i = base^(-2i/D) for i = 0..D/2-1, `[D/2]` (float64 NumPy, a trace-time constant)."""
    if not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
        fail(f"`head_dim` must be an even int >= 2 for rotary encodings, got {head_dim!r}")
    return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def apply_rotary(x: Array, positions: Array, *, base: float = 10000.0) -> Array:
    """Rotates each head's channel pairs (2i, 2i+1) by positions * theta_i (RoFormer §3.4).

    Args:
      x: queries or keys `[B, T, H, D]`, D even.
      positions: integer or float positions, `[T]` or `[B, T]` (packed documents restart theirs:
        `zoo_core.ops.packing.positions_from_segments`).
      base: frequency base (10000 as in RoFormer / the spec).

    Returns:
      The rotated array, `[B, T, H, D]`, in x's dtype (angles are computed in float32, float64
      for float64 inputs).
    """
    check_rank("x", x, 4, "[B, T, H, D]")
    positions = jnp.asarray(positions)
    if positions.shape not in ((x.shape[1],), tuple(x.shape[:2])):
        fail(f"`positions` must have shape [T] = ({x.shape[1]},) or [B, T] = {tuple(x.shape[:2])}, "
             f"got {tuple(positions.shape)}")
    dt = jnp.promote_types(x.dtype, jnp.float32)
    theta = jnp.asarray(rotary_frequencies(x.shape[-1], base=base), dt)
    angles = positions.astype(dt)[..., None] * theta  # [(B,) T, D/2]
    if angles.ndim == 2:
        angles = angles[None]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    pairs = x.astype(dt).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# (b) Spectral node encodings
# --------------------------------------------------------------------------------------------


def path_graph_eigenvalues(length: int, num_pe: int, *, basis: str = "laplacian") -> np.ndarray:
    """Eigenvalues of the encoded modes k = 1..K of the path graph, `[K]` (NumPy).

    Laplacian: lambda_k = 2 - 2 cos(pi k / N); adjacency: mu_k = 2 cos(pi k / (N + 1)).
    """
    check_choice("basis", basis, BASES)
    check_int("length", length, 1)
    check_int("num_pe", num_pe, 1)
    k = np.arange(1, num_pe + 1, dtype=np.float64)
    if basis == "laplacian":
        return 2.0 - 2.0 * np.cos(np.pi * k / length)
    return 2.0 * np.cos(np.pi * k / (length + 1))


def _path_modes(n: Array, length: Array, num_pe: int, basis: str, xp=jnp) -> Array:
    """Closed-form path modes at node index n of a path with `length` nodes (broadcasting).

    `xp` is `jnp` (traced lengths) or `np` (static lengths: a trace-time constant).
    """
    k = xp.arange(1, num_pe + 1, dtype=n.dtype)
    if basis == "laplacian":
        pe = xp.cos(np.pi * k * (n + 0.5) / length)
        exists = k < length
    else:
        pe = xp.sin(np.pi * k * (n + 1.0) / (length + 1.0))
        exists = k <= length
    return xp.where(exists, pe, 0.0)


def path_graph_pe(length: int, num_pe: int, *, basis: str = "laplacian",
                  dtype: Any = jnp.float32) -> Array:
    """Closed-form spectral encodings of the path graph on `length` nodes (htgn.md §5.2 (b)).

    Args:
      length: N, number of nodes (tokens).
      num_pe: K, number of encoded modes (k = 1..K).
      basis: 'laplacian' (DCT-II cosines, constant mode dropped; the default) or 'adjacency'
        (DST-I sines, the top-K adjacency eigenvectors).
      dtype: result dtype.

    Returns:
      `[N, K]`; column k-1 is mode k (zero if the mode does not exist for this N).
    """
    check_choice("basis", basis, BASES)
    check_int("length", length, 1)
    check_int("num_pe", num_pe, 1)
    n = np.arange(length, dtype=np.float64)[:, None]
    return jnp.asarray(_path_modes(n, float(length), num_pe, basis, xp=np), dtype)


def masked_path_graph_pe(mask: Array, num_pe: int, *, basis: str = "laplacian",
                         dtype: Any = jnp.float32, segment_ids: Array | None = None) -> Array:
    """Length-aware path encodings for a padded batch (htgn.md §5.2: encoder uses the true length).

    Example b gets the encodings of a path over its L_b = sum(mask[b]) real tokens, taken in
    order (node index = number of real tokens before it, so left, right or interleaved padding
    all work); padded positions get zeros. Appending pads therefore leaves the real tokens' PE
    unchanged. Packed (`segment_ids`), each document is its own path: its tokens get the
    encodings of the document computed alone.

    Args:
      mask: `[B, T]`, True/1 for real tokens.
      num_pe: K.
      basis: 'laplacian' or 'adjacency'.
      dtype: result dtype.
      segment_ids: optional int `[B, T]` packed documents (0 = padding; `zoo_core.ops.packing`).

    Returns:
      `[B, T, K]`.
    """
    check_choice("basis", basis, BASES)
    check_int("num_pe", num_pe, 1)
    valid = _check_path_mask(mask, segment_ids)
    index, lengths = _path_nodes(valid, segment_ids)
    pe = _path_modes(index.astype(jnp.float32)[..., None],
                     jnp.maximum(lengths, 1).astype(jnp.float32)[..., None], num_pe, basis)
    return jnp.where(valid[..., None], pe, 0.0).astype(dtype)


def _check_path_mask(mask: Array, segment_ids: Array | None) -> Array:
    """The masked encodings' checks; returns the bool valid tokens `[B, T]` (mask, and id > 0)."""
    check_rank("mask", mask, 2, "[B, T]")
    packing.check_segment_ids(segment_ids, np.shape(mask))
    valid = jnp.asarray(mask).astype(bool)
    return valid if segment_ids is None else packing.valid(jnp.asarray(segment_ids), valid)


def _path_nodes(valid: Array, segment_ids: Array | None) -> tuple[Array, Array]:
    """int `[B, T]` node index of each token among the real tokens of its path (its row, or its
    document with `segment_ids`) and `[B, 1]` or `[B, T]` that path's number of real tokens."""
    count = jnp.cumsum(valid, axis=1)
    if segment_ids is None:
        return count - 1, count[:, -1:]
    t = jnp.arange(valid.shape[1])[None]
    start = packing.starts(jnp.asarray(segment_ids))
    begin = jax.lax.cummax(jnp.where(start, t, 0), axis=1)
    is_end = jnp.concatenate([start[:, 1:], jnp.ones_like(start[:, :1])], axis=1)
    end = jax.lax.cummin(jnp.where(is_end, t, valid.shape[1] - 1), axis=1, reverse=True)
    before = jnp.take_along_axis(count - valid, begin, axis=1)      # real tokens before the document
    return count - before - 1, jnp.take_along_axis(count, end, axis=1) - before


def grid_graph_modes(height: int, width: int, num_pe: int) -> tuple[np.ndarray, np.ndarray]:
    """The K lowest non-constant Laplacian modes (a, b) of the H x W grid and their eigenvalues.

    lambda_(a,b) = (2 - 2 cos(pi a / H)) + (2 - 2 cos(pi b / W)); ties (e.g. (a, b) and (b, a) on a
    square grid) are ordered by (a, b), which makes the basis deterministic.

    Returns:
      (modes `[K, 2]` int, eigenvalues `[K]`), NumPy.
    """
    check_int("height", height, 1)
    check_int("width", width, 1)
    check_int("num_pe", num_pe, 1)
    if num_pe > height * width - 1:
        fail(f"`num_pe` must be <= height * width - 1 = {height * width - 1}, got {num_pe}")
    a, b = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    a, b = a.ravel(), b.ravel()
    lam = (2.0 - 2.0 * np.cos(np.pi * a / height)) + (2.0 - 2.0 * np.cos(np.pi * b / width))
    # Round before sorting so that float noise cannot reorder degenerate modes.
    order = np.lexsort((b, a, np.round(lam, 12)))
    order = order[1:num_pe + 1]  # drop the constant mode (0, 0)
    return np.stack([a[order], b[order]], axis=1), lam[order]


def grid_graph_pe(height: int, width: int, num_pe: int, *, dtype: Any = jnp.float32) -> Array:
    """Spectral encodings of image patches on an H x W grid (row-major raster order).

    u_(a,b)(r, c) = cos(pi a (r + 1/2) / H) cos(pi b (c + 1/2) / W), the K modes of lowest
    eigenvalue excluding (0, 0) (htgn.md §5.2). Each column is scaled to squared norm H W / 2.

    Returns:
      `[H * W, K]`.
    """
    modes, _ = grid_graph_modes(height, width, num_pe)
    r = np.arange(height, dtype=np.float64)[:, None, None]
    c = np.arange(width, dtype=np.float64)[None, :, None]
    pe = (np.cos(np.pi * modes[:, 0] * (r + 0.5) / height)
          * np.cos(np.pi * modes[:, 1] * (c + 0.5) / width)).reshape(height * width, num_pe)
    pe = pe * math.sqrt(height * width / 2.0) / np.linalg.norm(pe, axis=0)
    return jnp.asarray(pe, dtype)


def adjacency_graph_pe(adjacency: Array, num_pe: int, *, basis: str = "laplacian",
                       dtype: Any = jnp.float32) -> Array:
    """Spectral encodings of an arbitrary small undirected graph, by eigendecomposition.

    'laplacian': eigenvectors of L = diag(A 1) - A with the K smallest eigenvalues after the
    first (for a connected graph, the constant one). 'adjacency': the K largest eigenvectors of A.
    Signs are made canonical: the first entry with |u_n| > 1e-3 max|u| is positive (this gives
    the closed-form signs on the path graph). Degenerate eigenvalues have no canonical basis.
    Columns are scaled to squared norm N/2 (the Laplacian closed form's; the adjacency sines of
    the path have (N + 1)/2, so on a path the two adjacency encodings differ by that factor).

    Args:
      adjacency: `[N, N]` symmetric non-negative weights.
      num_pe: K.
      basis: 'laplacian' or 'adjacency'.
      dtype: result dtype.

    Returns:
      `[N, K]`.
    """
    check_choice("basis", basis, BASES)
    check_int("num_pe", num_pe, 1)
    adjacency = jnp.asarray(adjacency)
    if adjacency.ndim != 2 or adjacency.shape[0] != adjacency.shape[1]:
        fail(f"`adjacency` must be a square [N, N] matrix, got {tuple(adjacency.shape)}")
    n = adjacency.shape[0]
    limit = n - 1 if basis == "laplacian" else n
    if num_pe > limit:
        fail(f"`num_pe` must be <= {limit} for a {n}-node graph with basis={basis!r}, got {num_pe}")
    a = adjacency.astype(jnp.promote_types(adjacency.dtype, jnp.float32))
    if basis == "laplacian":
        _, vecs = jnp.linalg.eigh(jnp.diag(jnp.sum(a, axis=1)) - a)
        vecs = vecs[:, 1:num_pe + 1]
    else:
        _, vecs = jnp.linalg.eigh(a)
        vecs = vecs[:, ::-1][:, :num_pe]
    big = jnp.abs(vecs) > 1e-3 * jnp.max(jnp.abs(vecs), axis=0, keepdims=True)
    first = jnp.take_along_axis(vecs, jnp.argmax(big, axis=0)[None], axis=0)
    vecs = vecs * jnp.where(first < 0, -1.0, 1.0)
    return (vecs * math.sqrt(n / 2.0)).astype(dtype)


def path_adjacency(length: int, *, radius: int = 1) -> np.ndarray:
    """Adjacency `[N, N]` of the band graph |i - j| <= radius, i != j (radius 1 = the path)."""
    check_int("length", length, 1)
    check_int("radius", radius, 1)
    idx = np.arange(length)
    dist = np.abs(idx[:, None] - idx[None, :])
    return ((dist >= 1) & (dist <= radius)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# (b) with skip edges: the spectral encodings of the graph the graph layers use
# --------------------------------------------------------------------------------------------


def _numpy_spectral(adjacency: np.ndarray, num_pe: int, basis: str) -> np.ndarray:
    """`adjacency_graph_pe` in NumPy float64 (a trace-time constant), K columns, the modes a short
    graph lacks as zero columns."""
    n = adjacency.shape[0]
    limit = n - 1 if basis == "laplacian" else n
    out = np.zeros((n, num_pe))
    k = min(num_pe, limit)
    if k == 0:
        return out
    if basis == "laplacian":
        vecs = np.linalg.eigh(np.diag(adjacency.sum(1)) - adjacency)[1][:, 1:k + 1]
    else:
        vecs = np.linalg.eigh(adjacency)[1][:, ::-1][:, :k]
    big = np.abs(vecs) > 1e-3 * np.abs(vecs).max(axis=0, keepdims=True)
    first = np.take_along_axis(vecs, np.argmax(big, axis=0)[None], axis=0)
    out[:, :k] = vecs * np.where(first < 0, -1.0, 1.0) * math.sqrt(n / 2.0)
    return out


def skip_path_adjacency(length: int, skip_offsets: tuple[int, ...]) -> np.ndarray:
    """`[N, N]` adjacency of the path plus the skip edges |i - j| = s (the graph layers' sequence
    graph with `skip_offsets`, htgn.md §5.3)."""
    dist = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
    return np.isin(dist, (1,) + tuple(skip_offsets)).astype(np.float64)


@functools.lru_cache(maxsize=32)
def _skip_path_table(max_length: int, num_pe: int, skip_offsets: tuple[int, ...],
                     basis: str) -> np.ndarray:
    """`[max_length + 1, max_length, K]`: row n holds the encodings of the n-node skip graph."""
    table = np.zeros((max_length + 1, max_length, num_pe))
    for n in range(1, max_length + 1):
        table[n, :n] = _numpy_spectral(skip_path_adjacency(n, skip_offsets), num_pe, basis)
    return table


def skip_path_graph_pe(length: int, num_pe: int, skip_offsets: tuple[int, ...], *,
                       basis: str = "laplacian", dtype: Any = jnp.float32) -> Array:
    """`path_graph_pe` of the path plus skip edges (eigh; degenerate modes have no canonical basis):
    `[N, K]`. With no skips use the closed form `path_graph_pe`."""
    check_choice("basis", basis, BASES)
    check_int("length", length, 1)
    check_int("num_pe", num_pe, 1)
    return jnp.asarray(_numpy_spectral(skip_path_adjacency(length, tuple(skip_offsets)), num_pe,
                                       basis), dtype)


def masked_skip_path_graph_pe(mask: Array, num_pe: int, skip_offsets: tuple[int, ...], *,
                              basis: str = "laplacian", dtype: Any = jnp.float32,
                              segment_ids: Array | None = None) -> Array:
    """`masked_path_graph_pe` on the path plus skip edges: example b (each document with
    `segment_ids` `[B, T]`) gets the encodings of the skip graph over its L_b real tokens (a table
    over every length up to T, computed once in NumPy), padded positions zeros. `[B, T, K]`."""
    check_choice("basis", basis, BASES)
    check_int("num_pe", num_pe, 1)
    valid = _check_path_mask(mask, segment_ids)
    table = jnp.asarray(_skip_path_table(valid.shape[1], num_pe, tuple(skip_offsets), basis), dtype)
    index, lengths = _path_nodes(valid, segment_ids)
    pe = table[jnp.broadcast_to(lengths, index.shape), jnp.maximum(index, 0)]
    return jnp.where(valid[..., None], pe, 0.0).astype(dtype)


def skip_grid_graph_pe(height: int, width: int, num_pe: int, skip_offsets: tuple[int, ...], *,
                       dtype: Any = jnp.float32) -> Array:
    """`grid_graph_pe` of the 4-neighbour grid plus the dilated 8-neighbourhood edges of each skip
    s (the classifier's stencil graph with `skip_offsets`), by eigh: `[H * W, K]`."""
    grid_graph_modes(height, width, num_pe)   # checks the arguments
    r, c = np.divmod(np.arange(height * width), width)
    dr, dc = np.abs(r[:, None] - r[None, :]), np.abs(c[:, None] - c[None, :])
    adj = (dr + dc == 1)
    for s in skip_offsets:
        adj |= ((dr == 0) | (dr == s)) & ((dc == 0) | (dc == s)) & (dr + dc > 0)
    return jnp.asarray(_numpy_spectral(adj.astype(np.float64), num_pe, "laplacian"), dtype)
