"""Non-causal AGF with its regulariser, one head at a time, with a hand-written backward pass.

The training form of the non-causal layer: `agf_with_orthogonality` returns the same numbers as
`agf_jax.forms.agf_parallel` and `agf_jax.factors.orthogonality_loss` in one pass.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from agf_jax.basis import _basis_and_derivative_iter, basis_params, check_filter, spectrum_filter
from agf_jax.factors import (
    MASK_OFFSET,
    _document_softmax,
    _left_factor,
    _packed_orthogonality,
    agf_factors,
    as_float,
    check_projections,
    orthogonality_loss,
)
from zoo_core.ops import guard, linear_attention, masking, packing, xla_forms

Array = jax.Array



def agf_with_orthogonality(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
                           basis: str = "jacobi", alpha: Optional[float] = None,
                           beta: Optional[float] = None, mask: Optional[Array] = None,
                           count_padding: bool = True, spectrum: Optional[Array] = None,
                           segment_ids: Optional[Array] = None) -> tuple[Array, Array]:
    """`(agf_parallel(...), orthogonality_loss(...))` of the non-causal layer in one pass.

    The training form of the non-causal layer (agf.md §2.2-2.6): the same numbers as the two
    reference functions, computed one head at a time (`zoo_core.ops.xla_forms.heads`) by a function with
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
        spectrum: None, or `[H, D]` fixed singular values (`left_factor`; the Table 6 variants,
            which have no polynomial filter): computed by `agf_with_orthogonality_plain`.
        segment_ids: None, or int `[B, T]` packed documents (0 = padding): `_agf_packed`.

    Returns:
        (o `[B, T, H, M]`, regulariser `[B]`), float32 (float64 for float64 inputs).
    """
    check_projections(zu, zv, zs, val)
    masking.check_mask(mask, jnp.shape(zu)[:2])
    packing.check_segment_ids(segment_ids, jnp.shape(zu)[:2])
    if spectrum is None:
        check_filter(coeffs, basis, alpha, beta)
    return _with_orthogonality(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta, mask=mask,
                               count_padding=count_padding, spectrum=spectrum, segment_ids=segment_ids)


def _with_orthogonality(zu, zv, zs, val, coeffs, *, basis, alpha, beta, mask, count_padding, spectrum,
                        segment_ids):
    """`agf_with_orthogonality` after its checks (trusted)."""
    if segment_ids is not None:
        return _agf_packed(zu, zv, zs, val, coeffs, basis=basis, alpha=alpha, beta=beta, mask=mask,
                          count_padding=count_padding, spectrum=spectrum, segment_ids=segment_ids)
    if spectrum is not None:
        # The hand-written backward differentiates the polynomial filter; the variants have none.
        return agf_with_orthogonality_plain(zu, zv, zs, val, coeffs, mask=mask,
                                            count_padding=count_padding, spectrum=spectrum)
    a, b = basis_params(basis, alpha, beta)
    valid = jnp.ones(jnp.shape(zu)[:2], bool) if mask is None else jnp.asarray(mask) != 0
    dtype = jnp.result_type(*(as_float(x) for x in (zu, zv, zs, val)))
    coeffs = jnp.asarray(coeffs).astype(dtype)
    out, reg = [], 0.0
    for zu_h, zv_h, zs_h, val_h in zip(*(xla_forms.heads(x.astype(dtype)) for x in (zu, zv, zs, val))):
        o, r = _agf_head(zu_h, zv_h, zs_h, val_h, coeffs, valid, (basis, a, b), count_padding)
        out.append(o)
        reg = reg + r
    h, d = jnp.shape(zu)[2:]
    return jnp.stack(out, axis=2), reg / (h * d * d)


def agf_with_orthogonality_plain(zu: Array, zv: Array, zs: Optional[Array], val: Array,
                                 coeffs: Array, *, basis: str = "jacobi",
                                 alpha: Optional[float] = None, beta: Optional[float] = None,
                                 mask: Optional[Array] = None, count_padding: bool = True,
                                 spectrum: Optional[Array] = None) -> tuple[Array, Array]:
    """`agf_with_orthogonality`'s numbers from the plain maths, differentiated by autodiff.

    O = (U * g) (V^T Val) batched over heads, and `orthogonality_loss`; no custom backward, no
    optimisation barrier, no variadic reduce. The plain form a model takes inside
    `zoo_core.ops.xla_forms.plain('agf_backward')`, to time the hand-written backward against it, and
    the form of the spectrum variants. Arguments and result as in `agf_with_orthogonality`.
    """
    f = agf_factors(zu, zv, zs, coeffs, basis=basis, alpha=alpha, beta=beta, mask=mask,
                    spectrum=spectrum)
    kv = jnp.einsum("bthd,bthm->bhdm", f.v, as_float(masking.zero_padding(val, mask)).astype(f.v.dtype))
    o = jnp.einsum("bthd,bhdm->bthm", f.u * f.g, kv)
    return o, orthogonality_loss(zu, zv, mask=mask, count_padding=count_padding)


def _agf_packed(zu: Array, zv: Array, zs: Optional[Array], val: Array, coeffs: Array, *,
               segment_ids: Array, basis: str = "jacobi", alpha: Optional[float] = None,
               beta: Optional[float] = None, mask: Optional[Array] = None, count_padding: bool = True,
               spectrum: Optional[Array] = None) -> tuple[Array, Array]:
    """`agf_with_orthogonality` of packed documents: each document as if alone (autodiff).

    V is the softmax over the token's own document (`_document_softmax`), so the output
    O_t = (U_t * g_t) sum_{j in doc(t)} V_j (x) Val_j is packed non-causal linear attention with
    queries U * g, keys V and values Val (`zoo_core.ops.linear_attention.noncausal`, O(T) memory,
    no per-document table); the regulariser is `_packed_orthogonality`. A non-finite Z_V or Val
    at a valid position makes its document's outputs NaN, and no other document's. Arguments
    and result as in `agf_with_orthogonality` (trusted: checked there).
    """
    a = masking.zero_padding(_left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta,
                                          spectrum=spectrum), segment_ids > 0)
    valid = packing.valid(segment_ids, mask)
    zv_m = masking.zero_padding(as_float(zv), valid, fill=-MASK_OFFSET).astype(a.dtype)
    val = as_float(masking.zero_padding(val, valid)).astype(a.dtype)
    bad = guard.nonfinite(zv_m, val)
    v, doc_bad = _document_softmax(guard.clean(zv_m, bad, -MASK_OFFSET), segment_ids, bad)
    o, _ = linear_attention.noncausal(a, v, guard.clean(val, bad), segment_ids=segment_ids)
    o = guard.poison(o, doc_bad & masking.expand(segment_ids > 0, 3))
    return o, _packed_orthogonality(zu, zv, segment_ids, mask=mask, count_padding=count_padding)


def _agf_head_forward(zu, zv, zs, val, coeffs, valid, basis, count_padding):
    """One head `[B, T, D]`: (o `[B, T, M]`, sum |U^T U - I| + sum |V^T V - I| `[B]`) and the
    residuals of `_agf_head_backward`."""
    kind, a, b = basis
    u = jax.nn.softmax(zu, axis=-1)
    s = jax.nn.sigmoid(zs)
    g = spectrum_filter(s, coeffs, kind, a, b)
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
    # The basis is recomputed from s behind a barrier (else XLA merges these P_k(s) with the
    # forward's and writes each to memory), and the K+1 sums dc_k = sum dA * U * P_k(s) are one
    # variadic reduce, so dG and P_k are read once rather than K+1 times.
    s = jax.lax.optimization_barrier(s)
    dg_ds, terms = None, []
    for k, (p, dp) in enumerate(_basis_and_derivative_iter(s, coeffs.shape[0] - 1, kind, a, b)):
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
