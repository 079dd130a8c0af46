"""The per-head pieces of HTGN's graph layers (`graph_layers`): the bias-free projection x `[..., d]`
-> `[..., H, D]` (W_s, W_t) and a per-head vector `[H, D]` (the GAT attention vectors a_h)."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from htgn_jax.layers import flat_init
from zoo_core.checks import fail

Array = jax.Array
Initializer = Callable[..., Array]


def resolve_head_dim(width: int, num_heads: int, head_dim: int | None, arg: str) -> int:
    if head_dim is not None:
        return head_dim
    if width % num_heads:
        fail(f"width of `{arg}` ({width}) is not divisible by num_heads={num_heads}; "
              f"set head_dim explicitly")
    return width // num_heads


class HeadProjection(nn.Module):
    """x `[..., d]` -> `[..., H, D]` without bias; D = head_dim, or d // H when head_dim is None.

    Compact on purpose: the kernel shape may follow the input width, which setup() cannot see.
    """
    num_heads: int
    head_dim: int | None
    arg: str
    dtype: Any
    param_dtype: Any
    kernel_init: Initializer

    @nn.compact
    def __call__(self, x: Array, head_dim: int | None = None) -> Array:
        d = x.shape[-1]
        hd = head_dim or resolve_head_dim(d, self.num_heads, self.head_dim, self.arg)
        kernel = self.param("kernel", flat_init(self.kernel_init, 1), (d, self.num_heads, hd),
                            self.param_dtype)
        x, kernel = promote_dtype(x, kernel, dtype=self.dtype)
        return jnp.einsum("...d,dhk->...hk", x, kernel)


class HeadVector(nn.Module):
    """A per-head vector `[H, D]` (GAT attention vector a_h); D is given at call time."""
    num_heads: int
    param_dtype: Any
    init: Initializer

    @nn.compact
    def __call__(self, head_dim: int) -> Array:
        return self.param("vector", self.init, (self.num_heads, head_dim), self.param_dtype)
