"""Pure AGF (Attentive Graph Filter) kernels: singular factors, polynomial filter, all forms.

Paper: H. Wi, J. Choi, N. Park, "Learning Advanced Self-Attention for Linear Transformers in the
Singular Value Domain", IJCAI 2025 (arXiv 2505.08516); reference code jeongwhanchoi/agf
(`AGF_LRA/attention_svd.py`, `AGF_LRA/polyconv.py`, `AGF_UEA/models/AGF_Attention.py`). Section
numbers below refer to the project spec `agf.md`, which was checked against the reference code
(the paper's own equation numbers were not available to the spec writers).

Notation (shape letters of the zoo): B batch, T sequence, H heads, D head width of the singular
vectors, M value head width, K polynomial order.

Non-causal AGF, per head (spec §2.2-2.3):

        U = softmax_D(Z_U)                     left singular vectors, each token's row sums to 1
        V = softmax_T(Z_V - 1e9 (1 - mask))    right singular vectors, each column sums to 1 over T
        s = sigmoid(Z_S)                       token-specific "singular values", in (0, 1)^D
        g = sum_k c_k P_k(s)                   elementwise polynomial filter, c_k = tanh(theta_k)
        O = (U * g) (V^T Val)                  O(T D M); the implicit T x T matrix is never formed

with the implicit attention matrix H_tj = sum_k U_tk g_tk V_jk (token-specific spectrum diag(g_t)).
The orthogonality regulariser (spec §2.5, pitfall 5) is, per sample,
mean_{H,D,D} |U^T U - I| + mean_{H,D,D} |V^T V - I|.

**Causal AGF (an extension; the paper and the reference code do not have it).** For
autoregressive use the right factor of token t is normalised over the prefix only,

        V^(t)_jk = exp(Z_V[j,k]) / sum_{i<=t} exp(Z_V[i,k])   for j <= t,
        O_t = (U_t * g_t) (V^(t)T Val_{<=t}) = sum_k A_tk N_t[k, :] / z_t[k],   A = U * g,

with N_t = sum_{j<=t} exp(Z_V[j]) (x) Val_j [D, M] and z_t = sum_{j<=t} exp(Z_V[j]) [D]. This is an
online softmax per (head, feature k), so the recurrent state is (N, z, m) with a running maximum m
for stability: O(D M) per head, O(T D M) for the whole sequence. U, s and g are token-local and need
no change. At the last position V^(T) equals the non-causal V, so the final causal output equals
the non-causal one. Four forms compute the same numbers: `agf_parallel(causal=True)`
(associative scan over the online-softmax monoid), `agf_chunked` (exact intra-chunk sums with
per-row maxima plus a carried state), `agf_recurrent` (`jax.lax.scan`) and `agf_step`.

*Regulariser in causal mode (design choice, documented here once).* `orthogonality_loss` is the same
function in both modes: U is token-local, and V is taken as the whole-sequence softmax, which is
V^(T), the right factor of the last (full) prefix. We do not average a per-prefix penalty: V^(t) has
only t rows, so for t < D the columns cannot be orthonormal and |V^(t)T V^(t) - I| has a floor that
would dominate early positions and make the penalty's scale depend on T. The regulariser only enters
the loss, so it leaks no future information into any output. The recurrent forms (`agf_recurrent`,
`agf_step`) are inference forms and do not compute it.

Masking is NaN-safe (the zoo's layer contract): padded V logits and values are replaced with
`jnp.where` (`masked_logits`, `masked_values`), never multiplied by 0, so a padded position holding
NaN or 1e30 changes no valid output; the chunked form also replaces a non-finite Z_V / Val at a
valid position and sets every output at or after it to NaN, as the recurrence gives. Finite inputs
give the reference's numbers bit for bit.

All attention maths runs in float32 (float64 stays float64) whatever the input dtype, as the
reference does under AMP (spec §2.3, pitfall 8); outputs are returned in that float type and callers
cast back.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from zoo_core import layout

Array = jax.Array

BASES = ("jacobi", "chebyshev", "legendre", "monomial")
# Defaults of the reference PolyConvFrame (spec §4).
JACOBI_DEFAULT_ALPHA = 1.0
JACOBI_DEFAULT_BETA = 0.2
# The reference masks V by subtracting 1e9 from padded logits (spec §2.2); we do the same so that
# fully padded sequences behave like the reference (uniform over the padded tokens).
MASK_OFFSET = 1e9


# ---------------------------------------------------------------------------------------------
# Polynomial basis and filter (spec §2.4).
# ---------------------------------------------------------------------------------------------


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


def _jacobi_abc(k: int, a: float, b: float) -> tuple[float, float, float]:
    """Coefficients of P_k = (A x + B) P_{k-1} - C P_{k-2} for Jacobi (a, b), k >= 2 (spec §2.4)."""
    s = 2 * k + a + b
    big_a = s * (s - 1) / (2 * k * (k + a + b))
    big_b = (s - 1) * (a * a - b * b) / (2 * k * (k + a + b) * (s - 2))
    big_c = (k + a - 1) * (k + b - 1) * s / (k * (k + a + b) * (s - 2))
    return big_a, big_b, big_c


def _recurrence(order: int, basis: str, alpha, beta):
    """Yields (A, B, C) of P_k = (A x + B) P_{k-1} - C P_{k-2} for k = 1..order (P_0 = 1, and
    C = 0 at k = 1, where P_{-1} does not exist)."""
    a, b = resolve_basis(basis, alpha, beta, order)
    for k in range(1, order + 1):
        if basis == "monomial":
            yield 1.0, 0.0, 0.0
        elif k == 1:
            yield 0.5 * (a + b + 2), 0.5 * (a - b), 0.0
        else:
            yield _jacobi_abc(k, a, b)


def _basis_iter(x: Array, order: int, basis: str, alpha, beta):
    """Yields P_0(x), ..., P_order(x) through the three-term recurrence (two terms kept alive)."""
    p_prev, p = None, jnp.ones_like(x)
    yield p
    for big_a, big_b, big_c in _recurrence(order, basis, alpha, beta):
        p_new = (big_a * x + big_b) * p
        if big_c:
            p_new = p_new - big_c * p_prev
        p_prev, p = p, p_new
        yield p


def _basis_and_derivative_iter(x: Array, order: int, basis: str, alpha, beta):
    """Yields (P_k(x), P_k'(x)) for k = 0..order: the recurrence and its derivative,
    P_k' = (A x + B) P_{k-1}' + A P_{k-1} - C P_{k-2}' (two terms of each kept alive)."""
    p_prev = dp_prev = None
    p, dp = jnp.ones_like(x), jnp.zeros_like(x)
    yield p, dp
    for big_a, big_b, big_c in _recurrence(order, basis, alpha, beta):
        factor = big_a * x + big_b
        p_new, dp_new = factor * p, big_a * p + factor * dp
        if big_c:
            p_new, dp_new = p_new - big_c * p_prev, dp_new - big_c * dp_prev
        p_prev, p, dp_prev, dp = p, p_new, dp, dp_new
        yield p, dp


def polynomial_basis(x: Array, order: int, *, basis: str = "jacobi", alpha: Optional[float] = None,
                     beta: Optional[float] = None) -> Array:
    """Evaluates P_0..P_K elementwise (spec §2.4); x is used as is (not mapped to [-1, 1]).

    Args:
        x: any shape `[...]`.
        order: K >= 0.
        basis, alpha, beta: see `resolve_basis`.

    Returns:
        `[..., K+1]`.
    """
    if order < 0:
        raise ValueError(f"order must be >= 0, got {order}")
    return jnp.stack(list(_basis_iter(x, order, basis, alpha, beta)), axis=-1)


def filter_coefficients(theta: Optional[Array], theta_0: Optional[Array] = None) -> Array:
    """Effective coefficients c_0..c_K of the filter (spec §2.4).

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
    """g = sum_k c_k P_k(s), elementwise, without materialising the K+1 basis values (spec §2.3).

    Args:
        s: `[...]` singular values in (0, 1).
        coeffs: `[K+1]` effective coefficients (`filter_coefficients`).
        basis, alpha, beta: see `resolve_basis`.

    Returns:
        `[...]`, the same shape as `s`.
    """
    coeffs = jnp.asarray(coeffs)
    if coeffs.ndim != 1:
        raise ValueError(f"coeffs must be rank 1 [K+1], got shape {coeffs.shape}")
    coeffs = coeffs.astype(s.dtype)
    g = None
    for k, p in enumerate(_basis_iter(s, coeffs.shape[0] - 1, basis, alpha, beta)):
        g = coeffs[k] * p if g is None else g + coeffs[k] * p
    return g


# ---------------------------------------------------------------------------------------------
# Singular factors (spec §2.2).
# ---------------------------------------------------------------------------------------------


def _float(x: Array) -> Array:
    """Casts to float32, keeping float64 (the attention maths never runs in bf16/f16)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check_projections(zu, zv, zs=None, val=None, *, rank=4):
    names = {"zu": zu, "zv": zv, "zs": zs, "val": val}
    for name, arr in names.items():
        if arr is not None and jnp.ndim(arr) != rank:
            what = "[B, T, H, D]" if rank == 4 else "[B, H, D]"
            raise ValueError(f"{name} must have rank {rank} {what}, got shape {jnp.shape(arr)}")
    shape = jnp.shape(zu)
    for name in ("zv", "zs"):
        if names[name] is not None and jnp.shape(names[name]) != shape:
            raise ValueError(f"{name} shape {jnp.shape(names[name])} != zu shape {shape}")
    if val is not None and jnp.shape(val)[:-1] != shape[:-1]:
        raise ValueError(f"val shape {jnp.shape(val)} must match zu {shape} except the last axis")


def masked_logits(zv: Array, mask: Optional[Array]) -> Array:
    """The V logits with padded tokens set to -1e9 (the reference's Z_V - 1e9 (1 - mask)).

    Padding is removed with `jnp.where`, so a padded position holding NaN or 1e30 gets the same
    logit as any other; for partially padded sequences the result equals the reference's bit for
    bit (a padded weight is exp(-1e9 - max) = 0 either way).

    Args:
        zv: `[B, T, H, D]`.
        mask: `[B, T]` bool or 0/1 (nonzero = real token), or None.

    Returns:
        `[B, T, H, D]` float32 (or float64).
    """
    zv = _float(zv)
    if mask is None:
        return zv
    _check_mask(mask, zv)
    return jnp.where(_valid(mask), zv, -MASK_OFFSET)


def masked_values(val: Array, mask: Optional[Array]) -> Array:
    """Val with padded rows replaced by 0 (`jnp.where`: 0 * NaN would still be NaN), float32."""
    val = _float(val)
    return val if mask is None else jnp.where(_valid(mask), val, 0.0)


def _valid(mask: Array) -> Array:
    """`[B, T]` mask -> `[B, T, 1, 1]` bool (any nonzero entry is a valid token)."""
    return jnp.asarray(mask).astype(bool)[:, :, None, None]


def _check_mask(mask: Array, x: Array) -> None:
    if tuple(jnp.shape(mask)) != tuple(x.shape[:2]):
        raise ValueError(f"mask must have shape [B, T] = {x.shape[:2]}, got {jnp.shape(mask)}")


def left_factor(zu: Array, zs: Array, coeffs: Array, *, basis: str = "jacobi",
                alpha: Optional[float] = None, beta: Optional[float] = None) -> Array:
    """A = U * g, the token-local part of AGF: softmax over D times the filtered spectrum.

    Args:
        zu: `[..., D]` left-factor logits (the "query" projection).
        zs: `[..., D]` singular-value logits (the "Sigma" projection).
        coeffs: `[K+1]`.
        basis, alpha, beta: see `resolve_basis`.

    Returns:
        `[..., D]` float32.
    """
    u = jax.nn.softmax(_float(zu), axis=-1)
    g = graph_filter(jax.nn.sigmoid(_float(zs)), coeffs, basis=basis, alpha=alpha, beta=beta)
    return u * g


class AGFFactors(NamedTuple):
    """Singular-domain factors of one AGF layer, all `[B, T, H, D]` float32.

    Attributes:
        u: left singular vectors, softmax over D.
        v: right singular vectors, softmax over T (masked; the whole sequence even in causal mode).
        s: singular values sigmoid(Z_S).
        g: filtered spectrum sum_k c_k P_k(s).
    """
    u: Array
    v: Array
    s: Array
    g: Array


def agf_factors(zu: Array, zv: Array, zs: Array, coeffs: Array, *, basis: str = "jacobi",
                alpha: Optional[float] = None, beta: Optional[float] = None,
                mask: Optional[Array] = None) -> AGFFactors:
    """Computes U, V, s and g (spec §2.2-2.3), for analysis and the explicit reference.

    Args:
        zu, zv, zs: `[B, T, H, D]` projections.
        coeffs: `[K+1]`.
        basis, alpha, beta: see `resolve_basis`.
        mask: `[B, T]` padding mask applied to V only, or None.

    Returns:
        `AGFFactors`.
    """
    _check_projections(zu, zv, zs)
    u = jax.nn.softmax(_float(zu), axis=-1)
    v = jax.nn.softmax(masked_logits(zv, mask), axis=1)
    s = jax.nn.sigmoid(_float(zs))
    g = graph_filter(s, coeffs, basis=basis, alpha=alpha, beta=beta)
    return AGFFactors(u, v, s, g)


def orthogonality_loss(zu: Array, zv: Array, *, mask: Optional[Array] = None,
                       count_padding: bool = True) -> Array:
    """Per-sample orthogonality regulariser on the post-softmax factors (spec §2.5, pitfall 5).

    ortho_b = mean_{H,D,D} |U^T U - I| + mean_{H,D,D} |V^T V - I|, where U^T U = sum_t U_t U_t^T.
    V uses the masked sequence softmax, so padded rows of V are exactly 0. In causal mode the same
    function is used (see module docstring).

    Args:
        zu, zv: `[B, T, H, D]`.
        mask: `[B, T]` or None.
        count_padding: True (the reference): padded rows of U count in U^T U, so the value depends
            on what padded positions hold; False: they are removed with `jnp.where`, so padding
            (even NaN or 1e30) cannot change it (the zoo's layer contract).

    Returns:
        `[B]`, unweighted (the LRA layer multiplies it by `reg`, the UEA loss by `eta`).
    """
    _check_projections(zu, zv)
    valid = None if mask is None or count_padding else _valid(mask)[..., 0]     # [B, T, 1]
    eye = jnp.eye(zu.shape[-1], dtype=jnp.promote_types(zu.dtype, jnp.float32))
    total = 0.0
    for zu_h, zv_h in zip(layout.heads(_float(zu)), layout.heads(masked_logits(zv, mask))):
        u = jax.nn.softmax(zu_h, axis=-1)
        if valid is not None:
            u = jnp.where(valid, u, 0.0)
        v = jax.nn.softmax(zv_h, axis=1)
        total = total + jnp.sum(jnp.abs(jnp.einsum("btd,bte->bde", u, u) - eye), axis=(1, 2))
        total = total + jnp.sum(jnp.abs(jnp.einsum("btd,bte->bde", v, v) - eye), axis=(1, 2))
    return total / (zu.shape[2] * zu.shape[3] ** 2)


# ---------------------------------------------------------------------------------------------
# Non-causal AGF with its regulariser, one head at a time, with a hand-written backward pass.
# ---------------------------------------------------------------------------------------------


def agf_with_orthogonality(zu: Array, zv: Array, zs: Array, val: Array, coeffs: Array, *,
                           basis: str = "jacobi", alpha: Optional[float] = None,
                           beta: Optional[float] = None, mask: Optional[Array] = None,
                           count_padding: bool = True) -> tuple[Array, Array]:
    """`(agf_parallel(...), orthogonality_loss(...))` of the non-causal layer in one pass.

    The training form of the non-causal layer (spec §2.2-2.6): the same numbers as the two
    reference functions, computed one head at a time (`zoo_core.layout.heads`) by a function with
    a hand-written backward pass (`jax.custom_vjp`). Per head, with A = U * g, kv = V^T Val:

        dA = dO kv^T,  dkv = A^T dO,  dU = dA * g + 2 U dG_U,  dV = Val dkv^T + 2 V dG_V,
        dVal = V dkv,  dZ_U = U * (dU - sum_D dU U),  dZ_V = V * (dV - sum_T dV V),
        dZ_S = dA * U * g'(s) * s (1 - s),  dc_k = sum dA * U * P_k(s),

    with dG = d(regulariser) * sign(G - I) and g' from the derivative of the basis recurrence.
    Autodiff of the same forward kept every basis term and more intermediates alive; this takes
    the AGF ListOps train step from 0.962 to 0.841 s on 2 CPU devices (1.857 to 1.582 s on one
    core). Gradients are checked in float64 against finite differences (tests/agf_jax/ops_test.py).

    Args:
        zu, zv, zs, val, coeffs, basis, alpha, beta, mask: as in `agf_parallel`.
        count_padding: as in `orthogonality_loss`.

    Returns:
        (o `[B, T, H, M]`, regulariser `[B]`), float32 (float64 for float64 inputs).
    """
    _check_projections(zu, zv, zs, val)
    a, b = resolve_basis(basis, alpha, beta, jnp.shape(coeffs)[0] - 1)
    if mask is None:
        valid = jnp.ones(jnp.shape(zu)[:2], bool)
    else:
        _check_mask(mask, zu)
        valid = jnp.asarray(mask).astype(bool)
    dtype = jnp.result_type(*(_float(x) for x in (zu, zv, zs, val)))
    coeffs = jnp.asarray(coeffs).astype(dtype)
    out, reg = [], 0.0
    for zu_h, zv_h, zs_h, val_h in zip(*(layout.heads(x.astype(dtype)) for x in (zu, zv, zs, val))):
        o, r = _agf_head(zu_h, zv_h, zs_h, val_h, coeffs, valid, (basis, a, b), count_padding)
        out.append(o)
        reg = reg + r
    h, d = jnp.shape(zu)[2:]
    return jnp.stack(out, axis=2), reg / (h * d * d)


def _agf_head_forward(zu, zv, zs, val, coeffs, valid, basis, count_padding):
    """One head `[B, T, D]`: (o `[B, T, M]`, sum |U^T U - I| + sum |V^T V - I| `[B]`) and the
    residuals of `_agf_head_backward`."""
    kind, a, b = basis
    u = jax.nn.softmax(zu, axis=-1)
    s = jax.nn.sigmoid(zs)
    g = graph_filter(s, coeffs, basis=kind, alpha=a if kind == "jacobi" else None,
                     beta=b if kind == "jacobi" else None)
    keep = valid[:, :, None]
    v = jax.nn.softmax(jnp.where(keep, zv, -MASK_OFFSET), axis=1)
    val = jnp.where(keep, val, 0.0)
    kv = jnp.einsum("btd,btm->bdm", v, val)
    o = jnp.einsum("btd,bdm->btm", u * g, kv)
    uc = u if count_padding else jnp.where(keep, u, 0.0)
    eye = jnp.eye(u.shape[-1], dtype=u.dtype)
    gu = jnp.einsum("btd,bte->bde", uc, uc) - eye
    gv = jnp.einsum("btd,bte->bde", v, v) - eye
    reg = jnp.sum(jnp.abs(gu), axis=(1, 2)) + jnp.sum(jnp.abs(gv), axis=(1, 2))
    return (o, reg), (u, s, g, v, val, kv, jnp.sign(gu), gv, coeffs, valid)


def _agf_head_backward(basis, count_padding, res, cotangents):
    kind, a, b = basis
    u, s, g, v, val, kv, sign_u, gv, coeffs, valid = res
    do, dreg = cotangents
    keep = valid[:, :, None]
    da = jnp.einsum("btm,bdm->btd", do, kv)
    dkv = jnp.einsum("btd,btm->bdm", u * g, do)
    two_dreg = 2.0 * dreg[:, None, None]
    uc = u if count_padding else jnp.where(keep, u, 0.0)
    du_reg = jnp.einsum("bte,bde->btd", uc, two_dreg * sign_u)
    if not count_padding:
        du_reg = jnp.where(keep, du_reg, 0.0)
    du = da * g + du_reg
    dzu = u * (du - jnp.sum(du * u, axis=-1, keepdims=True))
    dg = da * u
    # The basis is recomputed from s behind a barrier, and the K+1 sums dc_k = sum dA * U * P_k(s)
    # are one variadic reduce (over D, then the [B, T] partial sums). Without the barrier XLA
    # merged these P_k(s) with the forward's and wrote each to memory for both passes, and it
    # ran the K+1 sums as K+1 reductions that each re-read dG and P_k. AGF ListOps step (2 CPU
    # devices, interleaved): 0.618 -> 0.538 s, XLA's bytes 8.49 -> 7.45 GB.
    s = jax.lax.optimization_barrier(s)
    dg_ds, terms = None, []
    for k, (p, dp) in enumerate(_basis_and_derivative_iter(
            s, coeffs.shape[0] - 1, kind, a if kind == "jacobi" else None,
            b if kind == "jacobi" else None)):
        dg_ds = coeffs[k] * dp if dg_ds is None else dg_ds + coeffs[k] * dp
        terms.append(dg * p)
    rows = jax.lax.reduce(tuple(terms), tuple(jnp.zeros((), t.dtype) for t in terms),
                          lambda x, y: tuple(i + j for i, j in zip(x, y)), (2,))
    dcoeffs = [jnp.sum(r) for r in rows]
    dzs = dg * dg_ds * s * (1.0 - s)
    s_v = two_dreg * jnp.sign(gv)
    eye = jnp.eye(gv.shape[-1], dtype=gv.dtype)
    dv = jnp.einsum("btm,bdm->btd", val, dkv) + jnp.einsum("bte,bde->btd", v, s_v)
    # The softmax's sum over the sequence, sum_T dV * V, from the D x D products instead of T rows:
    # sum_T V (Val dkv^T) = rowsum(kv * dkv) and sum_T V (V S^T) = rowsum((G_V + I) * S). Written
    # as the sum over T, XLA's CPU backend fused it with the two products that make dV and its
    # broadcast back, and recomputed them per output tile: O(T^2) per head (5.7 s at T = 32K,
    # 8 x 64 heads, against 1.0 s at 16K).
    colsum = (jnp.sum(kv * dkv, axis=-1) + jnp.sum((gv + eye) * s_v, axis=-1))[:, None, :]
    dzv = jnp.where(keep, v * (dv - colsum), 0.0)
    dval = jnp.where(keep, jnp.einsum("btd,bdm->btm", v, dkv), 0.0)
    return dzu, dzv, dzs, dval, jnp.stack(dcoeffs), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _agf_head(zu, zv, zs, val, coeffs, valid, basis, count_padding):
    return _agf_head_forward(zu, zv, zs, val, coeffs, valid, basis, count_padding)[0]


_agf_head.defvjp(_agf_head_forward, _agf_head_backward)


# ---------------------------------------------------------------------------------------------
# Forms.
# ---------------------------------------------------------------------------------------------


class AGFState(NamedTuple):
    """Recurrent state of causal AGF per head: an online softmax over the prefix (float32).

    Attributes:
        num: `[B, H, D, M]` sum_j exp(Z_V[j] - m) (x) Val_j.
        den: `[B, H, D]` sum_j exp(Z_V[j] - m).
        max: `[B, H, D]` running maximum m of Z_V (-inf before the first token).
    """
    num: Array
    den: Array
    max: Array


def init_state(batch_size: int, num_heads: int, head_dim: int, value_dim: Optional[int] = None,
               dtype=jnp.float32) -> AGFState:
    """Empty causal state: num `[B, H, D, M]` (M = value_dim, default D), den and max `[B, H, D]`,
    in float32 (float64 stays float64; never a low-precision type)."""
    value_dim = head_dim if value_dim is None else value_dim
    dtype = jnp.promote_types(dtype, jnp.float32)
    return AGFState(num=jnp.zeros((batch_size, num_heads, head_dim, value_dim), dtype),
                    den=jnp.zeros((batch_size, num_heads, head_dim), dtype),
                    max=jnp.full((batch_size, num_heads, head_dim), -jnp.inf, dtype))


def _check_state(state: AGFState, a: Array, val: Array, time_axis: bool = True):
    b, h, d = (a.shape[0], a.shape[2], a.shape[3]) if time_axis else a.shape
    want = (b, h, d, val.shape[-1])
    if tuple(state.num.shape) != want or tuple(state.den.shape) != want[:3] or \
        tuple(state.max.shape) != want[:3]:
        raise ValueError(f"state shapes {state.num.shape}/{state.den.shape}/{state.max.shape} do "
                         f"not match [B, H, D, M] = {want}")


def agf_parallel(zu: Array, zv: Array, zs: Array, val: Array, coeffs: Array, *,
                 basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                 mask: Optional[Array] = None, causal: bool = False) -> Array:
    """AGF attention over a whole sequence, O(T D M) per head (spec §2.2-2.3).

    Non-causal: O = (U * g) (V^T Val), exactly the reference. Causal (extension, see module
    docstring): V is normalised over each prefix; computed with an associative scan of the
    online-softmax monoid, O(T D M) memory, no T x T matrix.

    Args:
        zu: `[B, T, H, D]` left-factor logits (reference: query projection).
        zv: `[B, T, H, D]` right-factor logits (reference: key projection).
        zs: `[B, T, H, D]` singular-value logits (reference: Sigma projection).
        val: `[B, T, H, M]` values.
        coeffs: `[K+1]` filter coefficients.
        basis, alpha, beta: see `resolve_basis`.
        mask: `[B, T]` padding mask (1/True = real), applied to V and Val only, or None.
        causal: prefix-normalised V.

    Returns:
        `[B, T, H, M]` float32 (float64 for float64 inputs).
    """
    _check_projections(zu, zv, zs, val)
    if not causal:
        return agf_with_orthogonality(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta,
                                      mask=mask)[0]
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta)
    zv = masked_logits(zv, mask)
    val = masked_values(val, mask).astype(a.dtype)
    # Per-token elements (m, z, N) = (Z_V, 1, 1 (x) Val): combining prefixes is an associative
    # log-sum-exp merge, so every prefix state is available in parallel.
    m = zv
    z = jnp.ones_like(zv)
    num = jnp.broadcast_to(val[:, :, :, None, :], zv.shape + val.shape[-1:])
    m, z, num = jax.lax.associative_scan(_merge, (m, z, num), axis=1)
    return jnp.einsum("bthd,bthdm->bthm", a / z, num)


def _merge(left, right):
    """Associative merge of two online-softmax partial sums (m, z, N); element shapes broadcast."""
    m1, z1, n1 = left
    m2, z2, n2 = right
    m = jnp.maximum(m1, m2)
    w1 = jnp.exp(m1 - m)
    w2 = jnp.exp(m2 - m)
    return m, w1 * z1 + w2 * z2, w1[..., None] * n1 + w2[..., None] * n2


def agf_chunked(zu: Array, zv: Array, zs: Array, val: Array, coeffs: Array, *, chunk_size: int,
                basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                mask: Optional[Array] = None,
                state: Optional[AGFState] = None) -> tuple[Array, AGFState]:
    """Causal AGF in chunks of C tokens: O(T C D + T D M) time, a carried O(D M) state per head.

    Within a chunk every row t uses its own running maximum M_t = max(m_prev, max_{j<=t} Z_V[j]),
    so all exponentials are <= 1 and every denominator is >= 1 (exactly stable, no underflow of the
    early rows); the previous chunks enter through the carried state rescaled by exp(m_prev - M_t).
    T need not be a multiple of C: the tail is padded with tokens of weight exactly 0.

    Args:
        zu, zv, zs: `[B, T, H, D]`.
        val: `[B, T, H, M]`.
        coeffs: `[K+1]`.
        chunk_size: C >= 1 (any value; need not divide T).
        basis, alpha, beta: see `resolve_basis`.
        mask: `[B, T]` or None.
        state: `AGFState` of the tokens before this sequence, or None for an empty prefix.

    Returns:
        (y `[B, T, H, M]`, final `AGFState`).
    """
    _check_projections(zu, zv, zs, val)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta)
    zv = masked_logits(zv, mask)
    val = masked_values(val, mask).astype(a.dtype)
    # The intra-chunk sum multiplies the future weights (exactly 0) with the future values, and
    # 0 * NaN = NaN: a non-finite Z_V or Val at a valid position is replaced here and every output
    # at or after it is set to NaN below, which is what the recurrence gives.
    bad = ~(jnp.all(jnp.isfinite(zv), axis=-1) & jnp.all(jnp.isfinite(val), axis=-1))   # [B, T, H]
    poisoned = jnp.cumsum(bad.astype(jnp.int32), axis=1) > 0
    zv = jnp.where(bad[..., None], -MASK_OFFSET, zv)
    val = jnp.where(bad[..., None], 0.0, val)
    b, t, h, d = a.shape
    if state is None:
        state = init_state(b, h, d, val.shape[-1], a.dtype)
    _check_state(state, a, val)
    state = AGFState(*(s.astype(a.dtype) for s in state))
    c = chunk_size
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        # Padded tokens: Z_V = -inf (weight exactly 0, max unchanged), A = 0, Val = 0.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        a = jnp.pad(a, widths)
        val = jnp.pad(val, widths)
        zv = jnp.pad(zv, widths, constant_values=-jnp.inf)

    def to_chunks(x):  # [B, n*C, ...] -> [n, B, C, ...]
        return jnp.moveaxis(x.reshape((b, n_chunks, c) + x.shape[2:]), 1, 0)

    tril = jnp.tril(jnp.ones((c, c), bool))[None, :, :, None, None]   # [1, t, j, 1, 1]

    def body(carry: AGFState, xs):
        a_c, zv_c, val_c = xs                                   # [B, C, H, D], ..., [B, C, H, M]
        row_max = jnp.maximum(carry.max[:, None], jax.lax.cummax(zv_c, axis=1))      # [B, C, H, D]
        logits = zv_c[:, None, :] - row_max[:, :, None]                     # [B, t, j, H, D]
        p = jnp.exp(jnp.where(tril, logits, -jnp.inf))
        carry_scale = jnp.exp(carry.max[:, None] - row_max)                          # [B, C, H, D]
        den = carry.den[:, None] * carry_scale + jnp.sum(p, axis=2)                  # >= 1
        w = a_c / den
        y = (jnp.einsum("bthd,bhdm->bthm", w * carry_scale, carry.num)
             + jnp.einsum("bthd,btjhd,bjhm->bthm", w, p, val_c))
        new_max = row_max[:, -1]
        e = jnp.exp(zv_c - new_max[:, None])
        old_scale = jnp.exp(carry.max - new_max)
        new = AGFState(num=(carry.num * old_scale[..., None]
                            + jnp.einsum("bjhd,bjhm->bhdm", e, val_c)),
                       den=carry.den * old_scale + jnp.sum(e, axis=1),
                       max=new_max)
        return new, y

    state, ys = jax.lax.scan(body, state, (to_chunks(a), to_chunks(zv), to_chunks(val)))
    y = jnp.moveaxis(ys, 0, 1).reshape((b, n_chunks * c) + ys.shape[3:])[:, :t]
    last = poisoned[:, -1]                                                            # [B, H]
    state = AGFState(jnp.where(last[..., None, None], jnp.nan, state.num),
                     jnp.where(last[..., None], jnp.nan, state.den),
                     jnp.where(last[..., None], jnp.nan, state.max))
    return jnp.where(poisoned[..., None], jnp.nan, y), state


def _step_core(state: AGFState, a_t: Array, zv_t: Array, val_t: Array) -> tuple[AGFState, Array]:
    new_max = jnp.maximum(state.max, zv_t)
    old_scale = jnp.exp(state.max - new_max)
    e = jnp.exp(zv_t - new_max)
    num = state.num * old_scale[..., None] + e[..., None] * val_t[:, :, None, :]
    den = state.den * old_scale + e
    y = jnp.einsum("bhd,bhdm->bhm", a_t / den, num)
    return AGFState(num, den, new_max), y


def agf_recurrent(zu: Array, zv: Array, zs: Array, val: Array, coeffs: Array, *,
                  basis: str = "jacobi", alpha: Optional[float] = None,
                  beta: Optional[float] = None, mask: Optional[Array] = None,
                  state: Optional[AGFState] = None) -> tuple[Array, AGFState]:
    """Causal AGF as a `jax.lax.scan` of `agf_step` over time (O(D M) state per head).

    Arguments as in `agf_chunked` (without chunk_size); returns (y `[B, T, H, M]`, final state).
    """
    _check_projections(zu, zv, zs, val)
    # The token-local factor is computed for the whole sequence first; only the parameter-free
    # online softmax is scanned.
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta)
    zv = masked_logits(zv, mask)
    val = masked_values(val, mask).astype(a.dtype)
    b, _, h, d = a.shape
    if state is None:
        state = init_state(b, h, d, val.shape[-1], a.dtype)
    _check_state(state, a, val)
    state = AGFState(*(s.astype(a.dtype) for s in state))
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (a, zv, val))
    state, ys = jax.lax.scan(lambda c, x: _step_core(c, *x), state, xs)
    return jnp.moveaxis(ys, 0, 1), state


def agf_step(state: AGFState, zu_t: Array, zv_t: Array, zs_t: Array, val_t: Array, coeffs: Array,
             *, basis: str = "jacobi", alpha: Optional[float] = None,
             beta: Optional[float] = None) -> tuple[AGFState, Array]:
    """One causal AGF token, O(D M) per head: state of the prefix, zu_t, zv_t, zs_t `[B, H, D]`,
    val_t `[B, H, M]` -> (new `AGFState`, y_t `[B, H, M]`); coeffs and basis as in `agf_parallel`.
    """
    _check_projections(zu_t, zv_t, zs_t, val_t, rank=3)
    a_t = left_factor(zu_t, zs_t, coeffs, basis=basis, alpha=alpha, beta=beta)
    val_t = _float(val_t).astype(a_t.dtype)
    _check_state(state, a_t, val_t, time_axis=False)
    state = AGFState(*(s.astype(a_t.dtype) for s in state))
    return _step_core(state, a_t, _float(zv_t).astype(a_t.dtype), val_t)


def agf_attention_matrix(zu: Array, zv: Array, zs: Array, coeffs: Array, *, basis: str = "jacobi",
                         alpha: Optional[float] = None, beta: Optional[float] = None,
                         mask: Optional[Array] = None, causal: bool = False) -> Array:
    """The implicit T x T attention matrix H_tj = sum_k U_tk g_tk V^(t)_jk; O(T^2 D), small T only.

    Used as the explicit reference in tests and by `agf_jax.analysis`. Non-causal: V^(t) = V.
    Causal: V^(t) is the softmax over the prefix j <= t (zero for j > t). Arguments as in
    `agf_parallel` (no values); returns `[B, H, T, T]` (query t, key j), `O = H @ Val` per head.
    """
    _check_projections(zu, zv, zs)
    a = left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta)
    zv = masked_logits(zv, mask)
    if not causal:
        v = jax.nn.softmax(zv, axis=1)
        return jnp.einsum("bthd,bjhd->bhtj", a, v)
    t = zv.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None, :, :, None, None]            # [1, t, j, 1, 1]
    logits = jnp.broadcast_to(zv[:, None], (zv.shape[0], t) + zv.shape[1:])      # [B, t, j, H, D]
    v_t = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=2)
    return jnp.einsum("bthd,btjhd->bhtj", a, v_t)
