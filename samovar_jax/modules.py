"""Flax (Linen) building blocks of SAMoVAR and its baselines (Lu & Yang, ICML 2025, arXiv:2502.07244).

The layers own parameters only; the maths is in `samovar_jax.ops`. Section numbers refer to the
project spec `samovar.md` (which follows the released code, LJC-FVNR/Structural-Aligned-Mixture-of-VAR
@ 4e2581f); the reference module each layer replaces is named in its docstring, and
`samovar_jax.convert` maps the reference state_dict onto these parameter names.

Layers:

* `RMSNorm` (gain [E], eps 1e-5) and `MultiHeadRMSNorm` (gain [H, D], eps 1e-8) (samovar.md §1).
* `MLPBlock`: pre-norm residual MLP `h + Dropout(W2 GELU(W1 RMSNorm(h)))` (samovar.md §2.5).
* `ARXTokenizer`: exogenous/endogenous token pairs of every patch (samovar.md §2.3).
* `ARXEmbedding`: additive position / channel / type embeddings (samovar.md §2.4; LinTrans §7).
* `StructuralMatrix`: the LU-parameterised invertible per-head matrix D (samovar.md §2.7).

The causal attention layers (`LinearAttention`, `LinTransBlock`, `VARChain`) are in
`samovar_jax.layers`.

dtype policy: every parameterised layer has `dtype` (compute; None = promote inputs and params) and
`param_dtype` (float32). Norms compute in float32 and cast back (as the reference); attention sums
and recurrent states are float32 (see `samovar_jax.layers`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from samovar_jax import ops
from zoo_core import checks
from zoo_core.ops import xla_forms
from zoo_core.ops.dropout import Dropout
from zoo_core.ops.residual import feed_forward, residual

Array = jax.Array

# samovar.md §5: every nn.Linear weight N(0, 0.02^2), bias 0; embeddings N(0, 0.02^2).
normal002 = nn.initializers.normal(0.02)


def dense(features: int, *, name: str, dtype, param_dtype, use_bias: bool = True, std: float = 0.02):
    """`zoo_core.ops.xla_forms.Dense` (flax's Dense as a 2-D matmul) with the reference init: kernel
    N(0, std^2), bias 0 (samovar.md §5)."""
    return xla_forms.Dense(features, use_bias=use_bias, kernel_init=nn.initializers.normal(std),
                    bias_init=nn.initializers.zeros, dtype=dtype, param_dtype=param_dtype, name=name)


class RMSNorm(nn.Module):
    """Model-wide RMSNorm of the reference (`RMSNorm`): gain `scale` [E], ones at init.

    The reference ignores its constructor eps and always uses 1e-5; it normalises in float32.

    Attributes:
      features: E, the normalised (last) axis.
      eps: stabiliser (1e-5, as the reference).
    """
    features: int
    eps: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        self.scale = self.param("scale", nn.initializers.ones, (self.features,), self.param_dtype)

    def __call__(self, x: Array) -> Array:
        """[..., E] -> [..., E]."""
        if x.shape[-1:] != (self.features,):
            checks.fail(f"`x` must be [..., {self.features}], got shape {tuple(x.shape)}")
        x, scale = nn.dtypes.promote_dtype(x, self.scale, dtype=self.dtype)
        return ops.rms_norm(x, scale, self.eps)


class MultiHeadRMSNorm(nn.Module):
    """Per-head RMSNorm (`RMSNormMultiHead`): each head's D slice, gain `scale` [H, D], eps 1e-8.

    Attributes:
      num_heads: H.
      head_dim: D.
      eps: stabiliser (1e-8, as the reference).
    """
    num_heads: int
    head_dim: int
    eps: float = 1e-8
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        self.scale = self.param("scale", nn.initializers.ones, (self.num_heads, self.head_dim),
                                self.param_dtype)

    def __call__(self, x: Array) -> Array:
        """[..., H, D] -> [..., H, D]."""
        if x.shape[-2:] != (self.num_heads, self.head_dim):
            checks.fail(f"`x` must be [..., {self.num_heads}, {self.head_dim}], got shape {tuple(x.shape)}")
        x, scale = nn.dtypes.promote_dtype(x, self.scale, dtype=self.dtype)
        return ops.rms_norm(x, scale, self.eps)


class MLPBlock(nn.Module):
    """Pre-norm residual MLP (samovar.md §2.5): `h + Dropout(fc_out(GELU_erf(fc_in(RMSNorm(h)))))`.

    Reference: `transformer.lns[i]` (-> `norm`) and `transformer.mlps[i].c_fc` / `.c_proj`
    (-> `fc_in` / `fc_out`); both linears have a bias, GELU is the exact erf form.

    Attributes:
      width: E.
      hidden: MLP width (4E in the reference).
      dropout_rate: rate of the output dropout.
      out_init_std: init std of `fc_out` (0.02 / sqrt(2 l) in the reference, samovar.md §5).
    """
    width: int
    hidden: int
    dropout_rate: float = 0.0
    out_init_std: float = 0.02
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.norm = RMSNorm(self.width, **kw, name="norm")
        self.fc_in = dense(self.hidden, name="fc_in", **kw)
        self.fc_out = dense(self.width, name="fc_out", std=self.out_init_std, **kw)
        self.drop = Dropout(self.dropout_rate, position_axis=1)  # keyed by position: padding to P shards changes no mask

    def __call__(self, h: Array, *, deterministic: bool = True) -> Array:
        """[..., E] -> [..., E]; position-wise, so it also serves the recurrent paths."""
        mlp = lambda x: feed_forward(x, self.fc_in, self.fc_out, xla_forms.gelu)  # noqa: E731
        return residual(h, mlp, norm=self.norm, drop=functools.partial(self.drop, deterministic=deterministic))


class ARXTokenizer(nn.Module):
    """ARX tokeniser (`MultiSegmentTokenizer.tokenize`, samovar.md §2.3).

    For target channel c and patch i: endogenous token `en = RMSNorm_en(s_{c,i} W_tok^T + b)`;
    exogenous token: channels mixed at every step of the patch (`u = s W_exC^T + b`, all C channels,
    the target included), then `ex = RMSNorm_ex(u_{c,i} W_exT^T + b)`. Each patch gives
    `[ex_{c,i}, en_{c,i}]` (exogenous first; even token index = exogenous).

    Parameters: `endogenous` (W_tok, P -> E), `channel_mix` (W_exC, C -> C_t), `exogenous`
    (W_exT, P -> E), `endogenous_norm`, `exogenous_norm`. With `univariate=True` (the ablation
    `--univariate 1`, where the reference zeroes the exogenous token) the exogenous path has no
    parameters and the exogenous tokens are exactly 0.

    Attributes:
      patch_len: P.
      num_channels: C (input series).
      num_targets: C_t (the last C_t channels are the targets).
      width: E.
      univariate: exogenous tokens are zero.
    """
    patch_len: int
    num_channels: int
    num_targets: int
    width: int
    univariate: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.endogenous = dense(self.width, name="endogenous", **kw)
        self.endogenous_norm = RMSNorm(self.width, **kw, name="endogenous_norm")
        if not self.univariate:
            self.channel_mix = dense(self.num_targets, name="channel_mix", **kw)
            self.exogenous = dense(self.width, name="exogenous", **kw)
            self.exogenous_norm = RMSNorm(self.width, **kw, name="exogenous_norm")

    def __call__(self, segments: Array) -> Array:
        """Tokenises patches.

        Args:
          segments: [B, C, N, P] normalised, patched series (all C channels).

        Returns:
          [B, C_t, 2N, E] tokens `[ex_0, en_0, ex_1, en_1, ...]` per target channel.
        """
        b, c, n, p = segments.shape
        if c != self.num_channels or p != self.patch_len:
            checks.fail(f"`segments` must be [B, {self.num_channels}, N, {self.patch_len}], got {segments.shape}")
        endo = self.endogenous_norm(self.endogenous(segments[:, c - self.num_targets:]))
        if self.univariate:
            exo = jnp.zeros_like(endo)
        else:
            mixed = self.channel_mix(jnp.transpose(segments, (0, 2, 3, 1)))       # [B, N, P, C_t]
            exo = self.exogenous_norm(self.exogenous(jnp.transpose(mixed, (0, 3, 1, 2))))
        tokens = jnp.stack([exo, endo.astype(exo.dtype)], axis=3)                  # [B, C_t, N, 2, E]
        return tokens.reshape(b, self.num_targets, 2 * n, self.width)


class ARXEmbedding(nn.Module):
    """Additive embeddings of the ARX tokens (samovar.md §2.4 for SAMoVAR/FixedVAR, §7 for LinTrans).

    `with_types=True` (SAMoVAR, FixedVAR): `E[c, t] = position[t // 2] + channel[c, t] + type[t % 2]
    + channel_type[c, t % 2]` (the position table has `max_tokens` rows of which only the first half
    is used, as in the reference). `with_types=False` (LinTrans): `E[c, t] = position[t] +
    channel[c, t]`. Parameters: `position` [max_tokens, E], `channel` [C_t, max_tokens, E] and, with
    types, `type` [2, E], `channel_type` [C_t, 2, E]; all N(0, 0.02^2) at init (samovar.md §5).

    Attributes:
      num_targets: C_t.
      max_tokens: rows of the position tables (2 * maximum number of patches).
      width: E.
      with_types: SAMoVAR layout (True) or LinTrans layout (False).
    """
    num_targets: int
    max_tokens: int
    width: int
    with_types: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        shape = lambda *s: s  # noqa: E731
        self.position = self.param("position", normal002, shape(self.max_tokens, self.width), self.param_dtype)
        self.channel = self.param("channel", normal002, shape(self.num_targets, self.max_tokens, self.width),
                                  self.param_dtype)
        if self.with_types:
            self.type = self.param("type", normal002, shape(2, self.width), self.param_dtype)
            self.channel_type = self.param("channel_type", normal002, shape(self.num_targets, 2, self.width),
                                           self.param_dtype)

    def __call__(self, positions: Array) -> Array:
        """Embeddings of the tokens at absolute token indices `positions`.

        Args:
          positions: [T] int token indices (< max_tokens: a concrete index past the table raises;
            a traced one would read jnp.take's NaN fill).

        Returns:
          [C_t, T, E].
        """
        try:
            concrete = np.asarray(positions)
        except jax.errors.TracerArrayConversionError:   # under jit: not checkable here
            concrete = None
        if concrete is not None and concrete.size and (concrete.max() >= self.max_tokens or concrete.min() < 0):
            checks.fail(f"token positions must be in [0, max_tokens={self.max_tokens}), got "
                        f"{int(concrete.min())}..{int(concrete.max())}")
        parity = positions % 2
        pos_index = positions // 2 if self.with_types else positions
        e = jnp.take(self.position, pos_index, axis=0)[None] + jnp.take(self.channel, positions, axis=1)
        if self.with_types:
            e = e + jnp.take(self.type, parity, axis=0)[None] + jnp.take(self.channel_type, parity, axis=1)
        dtype = self.dtype if self.dtype is not None else self.param_dtype
        return e.astype(dtype)


class StructuralMatrix(nn.Module):
    """Invertible per-head structural matrix D = L U (`BatchedInvertibleMatrix`, samovar.md §2.7).

    One parameter `theta` [H, D, D] (`generate_S.LU`), init `N(0,1) sqrt(0.02 / sqrt(D))` (samovar.md §5):
    L = I + strict_lower(theta), U = strict_upper(theta) + diag(softplus(diag theta)).

    Attributes:
      num_heads: H.
      head_dim: D.
      inverse: False -> D (the released forward); True -> D^-1 via two triangular solves (the paper's
        reading, never used by the released code).
    """
    num_heads: int
    head_dim: int
    inverse: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        scale = math.sqrt(0.02 / math.sqrt(self.head_dim))

        def init(key, shape, dtype):
            return scale * jax.random.normal(key, shape, dtype)

        self.theta = self.param("theta", init, (self.num_heads, self.head_dim, self.head_dim), self.param_dtype)

    def matrix(self) -> Array:
        """The matrix applied on the row-vector side, [H, D, D]: D or D^-1 (computed in float32)."""
        theta = self.theta.astype(jnp.promote_types(self.param_dtype, jnp.float32))
        return ops.structural_matrix_inverse(theta) if self.inverse else ops.structural_matrix(theta)

    def __call__(self, x: Array) -> Array:
        """Row-vector product per head, `einsum('...hd,hde->...he')`: x [..., H, D] -> [..., H, D]."""
        m = self.matrix()
        dtype = self.dtype if self.dtype is not None else jnp.promote_types(x.dtype, self.param_dtype)
        return ops.per_head_product(x.astype(dtype), m.astype(dtype))
