"""Flax (Linen) layers of SAMoVAR and its baselines (Lu & Yang, ICML 2025, arXiv:2502.07244).

The layers own parameters only; the maths is in `samovar_jax.ops`. Section numbers refer to the
project spec `samovar.md` (which follows the released code, LJC-FVNR/Structural-Aligned-Mixture-of-VAR
@ 4e2581f); the reference module each layer replaces is named in its docstring, and
`samovar_jax.convert` maps the reference state_dict onto these parameter names.

Layers:

* `RMSNorm` (gain [E], eps 1e-5) and `MultiHeadRMSNorm` (gain [H, D], eps 1e-8) (spec §1).
* `MLPBlock`: pre-norm residual MLP `h + Dropout(W2 GELU(W1 RMSNorm(h)))` (spec §2.5).
* `ARXTokenizer`: exogenous/endogenous token pairs of every patch (spec §2.3).
* `ARXEmbedding`: additive position / channel / type embeddings (spec §2.4; LinTrans §7).
* `VARChain`: the VAR attention stack, q/v from x0 by projection (SAMoVAR) or fixed tables
  (FixedVAR, §8), key = previous layer output (spec §2.6), with `__call__` / `scan` / `step` /
  `init_state` on one parameter tree.
* `StructuralMatrix`: the LU-parameterised invertible per-head matrix D (spec §2.7).
* `LinearAttentionBlock`: the LinTrans pre-norm causal linear-attention block (spec §7), also with
  `__call__` / `scan` / `step` / `init_state`; `LinTransBlock` = attention block + MLP block.

dtype policy: every parameterised layer has `dtype` (compute; None = promote inputs and params) and
`param_dtype` (float32). Norms compute in float32 and cast back (as the reference); attention sums
and recurrent states are float32 (see `ops`).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from samovar_jax import ops

Array = jax.Array

FORMS = ("parallel", "chunked", "recurrent")

# spec §5: every nn.Linear weight N(0, 0.02^2), bias 0; embeddings N(0, 0.02^2).
_normal002 = nn.initializers.normal(0.02)


def dense(features: int, *, name: str, dtype, param_dtype, use_bias: bool = True, std: float = 0.02):
    """nn.Dense with the reference init: kernel N(0, std^2), bias 0 (spec §5)."""
    return nn.Dense(features, use_bias=use_bias, kernel_init=nn.initializers.normal(std),
                    bias_init=nn.initializers.zeros, dtype=dtype, param_dtype=param_dtype, name=name)


def _check_form(form: str, chunk_size: int) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _check_dropout(rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {rate}")


def _dropout_mask(module: nn.Module, rate: float, shape, train: bool) -> Optional[Array]:
    """Inverted-dropout multiplier (1/(1-rate) or 0), or None when dropout is off."""
    if not train or rate == 0.0:
        return None
    keep = 1.0 - rate
    return jax.random.bernoulli(module.make_rng("dropout"), keep, shape).astype(jnp.float32) / keep


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
            raise ValueError(f"x must be [..., {self.features}], got shape {tuple(x.shape)}")
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
            raise ValueError(f"x must be [..., {self.num_heads}, {self.head_dim}], got shape "
                             f"{tuple(x.shape)}")
        x, scale = nn.dtypes.promote_dtype(x, self.scale, dtype=self.dtype)
        return ops.rms_norm(x, scale, self.eps)


class MLPBlock(nn.Module):
    """Pre-norm residual MLP (spec §2.5): `h + Dropout(fc_out(GELU_erf(fc_in(RMSNorm(h)))))`.

    Reference: `transformer.lns[i]` (-> `norm`) and `transformer.mlps[i].c_fc` / `.c_proj`
    (-> `fc_in` / `fc_out`); both linears have a bias, GELU is the exact erf form.

    Attributes:
      width: E.
      hidden: MLP width (4E in the reference).
      dropout: rate of the output dropout.
      out_init_std: init std of `fc_out` (0.02 / sqrt(2 l) in the reference, spec §5).
    """
    width: int
    hidden: int
    dropout: float = 0.0
    out_init_std: float = 0.02
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_dropout(self.dropout)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.norm = RMSNorm(self.width, **kw, name="norm")
        self.fc_in = dense(self.hidden, name="fc_in", **kw)
        self.fc_out = dense(self.width, name="fc_out", std=self.out_init_std, **kw)
        self.drop = nn.Dropout(self.dropout)

    def __call__(self, h: Array, *, train: bool = False) -> Array:
        """[..., E] -> [..., E]; position-wise, so it also serves the recurrent paths."""
        y = self.fc_out(nn.gelu(self.fc_in(self.norm(h)), approximate=False))
        return h + self.drop(y, deterministic=not train)


class ARXTokenizer(nn.Module):
    """ARX tokeniser (`MultiSegmentTokenizer.tokenize`, spec §2.3).

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
        if not 1 <= self.num_targets <= self.num_channels:
            raise ValueError(f"num_targets must be in [1, num_channels={self.num_channels}], got "
                             f"{self.num_targets}")
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
            raise ValueError(f"segments must be [B, {self.num_channels}, N, {self.patch_len}], got "
                             f"{segments.shape}")
        endo = self.endogenous_norm(self.endogenous(segments[:, c - self.num_targets:]))
        if self.univariate:
            exo = jnp.zeros_like(endo)
        else:
            mixed = self.channel_mix(jnp.transpose(segments, (0, 2, 3, 1)))       # [B, N, P, C_t]
            exo = self.exogenous_norm(self.exogenous(jnp.transpose(mixed, (0, 3, 1, 2))))
        tokens = jnp.stack([exo, endo.astype(exo.dtype)], axis=3)                  # [B, C_t, N, 2, E]
        return tokens.reshape(b, self.num_targets, 2 * n, self.width)


class ARXEmbedding(nn.Module):
    """Additive embeddings of the ARX tokens (spec §2.4 for SAMoVAR/FixedVAR, §7 for LinTrans).

    `with_types=True` (SAMoVAR, FixedVAR): `E[c, t] = position[t // 2] + channel[c, t] + type[t % 2]
    + channel_type[c, t % 2]` (the position table has `max_tokens` rows of which only the first half
    is used, as in the reference). `with_types=False` (LinTrans): `E[c, t] = position[t] +
    channel[c, t]`. Parameters: `position` [max_tokens, E], `channel` [C_t, max_tokens, E] and, with
    types, `type` [2, E], `channel_type` [C_t, 2, E]; all N(0, 0.02^2) at init (spec §5).

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
        self.position = self.param("position", _normal002, shape(self.max_tokens, self.width), self.param_dtype)
        self.channel = self.param("channel", _normal002, shape(self.num_targets, self.max_tokens, self.width),
                                  self.param_dtype)
        if self.with_types:
            self.type = self.param("type", _normal002, shape(2, self.width), self.param_dtype)
            self.channel_type = self.param("channel_type", _normal002, shape(self.num_targets, 2, self.width),
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
        if concrete is not None and concrete.size and (
                concrete.max() >= self.max_tokens or concrete.min() < 0):
            raise ValueError(f"token positions must be in [0, max_tokens={self.max_tokens}), got "
                             f"{int(concrete.min())}..{int(concrete.max())}")
        parity = positions % 2
        pos_index = positions // 2 if self.with_types else positions
        e = jnp.take(self.position, pos_index, axis=0)[None] + jnp.take(self.channel, positions, axis=1)
        if self.with_types:
            e = e + jnp.take(self.type, parity, axis=0)[None] + jnp.take(self.channel_type, parity, axis=1)
        dtype = self.dtype if self.dtype is not None else self.param_dtype
        return e.astype(dtype)


class _ProjectedQV(nn.Module):
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
            self.key = self.param("key", _normal002, (self.width, self.width), self.param_dtype)

    def __call__(self, x0: Array) -> tuple[Array, Array]:
        """x0 [B, T, E] -> q, v [B, T, H, D]."""
        split = lambda y: y.reshape(y.shape[:-1] + (self.num_heads, -1))  # noqa: E731
        q, v = split(self.query(x0)), split(self.value(x0))
        if self.use_qv_norm:
            q, v = self.query_norm(q), self.value_norm(v)
        return q, v

    def key_kernel(self) -> Array:
        """[E, E] matrix of the key map (row-vector layout); only with use_key_proj."""
        return self.key


class _FixedQV(nn.Module):
    """One FixedVAR layer (`transformer.attn[m].fixed_q / fixed_v`, spec §8): free per-(channel,
    token) queries and values, tables `query` / `value` [C_t, max_tokens, H, D], 0.02 N(0,1) init."""
    num_channels: int
    max_tokens: int
    num_heads: int
    head_dim: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        shape = (self.num_channels, self.max_tokens, self.num_heads, self.head_dim)
        self.query = self.param("query", _normal002, shape, self.param_dtype)
        self.value = self.param("value", _normal002, shape, self.param_dtype)

    def __call__(self, positions: Array, batch: int) -> tuple[Array, Array]:
        """Tables at token indices `positions` [T] for folded rows (row = b * C_t + c): q, v [B', T, H, D]."""
        def rows(table):
            t = jnp.take(table, positions, axis=1)                                 # [C_t, T, H, D]
            t = jnp.tile(t, (batch // self.num_channels, 1, 1, 1))
            return t if self.dtype is None else t.astype(self.dtype)
        return rows(self.query), rows(self.value)


class VARChain(nn.Module):
    """The VAR attention stack of SAMoVAR / FixedVAR (`Transformer` with `use_AR_structure=True`,
    spec §2.6), as a parameter owner around `ops.var_chain_*`.

    Queries and values of every layer come from the first-layer input x0: projected and per-head
    RMS-normalised (`qv_source='projection'`, SAMoVAR) or read from per-(channel, position) tables
    (`qv_source='fixed'`, FixedVAR). Layer m's key is layer m-1's raw output (layer 1: x0), with no
    W_k (unless `use_key_proj`, the "w/ W_k" ablation), no norm, no residual; each layer output goes
    through dropout before it becomes the next key. Outputs are returned per layer; the model sums
    them (the mixture over layers).

    Parameters: `layer_00`, `layer_01`, ... each holding `query`, `value` (+ `query_norm`,
    `value_norm`, `key`) -- Dense/norm modules for SAMoVAR, [C_t, max_tokens, H, D] tables for FixedVAR.

    Entry points on one parameter tree:
      `__call__(x0, ...)` -> o [L, B, T, H, D] (form chosen by `form`);
      `scan(x0, state, ...)` -> (o, final state) (chunked or recurrent);
      `step(state, x0_t, position, ...)` -> (o_t [L, B, H, D], state);
      `init_state(batch)` -> zeros [L, B, H, D, D].

    Attributes:
      width: E.
      num_heads: H (D = E / H).
      num_layers: L.
      qv_source: 'projection' (SAMoVAR) or 'fixed' (FixedVAR).
      use_qv_norm: per-head RMSNorm on q and v (SAMoVAR; "w/o QV Norm" ablation = False).
      use_key_proj: bias-free W_k (E x E) on every key ("w/ W_k" ablation; SAMoVAR only).
      num_channels: C_t, rows are folded as b * C_t + c (needed by 'fixed').
      max_tokens: table length for 'fixed' (128 in the reference).
      dropout: rate of the dropout on every layer output.
      form: 'parallel' (masked), 'chunked' or 'recurrent' for `__call__`.
      chunk_size: chunk length of the chunked form.
    """
    width: int
    num_heads: int
    num_layers: int
    qv_source: str = "projection"
    use_qv_norm: bool = True
    use_key_proj: bool = False
    num_channels: int = 1
    max_tokens: int = 128
    dropout: float = 0.0
    form: str = "parallel"
    chunk_size: int = 64
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_dropout(self.dropout)
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {self.num_heads}, "
                             f"{self.num_layers}")
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        _check_form(self.form, self.chunk_size)
        if self.qv_source == "projection":
            self.layers = [
                _ProjectedQV(self.width, self.num_heads, self.use_qv_norm, self.use_key_proj,
                             dtype=self.dtype, param_dtype=self.param_dtype, name=f"layer_{m:02d}")
                for m in range(self.num_layers)]
        elif self.qv_source == "fixed":
            if self.use_key_proj or self.use_qv_norm:
                raise ValueError("qv_source='fixed' (FixedVAR) has no q/v norms and no key projection: "
                                 "set use_qv_norm=False and use_key_proj=False")
            self.layers = [
                _FixedQV(self.num_channels, self.max_tokens, self.num_heads, self.width // self.num_heads,
                         dtype=self.dtype, param_dtype=self.param_dtype, name=f"layer_{m:02d}")
                for m in range(self.num_layers)]
        else:
            raise ValueError(f"qv_source must be 'projection' or 'fixed', got {self.qv_source!r}")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def _compute_dtype(self, x):
        return self.dtype if self.dtype is not None else jnp.promote_types(x.dtype, self.param_dtype)

    def project(self, x0: Array, positions: Array) -> tuple[Array, Array, Array, Optional[Array]]:
        """Per-layer operands of the chain.

        Args:
          x0: [B, T, E] VAR observations (B = batch x C_t, folded).
          positions: [T] absolute token indices (used by FixedVAR's tables).

        Returns:
          (x0 split into heads [B, T, H, D], q [L, B, T, H, D], v [L, B, T, H, D],
           key kernels [L, E, E] or None).
        """
        if x0.ndim != 3 or x0.shape[-1] != self.width:
            raise ValueError(f"x0 must be [B, T, {self.width}], got {x0.shape}")
        dtype = self._compute_dtype(x0)
        x0 = x0.astype(dtype)
        if self.qv_source == "projection":
            qv = [layer(x0) for layer in self.layers]
        else:
            if x0.shape[0] % self.num_channels:
                raise ValueError(f"FixedVAR rows must be batch x {self.num_channels} channels, got {x0.shape[0]}")
            qv = [layer(positions, x0.shape[0]) for layer in self.layers]
        q = jnp.stack([a.astype(dtype) for a, _ in qv])
        v = jnp.stack([b.astype(dtype) for _, b in qv])
        kernels = None
        if self.use_key_proj:
            kernels = jnp.stack([layer.key_kernel() for layer in self.layers]).astype(dtype)
        xh = x0.reshape(x0.shape[:2] + (self.num_heads, self.head_dim))
        return xh, q, v, kernels

    def init_state(self, batch: int) -> Array:
        """Zero per-layer states [L, B, H, D, D] (float32)."""
        return ops.var_chain_init_state(self.num_layers, batch, self.num_heads, self.head_dim)

    def __call__(self, x0: Array, *, positions: Optional[Array] = None, train: bool = False) -> Array:
        """Parallel use of the chain (form per `form`).

        Args:
          x0: [B, T, E].
          positions: [T] token indices (default 0..T-1).
          train: dropout on.

        Returns:
          o [L, B, T, H, D].
        """
        if positions is None:
            positions = jnp.arange(x0.shape[1])
        xh, q, v, kernels = self.project(x0, positions)
        mask = _dropout_mask(self, self.dropout, q.shape, train)
        if self.form == "parallel":
            return ops.var_chain_parallel(xh, q, v, key_kernels=kernels, dropout_mask=mask)
        if self.form == "chunked":
            return ops.var_chain_chunked(xh, q, v, self.chunk_size, key_kernels=kernels, dropout_mask=mask)[0]
        return ops.var_chain_recurrent(xh, q, v, key_kernels=kernels, dropout_mask=mask)[0]

    def scan(self, x0: Array, state: Optional[Array] = None, *, positions: Optional[Array] = None,
             train: bool = False) -> tuple[Array, Array]:
        """Stateful use: continues from `state` and returns the final state.

        Uses `ops.var_chain_recurrent` when `form == 'recurrent'`, else `ops.var_chain_chunked`.

        Args:
          x0: [B, T, E]; state: [L, B, H, D, D] or None (zeros); positions: [T] (default 0..T-1).

        Returns:
          (o [L, B, T, H, D], final state [L, B, H, D, D]).
        """
        if positions is None:
            positions = jnp.arange(x0.shape[1])
        xh, q, v, kernels = self.project(x0, positions)
        mask = _dropout_mask(self, self.dropout, q.shape, train)
        if self.form == "recurrent":
            return ops.var_chain_recurrent(xh, q, v, state=state, key_kernels=kernels, dropout_mask=mask)
        return ops.var_chain_chunked(xh, q, v, self.chunk_size, state=state, key_kernels=kernels,
                                     dropout_mask=mask)

    def step(self, state: Array, x0_t: Array, position: Array, *, train: bool = False) -> tuple[Array, Array]:
        """One token: state [L, B, H, D, D], x0_t [B, E], position [] int -> (o_t [L, B, H, D], state).

        Returns (output, state) like `scan` (style.md: attention layers return `(y, state)`); the ops'
        `var_chain_step` keeps the scan-carry order `(state, y)`.
        """
        xh, q, v, kernels = self.project(x0_t[:, None], jnp.reshape(position, (1,)))
        mask = _dropout_mask(self, self.dropout, q[:, :, 0].shape, train)
        state, o_t = ops.var_chain_step(state, xh[:, 0], q[:, :, 0], v[:, :, 0], key_kernels=kernels,
                                        dropout_mask_t=mask)
        return o_t, state


class StructuralMatrix(nn.Module):
    """Invertible per-head structural matrix D = L U (`BatchedInvertibleMatrix`, spec §2.7).

    One parameter `theta` [H, D, D] (`generate_S.LU`), init `N(0,1) sqrt(0.02 / sqrt(D))` (spec §5):
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
        return jnp.einsum("...hd,hde->...he", x.astype(dtype), m.astype(dtype))


class LinearAttentionBlock(nn.Module):
    """Pre-norm causal linear-attention residual block of LinTrans (`Autoregressive.LinearAttention`
    with `transformer.pns[i]`, spec §7): `h + Dropout(out(LinAttn(q(u), k(Dropout(u)), v(u))))`,
    `u = RMSNorm(h)`. q/k/v/out are E x E with bias; no norms, no feature map, no normaliser;
    the dropout acts on the key input and on the output.

    Parameters: `norm`, `query`, `key`, `value`, `out`.

    Entry points: `__call__(h)`, `scan(h, state)`, `step(state, h_t)`, `init_state(batch)`.

    Attributes:
      width: E.
      num_heads: H.
      dropout: rate.
      out_init_std: init std of `out` (0.02 / sqrt(2 l) in the reference).
      form: 'parallel', 'chunked' or 'recurrent' for `__call__`.
      chunk_size: chunk length of the chunked form.
    """
    width: int
    num_heads: int
    dropout: float = 0.0
    out_init_std: float = 0.02
    form: str = "parallel"
    chunk_size: int = 64
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_dropout(self.dropout)
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        _check_form(self.form, self.chunk_size)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.norm = RMSNorm(self.width, **kw, name="norm")
        self.query = dense(self.width, name="query", **kw)
        self.key = dense(self.width, name="key", **kw)
        self.value = dense(self.width, name="value", **kw)
        self.out = dense(self.width, name="out", std=self.out_init_std, **kw)
        self.drop = nn.Dropout(self.dropout)

    def _qkv(self, h, train):
        split = lambda y: y.reshape(y.shape[:-1] + (self.num_heads, -1))  # noqa: E731
        u = self.norm(h)
        return (split(self.query(u)), split(self.key(self.drop(u, deterministic=not train))),
                split(self.value(u)))

    def _finish(self, h, o, train):
        o = o.reshape(o.shape[:-2] + (self.width,))
        return h + self.drop(self.out(o), deterministic=not train)

    def init_state(self, batch: int) -> Array:
        """Zero state [B, H, D, D] (float32)."""
        d = self.width // self.num_heads
        return ops.linear_attention_init_state(batch, self.num_heads, d, d)

    def __call__(self, h: Array, *, train: bool = False) -> Array:
        """h [B, T, E] -> [B, T, E]."""
        q, k, v = self._qkv(h, train)
        if self.form == "parallel":
            o = ops.linear_attention_parallel(q, k, v)
        elif self.form == "chunked":
            o = ops.linear_attention_chunked(q, k, v, self.chunk_size)[0]
        else:
            o = ops.linear_attention_recurrent(q, k, v)[0]
        return self._finish(h, o, train)

    def scan(self, h: Array, state: Optional[Array] = None, *, train: bool = False) -> tuple[Array, Array]:
        """h [B, T, E], state [B, H, D, D] or None -> (h' [B, T, E], final state)."""
        q, k, v = self._qkv(h, train)
        if self.form == "recurrent":
            o, state = ops.linear_attention_recurrent(q, k, v, state)
        else:
            o, state = ops.linear_attention_chunked(q, k, v, self.chunk_size, state)
        return self._finish(h, o, train), state

    def step(self, state: Array, h_t: Array, *, train: bool = False) -> tuple[Array, Array]:
        """state [B, H, D, D], h_t [B, E] -> (h'_t [B, E], state), the order of `scan`."""
        q, k, v = self._qkv(h_t, train)
        state, o = ops.linear_attention_step(state, q, k, v)
        return self._finish(h_t, o, train), state


class LinTransBlock(nn.Module):
    """One LinTrans layer (spec §7): `h += attention(h)` then `h += mlp(h)`, both pre-norm residual.

    Parameters: `attention` (`LinearAttentionBlock`), `mlp` (`MLPBlock`).

    Attributes:
      width: E.
      num_heads: H.
      hidden: MLP width.
      dropout: rate.
      out_init_std: init std of the attention `out` and MLP `fc_out` (0.02 / sqrt(2 l)).
      form, chunk_size: as in `LinearAttentionBlock`.
    """
    width: int
    num_heads: int
    hidden: int
    dropout: float = 0.0
    out_init_std: float = 0.02
    form: str = "parallel"
    chunk_size: int = 64
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_dropout(self.dropout)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.attention = LinearAttentionBlock(self.width, self.num_heads, self.dropout, self.out_init_std,
                                              self.form, self.chunk_size, **kw, name="attention")
        self.mlp = MLPBlock(self.width, self.hidden, self.dropout, self.out_init_std, **kw, name="mlp")

    def init_state(self, batch: int) -> Array:
        """Zero attention state [B, H, D, D]."""
        return self.attention.init_state(batch)

    def __call__(self, h: Array, *, train: bool = False) -> Array:
        """h [B, T, E] -> [B, T, E]."""
        return self.mlp(self.attention(h, train=train), train=train)

    def scan(self, h: Array, state: Optional[Array] = None, *, train: bool = False) -> tuple[Array, Array]:
        """h [B, T, E], state [B, H, D, D] or None -> (h' [B, T, E], final state)."""
        h, state = self.attention.scan(h, state, train=train)
        return self.mlp(h, train=train), state

    def step(self, state: Array, h_t: Array, *, train: bool = False) -> tuple[Array, Array]:
        """state [B, H, D, D], h_t [B, E] -> (h'_t [B, E], state), the order of `scan`."""
        h_t, state = self.attention.step(state, h_t, train=train)
        return self.mlp(h_t, train=train), state
