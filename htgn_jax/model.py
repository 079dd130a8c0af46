"""HTGN models: hybrid FAVOR+ / graph-attention encoder-decoder and encoder-only classifier.

Design: HTGN spec (`htgn.md`) §5.1 (block order), §5.2 (HRPE at linear cost), §5.4 (FAVOR+),
§5.5 (Cross-Graph), §5.6 (FFN, norms, dropout, tied embeddings), §5.7 (KL smoothness term),
§5.8 (DropPath), §5.12 (presets) and §5.13 (ablation switches). FAVOR+ is Performer (Choromanski
et al., ICLR 2021, Eqs. 5-7, `htgn_jax.ops` / `htgn_jax.layers`); the graph convolution is
GATv2 (Brody et al., ICLR 2022) or GAT (Velickovic et al., ICLR 2018) on a window + global-node
stencil graph (`htgn_jax.graph`).

Blocks (Pre-LN; `norm='post'` gives x <- LN(x + branch(x)) and no final LN). Every residual
branch is `x + DropPath_l(Dropout(f(LN(x))))`, DropPath rate p_l = drop_path * l / (L - 1):

* encoder hybrid block (§5.1): FAVOR+ self-attention (RoPE; globals at position 0) ->
  WinGAT (window +-w plus g global nodes) -> FFN (Dense -> GELU -> Dropout -> Dense);
* decoder hybrid + Cross-Graph block (§5.1): causal chunked FAVOR+ -> causal WinGAT (offsets
  -w..0, no globals) -> FAVOR+ cross-attention to the memory (no RoPE) -> Cross-Graph GAT
  (encoder window of radius w_x around c_i = round(rho * i) plus the encoder globals) -> FFN.

Inputs (§5.2): h_i = W_in [E(x_i) sqrt(d) ; U_i] + b_in with U the spectral (Laplacian DCT-II)
node encodings of the path graph: the example's true length in the encoder (padding-invariant),
a fixed N_ref = `max_target_len` in the decoder (the final length is unknown while decoding).
g learned global vectors are prepended to the encoder tokens. Output logits use the target
embedding transposed (tied input/output embeddings). The classifier embeds non-overlapping image
patches, uses 2-D grid spectral encodings (`hrpe.grid_graph_pe`), and reads global 0 (CLS) or the
mean over tokens.

Ablations (§5.13), as fields: `use_graph_conv=False` (Performer encoder-decoder), `use_hrpe=False`
(no RoPE, no spectral PE, no window bias; learned absolute position embeddings instead),
`num_global=0`, `kl_weight=0`, `kl_tau` (the distance KL prior) and `kl_mode='neighbour'`
(spec §5.7), `gat_version='v1'|'v2'|'dot'`, `feature_map` ('softmax' FAVOR+, 'relu', 'elu',
'exact'). `attention='softmax'` is the vanilla Transformer baseline on the same code: exact softmax
attention (`ops.exact_softmax_attention`), graph layers and HRPE off by default.

Interface (the zoo's model contract): `apply(variables, batch, train=False, rngs={'dropout': k})` returns
`(outputs, aux)`:

* kind='seq2seq': batch['inputs'] int [B, S] (ids + EOS, then `pad_id`), batch['targets'] int
  [B, T] (same convention), optional batch['inputs_mask'] bool [B, S] (default inputs != pad_id).
  The decoder is fed [BOS] + targets[:, :-1]. outputs = {'logits': float32 [B, T, V_tgt]}.
* kind='classifier': batch['image'] (or batch['inputs']) float [B, H, W, C].
  outputs = {'logits': float32 [B, num_classes]}.

aux: 'loss/kl' = kl_weight * L_KL (a scalar the trainer adds to the task loss; 0 when disabled
or without graph layers) and 'graph/kl' = L_KL unweighted, the mean over every graph-attention
layer's terms (§5.7): KL(alpha_i || pi_i) per (head, valid node), pi uniform or the distance prior
(`kl_tau`), or KL(alpha_i || alpha_{i-1}) per (head, consecutive pair) with kl_mode='neighbour'.

Random features: Omega is `FavorAttention`'s deterministic draw, one for all self-attention
layers and one (seed + 1) for all cross-attention layers, unless `per_layer_features=True`. With `redraw_every = k > 0` (spec §2.4, §5.4: k = 1000) the model
`uses_step`: every public method takes `step=` (the training-step index) and the draw in force is
Omega(step // k), a pure function of the seed and the step; the shared trainer passes the update's
index while training and the last update's index at evaluation, so evaluation and decoding use the
features the parameters were last trained with (frozen between redraws). With k = 0 it is draw 0
throughout and `step` is not needed.

Decoding (`htgn_jax.decoding`) uses the methods `encode`, `decode`, `init_cache` and
`decode_step` of `Seq2Seq`: the FAVOR+ (S, z) state, the rolling window cache of the causal
graph layer, and the cross-attention / Cross-Graph memory projections computed once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from htgn_jax import hrpe
from htgn_jax.graph import CrossGraphAttention, WindowGraphAttention, check_kl
from htgn_jax.layers import FavorAttention

Array = jax.Array

LN_EPS = 1e-6                          # spec §5.6
ATTENTIONS = ("favor", "softmax")
FEATURE_MAPS = ("softmax", "relu", "elu", "exact")
GAT_VERSIONS = ("v1", "v2", "dot")
NORMS = ("pre", "post")
POOLS = ("cls", "mean")
CROSS_GRAPH_LAYERS = ("all", "last")
PE_BASES = hrpe.BASES

# Sizes (spec §5.12). Keys not used by a kind are dropped for it (e.g. cross_window, chunk_size
# for the classifier). `num_layers` is the depth of each stack (L_e = L_d for seq2seq).
VARIANTS: dict[str, dict[str, Any]] = {
    # tiny-cpu: d=64, H=4, m=32, L_e=L_d=2, d_ff=128, w=4, g=2, w_x=4, K_pe=8, DropPath 0, C=16.
    "tiny": dict(d_model=64, num_heads=4, num_features=32, num_layers=2, mlp_dim=128, window=4,
                 num_global=2, cross_window=4, num_pe=8, drop_path=0.0, chunk_size=16),
    # base-mt: d=512, H=8, m=256, L=6, d_ff=2048, w=8, g=4, w_x=8, K_pe=16, p_max 0.1, C=64.
    "base": dict(d_model=512, num_heads=8, num_features=256, num_layers=6, mlp_dim=2048, window=8,
                 num_global=4, cross_window=8, num_pe=16, drop_path=0.1, chunk_size=64),
    # image-patch encoder for the 8x8 digits (4x4 grid of 2x2 patches; 2-D stencil r=1, the
    # 8-neighbourhood, spec §5.12).
    "digits": dict(d_model=64, num_heads=4, num_features=32, num_layers=2, mlp_dim=128, window=1,
                   num_global=1, num_pe=8, drop_path=0.0, image_size=8, patch_size=2),
    # Test size.
    "test": dict(d_model=16, num_heads=2, num_features=8, num_layers=2, mlp_dim=32, window=2,
                 num_global=2, cross_window=2, num_pe=4, drop_path=0.0, chunk_size=4),
}


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(f"{name} must be one of {choices}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_rate(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        _fail(f"{name} must be in [0, 1), got {value!r}")


def _drop_path_rate(p_max: float, layer: int, num_layers: int) -> float:
    """p_l = p_max * l / (L - 1), l = 0..L-1 (spec §5.8); 0 for a one-layer stack."""
    return 0.0 if num_layers < 2 else p_max * layer / (num_layers - 1)


def _layer_norm(m, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=LN_EPS, dtype=m.dtype, param_dtype=m.param_dtype, name=name)


def _check_common(m) -> None:
    """Field checks shared by every HTGN module (plain Python, before anything is traced)."""
    _check_choice("attention", m.attention, ATTENTIONS)
    _check_choice("feature_map", m.feature_map, FEATURE_MAPS)
    _check_choice("gat_version", m.gat_version, GAT_VERSIONS)
    _check_choice("norm", m.norm, NORMS)
    for name in ("d_model", "num_heads", "mlp_dim"):
        _check_int(name, getattr(m, name), 1)
    _check_int("window", m.window, 0)
    _check_int("num_global", m.num_global, 0)
    if m.d_model % m.num_heads:
        _fail(f"d_model ({m.d_model}) must be divisible by num_heads ({m.num_heads})")
    head_dim = m.d_model // m.num_heads
    if m.use_hrpe and head_dim % 2:
        _fail(f"use_hrpe=True rotates channel pairs, so d_model / num_heads must be even, "
              f"got {head_dim}")
    if m.feature_map == "softmax" and m.attention == "favor":
        _check_int("num_features", m.num_features, 1)
    if m.attention == "softmax" and m.feature_map != "softmax":
        _fail(f"feature_map applies to attention='favor' only, got feature_map={m.feature_map!r} "
              f"with attention='softmax'")
    for name in ("dropout_rate", "attention_dropout", "drop_path"):
        _check_rate(name, getattr(m, name))
    check_kl(m.kl_tau, m.kl_mode)
    if _kl_options_set(m) and not m.use_graph_conv:
        _fail(f"{_kl_options_set(m)[0]} shapes the KL term of the graph layers, but "
              f"use_graph_conv=False")
    if m.attention_dropout and not m.use_graph_conv:
        _fail("attention_dropout acts on the graph-attention probabilities (spec §5.6), but "
              "use_graph_conv=False")
    _check_int("redraw_every", m.redraw_every, 0)
    if m.redraw_every and (m.attention != "favor" or m.feature_map != "softmax"):
        _fail(f"redraw_every redraws the FAVOR+ random features, so it needs attention='favor' and "
              f"feature_map='softmax', got attention={m.attention!r}, feature_map={m.feature_map!r}")


def _kl_options_set(m) -> list[str]:
    """The KL alternatives (spec §5.7) a module sets away from the plain uniform prior."""
    return [name for name, default in (("kl_tau", None), ("kl_mode", "prior"))
            if getattr(m, name) != default]


def _check_grid_width(m) -> None:
    if m.grid_width is None:
        return
    _check_int("grid_width", m.grid_width, 1)
    if not m.use_graph_conv:
        _fail("grid_width sets the WinGAT stencil, but use_graph_conv=False")


def _check_model(m) -> None:
    """Checks of the top-level models on top of `_check_common`."""
    _check_common(m)
    if not isinstance(m.kl_weight, (int, float)) or m.kl_weight < 0:
        _fail(f"kl_weight must be a number >= 0, got {m.kl_weight!r}")
    if _kl_options_set(m) and not m.kl_weight:
        _fail(f"{_kl_options_set(m)[0]} shapes the KL term, but kl_weight={m.kl_weight!r} turns it "
              f"off")
    if m.use_hrpe:
        _check_int("num_pe", m.num_pe, 1)


def _attention_kwargs(m) -> dict[str, Any]:
    """FavorAttention fields from a model's attention / feature_map / num_features choice."""
    feature_map = "exact" if m.attention == "softmax" else m.feature_map
    return dict(num_heads=m.num_heads, head_dim=m.d_model // m.num_heads, feature_map=feature_map,
                num_features=m.num_features if feature_map == "softmax" else None,
                redraw_every=m.redraw_every, dtype=m.dtype, param_dtype=m.param_dtype)


class _Residual(nn.Module):
    """Mixin: residual branch with Pre-LN / Post-LN, dropout and DropPath (spec §5.1, §5.8)."""

    def _setup_residual(self) -> None:
        self.dropout = nn.Dropout(self.dropout_rate)
        # Per-sample mask (broadcast over time and channels), scaled by 1 / (1 - p) (§5.8).
        self.drop_path_layer = nn.Dropout(self.drop_path, broadcast_dims=(1, 2))

    def _residual(self, x: Array, norm: nn.Module, fn, deterministic: bool) -> Array:
        """x + DP(Drop(fn(LN(x)))) (pre) or LN(x + DP(Drop(fn(x)))) (post); x `[B, L, d]`."""
        y = fn(norm(x) if self.norm == "pre" else x)
        y = self.drop_path_layer(self.dropout(y, deterministic=deterministic),
                                 deterministic=deterministic)
        return x + y if self.norm == "pre" else norm(x + y)

    def _residual_step(self, x_t: Array, norm: nn.Module, fn) -> Array:
        """One decoding token `[B, d]` through a residual branch (deterministic)."""
        if self.norm == "pre":
            return x_t + fn(norm(x_t))
        return norm(x_t + fn(x_t))

    def _mlp(self, x: Array, deterministic: bool) -> Array:
        h = nn.gelu(self.mlp_in(x), approximate=False)
        return self.mlp_out(self.dropout(h, deterministic=deterministic))

    def _setup_mlp(self) -> None:
        self.mlp_norm = _layer_norm(self, "mlp_norm")
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.mlp_in = nn.Dense(self.mlp_dim, name="mlp_in", **dense)
        self.mlp_out = nn.Dense(self.d_model, name="mlp_out", **dense)


class EncoderBlock(_Residual):
    """Encoder hybrid block (spec §5.1): FAVOR+ self-attention -> WinGAT -> FFN.

    Shapes: x `[B, L, d]` with L = g + N (`[globals ; tokens]`), mask `[B, L]`.

    Attributes:
      d_model, num_heads, mlp_dim: width d, heads H (d_h = d / H), FFN width d_ff.
      attention, feature_map, num_features, redraw_every: see `Seq2Seq`.
      window, num_global: WinGAT radius w and the g leading global nodes.
      grid_width: None (1-D window over the tokens), or W: the tokens are image patches in
        raster order with rows of W and the WinGAT stencil is 2-D of radius w (spec §5.12).
      use_graph_conv, use_hrpe, gat_version: ablation switches (spec §5.13).
      kl_tau, kl_mode: the KL term's prior and mode (spec §5.7), see `Seq2Seq`.
      dropout_rate: dropout on residual branches and inside the FFN.
      attention_dropout: dropout on the graph-attention probabilities.
      drop_path: this block's DropPath rate p_l.
      norm: 'pre' | 'post'.
      projection_seed: seed of this block's FAVOR+ projection.
      dtype, param_dtype: compute and parameter dtypes.
    """
    d_model: int
    num_heads: int
    mlp_dim: int
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: Optional[int] = 32
    redraw_every: int = 0
    window: int = 4
    num_global: int = 0
    grid_width: Optional[int] = None
    use_graph_conv: bool = True
    use_hrpe: bool = True
    gat_version: str = "v2"
    kl_tau: Optional[float] = None
    kl_mode: str = "prior"
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    norm: str = "pre"
    projection_seed: int = 0
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_common(self)
        _check_grid_width(self)
        self._setup_residual()
        self.self_attention_norm = _layer_norm(self, "self_attention_norm")
        self.self_attention = FavorAttention(causal=False, use_rotary=self.use_hrpe,
                                             projection_seed=self.projection_seed,
                                             name="self_attention", **_attention_kwargs(self))
        if self.use_graph_conv:
            self.graph_norm = _layer_norm(self, "graph_norm")
            self.graph = WindowGraphAttention(
                num_heads=self.num_heads, head_dim=self.d_model // self.num_heads,
                window=self.window, num_global=self.num_global, causal=False,
                grid_width=self.grid_width, version=self.gat_version, use_relative_bias=self.use_hrpe,
                dropout_rate=self.attention_dropout, kl_tau=self.kl_tau, kl_mode=self.kl_mode,
                dtype=self.dtype,
                param_dtype=self.param_dtype, name="graph")
        self._setup_mlp()

    def __call__(self, x: Array, mask: Array, positions: Optional[Array], *,
                 deterministic: bool = True,
                 step: Optional[Array] = None) -> tuple[Array, Array, Array]:
        """Returns (x `[B, L, d]`, kl_sum, kl_count) (KL terms 0 without graph layers).

        `step`: training-step index selecting the FAVOR+ random-feature draw (redraw_every > 0).
        """
        x = self._residual(x, self.self_attention_norm,
                           lambda h: self.self_attention(h, mask=mask, positions=positions,
                                                         deterministic=deterministic, step=step),
                           deterministic)
        kl_sum = kl_count = jnp.zeros((), jnp.float32)
        if self.use_graph_conv:
            st = {}

            def graph(h):
                y, st["aux"] = self.graph(h, mask=mask, deterministic=deterministic)
                return y
            x = self._residual(x, self.graph_norm, graph, deterministic)
            kl_sum, kl_count = st["aux"]["kl_sum"], st["aux"]["kl_count"]
        x = self._residual(x, self.mlp_norm, lambda h: self._mlp(h, deterministic), deterministic)
        return x, kl_sum, kl_count


class DecoderBlock(_Residual):
    """Decoder hybrid + Cross-Graph block (spec §5.1): causal FAVOR+ -> causal WinGAT ->
    FAVOR+ cross-attention -> Cross-Graph GAT -> FFN.

    Shapes: y `[B, T, d]`, memory `[B, g + N, d]`, memory_mask `[B, g + N]`.

    Attributes (besides those of `EncoderBlock`):
      cross_window: Cross-Graph radius w_x.
      rho: Cross-Graph centre ratio (c_i = round(rho * i)).
      use_cross_graph: whether this block has the Cross-Graph sub-layer.
      chunk_size: C of the chunked causal FAVOR+.
    """
    d_model: int
    num_heads: int
    mlp_dim: int
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: Optional[int] = 32
    redraw_every: int = 0
    window: int = 4
    num_global: int = 0
    cross_window: int = 4
    rho: float = 1.0
    use_graph_conv: bool = True
    use_cross_graph: bool = True
    use_hrpe: bool = True
    gat_version: str = "v2"
    kl_tau: Optional[float] = None
    kl_mode: str = "prior"
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    norm: str = "pre"
    chunk_size: int = 64
    projection_seed: int = 0
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_common(self)
        self._setup_residual()
        kw = _attention_kwargs(self)
        hd = self.d_model // self.num_heads
        self.self_attention_norm = _layer_norm(self, "self_attention_norm")
        self.self_attention = FavorAttention(causal=True, use_rotary=self.use_hrpe,
                                             chunk_size=self.chunk_size,
                                             projection_seed=self.projection_seed,
                                             name="self_attention", **kw)
        graph_kw = dict(num_heads=self.num_heads, head_dim=hd, version=self.gat_version,
                        use_relative_bias=self.use_hrpe, dropout_rate=self.attention_dropout,
                        kl_tau=self.kl_tau, kl_mode=self.kl_mode, dtype=self.dtype,
                        param_dtype=self.param_dtype)
        if self.use_graph_conv:
            self.graph_norm = _layer_norm(self, "graph_norm")
            self.graph = WindowGraphAttention(window=self.window, num_global=0, causal=True,
                                              name="graph", **graph_kw)
        self.cross_attention_norm = _layer_norm(self, "cross_attention_norm")
        self.cross_attention = FavorAttention(causal=False, use_rotary=False,
                                              projection_seed=self.projection_seed + 1,
                                              name="cross_attention", **kw)
        if self.use_graph_conv and self.use_cross_graph:
            self.cross_graph_norm = _layer_norm(self, "cross_graph_norm")
            cross_kw = dict(graph_kw)
            if self.cross_window == 0 and self.num_global == 0:
                # One neighbour per row: its KL is 0 in every mode, and the layer refuses the
                # alternatives there, which still apply to this block's self-graph.
                cross_kw.update(kl_tau=None, kl_mode="prior")
            self.cross_graph = CrossGraphAttention(window=self.cross_window,
                                                   num_global=self.num_global, rho=self.rho,
                                                   name="cross_graph", **cross_kw)
        self._setup_mlp()

    @property
    def _has_cross_graph(self) -> bool:
        return self.use_graph_conv and self.use_cross_graph

    def __call__(self, y: Array, memory: Array, memory_mask: Array, mask: Array, *,
                 deterministic: bool = True,
                 step: Optional[Array] = None) -> tuple[Array, Array, Array]:
        """Teacher-forced pass. mask `[B, T]` marks real decoder inputs (graph layers only:
        padding sits after the real tokens, so causal attention needs no mask). `step` selects
        the FAVOR+ random-feature draw (redraw_every > 0).

        Returns (y `[B, T, d]`, kl_sum, kl_count).
        """
        kl = [jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)]

        def add(aux):
            kl[0] = kl[0] + aux["kl_sum"]
            kl[1] = kl[1] + aux["kl_count"]

        y = self._residual(y, self.self_attention_norm,
                           lambda h: self.self_attention(h, deterministic=deterministic,
                                                         step=step),
                           deterministic)
        if self.use_graph_conv:
            def graph(h):
                out, aux = self.graph(h, mask=mask, deterministic=deterministic)
                add(aux)
                return out
            y = self._residual(y, self.graph_norm, graph, deterministic)
        y = self._residual(y, self.cross_attention_norm,
                           lambda h: self.cross_attention.cross(h, memory, memory_mask=memory_mask,
                                                                deterministic=deterministic,
                                                                step=step),
                           deterministic)
        if self._has_cross_graph:
            def cross_graph(h):
                out, aux = self.cross_graph(h, memory, mask=mask, memory_mask=memory_mask,
                                            deterministic=deterministic)
                add(aux)
                return out
            y = self._residual(y, self.cross_graph_norm, cross_graph, deterministic)
        y = self._residual(y, self.mlp_norm, lambda h: self._mlp(h, deterministic), deterministic)
        return y, kl[0], kl[1]

    def init_cache(self, memory: Array, memory_mask: Array, *,
                   step: Optional[Array] = None) -> tuple[dict, dict]:
        """(static, dynamic) decoding caches for a batch of B sources (`step`: the feature draw).

        static (computed once per source): 'cross' = `FavorState` Z_M = phi(K_M)^T V_M
        `[B, H, M, d_h]`, t_M `[B, H, M]`; 'cross_graph' = projected memory {'value' `[B, L, H,
        d_h]`, 'mask' `[B, L]`, (v1) 'key'}. dynamic (changes every token): 'self' = FAVOR+ state
        (S `[B, H, M, d_h]`, z `[B, H, M]`); 'graph' = rolling window cache {'value' `[B, w, H,
        d_h]`, (v1) 'key'}. Every leaf has the batch as its leading axis.
        """
        b = memory.shape[0]
        static = {"cross": self.cross_attention.cross_cache(memory, memory_mask=memory_mask,
                                                            step=step)}
        dynamic = {"self": self.self_attention.init_state(b)}
        if self.use_graph_conv:
            dynamic["graph"] = self.graph.init_state(b)
        if self._has_cross_graph:
            static["cross_graph"] = self.cross_graph.prepare_memory(memory,
                                                                    memory_mask=memory_mask)
        return static, dynamic

    def step(self, static: dict, dynamic: dict, y_t: Array, position: Array, *,
             step: Optional[Array] = None) -> tuple[Array, dict]:
        """One token `[B, d]` at decoder index `position` (int scalar); O(1) attention work.

        `step` selects the FAVOR+ random-feature draw (the one `init_cache` used).
        """
        new = {}

        def self_attention(h):
            out, new["self"] = self.self_attention.step(
                dynamic["self"], h, position if self.use_hrpe else None, step=step)
            return out

        y_t = self._residual_step(y_t, self.self_attention_norm, self_attention)
        if self.use_graph_conv:
            def graph(h):
                out, new["graph"] = self.graph.step(dynamic["graph"], h, position)
                return out
            y_t = self._residual_step(y_t, self.graph_norm, graph)
        y_t = self._residual_step(y_t, self.cross_attention_norm,
                                  lambda h: self.cross_attention.cross_step(static["cross"], h,
                                                                            step=step))
        if self._has_cross_graph:
            y_t = self._residual_step(
                y_t, self.cross_graph_norm,
                lambda h: self.cross_graph.step(static["cross_graph"], h, position))
        y_t = self._residual_step(y_t, self.mlp_norm, lambda h: self._mlp(h, True))
        return y_t, new


def _block_kwargs(m, fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: getattr(m, f) for f in fields}


_SHARED_BLOCK_FIELDS = ("d_model", "num_heads", "mlp_dim", "attention", "feature_map",
                        "num_features", "redraw_every", "window", "num_global", "use_graph_conv",
                        "use_hrpe", "gat_version", "kl_tau", "kl_mode", "dropout_rate",
                        "attention_dropout", "norm", "dtype", "param_dtype")


class Encoder(nn.Module):
    """Global tokens + a stack of `EncoderBlock`s + final LN (pre-LN only).

    Shapes: tokens `[B, N, d]` (already embedded), mask `[B, N]` -> memory `[B, g + N, d]`
    (`[globals ; tokens]`) and memory_mask `[B, g + N]`.
    """
    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: Optional[int] = 32
    redraw_every: int = 0
    window: int = 4
    num_global: int = 0
    grid_width: Optional[int] = None
    use_graph_conv: bool = True
    use_hrpe: bool = True
    gat_version: str = "v2"
    kl_tau: Optional[float] = None
    kl_mode: str = "prior"
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    norm: str = "pre"
    per_layer_features: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        _check_common(self)
        _check_grid_width(self)
        _check_int("num_layers", self.num_layers, 1)
        if self.num_global:
            self.global_tokens = self.param("global_tokens", nn.initializers.normal(0.02),
                                            (self.num_global, self.d_model), self.param_dtype)
        kw = _block_kwargs(self, _SHARED_BLOCK_FIELDS + ("grid_width",))
        self.blocks = [EncoderBlock(drop_path=_drop_path_rate(self.drop_path, i, self.num_layers),
                                    projection_seed=2 * i if self.per_layer_features else 0,
                                    name=f"block_{i:02d}", **kw)
                       for i in range(self.num_layers)]
        if self.norm == "pre":
            self.final_norm = _layer_norm(self, "final_norm")

    def __call__(self, tokens: Array, mask: Array, *, deterministic: bool = True,
                 step: Optional[Array] = None):
        """Returns (memory `[B, g+N, d]`, memory_mask `[B, g+N]`, kl_sum, kl_count).

        `step` selects the FAVOR+ random-feature draw (redraw_every > 0).
        """
        b, n, _ = tokens.shape
        if self.grid_width and n % self.grid_width:
            _fail(f"grid_width={self.grid_width} lays the tokens out in rows, but there are {n} "
                  f"tokens, not a multiple of it")
        g = self.num_global
        x, positions = tokens, None
        if g:
            glb = jnp.broadcast_to(self.global_tokens.astype(tokens.dtype)[None],
                                   (b, g, self.d_model))
            x = jnp.concatenate([glb, tokens], axis=1)
            mask = jnp.concatenate([jnp.ones((b, g), bool), mask], axis=1)
        if self.use_hrpe:
            # RoPE: globals at position 0, tokens at their index (spec §5.1 step 1).
            positions = jnp.concatenate([jnp.zeros((g,), jnp.int32),
                                         jnp.arange(n, dtype=jnp.int32)])
        kl_sum = kl_count = jnp.zeros((), jnp.float32)
        for block in self.blocks:
            x, s, c = block(x, mask, positions, deterministic=deterministic, step=step)
            kl_sum, kl_count = kl_sum + s, kl_count + c
        if self.norm == "pre":
            x = self.final_norm(x)
        return x, mask, kl_sum, kl_count


def _check_step(m, step: Any) -> None:
    """`step` is required with redraw_every > 0 (it selects the random features) and refused without."""
    if m.redraw_every and step is None:
        _fail(f"redraw_every={m.redraw_every} makes the random features depend on the training step: "
              f"pass step= (the index of the last training update, trainer.eval_step_index(steps_done))")
    if not m.redraw_every and step is not None:
        _fail("step selects the redrawn FAVOR+ features, but redraw_every=0 (one fixed draw): "
              "do not pass step")


def _aux(m, kl_sum: Array, kl_count: Array) -> dict[str, Array]:
    kl = kl_sum / jnp.maximum(kl_count, 1.0)
    return {"loss/kl": jnp.asarray(m.kl_weight, jnp.float32) * kl, "graph/kl": kl}


def _check_int_array(name: str, x: Any, rank: int, doc: str) -> Array:
    x = jnp.asarray(x)
    if x.ndim != rank:
        _fail(f"batch[{name!r}] must have rank {rank} {doc}, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        _fail(f"batch[{name!r}] must hold integer ids, got dtype {x.dtype}")
    return x


class Seq2Seq(nn.Module):
    """HTGN encoder-decoder for translation (spec §5.1), or the vanilla Transformer baseline.

    batch: 'inputs' int [B, S], 'targets' int [B, T], optional 'inputs_mask' bool [B, S].
    outputs: {'logits': float32 [B, T, target_vocab_size]}; aux: see the module docstring.

    Attributes:
      source_vocab_size, target_vocab_size: vocabulary sizes (specials included).
      d_model, num_heads, mlp_dim: d, H (d_h = d / H), d_ff.
      num_layers: depth of both stacks unless num_encoder_layers / num_decoder_layers are set.
      num_encoder_layers, num_decoder_layers: L_e, L_d (None = num_layers).
      attention: 'favor' (HTGN) | 'softmax' (vanilla Transformer: exact softmax attention).
      feature_map: FAVOR+ map: 'softmax' (positive random features), 'relu', 'elu', 'exact'.
      num_features: m random features (feature_map='softmax').
      window: WinGAT radius w (encoder +-w, decoder -w..0).
      num_global: g encoder global nodes.
      cross_window: Cross-Graph radius w_x.
      rho: Cross-Graph centre ratio (mean source length / mean target length).
      cross_graph_layers: 'all' | 'last' decoder blocks with Cross-Graph attention.
      num_pe: K_pe spectral encodings; pe_basis: 'laplacian' | 'adjacency'.
      use_graph_conv, use_hrpe, gat_version, kl_weight: ablation switches (spec §5.13).
      kl_tau: None for the KL term's uniform prior, or tau > 0 of the spec's alternative
        `kl_prior = "distance"`, pi_i(j) proportional to exp(-dist / tau) with dist = |j - i|
        (max(|dr|, |dc|) on the classifier's grid, 1 to a global node; spec §5.7).
      kl_mode: 'prior' (KL(alpha_i || pi_i)) or 'neighbour' (KL(alpha_i || alpha_{i-1}) of
        consecutive rows aligned by offset, `graph.neighbour_kl`; spec §5.7).
      dropout_rate: embeddings, residual branches and FFN; attention_dropout: GAT probabilities.
      drop_path: p_max of the DropPath schedule (spec §5.8).
      norm: 'pre' | 'post'.
      chunk_size: C of the chunked causal FAVOR+.
      per_layer_features: a FAVOR+ projection per layer (default: one shared by all layers).
      redraw_every: redraw the FAVOR+ features every k training steps (0 = one fixed draw); then
        every public method takes `step=` (see the module docstring).
      share_embeddings: one table for source, target and output (needs equal vocab sizes).
      max_source_len: longest accepted source; rows of the learned source position table
        (use_hrpe=False).
      max_target_len: N_ref of the decoder spectral PE, or rows of the learned target position
        table; targets and decoded sequences must not be longer.
      pad_id, bos_id, eos_id: special ids (number_words / wmt convention 0, 1, 2).
      dtype, param_dtype: compute and parameter dtypes.
    """
    source_vocab_size: int
    target_vocab_size: int
    d_model: int
    num_heads: int
    mlp_dim: int
    num_layers: int
    num_encoder_layers: Optional[int] = None
    num_decoder_layers: Optional[int] = None
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: Optional[int] = 32
    redraw_every: int = 0
    window: int = 4
    num_global: int = 2
    cross_window: int = 4
    rho: float = 1.0
    cross_graph_layers: str = "all"
    num_pe: int = 8
    pe_basis: str = "laplacian"
    use_graph_conv: bool = True
    use_hrpe: bool = True
    gat_version: str = "v2"
    kl_tau: Optional[float] = None
    kl_mode: str = "prior"
    kl_weight: float = 1e-3
    dropout_rate: float = 0.1
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    norm: str = "pre"
    chunk_size: int = 64
    per_layer_features: bool = False
    share_embeddings: bool = False
    max_source_len: int = 256
    max_target_len: int = 256
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dtype: Any = None
    param_dtype: Any = jnp.float32

    # ------------------------------------------------------------------------------------------

    @property
    def encoder_layers(self) -> int:
        return self.num_layers if self.num_encoder_layers is None else self.num_encoder_layers

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def uses_step(self) -> bool:
        """Whether the forward pass depends on the training step (the trainer then passes it)."""
        return self.redraw_every > 0

    @property
    def supports_cache(self) -> bool:
        """Whether `init_cache` / `decode_step` exist (exact softmax has no constant-size state)."""
        return self.attention == "favor" and self.feature_map != "exact"

    def _check_fields(self) -> None:
        _check_model(self)
        for name in ("source_vocab_size", "target_vocab_size", "num_layers", "max_source_len",
                     "max_target_len", "chunk_size"):
            _check_int(name, getattr(self, name), 1)
        _check_int("encoder layers (num_encoder_layers)", self.encoder_layers, 1)
        _check_int("decoder layers (num_decoder_layers)", self.decoder_layers, 1)
        _check_int("cross_window", self.cross_window, 0)
        _check_choice("cross_graph_layers", self.cross_graph_layers, CROSS_GRAPH_LAYERS)
        _check_choice("pe_basis", self.pe_basis, PE_BASES)
        if not isinstance(self.rho, (int, float)) or not math.isfinite(self.rho) or self.rho < 0:
            _fail(f"rho must be a finite number >= 0, got {self.rho!r}")
        if self.share_embeddings and self.source_vocab_size != self.target_vocab_size:
            _fail(f"share_embeddings=True needs equal vocab sizes, got source_vocab_size="
                  f"{self.source_vocab_size} and target_vocab_size={self.target_vocab_size}")
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in ids.items():
            _check_int(name, value, 0)
            if value >= self.target_vocab_size:
                _fail(f"{name}={value} is outside the target vocabulary ({self.target_vocab_size})")
        if len(set(ids.values())) != 3:
            _fail(f"pad_id, bos_id and eos_id must differ, got {ids}")

    def setup(self):
        self._check_fields()
        d = self.d_model
        emb = dict(features=d, embedding_init=nn.initializers.normal(d ** -0.5), dtype=self.dtype,
                   param_dtype=self.param_dtype)
        if self.share_embeddings:
            self.shared_embed = nn.Embed(self.source_vocab_size, name="shared_embed", **emb)
            self.source_embed = self.target_embed = self.shared_embed
        else:
            self.source_embed = nn.Embed(self.source_vocab_size, name="source_embed", **emb)
            self.target_embed = nn.Embed(self.target_vocab_size, name="target_embed", **emb)
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        if self.use_hrpe:
            # h = W_in [E(x) sqrt(d) ; U] + b_in, W_in [(d + K_pe), d] (spec §5.2 (b)).
            self.encoder_input = nn.Dense(d, name="encoder_input", **dense)
            self.decoder_input = nn.Dense(d, name="decoder_input", **dense)
        else:
            init = nn.initializers.normal(0.02)
            self.source_pos_embed = self.param("source_pos_embed", init,
                                               (self.max_source_len, d), self.param_dtype)
            self.target_pos_embed = self.param("target_pos_embed", init,
                                               (self.max_target_len, d), self.param_dtype)
        self.dropout = nn.Dropout(self.dropout_rate)
        shared = _block_kwargs(self, _SHARED_BLOCK_FIELDS)
        self.encoder = Encoder(num_layers=self.encoder_layers, drop_path=self.drop_path,
                               per_layer_features=self.per_layer_features, name="encoder",
                               **shared)
        n_dec = self.decoder_layers
        self.decoder_blocks = [
            DecoderBlock(cross_window=self.cross_window, rho=self.rho,
                         use_cross_graph=self.cross_graph_layers == "all" or i == n_dec - 1,
                         chunk_size=self.chunk_size,
                         drop_path=_drop_path_rate(self.drop_path, i, n_dec),
                         projection_seed=(2 * (self.encoder_layers + i) + 2
                                          if self.per_layer_features else 0),
                         name=f"decoder_block_{i:02d}", **shared)
            for i in range(n_dec)]
        if self.norm == "pre":
            self.decoder_norm = _layer_norm(self, "decoder_norm")

    # --- embeddings -----------------------------------------------------------------------------

    def _embed(self, table: nn.Embed, ids: Array) -> Array:
        return table(ids) * math.sqrt(self.d_model)

    def _source_tokens(self, inputs: Array, mask: Array, deterministic: bool) -> Array:
        x = self._embed(self.source_embed, inputs)
        if self.use_hrpe:
            pe = hrpe.masked_path_graph_pe(mask, self.num_pe, basis=self.pe_basis, dtype=x.dtype)
            x = self.encoder_input(jnp.concatenate([x, pe], axis=-1))
        else:
            x = x + self.source_pos_embed[:inputs.shape[1]].astype(x.dtype)[None]
        return self.dropout(x, deterministic=deterministic)

    def _decoder_pe(self) -> Array:
        """`[max_target_len, K_pe]`: the path PE on the fixed N_ref = max_target_len nodes."""
        return hrpe.path_graph_pe(self.max_target_len, self.num_pe, basis=self.pe_basis)

    def _target_tokens(self, ids: Array, positions: Array, deterministic: bool) -> Array:
        """ids `[B, T]` at decoder indices `positions` `[T]` -> `[B, T, d]`."""
        y = self._embed(self.target_embed, ids)
        if self.use_hrpe:
            pe = jnp.take(self._decoder_pe(), positions, axis=0).astype(y.dtype)
            pe = jnp.broadcast_to(pe[None], ids.shape + pe.shape[-1:])
            y = self.decoder_input(jnp.concatenate([y, pe], axis=-1))
        else:
            y = y + jnp.take(self.target_pos_embed, positions, axis=0).astype(y.dtype)[None]
        return self.dropout(y, deterministic=deterministic)

    def _logits(self, y: Array) -> Array:
        if self.norm == "pre":
            y = self.decoder_norm(y)
        return self.target_embed.attend(y).astype(jnp.float32)   # tied output embedding

    # --- public methods -------------------------------------------------------------------------

    def _check_inputs(self, inputs: Any, inputs_mask: Any) -> tuple[Array, Array]:
        inputs = _check_int_array("inputs", inputs, 2, "[B, S]")
        if inputs.shape[1] > self.max_source_len:
            _fail(f"batch['inputs'] has length {inputs.shape[1]} > max_source_len="
                  f"{self.max_source_len}")
        if inputs_mask is None:
            return inputs, inputs != self.pad_id
        inputs_mask = jnp.asarray(inputs_mask)
        if inputs_mask.shape != inputs.shape:
            _fail(f"batch['inputs_mask'] must have the shape of batch['inputs'] [B, S] = "
                  f"{tuple(inputs.shape)}, got {tuple(inputs_mask.shape)}")
        return inputs, inputs_mask.astype(bool)

    def _check_target_length(self, length: int, what: str) -> None:
        if length > self.max_target_len:
            _fail(f"{what} has length {length} > max_target_len={self.max_target_len} (the decoder "
                  f"position encodings cover max_target_len positions)")

    def _encode(self, inputs: Array, mask: Array, deterministic: bool, step: Optional[Array]):
        tokens = self._source_tokens(inputs, mask, deterministic)
        return self.encoder(tokens, mask, deterministic=deterministic, step=step)

    def encode(self, inputs: Array, inputs_mask: Optional[Array] = None, *,
               step: Optional[Array] = None) -> tuple[Array, Array]:
        """Encoder (deterministic): inputs int `[B, S]` -> (memory `[B, g+S, d]`, memory mask
        `[B, g+S]`). `step`: the feature draw (required iff redraw_every > 0)."""
        _check_step(self, step)
        inputs, mask = self._check_inputs(inputs, inputs_mask)
        memory, memory_mask, _, _ = self._encode(inputs, mask, True, step)
        return memory, memory_mask

    def _decode(self, decoder_inputs: Array, memory: Array, memory_mask: Array,
                deterministic: bool, step: Optional[Array]):
        t = decoder_inputs.shape[1]
        y = self._target_tokens(decoder_inputs, jnp.arange(t), deterministic)
        mask = decoder_inputs != self.pad_id
        kl_sum = kl_count = jnp.zeros((), jnp.float32)
        for block in self.decoder_blocks:
            y, s, c = block(y, memory, memory_mask, mask, deterministic=deterministic, step=step)
            kl_sum, kl_count = kl_sum + s, kl_count + c
        return self._logits(y), kl_sum, kl_count

    def decode(self, decoder_inputs: Array, memory: Array, memory_mask: Array, *,
               step: Optional[Array] = None) -> Array:
        """Teacher-forced decoder (deterministic): decoder_inputs int `[B, T]` (BOS first)
        -> logits float32 `[B, T, V]`. Position t depends only on decoder_inputs[:, :t+1].
        `step`: the feature draw (required iff redraw_every > 0)."""
        _check_step(self, step)
        decoder_inputs = _check_int_array("decoder_inputs", decoder_inputs, 2, "[B, T]")
        self._check_target_length(decoder_inputs.shape[1], "decoder_inputs")
        return self._decode(decoder_inputs, memory, memory_mask, True, step)[0]

    def init_cache(self, memory: Array, memory_mask: Array, *,
                   step: Optional[Array] = None) -> tuple[list, list]:
        """(static, dynamic) per-decoder-layer caches (see `DecoderBlock.init_cache`).
        `step`: the feature draw (required iff redraw_every > 0)."""
        if not self.supports_cache:
            _fail("init_cache needs attention='favor' with a kernel feature_map (exact softmax "
                  "has no constant-size state); decode by recomputation instead")
        _check_step(self, step)
        pairs = [block.init_cache(memory, memory_mask, step=step) for block in self.decoder_blocks]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def decode_step(self, static: list, dynamic: list, token: Array,
                    position: Array, *, step: Optional[Array] = None) -> tuple[Array, list]:
        """One decoding step: token int `[B]` at decoder index `position` (int scalar, <
        max_target_len) -> (logits float32 `[B, V]`, new dynamic cache). Equal to row
        `position` of `decode` on the same prefix. `step`: the feature draw `init_cache` used
        (required iff redraw_every > 0)."""
        _check_step(self, step)
        if isinstance(position, int) and not 0 <= position < self.max_target_len:
            # (A traced position cannot be checked: past the table it reads jnp.take's NaN fill.)
            _fail(f"position must be in [0, max_target_len={self.max_target_len}), got {position}")
        position = jnp.asarray(position, jnp.int32)
        y = self._target_tokens(token[:, None], position[None], True)[:, 0]
        new_dynamic = []
        for block, st, dyn in zip(self.decoder_blocks, static, dynamic):
            y, dyn = block.step(st, dyn, y, position, step=step)
            new_dynamic.append(dyn)
        return self._logits(y), new_dynamic

    def __call__(self, batch: dict, *, train: bool = False, step: Optional[Array] = None):
        """Teacher-forced forward pass (see the class docstring); `step` is the training-step
        index (required iff redraw_every > 0: the update's index while training)."""
        _check_step(self, step)
        if "inputs" not in batch or "targets" not in batch:
            _fail(f"batch must contain 'inputs' [B, S] and 'targets' [B, T] ids, got keys "
                  f"{sorted(batch)}")
        inputs, mask = self._check_inputs(batch["inputs"], batch.get("inputs_mask"))
        targets = _check_int_array("targets", batch["targets"], 2, "[B, T]")
        if targets.shape[0] != inputs.shape[0]:
            _fail(f"batch['targets'] has batch size {targets.shape[0]} but batch['inputs'] has "
                  f"{inputs.shape[0]}")
        self._check_target_length(targets.shape[1], "batch['targets']")
        det = not train
        memory, memory_mask, kl_sum, kl_count = self._encode(inputs, mask, det, step)
        bos = jnp.full(targets.shape[:1] + (1,), self.bos_id, targets.dtype)
        decoder_inputs = jnp.concatenate([bos, targets[:, :-1]], axis=1)
        logits, s, c = self._decode(decoder_inputs, memory, memory_mask, det, step)
        return {"logits": logits}, _aux(self, kl_sum + s, kl_count + c)


class Classifier(nn.Module):
    """HTGN encoder-only image classifier (spec §5.1 "Classification", §5.12 image-patch).

    The image `[B, H, W, C]` is cut into non-overlapping p x p patches in raster order (N =
    (H/p)(W/p) tokens); with HRPE each patch vector is concatenated with the 2-D grid spectral
    encodings (`hrpe.grid_graph_pe`) and projected to d ('patch_embed'); without HRPE a learned
    position table ('pos_embed') is added. The WinGAT graph is the 2-D stencil of radius `window`
    on the W_p x W_p patch grid (spec §5.12; `window=1`: the 8-neighbourhood and self), plus the
    globals. pool='cls' reads global 0, 'mean' averages the tokens; head: Dense.

    batch: 'image' (or 'inputs') float [B, H, W, C]. outputs: {'logits': float32 [B, K]}.

    Attributes:
      num_classes: K.
      image_size, patch_size, channels: H = W, p, C.
      num_layers: encoder depth.
      window: radius r of the 2-D WinGAT stencil over the patch grid ((2r+1)^2 slots).
      pool: 'cls' (needs num_global >= 1) | 'mean'.
      Other fields as in `Seq2Seq`.
    """
    num_classes: int
    d_model: int
    num_heads: int
    mlp_dim: int
    num_layers: int
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    pool: str = "cls"
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: Optional[int] = 32
    redraw_every: int = 0
    window: int = 1
    num_global: int = 1
    num_pe: int = 8
    use_graph_conv: bool = True
    use_hrpe: bool = True
    gat_version: str = "v2"
    kl_tau: Optional[float] = None
    kl_mode: str = "prior"
    kl_weight: float = 1e-3
    dropout_rate: float = 0.1
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    norm: str = "pre"
    per_layer_features: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @property
    def uses_step(self) -> bool:
        """Whether the forward pass depends on the training step (the trainer then passes it)."""
        return self.redraw_every > 0

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    def _check_fields(self) -> None:
        _check_model(self)
        for name in ("num_classes", "num_layers", "image_size", "patch_size", "channels"):
            _check_int(name, getattr(self, name), 1)
        if self.image_size % self.patch_size:
            _fail(f"image_size ({self.image_size}) must be divisible by patch_size "
                  f"({self.patch_size})")
        _check_choice("pool", self.pool, POOLS)
        if self.pool == "cls" and not self.num_global:
            _fail("pool='cls' reads global token 0, so num_global must be >= 1 (or use "
                  "pool='mean')")
        if self.use_hrpe and self.num_pe > self.grid ** 2 - 1:
            _fail(f"num_pe must be <= (image_size / patch_size)^2 - 1 = {self.grid ** 2 - 1}, "
                  f"got {self.num_pe}")

    def setup(self):
        self._check_fields()
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.patch_embed = nn.Dense(self.d_model, name="patch_embed", **dense)
        if not self.use_hrpe:
            self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02),
                                        (self.grid ** 2, self.d_model), self.param_dtype)
        self.dropout = nn.Dropout(self.dropout_rate)
        self.encoder = Encoder(num_layers=self.num_layers, drop_path=self.drop_path,
                               per_layer_features=self.per_layer_features,
                               grid_width=self.grid if self.use_graph_conv else None,
                               name="encoder", **_block_kwargs(self, _SHARED_BLOCK_FIELDS))
        self.head = nn.Dense(self.num_classes, name="head", **dense)

    def __call__(self, batch: dict, *, train: bool = False, step: Optional[Array] = None):
        """Forward pass (see the class docstring); `step` as in `Seq2Seq.__call__`."""
        _check_step(self, step)
        key = "image" if "image" in batch else "inputs"
        if key not in batch:
            _fail(f"batch must contain 'image' (or 'inputs') [B, H, W, C], got keys "
                  f"{sorted(batch)}")
        x = jnp.asarray(batch[key])
        want = (self.image_size, self.image_size, self.channels)
        if x.ndim != 4 or tuple(x.shape[1:]) != want:
            _fail(f"batch[{key!r}] must have shape [B, {want[0]}, {want[1]}, {want[2]}] "
                  f"(image_size, image_size, channels), got {tuple(x.shape)}")
        b, p, gr = x.shape[0], self.patch_size, self.grid
        patches = x.reshape(b, gr, p, gr, p, self.channels).transpose(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(b, gr * gr, p * p * self.channels)
        patches = patches.astype(self.dtype or jnp.promote_types(x.dtype, jnp.float32))
        if self.use_hrpe:
            pe = hrpe.grid_graph_pe(gr, gr, self.num_pe, dtype=patches.dtype)
            h = self.patch_embed(jnp.concatenate(
                [patches, jnp.broadcast_to(pe[None], (b,) + pe.shape)], axis=-1))
        else:
            h = self.patch_embed(patches) + self.pos_embed.astype(patches.dtype)[None]
        det = not train
        h = self.dropout(h, deterministic=det)
        mask = jnp.ones((b, gr * gr), bool)
        memory, _, kl_sum, kl_count = self.encoder(h, mask, deterministic=det, step=step)
        pooled = memory[:, 0] if self.pool == "cls" else jnp.mean(memory[:, self.num_global:], 1)
        logits = self.head(pooled).astype(jnp.float32)
        return {"logits": logits}, _aux(self, kl_sum, kl_count)


# ---------------------------------------------------------------------------------------------
# Factory (the only place that reads config values).
# ---------------------------------------------------------------------------------------------

KINDS: dict[str, type] = {"seq2seq": Seq2Seq, "classifier": Classifier}

# Defaults that attention='softmax' (the vanilla Transformer baseline) changes unless given. The
# seq2seq baseline also has no learned global tokens (a vanilla encoder-decoder has none); the
# classifier keeps its one global token as the ViT-style CLS token it pools.
SOFTMAX_BASELINE_DEFAULTS = {"use_graph_conv": False, "use_hrpe": False, "kl_weight": 0.0}
SOFTMAX_BASELINE_KIND_DEFAULTS = {"seq2seq": {"num_global": 0}, "classifier": {}}

# Model kwargs that name an ablation (spec §5.13), for the configs.
ABLATIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "no_graph": {"use_graph_conv": False, "kl_weight": 0.0},
    "no_hrpe": {"use_hrpe": False},
    "no_global": {"num_global": 0},
    "no_kl": {"kl_weight": 0.0},
    "gat_v1": {"gat_version": "v1"},
    "gat_v2": {"gat_version": "v2"},
    "gat_dot": {"gat_version": "dot"},
    # The spec's alternative KL prior (§5.7), pi_i(j) ~ exp(-dist / tau); with tau = 2 the edge of
    # the tiny preset's window (radius 4) gets e^-2 of the prior mass of the centre.
    "kl_distance": {"kl_tau": 2.0},
    # The spec's other alternative: KL(alpha_i || alpha_{i-1}), consecutive rows aligned by offset.
    "kl_neighbour": {"kl_mode": "neighbour"},
}


# Fields that only the graph layers / HRPE / FAVOR+ read: given explicitly while that part is switched
# off they would be ignored, so the factory refuses them.
GRAPH_ONLY_KWARGS = ("window", "cross_window", "rho", "cross_graph_layers", "gat_version",
                     "kl_tau", "kl_mode")
HRPE_ONLY_KWARGS = ("num_pe", "pe_basis")


def _check_switched_off(given: dict, args: dict) -> None:
    if not args.get("use_graph_conv", True):
        unused = [k for k in GRAPH_ONLY_KWARGS if k in given] + (["kl_weight"] if given.get("kl_weight") else [])
        if unused:
            _fail(f"{unused} apply to the graph layers, but use_graph_conv=False")
    if not args.get("use_hrpe", True):
        unused = [k for k in HRPE_ONLY_KWARGS if k in given]
        if unused:
            _fail(f"{unused} apply to HRPE, but use_hrpe=False")
    if args.get("attention", "favor") == "softmax" and "chunk_size" in given:
        _fail("chunk_size applies to attention='favor' (the chunked causal FAVOR+ form) only")


def model_kwargs(kind: str) -> tuple[str, ...]:
    """The constructor kwargs accepted by `Model(kind=kind, ...)` besides `kind` and `variant`."""
    if kind not in KINDS:
        _fail(f"kind must be one of {tuple(KINDS)}, got {kind!r}")
    return tuple(f.name for f in dataclasses.fields(KINDS[kind])
                 if f.name not in ("parent", "name"))


def Model(*, kind: str, variant: Optional[str] = None, **kwargs) -> nn.Module:  # noqa: N802
    """Builds an HTGN model from `config.model`.

    Args:
      kind: 'seq2seq' (`Seq2Seq`) | 'classifier' (`Classifier`).
      variant: a key of `VARIANTS` (sizes; keys the kind does not have are skipped); explicit
        kwargs override it. Without a variant the required sizes must be given.
      **kwargs: fields of the selected class (see `model_kwargs(kind)` and the class docstrings).
        With attention='softmax', use_graph_conv, use_hrpe and kl_weight default to False,
        False, 0, and for kind='seq2seq' num_global to 0 (the vanilla Transformer baseline).

    Returns:
      An unbound Linen module: `apply(variables, batch, train=...)` -> ({'logits'}, aux).

    Raises:
      ValueError: unknown kind, variant or kwarg, or an invalid value (named), before any compile.
    """
    allowed = model_kwargs(kind)
    if variant is not None and variant not in VARIANTS:
        _fail(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        _fail(f"unknown Model kwargs for kind={kind!r}: {unknown}; allowed: {list(allowed)}")
    args = {k: v for k, v in (VARIANTS[variant] if variant else {}).items() if k in allowed}
    if kwargs.get("attention") == "softmax":
        for k, v in {**SOFTMAX_BASELINE_DEFAULTS, **SOFTMAX_BASELINE_KIND_DEFAULTS[kind]}.items():
            if k not in kwargs:
                args[k] = v
    args.update(kwargs)
    if "num_features" in kwargs and kwargs["num_features"] is not None and (
            args.get("attention", "favor") == "softmax"
            or args.get("feature_map", "softmax") != "softmax"):
        _fail("num_features applies to attention='favor' with feature_map='softmax' only")
    _check_switched_off(kwargs, args)
    fields = {f.name: f for f in dataclasses.fields(KINDS[kind])}
    missing = [n for n in allowed if fields[n].default is dataclasses.MISSING and n not in args]
    if missing:
        _fail(f"Model(kind={kind!r}) is missing required kwargs {missing}")
    module = KINDS[kind](**args)
    module._check_fields()   # raise on bad values now, not at the first trace
    return module
