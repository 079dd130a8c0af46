"""Causal attention layers of SAMoVAR and LinTrans (Lu & Yang, ICML 2025, arXiv:2502.07244).

Every layer follows the zoo's layer contract (README "Layer contract") on one parameter tree:
`__call__(x, *, mask=None, deterministic=True) -> (y, aux)` (the parallel form, or the chunked form
when `chunk_size` is an int), `init_state(batch_size) -> State`,
`scan(x, state=None, *, mask=None, deterministic=True) -> (y, state)` (the token recurrence) and
`step(state, x_t) -> (y_t, state)`. The maths is the zoo's causal linear attention
without normaliser (`zoo_core.ops.linear_attention`, denominator=False), whose `jnp.where` masking keeps
padded and future positions (NaN or 1e30 included) out of every valid, past output.

* `LinearAttention`: bare causal linear attention, query/key/value/out projections, no norm and no
  residual (a drop-in attention layer); state `LinearState`.
* `LinTransBlock`: one LinTrans layer (samovar.md §7), pre-norm `LinearAttention` + residual, then the
  pre-norm MLP block; state `LinearState`.
* `VARChain`: the VAR attention stack of SAMoVAR / FixedVAR (samovar.md §2.6): q, v from x0, key of layer
  m = output of layer m-1; state `VARChainState`.

Packed rows: `__call__`, `scan` (and `global_self`, `layer_outputs`) take `segment_ids` `[B, T]` (int, 0 =
padding, `zoo_core.ops.packing`): every state is cut at each document start, so a packed row gives each
document's own outputs (docs/samovar_packing.md). `sequence_axis` splits `__call__` over a mesh axis
(`zoo_core.ops.context_parallel`, `samovar_jax.context_parallel` for the chain); `prefill(x, state)` is
`scan`'s numbers in that form (a prompt over P devices, its final state replicated for `step`). `step` decodes one
document: a new document is a new `init_state`. `cross` takes no segment ids (zoo_core's global form
has no per-document cross-attention yet).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from samovar_jax import context_parallel as var_context_parallel
from samovar_jax import ops
from samovar_jax.modules import MLPBlock, MultiHeadRMSNorm, RMSNorm, dense, normal002
from zoo_core import checks
from zoo_core.ops import context_parallel, linear_attention, packing, xla_forms
from zoo_core.ops.dropout import Dropout, keep_mask
from zoo_core.ops.linear_attention import LinearState

Array = jax.Array
Initializer = Callable[..., Array]


class VARChainState(NamedTuple):
    """Carried state of `VARChain`.

    Attributes:
      num: `[L, B, H, D, D]` float32, per layer m the sum over seen tokens of k^(m-1)_s v^(m)_s^T.
      position: `[]` int32, the number of tokens seen = the absolute position of the next token
        (FixedVAR reads its query/value tables there when no positions are given).
    """

    num: Array
    position: Array


def _dropout_mask(module: nn.Module, rate: float, shape, deterministic: bool) -> Optional[Array]:
    """Inverted-dropout multiplier (1/(1-rate) or 0) of the chain's outputs `shape` [L, B, T, H, D]
    drawn from the 'dropout' rng, or None (`zoo_core.ops.dropout`'s cheap bits, keyed by position T:
    padding to P shards changes no mask)."""
    if deterministic or rate == 0.0:
        return None
    keep = 1.0 - rate
    mask = keep_mask(module.make_rng("dropout"), keep, shape, position_axis=2)
    return jnp.where(mask, jnp.float32(1.0 / keep), 0.0)


def _split_heads(y: Array, num_heads: int) -> Array:
    return y.reshape(y.shape[:-1] + (num_heads, -1))


class _OutProjection(nn.Module):
    """Dense `kernel` [H*D, F], `bias` [F] whose width F is given at call time (the input width by
    default, known only when the layer is called)."""
    kernel_init: Initializer
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, y: Array, features: int) -> Array:
        kernel = self.param("kernel", self.kernel_init, (y.shape[-1], features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        y, kernel, bias = nn.dtypes.promote_dtype(y, kernel, bias, dtype=self.dtype)
        # A 2-D matmul, as zoo_core.ops.xla_forms.Dense (its gradient needs no transposed copy of y).
        return xla_forms.matmul(y, kernel, bias=bias)


class LinearAttention(nn.Module):
    """Causal linear attention without normaliser (LinTrans, samovar.md §7; `Autoregressive.LinearAttention`):
    `y_t = out(sum_{s<=t} (q_t . k_s) v_s)` per head, with `q = query(x)`, `k = key(Dropout(x))`,
    `v = value(x)`; no scale, no feature map, no norm, no residual.

    Parameters: `query`, `key`, `value` (Dense E -> H*D with bias) and `out` (Dense H*D -> E_out).

    Attributes:
      num_heads: H.
      head_dim: D (queries, keys and values).
      out_features: E_out; None = the input width E.
      chunk_size: None = `__call__` uses the parallel form; an int C >= 1 = the chunked form.
      dropout_rate: dropout on the key projection's input (as the reference; the block drops the output).
      kernel_init, out_kernel_init: initialisers of the q/k/v and of the out kernels (N(0, 0.02^2),
        samovar.md §5; LinTrans uses 0.02 / sqrt(2 l) for `out`); biases start at 0.
      dtype: compute dtype (None: promote inputs and parameters); sums and states stay float32.
      param_dtype: parameter dtype.
      sequence_axis: the mesh axis one sequence is split over (context parallelism,
        `zoo_core.ops.context_parallel`): `__call__` and `global_self` then run under `jax.shard_map`, called
        under `jax.set_mesh(mesh)` with T divisible by the axis size, and give one device's numbers
        (`chunk_size` None: each shard one chunk). `scan`, `step` (decoding) and `cross` are one device's
        forms whatever it is. None: one device.
    """
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    chunk_size: Optional[int] = None
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = normal002
    out_kernel_init: Initializer = normal002
    sequence_axis: Optional[str] = None

    def setup(self):
        checks.check_chunk_size(self.chunk_size)
        _check_sequence_axis(self.sequence_axis)
        proj = lambda name: xla_forms.Dense(  # noqa: E731
            self.num_heads * self.head_dim, kernel_init=self.kernel_init, bias_init=nn.initializers.zeros,
            dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        self.query, self.key, self.value = proj("query"), proj("key"), proj("value")
        self.out = _OutProjection(self.out_kernel_init, self.dtype, self.param_dtype, name="out")
        self.key_dropout = Dropout(self.dropout_rate, position_axis=1)  # keyed by position: padding to P shards changes no mask

    def _qkv(self, x: Array, deterministic: bool, x_kv: Optional[Array] = None):
        """Queries from x, keys (their input dropped out) and values from x_kv (default x), per head."""
        x_kv = x if x_kv is None else x_kv
        k = self.key(self.key_dropout(x_kv, deterministic=deterministic))
        return tuple(_split_heads(y, self.num_heads) for y in (self.query(x), k, self.value(x_kv)))

    def _out(self, num: Array, x: Array) -> Array:
        dtype = self.dtype if self.dtype is not None else jnp.promote_types(x.dtype, self.param_dtype)
        num = num.astype(dtype).reshape(num.shape[:-2] + (-1,))
        return self.out(num, self.out_features or x.shape[-1])

    def cross(self, x: Array, memory: Array, *, memory_mask: Optional[Array] = None,
              query_mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
              kv_segment_ids: Optional[Array] = None, deterministic: bool = True) -> Array:
        """Global (non-causal) linear attention without normaliser on this layer's parameters:
        x [B, T, E] attends to every valid token of memory [B, S, E_m] (memory_mask [B, S],
        query_mask [B, T], True = valid) -> y [B, T, E_out] (`linear_attention.noncausal`); packed
        (`segment_ids` [B, T] and `kv_segment_ids` [B, S], both or neither), a query reads only its
        own document's memory."""
        checks.check_tokens("x", x, "[B, T, E]")
        checks.check_tokens("memory", memory, "[B, S, E_m]")
        if memory.shape[0] != x.shape[0]:
            checks.fail(f"`memory` [B, S, E_m] must have x's batch {x.shape[0]}, got shape {memory.shape}")
        if (segment_ids is None) != (kv_segment_ids is None):
            checks.fail("packed cross-attention takes both `segment_ids` [B, T] and `kv_segment_ids` [B, S]")
        q, k, v = self._qkv(x, deterministic, memory)
        num, _ = linear_attention.noncausal(q, k, v, mask=memory_mask, query_mask=query_mask,
                                            segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
        return self._out(num, x)

    def global_self(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                    deterministic: bool = True) -> Array:
        """Global (non-causal) self-attention: x [B, T, E] (mask [B, T], segment_ids [B, T] packed
        documents, 0 = padding) -> y [B, T, E_out]; over `sequence_axis` when set."""
        checks.check_tokens("x", x, "[B, T, E]")
        q, k, v = self._qkv(x, deterministic)
        if self.sequence_axis is None:
            num, _ = linear_attention.noncausal(q, k, v, mask=mask, query_mask=mask, segment_ids=segment_ids)
        else:
            num, _ = context_parallel.noncausal(q, k, v, axis_name=self.sequence_axis, mask=mask,
                                                query_mask=mask, segment_ids=segment_ids)
        return self._out(num, x)

    def init_state(self, batch_size: int) -> LinearState:
        """Zero state: num [B, H, D, D] float32, den None."""
        return linear_attention.init_state(batch_size, self.num_heads, self.head_dim, self.head_dim)

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x [B, T, E], mask [B, T] (True = valid), segment_ids [B, T] (packed documents, 0 = padding;
        `zoo_core.ops.packing`) -> (y [B, T, E_out], {}); over `sequence_axis` when set."""
        checks.check_tokens("x", x, "[B, T, E]")
        q, k, v = self._qkv(x, deterministic)
        if self.sequence_axis is not None:
            num, _ = context_parallel.causal(q, k, v, chunk_size=self.chunk_size or x.shape[1],
                                             axis_name=self.sequence_axis, mask=mask, segment_ids=segment_ids)
        elif self.chunk_size is None:
            num, _ = linear_attention.causal_parallel(q, k, v, mask=mask, segment_ids=segment_ids)
        else:
            num, _, _ = linear_attention.causal_chunked(q, k, v, chunk_size=self.chunk_size, mask=mask,
                                                        segment_ids=segment_ids)
        return self._out(num, x), {}

    def scan(self, x: Array, state: Optional[LinearState] = None, *, mask: Optional[Array] = None,
             segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, LinearState]:
        """Token recurrence from `state` (zeros if None): x [B, T, E] -> (y [B, T, E_out], final state).
        Packed (`segment_ids` [B, T]): the state restarts at each document start, `state` is read by
        each row's first document and the final state is the last document's."""
        checks.check_tokens("x", x, "[B, T, E]")
        q, k, v = self._qkv(x, deterministic)
        num, _, state = linear_attention.causal_scan(q, k, v, state=state, mask=mask, segment_ids=segment_ids)
        return self._out(num, x), state

    def prefill(self, x: Array, state: Optional[LinearState] = None, *, mask: Optional[Array] = None,
                segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, LinearState]:
        """`scan`'s numbers in `__call__`'s form: the chunked form from `state` (zeros if None), over
        `sequence_axis` when set (each shard's fold starts from the state, the final state is the last
        shard's, replicated): x [B, T, E] -> (y [B, T, E_out], final state), from which `step` decodes.
        Packed (`segment_ids`): as `scan`."""
        checks.check_tokens("x", x, "[B, T, E]")
        q, k, v = self._qkv(x, deterministic)
        if self.sequence_axis is not None:
            num, _, state = context_parallel.causal(q, k, v, chunk_size=self.chunk_size or x.shape[1],
                                                    axis_name=self.sequence_axis, mask=mask, segment_ids=segment_ids,
                                                    initial_state=state, return_state=True)
        else:
            num, _, state = linear_attention.causal_chunked(q, k, v, chunk_size=self.chunk_size or x.shape[1],
                                                            state=state, mask=mask, segment_ids=segment_ids)
        return self._out(num, x), state

    def step(self, state: LinearState, x_t: Array) -> tuple[Array, LinearState]:
        """One token (no dropout): state, x_t [B, E] -> (y_t [B, E_out], new state)."""
        checks.check_rank("x_t", x_t, 2, "[B, E]")
        q, k, v = self._qkv(x_t, True)
        num, _, state = linear_attention.causal_step(state, q, k, v)
        return self._out(num, x_t), state


class LinTransBlock(nn.Module):
    """One LinTrans layer (samovar.md §7): `h = x + Dropout(attention(attention_norm(x)))`, then the
    pre-norm residual MLP `h + Dropout(mlp(mlp.norm(h)))`.

    Reference: `transformer.pns[i]` (-> `attention_norm`), `transformer.attn[i].q1 / k1 / v1 / c_proj`
    (-> `attention/query|key|value|out`), `transformer.lns[i]`, `transformer.mlps[i]` (-> `mlp`).

    Attributes:
      width: E.
      num_heads: H (D = E / H).
      hidden: MLP width.
      dropout_rate: dropout on the attention's key input, the attention output and the MLP output.
      out_init_std: init std of the attention `out` and MLP `fc_out` kernels (0.02 / sqrt(2 l)).
      chunk_size: form of `__call__` (None = parallel, int = chunked), as in `LinearAttention`.
      dtype, param_dtype: compute and parameter dtypes.
      sequence_axis: the mesh axis `__call__`'s attention splits the sequence over (as in
        `LinearAttention`; the norms and the MLP act per token); None: one device.
    """
    width: int
    num_heads: int
    hidden: int
    dropout_rate: float = 0.0
    out_init_std: float = 0.02
    chunk_size: Optional[int] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    sequence_axis: Optional[str] = None

    def setup(self):
        checks.check_divisible("width", self.width, "num_heads", self.num_heads)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.attention_norm = RMSNorm(self.width, **kw, name="attention_norm")
        self.attention = LinearAttention(
            self.num_heads, self.width // self.num_heads, chunk_size=self.chunk_size,
            dropout_rate=self.dropout_rate, out_kernel_init=nn.initializers.normal(self.out_init_std),
            sequence_axis=self.sequence_axis, **kw, name="attention")
        self.attention_dropout = Dropout(self.dropout_rate, position_axis=1)
        self.mlp = MLPBlock(self.width, self.hidden, self.dropout_rate, self.out_init_std, **kw, name="mlp")

    def _finish(self, x: Array, y: Array, deterministic: bool) -> Array:
        return self.mlp(x + self.attention_dropout(y, deterministic=deterministic), deterministic=deterministic)

    def init_state(self, batch_size: int) -> LinearState:
        """The attention's zero state."""
        return self.attention.init_state(batch_size)

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x [B, T, E] (segment_ids [B, T]: packed documents) -> (y [B, T, E], aux of the attention)."""
        y, aux = self.attention(self.attention_norm(x), mask=mask, segment_ids=segment_ids,
                                deterministic=deterministic)
        return self._finish(x, y, deterministic), aux

    def scan(self, x: Array, state: Optional[LinearState] = None, *, mask: Optional[Array] = None,
             segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, LinearState]:
        """x [B, T, E], state or None (segment_ids [B, T]: packed) -> (y [B, T, E], final state)."""
        y, state = self.attention.scan(self.attention_norm(x), state, mask=mask, segment_ids=segment_ids,
                                       deterministic=deterministic)
        return self._finish(x, y, deterministic), state

    def step(self, state: LinearState, x_t: Array) -> tuple[Array, LinearState]:
        """state, x_t [B, E] -> (y_t [B, E], new state); no dropout."""
        y, state = self.attention.step(state, self.attention_norm(x_t))
        return self._finish(x_t, y, True), state


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
            self.key = self.param("key", normal002, (self.width, self.width), self.param_dtype)

    def __call__(self, x0: Array, positions: Optional[Array]) -> tuple[Array, Array]:
        """x0 [B, T, E] -> q, v [B, T, H, D] (positions are not read: the caller passes None)."""
        q, v = _split_heads(self.query(x0), self.num_heads), _split_heads(self.value(x0), self.num_heads)
        if self.use_qv_norm:
            q, v = self.query_norm(q), self.value_norm(v)
        return q, v

    def key_kernel(self) -> Array:
        """[E, E] matrix of the key map (row-vector layout); only with use_key_proj."""
        return self.key


class _FixedQV(nn.Module):
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


class VARChain(nn.Module):
    """The VAR attention stack of SAMoVAR / FixedVAR (`Transformer` with `use_AR_structure=True`,
    samovar.md §2.6) around `ops.var_chain_*`.

    Queries and values of every layer come from the first-layer input x0: projected and per-head
    RMS-normalised (`qv_source='projection'`, SAMoVAR) or read from per-(channel, position) tables
    (`qv_source='fixed'`, FixedVAR). Layer m's key is layer m-1's raw output (layer 1: x0), with no
    W_k (unless `use_key_proj`, the "w/ W_k" ablation), no norm, no residual; each layer output goes
    through dropout before it becomes the next key. Outputs are returned per layer, o [L, B, T, H, D];
    the model sums them (the mixture over layers).

    Parameters: `layer_00`, `layer_01`, ... each holding `query`, `value` (+ `query_norm`,
    `value_norm`, `key`): Dense/norm modules for SAMoVAR, [C_t, max_tokens, H, D] tables for FixedVAR.

    `positions` (token indices, [T] or [B, T]) are read only by FixedVAR's tables (default: 0..T-1 for
    `__call__`, `state.position` onwards for `scan` / `step`; packed, each document from 0); giving
    them to a SAMoVAR chain raises. `segment_ids` [B, T] (packed documents, 0 = padding) cut every
    layer's state at each document start (`ops.var_chain_*`).

    Attributes:
      width: E.
      num_heads: H (D = E / H).
      num_layers: L.
      qv_source: 'projection' (SAMoVAR) or 'fixed' (FixedVAR).
      use_qv_norm: per-head RMSNorm on q and v (SAMoVAR; "w/o QV Norm" ablation = False).
      use_key_proj: bias-free W_k (E x E) on every key ("w/ W_k" ablation; SAMoVAR only).
      num_channels: C_t, rows are folded as b * C_t + c (needed by 'fixed').
      max_tokens: table length for 'fixed' (128 in the reference).
      dropout_rate: rate of the dropout on every layer output.
      chunk_size: form of `__call__`: None = parallel (masked), an int C >= 1 = chunked.
      dtype, param_dtype: compute and parameter dtypes; sums and states stay float32.
      sequence_axis: the mesh axis one sequence is split over (`samovar_jax.context_parallel`):
        `__call__` and `layer_outputs` then run the chain under `jax.shard_map`, called under
        `jax.set_mesh(mesh)` with T divisible by the axis size, and give one device's numbers
        (`chunk_size` None: each shard one chunk). `scan` and `step` are one device's forms. None: one device.
    """
    width: int
    num_heads: int
    num_layers: int
    qv_source: str = "projection"
    use_qv_norm: bool = True
    use_key_proj: bool = False
    num_channels: int = 1
    max_tokens: int = 128
    dropout_rate: float = 0.0
    chunk_size: Optional[int] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    sequence_axis: Optional[str] = None

    def setup(self):
        checks.check_divisible("width", self.width, "num_heads", self.num_heads)
        checks.check_choice("qv_source", self.qv_source, ("projection", "fixed"))
        checks.check_chunk_size(self.chunk_size)
        _check_sequence_axis(self.sequence_axis)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        if self.qv_source == "projection":
            self.layers = [_ProjectedQV(self.width, self.num_heads, self.use_qv_norm, self.use_key_proj, **kw,
                                        name=f"layer_{m:02d}") for m in range(self.num_layers)]
        else:
            if self.use_key_proj or self.use_qv_norm:
                checks.fail("qv_source='fixed' (FixedVAR) has no q/v norms and no key projection: "
                            "set use_qv_norm=False and use_key_proj=False")
            self.layers = [_FixedQV(self.num_channels, self.max_tokens, self.num_heads, self.head_dim, **kw,
                                    name=f"layer_{m:02d}") for m in range(self.num_layers)]

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def _check_x0(self, x0: Array) -> None:
        checks.check_tokens("x0", x0, f"[B, T, {self.width}]")
        if x0.shape[-1] != self.width:
            checks.fail(f"`x0` must be [B, T, {self.width}], got shape {x0.shape}")
        if self.qv_source == "fixed" and x0.shape[0] % self.num_channels:
            checks.fail(f"FixedVAR rows must be batch x {self.num_channels} channels, got {x0.shape[0]}")

    def _positions(self, positions: Optional[Array], start, shape, segment_ids: Optional[Array]
                   ) -> Optional[Array]:
        """FixedVAR's table indices ([T] or [B, T]) for tokens of `shape` [B, T]; None for SAMoVAR."""
        if self.qv_source == "projection":
            if positions is not None:
                checks.fail("`positions` are read by qv_source='fixed' (FixedVAR) only; a SAMoVAR chain does "
                            "not depend on them")
            return None
        if positions is not None:
            if tuple(np.shape(positions)) not in (tuple(shape[1:]), tuple(shape)):
                checks.fail(f"`positions` must be [T] = {tuple(shape[1:])} or [B, T] = {tuple(shape)}, "
                            f"got {tuple(np.shape(positions))}")
            return positions
        if segment_ids is None:
            return start + jnp.arange(shape[1])
        return document_positions(segment_ids, start)

    def project(self, x0: Array, positions: Optional[Array] = None, start=0, segment_ids: Optional[Array] = None):
        """Per-layer operands of the chain.

        Args:
          x0: [B, T, E] VAR observations (B = batch x C_t, folded).
          positions: [T] or [B, T] token indices (FixedVAR only; default start..start+T-1, or each
            document's own from `segment_ids`).
          start: first default position.
          segment_ids: optional [B, T] packed documents (only FixedVAR's default positions read them here).

        Returns:
          (x0 split into heads [B, T, H, D], q [L, B, T, H, D], v [L, B, T, H, D],
           key kernels [L, E, E] or None), in the compute dtype.
        """
        self._check_x0(x0)
        xh, q, v, kernels = self._project_layers(x0, positions, start, segment_ids)
        return xh, jnp.stack(q), jnp.stack(v), kernels

    def _project_layers(self, x0: Array, positions: Optional[Array], start, segment_ids: Optional[Array] = None):
        """`project` with q and v as tuples of L arrays [B, T, H, D] (not stacked)."""
        positions = self._positions(positions, start, x0.shape[:2], segment_ids)
        dtype = self.dtype if self.dtype is not None else jnp.promote_types(x0.dtype, self.param_dtype)
        x0 = x0.astype(dtype)
        qv = [layer(x0, positions) for layer in self.layers]
        kernels = None
        if self.use_key_proj:
            kernels = jnp.stack([layer.key_kernel() for layer in self.layers]).astype(dtype)
        return (_split_heads(x0, self.num_heads), tuple(a.astype(dtype) for a, _ in qv),
                tuple(b.astype(dtype) for _, b in qv), kernels)

    def init_state(self, batch_size: int) -> VARChainState:
        """Zero per-layer states num [L, B, H, D, D] (float32), position 0."""
        num = ops.var_chain_init_state(self.num_layers, batch_size, self.num_heads, self.head_dim)
        return VARChainState(num, jnp.zeros((), jnp.int32))

    def _sequence_form(self, xh, q, v, **kw):
        """The chain of `__call__` / `layer_outputs` (q, v stacked or per layer): over `sequence_axis`
        when set, else parallel or chunked per `chunk_size`."""
        if self.sequence_axis is not None:
            return var_context_parallel.var_chain(xh, q, v, chunk_size=self.chunk_size or xh.shape[1],
                                                  axis_name=self.sequence_axis, **kw)
        if isinstance(q, tuple):
            return ops.var_chain_layers(xh, q, v, chunk_size=self.chunk_size, **kw)
        if self.chunk_size is None:
            return ops.var_chain_parallel(xh, q, v, **kw)
        return ops.var_chain_chunked(xh, q, v, self.chunk_size, **kw)[0]

    def __call__(self, x0: Array, *, positions: Optional[Array] = None, mask: Optional[Array] = None,
                 segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, dict]:
        """x0 [B, T, E], mask [B, T] (True = valid), segment_ids [B, T] (packed documents) ->
        (o [L, B, T, H, D], {}); form per `chunk_size` and `sequence_axis`."""
        xh, q, v, kernels = self.project(x0, positions, segment_ids=segment_ids)
        drop = _dropout_mask(self, self.dropout_rate, q.shape, deterministic)
        return self._sequence_form(xh, q, v, key_kernels=kernels, dropout_mask=drop, mask=mask,
                                   segment_ids=segment_ids), {}

    def layer_outputs(self, x0: Array, *, positions: Optional[Array] = None, mask: Optional[Array] = None,
                      segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, ...]:
        """`__call__`'s outputs as a tuple of L arrays [B, T, H, D] (`ops.var_chain_layers`): the
        same values, without stacking the layers' operands and outputs along L (for a caller that
        only sums them)."""
        self._check_x0(x0)
        xh, q, v, kernels = self._project_layers(x0, positions, 0, segment_ids)
        drop = _dropout_mask(self, self.dropout_rate, (len(q),) + q[0].shape, deterministic)
        return self._sequence_form(xh, q, v, key_kernels=kernels, dropout_mask=drop, mask=mask,
                                   segment_ids=segment_ids)

    def scan(self, x0: Array, state: Optional[VARChainState] = None, *, positions: Optional[Array] = None,
             mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
             deterministic: bool = True) -> tuple[Array, VARChainState]:
        """Token recurrence from `state` (zeros if None): x0 [B, T, E] -> (o [L, B, T, H, D], final state).

        Packed (`segment_ids` [B, T]): each layer's state restarts at every document start; `state` is
        read by each row's first document, the final state is the last document's, and FixedVAR
        needs `positions` [B, T] (one position in the state cannot follow every row's documents).
        """
        if segment_ids is not None and positions is None and self.qv_source == "fixed":
            checks.fail("a packed FixedVAR `scan` needs `positions` [B, T] (each document's token indices)")
        state = self.init_state(x0.shape[0]) if state is None else state
        xh, q, v, kernels = self.project(x0, positions, state.position, segment_ids)
        drop = _dropout_mask(self, self.dropout_rate, q.shape, deterministic)
        o, num = ops.var_chain_scan(xh, q, v, state=state.num, key_kernels=kernels, dropout_mask=drop, mask=mask,
                                    segment_ids=segment_ids)
        return o, VARChainState(num, state.position + x0.shape[1])

    def prefill(self, x0: Array, state: Optional[VARChainState] = None, *, positions: Optional[Array] = None,
                mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                deterministic: bool = True) -> tuple[Array, VARChainState]:
        """`scan`'s numbers (arguments and results as there) in `__call__`'s form: the chunked chain from
        `state`, over `sequence_axis` when set (every layer's fold starts from its state, the final
        state is the last shard's, replicated), from which `step` decodes."""
        if segment_ids is not None and positions is None and self.qv_source == "fixed":
            checks.fail("a packed FixedVAR `prefill` needs `positions` [B, T] (each document's token indices)")
        state = self.init_state(x0.shape[0]) if state is None else state
        xh, q, v, kernels = self.project(x0, positions, state.position, segment_ids)
        kw = dict(key_kernels=kernels, dropout_mask=_dropout_mask(self, self.dropout_rate, q.shape, deterministic),
                  mask=mask, segment_ids=segment_ids)
        if self.sequence_axis is not None:
            o, num = var_context_parallel.var_chain(xh, q, v, chunk_size=self.chunk_size or xh.shape[1],
                                                    axis_name=self.sequence_axis, initial_state=state.num,
                                                    return_state=True, **kw)
        else:
            o, num = ops.var_chain_chunked(xh, q, v, self.chunk_size or xh.shape[1], state=state.num, **kw)
        return o, VARChainState(num, state.position + x0.shape[1])

    def step(self, state: VARChainState, x0_t: Array, *, position: Optional[Array] = None
             ) -> tuple[Array, VARChainState]:
        """One token (no dropout): x0_t [B, E] -> (o_t [L, B, H, D], new state); position [] (FixedVAR)."""
        checks.check_rank("x0_t", x0_t, 2, f"[B, {self.width}]")
        pos = None if position is None else jnp.reshape(position, (1,))
        xh, q, v, kernels = self.project(x0_t[:, None], pos, state.position)
        num, o_t = ops.var_chain_step(state.num, xh[:, 0], q[:, :, 0], v[:, :, 0], key_kernels=kernels)
        return o_t, VARChainState(num, state.position + 1)


def document_positions(segment_ids: Array, start=0) -> Array:
    """int [B, T]: each token's index within its packed document (`zoo_core.ops.packing`), the first
    document of each row counted from `start` (it may continue an earlier call)."""
    begins = packing.starts(segment_ids)
    t = jnp.arange(segment_ids.shape[1])
    first = jax.lax.cummax(jnp.where(begins, t, 0), axis=1)
    return t - first + jnp.where(packing.first_segment(begins), start, 0)


def _check_sequence_axis(axis) -> None:
    if axis is not None and not isinstance(axis, str):
        checks.fail(f"`sequence_axis` must be a mesh axis name or None, got {axis!r}")
