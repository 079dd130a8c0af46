"""HTGN blocks (htgn.md §5.1, §5.6, §5.8): encoder hybrid block, decoder hybrid + Cross-Graph block,
and the encoder stack, configured by one frozen `BlockConfig`.

Every residual branch is `x + DropPath_l(Dropout(f(LN(x))))` (Pre-LN), or x <- LN(x + branch(x))
with `norm='post'`; DropPath rate p_l = p_0 + (drop_path - p_0) * l / (L - 1), p_0 =
`drop_path_start` (0 by default; the card's schedule is 0.1 -> 0.3):

* `EncoderBlock`: FAVOR+ self-attention (RoPE; globals at position 0) -> WinGAT (window +-w plus g
  global nodes) -> FFN (Dense -> GELU -> Dropout -> Dense);
* `DecoderBlock`: causal FAVOR+ -> causal WinGAT (offsets -w..0, no globals) -> FAVOR+
  cross-attention to the memory (no RoPE) -> Cross-Graph GAT (encoder window of radius w_x around
  c_i = round(rho * i) plus the encoder globals) -> FFN. Its wiring is written once for both
  paths: `block(y, memory, ...) -> (y, aux)` over a teacher-forced sequence, and
  `block.step(state, y_t, memory, position=t) -> (y_t, state)` for one decoding token from its
  `DecoderState` and `DecoderMemory` (`init_cache`; O(1) attention work per token).

Blocks and the encoder return `(y, aux)`, their layers' aux merged (`zoo_core.ops.aux_merge.sum_aux`:
equal keys summed).
The graph layers report the KL term of htgn.md §5.7 as 'kl_sum' and 'kl_count'; the model forms the
loss once from the sums over all layers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from htgn_jax import ops
from htgn_jax.graph_causal import WindowState
from htgn_jax.graph_layers import CrossGraphAttention, CrossGraphCache, WindowGraphAttention
from htgn_jax.layers import FavorAttention
from zoo_core import attention as zoo_attention
from zoo_core.ops import packing
from zoo_core.ops.aux_merge import sum_aux
from zoo_core.ops.block_config import config_from
from zoo_core.ops.dropout import Dropout
from zoo_core.ops.linear_attention import LinearState
from zoo_core.ops.remat import call_block
from zoo_core.ops.shard_padding import pad_end, padded_length

Array = jax.Array

LN_EPS = 1e-6                          # htgn.md §5.6


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Hyper-parameters shared by every block of a model, built once by the model and passed down
    (flax wmt's `TransformerConfig` pattern, `zoo_core.ops.block_config`).

    Attributes:
      d_model, num_heads, mlp_dim: width d, heads H (d_h = d / H), FFN width d_ff.
      attention: 'favor' (HTGN) | 'softmax' (exact softmax attention, the vanilla baseline).
      feature_map, num_features, redraw_every: FAVOR+ feature map, m random features, redraw
        period (`FavorAttention`).
      qk_rank: r, per-head width of the low-rank query/key projections (None = d_h).
      window, num_global: WinGAT radius w and the g leading global nodes of the encoder.
      skip_offsets: multi-scale skip edges beside the window in every graph layer (encoder,
        causal decoder, Cross-Graph around c_i); () = none.
      grid_width: None (1-D window), or W: encoder tokens are image patches in raster order with
        rows of W and the WinGAT stencil is 2-D of radius w (htgn.md §5.12).
      cross_window, rho: Cross-Graph radius w_x and centre ratio (c_i = round(rho * i)).
      use_graph_conv, use_hrpe, gat_version: ablation switches (htgn.md §5.13).
      kl_tau, kl_mode: the KL term's prior and mode (htgn.md §5.7).
      dropout_rate: dropout on residual branches and inside the FFN.
      attention_dropout: dropout on the graph-attention probabilities.
      drop_path_start: DropPath rate of the first block of each stack (the stacks' `drop_path`
        is the deepest block's rate; linear in between).
      graph_activation: the card's sigma after the graph convolution, 'none' | 'relu'.
      graph_alpha: 'learned' (GAT scores) | 'attention' (alpha from the block's FAVOR+ kernel
        scores over each node's neighbourhood: self-attention for the window graphs,
        cross-attention for Cross-Graph).
      norm: 'pre' | 'post'.
      chunk_size: C of the chunked causal FAVOR+ (decoder self-attention).
      dtype, param_dtype: compute and parameter dtypes.
      remat: recompute each block's forward pass in the backward pass (`zoo_core.ops.remat`).
      sequence_axis: the mesh axis the sequences are split over (context parallelism; None: one
        device), given to every self-attention, graph and Cross-Graph layer; the stacks pad their
        sequence to a multiple of the axis size (`Encoder`; the decoder's, `htgn_jax.model.Seq2Seq`).
    """
    d_model: int
    num_heads: int
    mlp_dim: int
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: Optional[int] = 32
    qk_rank: Optional[int] = None
    redraw_every: int = 0
    window: int = 4
    num_global: int = 0
    skip_offsets: tuple[int, ...] = ()
    grid_width: Optional[int] = None
    cross_window: int = 4
    rho: float = 1.0
    use_graph_conv: bool = True
    use_hrpe: bool = True
    gat_version: str = "v2"
    kl_tau: Optional[float] = None
    kl_mode: str = "prior"
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    drop_path_start: float = 0.0
    graph_activation: str = "none"
    graph_alpha: str = "learned"
    norm: str = "pre"
    chunk_size: int = 64
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: bool = False
    sequence_axis: Optional[str] = None

    @classmethod
    def from_module(cls, m: Any, **overrides) -> "BlockConfig":
        """The config from the same-named fields of a model (`overrides` win; `config_from`)."""
        return config_from(cls, m, **overrides)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def feature_width(self) -> int:
        """M of the FAVOR+ features (2m for 'trig', the q/k width for 'relu' / 'elu')."""
        if self.feature_map in ops.RANDOM_FEATURE_MAPS:
            return self.num_features * (2 if self.feature_map == "trig" else 1)
        return self.qk_rank or self.head_dim


class DecoderState(NamedTuple):
    """Per-token decoding state of a `DecoderBlock` (every leaf has the batch leading).

    Attributes:
      self_attention: FAVOR+ `LinearState` (S `[B, H, M, d_h]`, z `[B, H, M]`).
      graph: the causal WinGAT's `WindowState`, or None without graph layers.
    """
    self_attention: LinearState
    graph: Optional[WindowState]


class DecoderMemory(NamedTuple):
    """The encoder memory prepared once per source for a `DecoderBlock`'s decoding steps.

    Attributes:
      cross_attention: FAVOR+ cross cache `LinearState` (Z_M `[B, H, M, d_h]`, t_M `[B, H, M]`).
      cross_graph: the Cross-Graph `CrossGraphCache`, or None without that sub-layer.
    """
    cross_attention: LinearState
    cross_graph: Optional[CrossGraphCache]


def drop_path_rate(p_max: float, layer: int, num_layers: int, p_start: float = 0.0) -> float:
    """p_l = p_start + (p_max - p_start) l / (L - 1), l = 0..L-1 (htgn.md §5.8 with the card's
    first-layer rate p_start, e.g. 0.1 -> 0.3); p_start for a one-layer stack."""
    if num_layers < 2:
        return p_start
    return p_start + (p_max - p_start) * layer / (num_layers - 1)


def with_globals(mask: Array, num_global: int) -> Array:
    """The memory mask `[B, g + N]` of token mask `[B, N]` (globals are always real)."""
    return jnp.concatenate([jnp.ones((mask.shape[0], num_global), bool), mask.astype(bool)], 1)


def packed_layout(segment_ids: Array, positions: Array, num_global: int) -> tuple[Array, Array, Array, Array]:
    """Where a packed encoder row's nodes go when each document gets its own g global nodes.

    docs/htgn_packing.md: a packed row lays each document out as an unpacked row, `[its g globals ; its
    tokens]`. The N tokens of a packed row `[B, N]` (documents in runs of one segment id, 0 = padding)
    move to `[B, N + g N]` (room for g globals per document: a row holds at most N documents); the slots
    left over are padding (id 0).

    Returns:
      (index `[B, N]` of each token in the laid-out row, start `[B, N]` bool: token begins a document
      (its globals sit at index - g .. index - 1), segment ids `[B, N + g N]` of the laid-out row
      (globals: their document's id), positions `[B, N + g N]` (globals 0, tokens their `positions`)).
    """
    b, n = segment_ids.shape
    g = num_global
    # a document's first token (the row's first token too: `packing.starts` leaves it to an incoming state)
    start = (packing.starts(segment_ids) | (jnp.arange(n) == 0)[None]) & (segment_ids > 0)
    index = jnp.arange(n)[None] + g * jnp.cumsum(start, axis=1)
    rows = jnp.arange(b)[:, None]
    ids = jnp.zeros((b, n + g * n), segment_ids.dtype).at[rows, index].set(segment_ids)
    pos = jnp.zeros((b, n + g * n), jnp.int32).at[rows, index].set(positions.astype(jnp.int32))
    for k in range(g):
        ids = ids.at[rows, jnp.where(start, index - g + k, n + g * n)].set(segment_ids, mode="drop")
    return index, start, ids, pos


def _packed(**kwargs) -> dict:
    """The packed-sequence keyword arguments that are given (none: the unpacked call, unchanged)."""
    return {k: v for k, v in kwargs.items() if v is not None}


class _Block(nn.Module):
    """Residual wiring shared by the blocks (fields are declared by the subclasses)."""

    def _setup_residual(self) -> None:
        c = self.config
        self.dropout = Dropout(c.dropout_rate, position_axis=1)  # keyed by position: padding to P shards changes no mask
        # Per-sample mask (broadcast over time and channels), scaled by 1 / (1 - p) (§5.8).
        self.drop_path_layer = nn.Dropout(self.drop_path, broadcast_dims=(1, 2))
        self.mlp_norm = self._norm("mlp_norm")
        dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
        self.mlp_in = nn.Dense(c.mlp_dim, name="mlp_in", **dense)
        self.mlp_out = nn.Dense(c.d_model, name="mlp_out", **dense)

    def _norm(self, name: str) -> nn.LayerNorm:
        return nn.LayerNorm(epsilon=LN_EPS, dtype=self.config.dtype,
                            param_dtype=self.config.param_dtype, name=name)

    def _favor(self, name: str, *, causal: bool, rotary: bool, seed: int) -> FavorAttention:
        c = self.config
        exact = c.attention != "favor"   # softmax, and the decoder of a registry-encoder model
        fmap = "exact" if exact else c.feature_map
        return FavorAttention(num_heads=c.num_heads, head_dim=c.head_dim, causal=causal,
                              chunk_size=c.chunk_size if causal and not exact else None,
                              feature_map=fmap,
                              num_features=(c.num_features if fmap in ops.RANDOM_FEATURE_MAPS
                                            else None),
                              qk_rank=c.qk_rank,
                              redraw_every=c.redraw_every, use_rotary=rotary,
                              projection_seed=seed, dtype=c.dtype, param_dtype=c.param_dtype,
                              sequence_axis=None if exact else c.sequence_axis, name=name)

    def _graph_kwargs(self) -> dict:
        c = self.config
        return dict(num_heads=c.num_heads, head_dim=c.head_dim, version=c.gat_version,
                    use_relative_bias=c.use_hrpe, dropout_rate=c.attention_dropout,
                    activation=c.graph_activation, skip_offsets=tuple(c.skip_offsets),
                    alpha=c.graph_alpha,
                    score_dim=c.feature_width if c.graph_alpha == "attention" else None,
                    kl_tau=c.kl_tau, kl_mode=c.kl_mode, dtype=c.dtype, param_dtype=c.param_dtype,
                    sequence_axis=c.sequence_axis)

    def _residual(self, x: Array, norm: nn.Module, fn, deterministic: bool) -> Array:
        """x + DP(Drop(fn(LN(x)))) (pre) or LN(x + DP(Drop(fn(x)))) (post); x `[B, L, d]` or one
        decoding token `[B, d]` (then deterministic)."""
        pre = self.config.norm == "pre"
        y = fn(norm(x) if pre else x)
        y = self.drop_path_layer(self.dropout(y, deterministic=deterministic),
                                 deterministic=deterministic)
        return x + y if pre else norm(x + y)

    def _mlp(self, x: Array, deterministic: bool) -> Array:
        h = nn.gelu(self.mlp_in(x), approximate=False)
        return self.mlp_out(self.dropout(h, deterministic=deterministic))


class EncoderBlock(_Block):
    """Encoder hybrid block (htgn.md §5.1): FAVOR+ self-attention -> WinGAT -> FFN.

    Shapes: x `[B, L, d]` with L = g + N (`[globals ; tokens]`), mask `[B, L]`.

    Attributes:
      config: the shared `BlockConfig`.
      drop_path: this block's DropPath rate p_l.
      projection_seed: seed of this block's FAVOR+ projection.
    """
    config: BlockConfig
    drop_path: float = 0.0
    projection_seed: int = 0

    def setup(self):
        c = self.config
        self._setup_residual()
        self.self_attention_norm = self._norm("self_attention_norm")
        if c.attention in ("favor", "softmax"):
            self.self_attention = self._favor("self_attention", causal=False, rotary=c.use_hrpe,
                                              seed=self.projection_seed)
        else:   # a registry self-attention (its own contract layer; no RoPE, no feature step)
            cp = {} if c.sequence_axis is None else {"sequence_axis": c.sequence_axis}
            self.self_attention = zoo_attention.layer(
                c.attention, num_heads=c.num_heads, qkv_features=c.d_model,
                dtype=c.dtype if c.dtype is not None else jnp.float32, param_dtype=c.param_dtype, **cp)
        if c.use_graph_conv:
            self.graph_norm = self._norm("graph_norm")
            self.graph = WindowGraphAttention(window=c.window, num_global=c.num_global,
                                              grid_width=c.grid_width, name="graph",
                                              **self._graph_kwargs())

    def __call__(self, x: Array, *, mask: Array, positions: Optional[Array] = None,
                 deterministic: bool = True, feature_step: Optional[Array] = None,
                 segment_ids: Optional[Array] = None) -> tuple[Array, dict]:
        """Returns (x `[B, L, d]`, aux: the graph layer's {'kl_sum', 'kl_count'} or {}).

        `positions`: RoPE positions `[L]` or `[B, L]` (None without HRPE); `feature_step`: the
        training-step index selecting the FAVOR+ random-feature draw; `segment_ids`: int `[B, L]`
        packed documents (`packed_layout`; None: one per row), passed to every layer.
        """
        seg = _packed(segment_ids=segment_ids)
        auxes = []

        def sub(layer_call):
            def fn(h):
                y, aux = layer_call(h)
                auxes.append(aux)
                return y
            return fn

        if self.config.attention in ("favor", "softmax"):
            attend = lambda h: self.self_attention(h, mask=mask, positions=positions,
                                                   deterministic=deterministic,
                                                   feature_step=feature_step, **seg)
        else:
            attend = lambda h: self.self_attention(h, mask=mask, deterministic=deterministic, **seg)
        x = self._residual(x, self.self_attention_norm, sub(attend), deterministic)
        if self.config.use_graph_conv:
            def graph(h):
                features = None if self.config.graph_alpha == "learned" else \
                    self.self_attention.kernel_features(h, mask=mask, positions=positions,
                                                        feature_step=feature_step, **seg)
                return self.graph(h, mask=mask, deterministic=deterministic, features=features, **seg)
            x = self._residual(x, self.graph_norm, sub(graph), deterministic)
        x = self._residual(x, self.mlp_norm, lambda h: self._mlp(h, deterministic), deterministic)
        return x, sum_aux(*auxes)


class DecoderBlock(_Block):
    """Decoder hybrid + Cross-Graph block (htgn.md §5.1): causal FAVOR+ -> causal WinGAT -> FAVOR+
    cross-attention -> Cross-Graph GAT -> FFN, one wiring for the parallel and decoding paths.

    Attributes:
      config: the shared `BlockConfig`.
      drop_path: this block's DropPath rate p_l.
      projection_seed: seed of the self-attention projection (cross-attention: seed + 1).
      use_cross_graph: whether this block has the Cross-Graph sub-layer (with graph layers on).
    """
    config: BlockConfig
    drop_path: float = 0.0
    projection_seed: int = 0
    use_cross_graph: bool = True

    @property
    def _has_cross_graph(self) -> bool:
        return self.config.use_graph_conv and self.use_cross_graph

    def setup(self):
        c = self.config
        self._setup_residual()
        self.self_attention_norm = self._norm("self_attention_norm")
        self.self_attention = self._favor("self_attention", causal=True, rotary=c.use_hrpe,
                                          seed=self.projection_seed)
        if c.use_graph_conv:
            self.graph_norm = self._norm("graph_norm")
            self.graph = WindowGraphAttention(window=c.window, num_global=0, causal=True,
                                              name="graph", **self._graph_kwargs())
        self.cross_attention_norm = self._norm("cross_attention_norm")
        self.cross_attention = self._favor("cross_attention", causal=False, rotary=False,
                                           seed=self.projection_seed + 1)
        if self._has_cross_graph:
            self.cross_graph_norm = self._norm("cross_graph_norm")
            kw = self._graph_kwargs()
            if c.cross_window == 0 and c.num_global == 0:
                # One neighbour per row: its KL is 0 in every mode, and the kernel refuses the
                # alternatives there, which still apply to this block's self-graph.
                kw.update(kl_tau=None, kl_mode="prior")
            self.cross_graph = CrossGraphAttention(window=c.cross_window, num_global=c.num_global,
                                                   rho=c.rho, name="cross_graph", **kw)

    def __call__(self, y: Array, memory: Array, *, mask: Optional[Array] = None,
                 memory_mask: Optional[Array] = None, deterministic: bool = True,
                 feature_step: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 kv_segment_ids: Optional[Array] = None,
                 positions: Optional[Array] = None) -> tuple[Array, dict]:
        """The block over a teacher-forced sequence.

        Args:
          y: `[B, T, d]` decoder states.
          memory: encoder output `[B, g + N, d]`.
          mask: `[B, T]` real decoder inputs (graph layers only: padding follows the real tokens,
            so causal attention needs none).
          memory_mask: `[B, g + N]`.
          deterministic: no dropout.
          feature_step: training-step index selecting the FAVOR+ random-feature draw.
          segment_ids, kv_segment_ids, positions: a packed row (None: one sequence per row): int
            `[B, T]` the decoder's documents, `[B, g + N]`-like the memory's (`packed_layout`), `[B, T]`
            positions restarting per document (RoPE).

        Returns:
          (y `[B, T, d]`, aux {'kl_sum', 'kl_count'} or {}).
        """
        fs = dict(feature_step=feature_step)
        seg = _packed(segment_ids=segment_ids)
        cross_seg = _packed(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
        self_seg = _packed(segment_ids=segment_ids, positions=positions)
        auxes = []
        by_attention = self.config.graph_alpha == "attention"
        self_feats = lambda h: (self.self_attention.kernel_features(h, **fs, **self_seg) if by_attention
                                else None)
        cross_feats = lambda h: ((self.cross_attention.query_features(h, **fs),
                                  self.cross_attention.key_features(memory, memory_mask=memory_mask,
                                                                    **fs))
                                 if by_attention else None)

        def keep_aux(layer_call):
            def fn(h):
                out, aux = layer_call(h)
                auxes.append(aux)
                return out
            return fn

        y = self._wiring(y, deterministic, {
            "self_attention": keep_aux(
                lambda h: self.self_attention(h, deterministic=deterministic, **fs, **self_seg)),
            "graph": keep_aux(lambda h: self.graph(h, mask=mask, deterministic=deterministic,
                                                   features=self_feats(h), **seg)),
            "cross_attention": keep_aux(
                lambda h: self.cross_attention.cross(h, memory, memory_mask=memory_mask,
                                                     deterministic=deterministic, **fs, **cross_seg)),
            "cross_graph": keep_aux(
                lambda h: self.cross_graph(h, memory, mask=mask, memory_mask=memory_mask,
                                           deterministic=deterministic, features=cross_feats(h),
                                           **cross_seg)),
        })
        return y, sum_aux(*auxes)

    def step(self, state: DecoderState, y_t: Array, memory: DecoderMemory, *, position: Array,
             feature_step: Optional[Array] = None) -> tuple[Array, DecoderState]:
        """One decoding token through the block (deterministic), O(1) attention work per token.

        Args:
          state: the `DecoderState` of the previous tokens (`init_cache`, or the last `step`).
          y_t: `[B, d]` the token's decoder state.
          memory: the block's `DecoderMemory` (`init_cache`).
          position: decoder index of the token (int scalar).
          feature_step: the FAVOR+ random-feature draw `init_cache` used.

        Returns:
          (y_t `[B, d]`, new `DecoderState`), equal to row `position` of `__call__` on the prefix.
        """
        fs = dict(feature_step=feature_step)
        new = {}
        by_attention = self.config.graph_alpha == "attention"

        def self_feats(h):   # the token's (phi(q), phi(k)) `[B, H, M]`, as in the parallel form
            if not by_attention:
                return None
            pos = jnp.reshape(position, (-1, 1) if jnp.ndim(position) else 1) \
                if self.config.use_hrpe else None
            phi_q, phi_k = self.self_attention.kernel_features(h[:, None], positions=pos, **fs)
            return phi_q[:, 0], phi_k[:, 0]

        cross_q = lambda h: (self.cross_attention.query_features(h[:, None], **fs)[:, 0]
                             if by_attention else None)

        def keep_state(name, layer_step):
            def fn(h):
                out, new[name] = layer_step(h)
                return out
            return fn

        y_t = self._wiring(y_t, True, {
            "self_attention": keep_state("self_attention", lambda h: self.self_attention.step(
                state.self_attention, h, position=position, **fs)),
            "graph": keep_state("graph", lambda h: self.graph.step(state.graph, h,
                                                                   features=self_feats(h))),
            "cross_attention": lambda h: self.cross_attention.cross_step(
                memory.cross_attention, h, **fs),
            "cross_graph": lambda h: self.cross_graph.step(memory.cross_graph, h,
                                                           position=position,
                                                           query_features=cross_q(h))[0],
        })
        return y_t, DecoderState(new["self_attention"], new.get("graph"))

    def _wiring(self, y: Array, deterministic: bool, sublayers: dict) -> Array:
        """The block's residual wiring, written once for `__call__` and `step`: `sublayers[name]`
        maps the normalised input `h` to the sub-layer's output (the graph ones only when on)."""
        y = self._residual(y, self.self_attention_norm, sublayers["self_attention"], deterministic)
        if self.config.use_graph_conv:
            y = self._residual(y, self.graph_norm, sublayers["graph"], deterministic)
        y = self._residual(y, self.cross_attention_norm, sublayers["cross_attention"],
                           deterministic)
        if self._has_cross_graph:
            y = self._residual(y, self.cross_graph_norm, sublayers["cross_graph"], deterministic)
        return self._residual(y, self.mlp_norm, lambda h: self._mlp(h, deterministic),
                              deterministic)

    def init_cache(self, memory: Array, memory_mask: Array, *,
                   feature_step: Optional[Array] = None) -> tuple[DecoderMemory, DecoderState]:
        """(memory cache, empty decoding state) for a batch of B sources.

        The memory cache is computed once per source: the FAVOR+ cross cache Z_M = phi(K_M)^T
        V_M, t_M = phi(K_M)^T 1 and the projected memory of the Cross-Graph layer.
        """
        b = memory.shape[0]
        static = DecoderMemory(
            self.cross_attention.cross_cache(memory, memory_mask=memory_mask,
                                             feature_step=feature_step),
            self.cross_graph.prepare_memory(
                memory, memory_mask=memory_mask,
                key_features=self.cross_attention.key_features(
                    memory, memory_mask=memory_mask, feature_step=feature_step)
                if self.config.graph_alpha == "attention" else None)
            if self._has_cross_graph else None)
        state = DecoderState(self.self_attention.init_state(b),
                             self.graph.init_state(b) if self.config.use_graph_conv else None)
        return static, state


class Encoder(nn.Module):
    """Global tokens + a stack of `EncoderBlock`s + final LN (pre-LN only).

    Shapes: tokens `[B, N, d]` (already embedded), mask `[B, N]` -> memory `[B, g + N, d]`
    (`[globals ; tokens]`); its mask is `with_globals(mask, g)`.

    Attributes:
      config: the shared `BlockConfig`.
      num_layers: depth.
      drop_path: p_max of the DropPath schedule.
      per_layer_features: a FAVOR+ projection seed per block (default: one shared).
    """
    config: BlockConfig
    num_layers: int
    drop_path: float = 0.0
    per_layer_features: bool = False

    def setup(self):
        c = self.config
        if c.num_global:
            self.global_tokens = self.param("global_tokens", nn.initializers.normal(0.02),
                                            (c.num_global, c.d_model), c.param_dtype)
        self.blocks = [EncoderBlock(c, drop_path_rate(self.drop_path, i, self.num_layers,
                                                      c.drop_path_start),
                                    2 * i if self.per_layer_features else 0, name=f"block_{i:02d}")
                       for i in range(self.num_layers)]
        if c.norm == "pre":
            self.final_norm = nn.LayerNorm(epsilon=LN_EPS, dtype=c.dtype,
                                           param_dtype=c.param_dtype, name="final_norm")

    def __call__(self, tokens: Array, mask: Array, *, deterministic: bool = True,
                 feature_step: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 positions: Optional[Array] = None) -> tuple[Array, dict]:
        """Returns (memory `[B, g + N, d]`, aux merged over the blocks).

        Packed (`segment_ids`, `positions` int `[B, N]`): memory `[B, N + g N, d]` laid out by
        `packed_layout` (each document `[its globals ; its tokens]`), its ids those of `packed_layout`.
        With `config.sequence_axis` the memory is padded at its end to a multiple of the axis size
        (masked nodes: pad the memory's mask and ids alike, `pad_end`).
        """
        c = self.config
        b, n, _ = tokens.shape
        if c.grid_width and n % c.grid_width:
            raise ValueError(f"grid_width={c.grid_width} lays the tokens out in rows, but there "
                             f"are {n} tokens, not a multiple of it")
        g = c.num_global
        glb = self.global_tokens.astype(tokens.dtype) if g else None
        seg = {}
        if segment_ids is not None:
            index, start, ids, pos = packed_layout(segment_ids, positions, g)
            rows = jnp.arange(b)[:, None]
            x = jnp.zeros((b, ids.shape[1], c.d_model), tokens.dtype).at[rows, index].set(tokens)
            for k in range(g):
                x = x.at[rows, jnp.where(start, index - g + k, ids.shape[1])].set(glb[k], mode="drop")
            mask, positions, seg = ids > 0, (pos if c.use_hrpe else None), {"segment_ids": ids}
        else:
            x, positions = tokens, None
            if g:
                x = jnp.concatenate([jnp.broadcast_to(glb[None], (b, g, c.d_model)), tokens], axis=1)
            if c.use_hrpe:
                # RoPE: globals at position 0, tokens at their index (htgn.md §5.1 step 1).
                positions = jnp.concatenate([jnp.zeros((g,), jnp.int32), jnp.arange(n, dtype=jnp.int32)])
            mask = with_globals(mask, g)
        if c.sequence_axis is not None:   # context parallelism: nodes padded (masked) to a multiple of the shards
            length = padded_length(x.shape[1], c.sequence_axis)
            x, mask = pad_end(x, length), pad_end(mask, length, value=False)
            positions = pad_end(positions, length, axis=positions.ndim - 1) if positions is not None else None
            seg = {k: pad_end(v, length) for k, v in seg.items()}
        auxes = []
        for block in self.blocks:
            x, aux = call_block(block, x, mask=mask, positions=positions, deterministic=deterministic,
                                feature_step=feature_step, remat=c.remat, **seg)
            auxes.append(aux)
        if c.norm == "pre":
            x = self.final_norm(x)
        return x, sum_aux(*auxes)
