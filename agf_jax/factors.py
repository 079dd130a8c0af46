"""AGF's singular factors, masked V logits and orthogonality regulariser (the maths: `agf_jax.ops`).

U = softmax_D(Z_U), V = softmax_T(Z_V - 1e9 (1 - mask)), s = sigmoid(Z_S), g = sum_k c_k P_k(s),
all `[B, T, H, D]` in float32 (float64 stays float64). Padding is removed with `jnp.where`, never
multiplied by 0, so a padded position holding NaN or 1e30 changes no valid output.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from agf_jax.basis import basis_params, check_filter, spectrum_filter
from zoo_core.ops import guard, masking, packing, xla_forms

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
    if spectrum is None:
        check_filter(coeffs, basis, alpha, beta)
    return _left_factor(zu, zs, coeffs, basis=basis, alpha=alpha, beta=beta, spectrum=spectrum)


def _left_factor(zu, zs, coeffs, *, basis, alpha, beta, spectrum):
    """`left_factor` for the private forms (trusted: checked at their public kernel's entry)."""
    u = jax.nn.softmax(as_float(zu), axis=-1)
    if spectrum is not None:
        return u * as_float(spectrum).astype(u.dtype)
    s = jax.nn.sigmoid(as_float(zs))
    return u * spectrum_filter(s, coeffs, basis, *basis_params(basis, alpha, beta))


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
    check_filter(coeffs, basis, alpha, beta)
    s = jax.nn.sigmoid(as_float(zs))
    return AGFFactors(u, v, s, spectrum_filter(s, coeffs, basis, *basis_params(basis, alpha, beta)))


def gated(merge):
    """`merge` of two partial states on (cut, state) pairs, cut bool `[B, n]` (a document starts in
    the right block): the right state alone where it is cut, else the merge. Associative when
    `merge` is: the gated chain of `zoo_core.ops.packing.gated_prefix` with any merge (here the
    max-aware log-sum-exp one). `where`, so a NaN never crosses a cut."""
    def combine(left, right):
        (cut1, s1), (cut2, s2) = left, right
        merged = merge(s1, s2)
        return cut1 | cut2, tuple(jnp.where(masking.expand(cut2, x.ndim), x, y)
                                  for x, y in zip(s2, merged))
    return combine


def _merge_sums(left, right):
    """(max, sum exp(x - max), any bad) of two blocks."""
    (m1, z1, b1), (m2, z2, b2) = left, right
    m = jnp.maximum(m1, m2)
    return m, jnp.exp(m1 - m) * z1 + jnp.exp(m2 - m) * z2, b1 | b2


def _document_softmax(zv: Array, segment_ids: Array, bad: Optional[Array] = None) -> tuple[Array, Array]:
    """V of packed documents: the softmax of each (head, feature) over the tokens of the token's
    own document (agf.md §2.2, per document; docs/specs/context_parallel.md §2).

    Args:
        zv: `[B, T, H, D]` masked logits (padding at -1e9), finite.
        segment_ids: int `[B, T]`, 0 = padding (its rows of V are 0).
        bad: None or bool `[B, T, H]` (a replaced non-finite input).

    Returns:
        (V `[B, T, H, D]`, bool `[B, T, H]`: the token's document holds a bad position).
    """
    m, z, doc_bad = _document_totals(zv, packing.starts(segment_ids), bad)
    v = jnp.exp(zv - m) / z
    return masking.zero_padding(v, segment_ids > 0), doc_bad


def _document_totals(zv: Array, start: Array, bad: Optional[Array] = None):
    """Per token, (max, sum exp(Z_V - max), any bad) of its document: zv `[B, T, H, D]`, start bool
    `[B, T]` (the first token continues), bad `[B, T, H, ...]` or None -> leaves like the inputs.
    One gated scan of inclusive sums, read at each document's last token."""
    t = zv.shape[1]
    bad = jnp.zeros(zv.shape[:3], bool) if bad is None else bad
    _, totals = jax.lax.associative_scan(gated(_merge_sums), (start, (zv, jnp.ones_like(zv), bad)), axis=1)
    end = jnp.concatenate([start[:, 1:], jnp.ones_like(start[:, :1])], axis=1)
    last = jax.lax.cummin(jnp.where(end, jnp.arange(t), t), axis=1, reverse=True)     # [B, T]
    return tuple(jnp.take_along_axis(x, last.reshape(last.shape + (1,) * (x.ndim - 2)), axis=1)
                 for x in totals)


# Chunk length of the packed regulariser's scan (its Gram matrices are [B, C, H, D, D]).
GRAM_CHUNK = 32


def _document_penalty(u: Array, v: Array, segment_ids: Array, poisoned: Array, initial=None,
                      open_end: Optional[Array] = None) -> Array:
    """sum over each row's documents of sum |U^T U - I| + sum |V^T V - I| (the Grams of the
    document alone) and the number of documents, `[B]` each. A `lax.scan` over chunks of
    `GRAM_CHUNK` tokens carries the open document's Grams `[B, H, D, D]`; no per-document table.
    A document `poisoned` (bool `[B, T]`, read at its last token) adds NaN. Context parallelism:
    `initial` (Gu, Gv) enters the first document, and where `open_end` `[B]` the last document
    does not end here."""
    b, t, h, d = u.shape
    start = packing.starts(segment_ids)
    last = jnp.ones_like(start[:, :1]) if open_end is None else ~open_end[:, None]
    end = jnp.concatenate([start[:, 1:], last], axis=1) & (segment_ids > 0)
    c = min(GRAM_CHUNK, t)
    n = -(-t // c)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n * c - t)) + ((0, 0),) * (x.ndim - 2))
    chunks = lambda x: jnp.moveaxis(pad(x).reshape((b, n, c) + x.shape[2:]), 1, 0)
    eye = jnp.eye(d, dtype=u.dtype)

    def body(carry, xs):
        u_c, v_c, start_c, end_c, poisoned_c = xs
        outer = [jnp.einsum("bchd,bche->bchde", x, x) for x in (u_c, v_c)]
        entering, final = packing.gated_prefix(~start_c, outer, list(carry))
        penalty = 0.0
        for s, o in zip(entering, outer):
            gram = jnp.where(masking.expand(start_c, o.ndim), 0.0, s) + o          # through t
            penalty = penalty + jnp.sum(jnp.abs(gram - eye), axis=(2, 3, 4))
        penalty = jnp.where(poisoned_c, jnp.nan, penalty)
        return tuple(final), jnp.sum(jnp.where(end_c, penalty, 0.0), axis=1)

    empty = (jnp.zeros((b, h, d, d), u.dtype),) * 2 if initial is None else tuple(initial)
    _, sums = jax.lax.scan(body, empty, tuple(map(chunks, (u, v, start, end, poisoned))))
    return jnp.sum(sums, axis=0), jnp.sum(end, axis=1)


def orthogonality_loss(zu: Array, zv: Array, *, mask: Optional[Array] = None,
                       count_padding: bool = True, segment_ids: Optional[Array] = None) -> Array:
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

        segment_ids: None, or int `[B, T]` packed documents (0 = padding, never counted): each
            document's regulariser is computed as if alone (its own Grams, V its own softmax),
            and a row's value is the mean over its documents (0 for a row of padding).

    Returns:
        `[B]`, unweighted (the LRA layer multiplies it by `reg`, the UEA loss by `eta`).
    """
    check_projections(zu, zv)
    packing.check_segment_ids(segment_ids, jnp.shape(zu)[:2])
    if segment_ids is not None:
        masking.check_mask(mask, jnp.shape(zu)[:2])
        return _packed_orthogonality(zu, zv, segment_ids, mask=mask, count_padding=count_padding)
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


def _packed_orthogonality(zu: Array, zv: Array, segment_ids: Array, *, mask: Optional[Array] = None,
                          count_padding: bool = True) -> Array:
    """`orthogonality_loss` of packed documents, `[B]` (arguments there). A non-finite Z_U or Z_V
    in a document makes its regulariser NaN, as the document alone gives, and no other's."""
    zv, u, bad = _packed_factors(zu, zv, segment_ids, mask, count_padding)
    v, doc_bad = _document_softmax(zv, segment_ids, bad)
    total, docs = _document_penalty(u, v, segment_ids, jnp.any(doc_bad, axis=-1))
    h, d = zu.shape[2:]
    return total / (h * d * d) / jnp.maximum(docs, 1)


def _packed_factors(zu, zv, segment_ids, mask, count_padding):
    """The regulariser's masked Z_V and U `[B, T, H, D]` (U's rows of id 0 zeroed, and its masked
    rows unless `count_padding`), non-finite rows replaced, and where they were (`[B, T, H]`)."""
    valid = packing.valid(segment_ids, mask)
    zv = masking.zero_padding(as_float(zv), valid, fill=-MASK_OFFSET)
    u = jax.nn.softmax(as_float(zu), axis=-1).astype(zv.dtype)
    u = masking.zero_padding(u, segment_ids > 0 if count_padding else valid)
    bad = guard.nonfinite(zv, u)
    return guard.clean(zv, bad, -MASK_OFFSET), guard.clean(u, bad), bad
