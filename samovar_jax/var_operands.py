"""The per-layer operands of SAMoVAR's VAR chain (`samovar_jax.layers.VARChain`, samovar.md §2.6, §8): the
projected queries and values of SAMoVAR (`ProjectedQV`) and FixedVAR's free tables (`FixedQV`).

Each is one `layer_NN` of the chain's parameter tree; `VARChain` builds them by name.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from samovar_jax.modules import MultiHeadRMSNorm, dense, normal002
from zoo_core.ops import xla_forms

Array = jax.Array


def split_heads(y: Array, num_heads: int) -> Array:
    """[..., H * D] -> [..., H, D] (a reshape)."""
    return y.reshape(y.shape[:-1] + (num_heads, -1))


class ProjectedQV(nn.Module):
    """One SAMoVAR layer's q/v projections (`transformer.attn[m]`): query/value Dense E -> E with bias,
    optional per-head norms `query_norm` / `value_norm`, optional bias-free key matrix `key` [E, E]
    (ablation "w/ W_k", N(0, 0.02^2) init)."""
    width: int
    num_heads: int
    use_qv_norm: bool = True
    use_key_proj: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        d = self.width // self.num_heads
        self.query = dense(self.width, name="query", **kw)
        self.value = dense(self.width, name="value", **kw)
        if self.use_qv_norm:
            self.query_norm = MultiHeadRMSNorm(self.num_heads, d, **kw, name="query_norm")
            self.value_norm = MultiHeadRMSNorm(self.num_heads, d, **kw, name="value_norm")
        if self.use_key_proj:
            # A bare [E, E] matrix (row-vector layout, `k = o @ key`): the chain kernels need the
            # matrix itself, not a Dense call.
            self.key = self.param("key", normal002, (self.width, self.width), self.param_dtype)

    def __call__(self, x0: Array, positions: Optional[Array]) -> tuple[Array, Array]:
        """x0 [B, T, E] -> q, v [B, T, H, D] (positions are not read: the caller passes None)."""
        q, v = split_heads(self.query(x0), self.num_heads), split_heads(self.value(x0), self.num_heads)
        if self.use_qv_norm:
            q, v = self.query_norm(q), self.value_norm(v)
        return q, v

    def key_kernel(self) -> Array:
        """[E, E] matrix of the key map (row-vector layout); only with use_key_proj."""
        return self.key

    def qv(self, params, x0: Array, head: Optional[int] = None) -> tuple[Array, Array]:
        """`__call__`'s q and v from this layer's `params` given here (for a traced branch, which cannot call
        a submodule): head None -> [B, T, H, D]; head h -> head h's [B, T, D] alone, from its D columns of
        the kernels and biases (the same dot products)."""
        d = self.width // self.num_heads
        cols = slice(None) if head is None else slice(head * d, (head + 1) * d)
        out = []
        for name in ("query", "value"):
            p = params[name]
            y = xla_forms.dense_matmul(getattr(self, name), x0, p["kernel"][:, cols], p["bias"][cols])
            if head is None:
                y = split_heads(y, self.num_heads)
            if self.use_qv_norm:
                scale = params[f"{name}_norm"]["scale"]
                y = getattr(self, f"{name}_norm").normalise(y, scale if head is None else scale[head])
            out.append(y)
        return out[0], out[1]


class FixedQV(nn.Module):
    """One FixedVAR layer (`transformer.attn[m].fixed_q / fixed_v`, samovar.md §8): free per-(channel,
    token) queries and values, tables `query` / `value` [C_t, max_tokens, H, D], 0.02 N(0,1) init."""
    num_channels: int
    max_tokens: int
    num_heads: int
    head_dim: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        shape = (self.num_channels, self.max_tokens, self.num_heads, self.head_dim)
        self.query = self.param("query", normal002, shape, self.param_dtype)
        self.value = self.param("value", normal002, shape, self.param_dtype)

    def __call__(self, x0: Array, positions: Array) -> tuple[Array, Array]:
        """Tables at token indices `positions` [T] (every row) or [B', T] (per row, e.g. restarting at
        each packed document) for folded rows (row = b * C_t + c): q, v [B', T, H, D]."""
        def rows(table):
            if positions.ndim == 1:
                t = jnp.take(table, positions, axis=1)                             # [C_t, T, H, D]
                t = jnp.tile(t, (x0.shape[0] // self.num_channels, 1, 1, 1))
            else:   # out-of-table positions give NaN, as `jnp.take`'s fill mode does above
                channel = jnp.arange(x0.shape[0]) % self.num_channels
                inside = (positions >= 0) & (positions < self.max_tokens)
                t = table[channel[:, None], jnp.clip(positions, 0, self.max_tokens - 1)]   # [B', T, H, D]
                t = jnp.where(inside[..., None, None], t, jnp.asarray(jnp.nan, t.dtype))
            return t if self.dtype is None else t.astype(self.dtype)
        return rows(self.query), rows(self.value)
