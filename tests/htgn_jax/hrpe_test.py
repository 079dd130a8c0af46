"""Tests of htgn_jax.hrpe: rotary and spectral node encodings (htgn.md §5.2, §5.14)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from htgn_jax import hrpe, ops
from zoo_core.testing import F32_SIMPLE, F64

B, T, H, D = 2, 7, 2, 8


_masked_pe = jax.jit(hrpe.masked_path_graph_pe, static_argnames=("num_pe", "basis", "dtype"))


def _laplacian(adjacency):
    return np.diag(adjacency.sum(1)) - adjacency


def test_rotary_relative_property():
    kq, kk = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(kq, (1, 1, H, D))
    k = jax.random.normal(kk, (1, 1, H, D))
    pos = np.arange(16)
    rotate = jax.jit(jax.vmap(lambda x, p: hrpe.apply_rotary(x, p[None]), in_axes=(None, 0)))
    rq, rk = rotate(q, pos)[:, 0, 0], rotate(k, pos)[:, 0, 0]  # [16, H, D]
    dots = np.asarray(jnp.einsum("mhd,nhd->hmn", rq, rk), np.float64)  # <R_m q, R_n k>
    for offset in range(-5, 6):
        diag = np.diagonal(dots, offset=offset, axis1=1, axis2=2)  # all (m, n) with n - m = offset
        np.testing.assert_allclose(diag, np.broadcast_to(diag[:, :1], diag.shape), **F32_SIMPLE)
    # ... and it does depend on the offset (the rotation is not trivial).
    assert not np.allclose(np.diagonal(dots, 0, 1, 2)[:, 0], np.diagonal(dots, 3, 1, 2)[:, 0],
                           atol=1e-3)
    # Rotations keep norms (so the -||x||^2/2 term of the FAVOR+ features is unchanged) and
    # position 0 is the identity.
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1),
                               jnp.broadcast_to(jnp.linalg.norm(q[0, 0], axis=-1), (16, H)),
                               **F32_SIMPLE)
    np.testing.assert_allclose(rq[0], q[0, 0], **F32_SIMPLE)


def test_rotary_shift_invariance_of_attention_and_batched_positions():
    # Spec §5.14 item 5: with RoPE, exact attention is invariant to a common position shift.
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in (kq, kk, kv))

    @jax.jit
    def attend(positions):
        rq, rk = hrpe.apply_rotary(q, positions), hrpe.apply_rotary(k, positions)
        return ops.exact_softmax_attention(rq, rk, v, causal=True)

    base = attend(jnp.arange(T))
    np.testing.assert_allclose(attend(jnp.arange(T) + 11), base, **F32_SIMPLE)
    per_example = jnp.stack([jnp.arange(T), jnp.arange(T) + 5])  # [B, T] positions
    np.testing.assert_allclose(attend(per_example), base, **F32_SIMPLE)
    assert not np.allclose(attend(jnp.arange(T) * 2), base, atol=1e-3)


def test_rotary_check_grads_float64():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(2), (B, T, H, D), jnp.float64)
        fn = jax.jit(lambda x: hrpe.apply_rotary(x, jnp.arange(T) + 3))
        assert fn(x).dtype == jnp.float64
        check_grads(fn, (x,), order=1, modes=("rev",), **F64)


@pytest.mark.parametrize("length,num_pe", [(7, 5), (4, 6)])
def test_path_laplacian_eigenvectors(length, num_pe):
    # Spec §5.14 item 6: L u_k = lambda_k u_k for the path graph (w = 1).
    lap = _laplacian(hrpe.path_adjacency(length).astype(np.float64))
    pe = np.asarray(hrpe.path_graph_pe(length, num_pe), np.float64)
    lam = hrpe.path_graph_eigenvalues(length, num_pe)
    assert pe.shape == (length, num_pe)
    exists = np.arange(1, num_pe + 1) < length
    np.testing.assert_allclose(lap @ pe[:, exists], pe[:, exists] * lam[exists], **F32_SIMPLE)
    np.testing.assert_array_equal(pe[:, ~exists], 0.0)  # modes a short path does not have
    # Orthogonal to the (dropped) constant mode and to each other, squared norm N/2.
    np.testing.assert_allclose(pe.sum(0), 0.0, **F32_SIMPLE)
    gram = pe[:, exists].T @ pe[:, exists]
    np.testing.assert_allclose(gram, np.eye(exists.sum()) * length / 2, **F32_SIMPLE)
    # The closed form agrees with an eigendecomposition (canonical signs, same scale).
    if exists.all():
        eig = hrpe.adjacency_graph_pe(hrpe.path_adjacency(length), num_pe)
        np.testing.assert_allclose(eig, pe, **F32_SIMPLE)


def test_path_adjacency_basis():
    length, num_pe = 7, 4
    adj = hrpe.path_adjacency(length).astype(np.float64)
    pe = np.asarray(hrpe.path_graph_pe(length, num_pe, basis="adjacency"), np.float64)
    mu = hrpe.path_graph_eigenvalues(length, num_pe, basis="adjacency")
    np.testing.assert_allclose(adj @ pe, pe * mu, **F32_SIMPLE)
    assert np.all(np.diff(mu) < 0)  # the top-K eigenvectors, in order
    eig = np.asarray(hrpe.adjacency_graph_pe(adj, num_pe, basis="adjacency"), np.float64)
    unit = lambda a: a / np.linalg.norm(a, axis=0)
    np.testing.assert_allclose(unit(eig), unit(pe), **F32_SIMPLE)


@pytest.mark.parametrize("basis", ["laplacian", "adjacency"])
def test_masked_path_pe_is_length_aware(basis):
    num_pe = 5
    right = jnp.arange(T)[None, :] < jnp.array([[7], [4]])  # right padding, lengths 7 and 4
    left = right[:, ::-1]  # left padding
    for mask in (right, left):
        pe = np.asarray(_masked_pe(mask, num_pe=num_pe, basis=basis))
        assert pe.shape == (B, T, num_pe)
        for b, n in enumerate((7, 4)):
            real = np.asarray(mask[b])
            np.testing.assert_allclose(pe[b][real], hrpe.path_graph_pe(n, num_pe, basis=basis),
                                       **F32_SIMPLE)
            np.testing.assert_array_equal(pe[b][~real], 0.0)
    # Appending pads (T=7 -> 16) leaves the real tokens' encodings unchanged.
    longer = jnp.pad(right, ((0, 0), (0, 9)))
    np.testing.assert_allclose(_masked_pe(longer, num_pe=num_pe, basis=basis)[:, :T],
                               _masked_pe(right, num_pe=num_pe, basis=basis), **F32_SIMPLE)


def test_grid_pe_is_grid_laplacian_eigenbasis():
    height, width, num_pe = 3, 4, 6
    pe = np.asarray(hrpe.grid_graph_pe(height, width, num_pe), np.float64)
    _, lam = hrpe.grid_graph_modes(height, width, num_pe)
    lap_h = _laplacian(hrpe.path_adjacency(height).astype(np.float64))
    lap_w = _laplacian(hrpe.path_adjacency(width).astype(np.float64))
    # Row-major raster: node r * W + c; the grid Laplacian is the Kronecker sum.
    lap = np.kron(lap_h, np.eye(width)) + np.kron(np.eye(height), lap_w)
    np.testing.assert_allclose(lap @ pe, pe * lam, **F32_SIMPLE)
    # They are the K smallest non-constant modes.
    np.testing.assert_allclose(lam, np.linalg.eigvalsh(lap)[1:num_pe + 1], **F32_SIMPLE)
    np.testing.assert_allclose(pe.T @ pe, np.eye(num_pe) * height * width / 2, **F32_SIMPLE)


def test_adjacency_pe_of_arbitrary_graph():
    rng = np.random.default_rng(3)
    n, num_pe = 6, 3
    adj = np.triu((rng.random((n, n)) < 0.6).astype(np.float64), 1)
    adj = adj + adj.T + np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)  # connected
    adj = np.minimum(adj, 1.0)
    lap = _laplacian(adj)
    pe = np.asarray(hrpe.adjacency_graph_pe(adj, num_pe), np.float64)
    lam = np.linalg.eigvalsh(lap)[1:num_pe + 1]
    np.testing.assert_allclose(lap @ pe, pe * lam, atol=1e-4)
    # Canonical sign: the first clearly non-zero entry of each vector is positive.
    for col in pe.T:
        assert col[np.argmax(np.abs(col) > 1e-3 * np.abs(col).max())] > 0
