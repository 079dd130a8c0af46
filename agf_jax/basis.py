"""AGF's polynomial filter: the basis recurrences, the coefficients and g = sum_k c_k P_k(s).

Jacobi family as in the reference `PolyConvFrame` (jeongwhanchoi/agf `AGF_LRA/polyconv.py`):
P_0 = 1, P_1 = ((a + b + 2) x + (a - b)) / 2 and the three-term recurrence
P_k = (A_k x + B_k) P_{k-1} - C_k P_{k-2}; 'legendre' is Jacobi(0, 0), 'chebyshev' Jacobi(-1/2, -1/2)
(a scaled T_k), 'monomial' x^k. The effective coefficients are c_k = tanh(theta_k), c_0 frozen at 1
unless learnt.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

BASES = ("jacobi", "chebyshev", "legendre", "monomial")
# Defaults of the reference PolyConvFrame (agf.md §4).
JACOBI_DEFAULT_ALPHA = 1.0
JACOBI_DEFAULT_BETA = 0.2



def resolve_basis(basis: str, alpha: Optional[float] = None, beta: Optional[float] = None,
                  order: Optional[int] = None) -> tuple[Optional[float], Optional[float]]:
    """Validates a basis name and returns the Jacobi parameters it uses.

    'legendre' is Jacobi(0, 0) and 'chebyshev' is Jacobi(-1/2, -1/2) (a scaled T_k, as in the
    reference); both fix alpha and beta, so passing either raises. 'monomial' has none.

    Args:
        basis: one of `BASES`.
        alpha: Jacobi alpha; only for 'jacobi' (default 1.0, the reference default).
        beta: Jacobi beta; only for 'jacobi' (default 0.2).
        order: if given, also checks that the recurrence has no zero denominator up to this order.

    Returns:
        (alpha, beta) for the Jacobi family, (None, None) for 'monomial'.
    """
    if basis not in BASES:
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}")
    if basis != "jacobi" and (alpha is not None or beta is not None):
        raise ValueError(f"alpha/beta apply only to basis='jacobi'; basis={basis!r} fixes them "
                         f"(got alpha={alpha}, beta={beta})")
    if basis == "monomial":
        return None, None
    if basis == "legendre":
        return 0.0, 0.0
    if basis == "chebyshev":
        return -0.5, -0.5
    a = JACOBI_DEFAULT_ALPHA if alpha is None else float(alpha)
    b = JACOBI_DEFAULT_BETA if beta is None else float(beta)
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"Jacobi alpha and beta must be finite numbers, got alpha={a}, beta={b}")
    if order is not None:
        for k in range(2, int(order) + 1):
            if k + a + b == 0 or 2 * k + a + b - 2 == 0:
                raise ValueError(f"Jacobi recurrence is singular at k={k} for alpha={a}, beta={b}")
    return a, b


def check_filter(coeffs: Array, basis: str, alpha: Optional[float], beta: Optional[float]) -> None:
    """The filter arguments of a public kernel, once: coeffs `[K+1]` and the basis (`resolve_basis`)."""
    if jnp.ndim(coeffs) != 1:
        raise ValueError(f"coeffs must be rank 1 [K+1], got shape {jnp.shape(coeffs)}")
    resolve_basis(basis, alpha, beta, jnp.shape(coeffs)[0] - 1)


def basis_params(basis: str, alpha: Optional[float], beta: Optional[float]):
    """`resolve_basis`'s (alpha, beta) without its checks, for the private forms (trusted: checked
    at their public kernel's entry)."""
    fixed = {"monomial": (None, None), "legendre": (0.0, 0.0), "chebyshev": (-0.5, -0.5)}
    if basis in fixed:
        return fixed[basis]
    return (JACOBI_DEFAULT_ALPHA if alpha is None else float(alpha),
            JACOBI_DEFAULT_BETA if beta is None else float(beta))


def jacobi_abc(k: int, a: float, b: float) -> tuple[float, float, float]:
    """Coefficients of P_k = (A x + B) P_{k-1} - C P_{k-2} for Jacobi (a, b), k >= 2 (agf.md §2.4)."""
    s = 2 * k + a + b
    big_a = s * (s - 1) / (2 * k * (k + a + b))
    big_b = (s - 1) * (a * a - b * b) / (2 * k * (k + a + b) * (s - 2))
    big_c = (k + a - 1) * (k + b - 1) * s / (k * (k + a + b) * (s - 2))
    return big_a, big_b, big_c


def _recurrence(order: int, basis: str, a, b):
    """Yields (A, B, C) of P_k = (A x + B) P_{k-1} - C P_{k-2} for k = 1..order (P_0 = 1, and
    C = 0 at k = 1, where P_{-1} does not exist); (a, b) from `resolve_basis` (trusted)."""
    for k in range(1, order + 1):
        if basis == "monomial":
            yield 1.0, 0.0, 0.0
        elif k == 1:
            yield 0.5 * (a + b + 2), 0.5 * (a - b), 0.0
        else:
            yield jacobi_abc(k, a, b)


def basis_iter(x: Array, order: int, basis: str, alpha, beta):
    """An iterator of P_0(x), ..., P_order(x) through the three-term recurrence (two terms kept
    alive); the basis is checked here, at the call."""
    a, b = resolve_basis(basis, alpha, beta, order)
    return _basis_iter(x, order, basis, a, b)


def _basis_iter(x, order, basis, a, b):
    p_prev, p = None, jnp.ones_like(x)
    yield p
    for big_a, big_b, big_c in _recurrence(order, basis, a, b):
        p_new = (big_a * x + big_b) * p
        if big_c:
            p_new = p_new - big_c * p_prev
        p_prev, p = p, p_new
        yield p


def basis_and_derivative_iter(x: Array, order: int, basis: str, alpha, beta):
    """An iterator of (P_k(x), P_k'(x)) for k = 0..order: the recurrence and its derivative,
    P_k' = (A x + B) P_{k-1}' + A P_{k-1} - C P_{k-2}' (two terms of each kept alive); the basis is
    checked here, at the call."""
    a, b = resolve_basis(basis, alpha, beta, order)
    return _basis_and_derivative_iter(x, order, basis, a, b)


def _basis_and_derivative_iter(x, order, basis, a, b):
    p_prev = dp_prev = None
    p, dp = jnp.ones_like(x), jnp.zeros_like(x)
    yield p, dp
    for big_a, big_b, big_c in _recurrence(order, basis, a, b):
        factor = big_a * x + big_b
        p_new, dp_new = factor * p, big_a * p + factor * dp
        if big_c:
            p_new, dp_new = p_new - big_c * p_prev, dp_new - big_c * dp_prev
        p_prev, p, dp_prev, dp = p, p_new, dp, dp_new
        yield p, dp


def polynomial_basis(x: Array, order: int, *, basis: str = "jacobi", alpha: Optional[float] = None,
                     beta: Optional[float] = None) -> Array:
    """Evaluates P_0..P_K elementwise (agf.md §2.4); x is used as is (not mapped to [-1, 1]).

    Args:
        x: any shape `[...]`.
        order: K >= 0.
        basis, alpha, beta: see `resolve_basis`.

    Returns:
        `[..., K+1]`.
    """
    if order < 0:
        raise ValueError(f"order must be >= 0, got {order}")
    return jnp.stack(list(basis_iter(x, order, basis, alpha, beta)), axis=-1)


def filter_coefficients(theta: Optional[Array], theta_0: Optional[Array] = None) -> Array:
    """Effective coefficients c_0..c_K of the filter (agf.md §2.4).

    c_k = tanh(theta_k) for k >= 1. c_0 is the frozen constant 1 when `theta_0` is None (LRA, and
    UEA with `fixI`), else tanh(theta_0) (UEA without `fixI`: the filter is 0 at init).

    Args:
        theta: `[K]` raw parameters for k = 1..K (None or `[0]` when K = 0).
        theta_0: `[]` raw learnable parameter for k = 0, or None for the frozen c_0 = 1.

    Returns:
        `[K+1]` coefficients, float32 at least.
    """
    dtype = jnp.float32
    if theta is not None:
        dtype = jnp.promote_types(jnp.asarray(theta).dtype, jnp.float32)
    if theta_0 is not None:
        dtype = jnp.promote_types(dtype, jnp.asarray(theta_0).dtype)
    c0 = jnp.ones((1,), dtype) if theta_0 is None else jnp.tanh(jnp.asarray(theta_0, dtype))[None]
    if theta is None:
        return c0
    theta = jnp.asarray(theta, dtype)
    if theta.ndim != 1:
        raise ValueError(f"theta must be rank 1 [K], got shape {theta.shape}")
    return jnp.concatenate([c0, jnp.tanh(theta)])


def graph_filter(s: Array, coeffs: Array, *, basis: str = "jacobi", alpha: Optional[float] = None,
                 beta: Optional[float] = None) -> Array:
    """g = sum_k c_k P_k(s), elementwise, without materialising the K+1 basis values (agf.md §2.3).

    Args:
        s: `[...]` singular values in (0, 1).
        coeffs: `[K+1]` effective coefficients (`filter_coefficients`).
        basis, alpha, beta: see `resolve_basis`.

    Returns:
        `[...]`, the same shape as `s`.
    """
    check_filter(coeffs, basis, alpha, beta)
    return spectrum_filter(s, coeffs, basis, *basis_params(basis, alpha, beta))


def spectrum_filter(s: Array, coeffs: Array, basis: str, a, b) -> Array:
    """`graph_filter` with (a, b) already from `resolve_basis` and coeffs `[K+1]` (trusted: the
    form of the kernels that checked them at their entry)."""
    coeffs = jnp.asarray(coeffs).astype(s.dtype)
    g = None
    for k, p in enumerate(_basis_iter(s, coeffs.shape[0] - 1, basis, a, b)):
        g = coeffs[k] * p if g is None else g + coeffs[k] * p
    return g
