"""AGF's singular factors, masked V logits and orthogonality regulariser (the maths: `agf_jax.ops`).

U = softmax_D(Z_U), V = softmax_T(Z_V - 1e9 (1 - mask)), s = sigmoid(Z_S), g = sum_k c_k P_k(s),
all `[B, T, H, D]` in float32 (float64 stays float64). Padding is removed with `jnp.where`, never
multiplied by 0, so a padded position holding NaN or 1e30 changes no valid output.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from agf_jax.basis import graph_filter
from zoo_core.ops import masking, xla_forms

Array = jax.Array

# The reference masks V by subtracting 1e9 from padded logits (agf.md §2.2); we do the same so that
# fully padded sequences behave like the reference (uniform over the padded tokens).
MASK_OFFSET = 1e9



def as_float(x: Array) -> Array:
    """Casts to float32, keeping float64 (the attention maths never runs in bf16/f16)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def check_projections(zu, zv, zs=None, val=None, *, rank=4):
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
    zv = as_float(zv)
    masking.check_mask(mask, zv.shape[:2])
    return masking.zero_padding(zv, mask, fill=-MASK_OFFSET)


def left_factor(zu: Array, zs: Optional[Array], coeffs: Array, *, basis: str = "jacobi",
                alpha: Optional[float] = None, beta: Optional[float] = None,
                spectrum: Optional[Array] = None) -> Array:
    """A = U * g, the token-local part of AGF: softmax over D times the filtered spectrum.

    Args:
        zu: `[..., H, D]` left-factor logits (the "query" projection).
        zs: `[..., H, D]` singular-value logits (the "Sigma" projection); unused (may be None)
            when `spectrum` is given.
        coeffs: `[K+1]`.
        basis, alpha, beta: see `resolve_basis`.
        spectrum: None (AGF: g = sum_k c_k P_k(sigmoid(Z_S))), or `[H, D]` singular values used as
            g directly, the same for every token (the Table 6 variants H_UV^T and H_SVD,
            docs/agf_options.md): zs, coeffs and the basis are then unused.

    Returns:
        `[..., H, D]` float32.
    """
    u = jax.nn.softmax(as_float(zu), axis=-1)
    if spectrum is not None:
        return u * as_float(spectrum).astype(u.dtype)
    g = graph_filter(jax.nn.sigmoid(as_float(zs)), coeffs, basis=basis, alpha=alpha, beta=beta)
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


def agf_factors(zu: Array, zv: Array, zs: Optional[Array], coeffs: Array, *,
                basis: str = "jacobi", alpha: Optional[float] = None, beta: Optional[float] = None,
                mask: Optional[Array] = None, spectrum: Optional[Array] = None) -> AGFFactors:
    """Computes U, V, s and g (agf.md §2.2-2.3), for analysis and the explicit reference.

    Args:
        zu, zv, zs: `[B, T, H, D]` projections (zs unused, may be None, with `spectrum`).
        coeffs: `[K+1]`.
        basis, alpha, beta: see `resolve_basis`.
        mask: `[B, T]` padding mask applied to V only, or None.
        spectrum: None, or `[H, D]` singular values (see `left_factor`); s and g are then both
            that spectrum, broadcast to `[B, T, H, D]`.

    Returns:
        `AGFFactors`.
    """
    check_projections(zu, zv, zs)
    u = jax.nn.softmax(as_float(zu), axis=-1)
    v = jax.nn.softmax(masked_logits(zv, mask), axis=1)
    if spectrum is not None:
        s = g = jnp.broadcast_to(as_float(spectrum).astype(u.dtype), u.shape)
        return AGFFactors(u, v, s, g)
    s = jax.nn.sigmoid(as_float(zs))
    g = graph_filter(s, coeffs, basis=basis, alpha=alpha, beta=beta)
    return AGFFactors(u, v, s, g)


def orthogonality_loss(zu: Array, zv: Array, *, mask: Optional[Array] = None,
                       count_padding: bool = True) -> Array:
    """Per-sample orthogonality regulariser on the post-softmax factors (agf.md §2.5, pitfall 5).

    ortho_b = mean_{H,D,D} |U^T U - I| + mean_{H,D,D} |V^T V - I|, where U^T U = sum_t U_t U_t^T.
    V uses the masked sequence softmax, so padded rows of V are exactly 0. In causal mode the same
    function is used (see the module docstring of `agf_jax.ops`).

    Args:
        zu, zv: `[B, T, H, D]`.
        mask: `[B, T]` or None.
        count_padding: True (the reference): padded rows of U count in U^T U, so the value depends
            on what padded positions hold; False: they are removed with `jnp.where`, so padding
            (even NaN or 1e30) cannot change it (the zoo's layer contract).

    Returns:
        `[B]`, unweighted (the LRA layer multiplies it by `reg`, the UEA loss by `eta`).
    """
    check_projections(zu, zv)
    valid = None if mask is None or count_padding else masking.expand(mask, 3)     # [B, T, 1]
    eye = jnp.eye(zu.shape[-1], dtype=jnp.promote_types(zu.dtype, jnp.float32))
    total = 0.0
    for zu_h, zv_h in zip(xla_forms.heads(as_float(zu)), xla_forms.heads(masked_logits(zv, mask))):
        u = jax.nn.softmax(zu_h, axis=-1)
        if valid is not None:
            u = jnp.where(valid, u, 0.0)
        v = jax.nn.softmax(zv_h, axis=1)
        total = total + jnp.sum(jnp.abs(jnp.einsum("btd,bte->bde", u, u) - eye), axis=(1, 2))
        total = total + jnp.sum(jnp.abs(jnp.einsum("btd,bte->bde", v, v) - eye), axis=(1, 2))
    return total / (zu.shape[2] * zu.shape[3] ** 2)
