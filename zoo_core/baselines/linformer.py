"""Linformer (Wang et al., 2020, "Linformer: Self-Attention with Linear Complexity"), non-causal.

Keys and values are projected along the sequence to k = `proj_len` rows (docs/specs/baselines.md,
"Linformer"; docs/baselines.md for the choices made here):

    K' = E K,  V' = F V     E, F `[k, n]` learned (n = `max_length`)
    O  = softmax(Q K'^T / sqrt(D)) V'        per head, cost O(n k)

A shorter input (T < n) uses the first T columns of E and F. The padded rows of K and V are replaced
by 0 (`jnp.where`) before the projection, so a padded token, even one holding NaN, never enters
K' or V'. The projected keys are not masked: a row of E K mixes every position, padded ones
included as zeros (the paper's and the Long Range Arena code's behaviour), so Linformer equals
masked softmax attention only without padding (the identity check of the spec).
Causal attention is refused: the projection mixes the future into every projected row.
"""
from __future__ import annotations

__all__ = ["LinformerAttention", "linformer_attention"]

import math
from typing import Callable, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo_core import checks
from zoo_core.baselines import Initializer, ProjectedAttention

Array = jax.Array


def _float(x: Array) -> Array:
    return jnp.asarray(x).astype(jnp.promote_types(jnp.result_type(x), jnp.float32))


def linformer_attention(q: Array, k: Array, v: Array, e: Array, f: Array, *,
                        mask: Optional[Array] = None,
                        dropout: Optional[Callable[[Array], Array]] = None) -> Array:
    """softmax(Q (E K)^T / sqrt(D)) (F V) per head (float32, float64 stays float64).

    Args:
      q, k: `[B, T, H, D]`.
      v: `[B, T, H, M]`.
      e, f: `[k, T]` (shared by the heads) or `[H, k, T]` (one per head): the sequence projections,
        already cut to the input's T columns.
      mask: `[B, T]` key-padding mask (True = valid) or None: padded keys and values are replaced
        by 0 before the projection.
      dropout: optional `w -> w` on the weights `[B, H, T, k]`.

    Returns:
      `[B, T, H, M]`.
    """
    q, k, v, e, f = (_float(a) for a in (q, k, v, e, f))
    if mask is not None:
        keep = jnp.asarray(mask).astype(bool)[:, :, None, None]
        k, v = jnp.where(keep, k, 0.0), jnp.where(keep, v, 0.0)
    sub = "kt" if e.ndim == 2 else "hkt"
    k_proj = jnp.einsum(f"{sub},bthd->bkhd", e, k)                             # [B, k, H, D]
    v_proj = jnp.einsum(f"{sub},bthm->bkhm", f, v)
    w = jax.nn.softmax(jnp.einsum("bthd,bkhd->bhtk", q, k_proj) / math.sqrt(q.shape[-1]), axis=-1)
    if dropout is not None:
        w = dropout(w)
    return jnp.einsum("bhtk,bkhm->bthm", w, v_proj)


class LinformerAttention(ProjectedAttention):
    """Multi-head Linformer self-attention (non-causal), the zoo's layer contract.

    Shapes: x `[B, T, E]` (T <= `max_length`) -> y `[B, T, E']`. Parameters: those of the softmax
    baseline (`query`, `key`, `value`, `out`, see `zoo_core.baselines`) and the sequence projections
    `proj_key` (E) and `proj_value` (F), `[proj_len, max_length]` (`[H, proj_len, max_length]` with
    `share_heads=False`), or one `proj_kv` with `share_kv=True`.

    Attributes (besides `ProjectedAttention`'s):
      max_length: n, the columns of E and F: the longest input.
      proj_len: k, the rows of E and F (the projected length).
      share_kv: E = F (the paper's key-value sharing): one projection `proj_kv`.
      share_heads: one E (and F) for every head (the paper's headwise sharing, the default); False:
        one per head.
      proj_init: initialiser of E and F (default: LeCun normal over the n columns, as a Dense
        layer from n to k).
    """
    keeps_documents_apart: ClassVar[bool] = False   # segment_ids refused in one line
    max_length: int = 512
    proj_len: int = 256
    share_kv: bool = False
    share_heads: bool = True
    proj_init: Initializer = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)

    def setup(self):
        self._check_common()
        checks.check_int("max_length", self.max_length, 1)
        checks.check_int("proj_len", self.proj_len, 1)
        for name in ("share_kv", "share_heads"):
            if not isinstance(getattr(self, name), bool):
                checks.fail(f"`{name}` must be True or False, got {getattr(self, name)!r}")
        self._qkv_layers()
        shape = (self.proj_len, self.max_length) if self.share_heads else (
            self.num_heads, self.proj_len, self.max_length)
        if self.share_kv:
            self.proj_kv = self.param("proj_kv", self.proj_init, shape, self.param_dtype)
        else:
            self.proj_key = self.param("proj_key", self.proj_init, shape, self.param_dtype)
            self.proj_value = self.param("proj_value", self.proj_init, shape, self.param_dtype)

    def projections(self, length: int) -> tuple[Array, Array]:
        """(E, F) cut to the first `length` columns: `[k, T]` each (`[H, k, T]` per head)."""
        if length > self.max_length:
            checks.fail(f"Linformer input length {length} exceeds `max_length` = {self.max_length} "
                        f"(the columns of its sequence projections)")
        e = self.proj_kv if self.share_kv else self.proj_key
        f = self.proj_kv if self.share_kv else self.proj_value
        return e[..., :length], f[..., :length]

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x `[B, T, E]`, mask `[B, T]` key-padding mask (True = valid) -> (y `[B, T, E']`, {}).
        `segment_ids` (packed documents) is refused in one line: the definition mixes the whole sequence."""
        self._refuse_segments(segment_ids, "Linformer", "sequence projections E and F")
        self._check_inputs(x, mask)
        e, f = self.projections(x.shape[1])
        o = linformer_attention(self.query(x), self.key(x), self.value(x), e, f, mask=mask,
                                dropout=self._weights_dropout(deterministic))
        return self._finish(o, x), {}
