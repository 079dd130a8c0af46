"""Flax (Linen) layers of HTGN's graph attention: window / causal window and Cross-Graph GAT.

The maths is in `htgn_jax.graph_ops` (spec `htgn.md` §3.4, §5.3, §5.5, §5.7); the layers own the
parameters only. Contract (README "Layer contract"):

* `WindowGraphAttention.__call__(x, *, mask=None, segment_ids=None, deterministic=True) -> (y,
  aux)`; when causal also `init_state(batch_size) -> WindowState`, `scan(x, state=None, *,
  mask=None, segment_ids=None, deterministic=True) -> (y, state)` and `step(state, x_t) -> (y_t,
  state)` (no position: the window needs no index). With `sequence_axis` set, `__call__` runs
  split over that mesh axis (`graph_context_parallel`).
* `CrossGraphAttention.__call__(x, memory, *, mask=None, memory_mask=None, segment_ids=None,
  kv_segment_ids=None, deterministic=True) -> (y, aux)`; decoding: `prepare_memory(memory, *,
  memory_mask=None) -> CrossGraphCache` once, then `step(cache, x_t, *, position) -> (y_t, cache)`.

`segment_ids` int `[B, L]` packs documents into a row (0 = padding), each laid out `[its globals ;
its tokens]`; nothing crosses a document (docs/htgn_packing.md).

aux = {'kl_sum', 'kl_count'}: the unweighted KL smoothness term of htgn.md §5.7 as a sum and a count
of (row, head) terms, so that a model can form the mean over all its layers (sums add up across
layers; the loss is formed once, by the model). Padded positions of x and memory are replaced by
0 with `jnp.where` before the projections (NaN-safe masking).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from htgn_jax import cross_graph_context_parallel, graph_causal, graph_context_parallel, graph_ops, validation
from htgn_jax.graph_causal import WindowState
from htgn_jax.graph_heads import HeadProjection, HeadVector
from htgn_jax.layers import HeadsOutput
from zoo_core.checks import check_rank, check_tokens, fail
from zoo_core.ops import masking, packing

Array = jax.Array
Initializer = Callable[..., Array]

ATTN_INIT = nn.initializers.glorot_uniform()      # GAT attention vectors a_h


class CrossGraphCache(NamedTuple):
    """The encoder memory projected once for Cross-Graph decoding.

    Attributes:
      value: `[B, L, H, D]` W_s M (for GATv2 and dot also the score key).
      mask: `[B, L]` bool memory mask.
      key: `[B, L, H, 1]` score keys a_s . W M (GAT v1), or None.
    """

    value: Array
    mask: Array
    key: Optional[Array] = None


class _GraphAttentionBase(nn.Module):
    """The fields and the setup/feature code shared by the two graph layers.

    The fields are documented in `WindowGraphAttention` (`CrossGraphAttention` reads them the
    same way, with `window` the encoder radius w_x and `num_global` the memory's globals); each
    layer adds its own (`causal`, `chunk_size`, `grid_width`; `rho`).
    """
    num_heads: int
    head_dim: int | None = None
    window: int = 4
    num_global: int = 0
    skip_offsets: tuple[int, ...] = ()
    version: str = "v2"
    use_relative_bias: bool = True
    negative_slope: float | None = None
    dropout_rate: float = 0.0
    activation: str = "none"
    alpha: str = "learned"
    score_dim: int | None = None
    kl_tau: float | None = None
    kl_mode: str = "prior"
    kl_weight: float = 0.0
    out_features: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    attn_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()

    def _setup_common(self, num_offsets: int, with_global_bias: bool) -> None:
        # The options the kernels read (the causal forms check none themselves).
        graph_ops.check_kl(self.kl_tau, self.kl_mode, num_offsets + self.num_global)
        graph_ops.check_negative_slope(self._scoring(), self.negative_slope)
        h = self.num_heads
        proj = dict(num_heads=h, head_dim=self.head_dim, dtype=self.dtype,
                    param_dtype=self.param_dtype, kernel_init=self.kernel_init)
        # GAT's and GATv2's score features run in at least float32 whatever `dtype` is: a query's
        # gradient is a sum over its neighbours of LeakyReLU slopes that nearly cancels (a row's
        # logit gradients sum to 0), so a bf16 rounding that moves q_i + k_j across the kink flips
        # a whole term of it (benchmarks.precision). The messages share the source projection.
        if self.version in ("v1", "v2") and self.alpha != "attention" and self.dtype is not None:
            score = dict(proj, dtype=jnp.promote_types(self.dtype, jnp.float32))
        else:
            score = proj
        if self.alpha == "attention":      # scores come from the attention layer's features
            self.source = HeadProjection(arg=self._source_arg, **proj)
        elif self.version in ("v2", "dot"):
            self.target = HeadProjection(arg="x", **score)
            self.source = HeadProjection(arg=self._source_arg, **score)
            if self.version == "v2":
                self.attn = HeadVector(h, self.param_dtype, self.attn_init or ATTN_INIT)
        else:
            # v1 (GAT): one projection W for both ends, two attention halves a = [a_t ; a_s].
            self.source = HeadProjection(arg=self._source_arg, **score)
            self.attn_target = HeadVector(h, self.param_dtype, self.attn_init or ATTN_INIT)
            self.attn_source = HeadVector(h, self.param_dtype, self.attn_init or ATTN_INIT)
        if self.use_relative_bias:
            self.rel_bias = self.param("rel_bias", self.bias_init, (h, num_offsets),
                                       self.param_dtype)
            if with_global_bias:
                self.global_bias = self.param("global_bias", self.bias_init, (h,),
                                              self.param_dtype)
        self.output = HeadsOutput(self.out_features, True, self.dtype, self.param_dtype,
                                  self.kernel_init, self.bias_init)

    def _output(self, out: Array, width: int) -> Array:
        """W_o sigma(out): the card's sigma (`activation`) on the aggregated messages `[..., H, D]`,
        then the heads' output projection."""
        if self.activation == "relu":
            out = jax.nn.relu(out)
        return self.output(out, width)

    def _given(self, features, what: str):
        """The attention features passed by the caller: required iff alpha='attention'."""
        if (features is None) != (self.alpha != "attention"):
            fail(f"`{what}` (the attention layer's kernel features) must be given exactly when "
                 f"alpha='attention', got alpha={self.alpha!r}")
        return features

    def _self_features(self, x: Array, features=None) -> tuple[Array, Array, Array]:
        """(query `[..., H, C]`, key `[..., H, C]`, message `[..., H, D]`) of nodes x."""
        if self._given(features, "features") is not None:
            return features[0], features[1], self.source(x)
        if self.version != "v1":
            u = self.source(x)
            return self.target(x), u, u
        z = self.source(x)
        q, k, _ = graph_ops.gat_v1_features(z, self._head_vector("attn_target", z),
                                            self._head_vector("attn_source", z))
        return q, k, z

    def _query_features(self, x: Array, head_dim: int, features=None) -> Array:
        """Receiver-side score features `[..., H, C]` (v1: a_t . W x, the same W as the senders).

        `head_dim` is the senders' D, so an unset head_dim follows the memory width.
        """
        if self._given(features, "query_features") is not None:
            return features
        if self.version != "v1":
            return self.target(x, head_dim)
        z = self.source(x)
        return jnp.einsum("...hd,hd->...h", z, self._head_vector("attn_target", z))[..., None]

    def _source_features(self, m: Array, features=None) -> tuple[Array, Array]:
        """(score key `[..., H, C]`, message `[..., H, D]`) of sender nodes m."""
        u = self.source(m)
        if self._given(features, "key_features") is not None:
            return features, u
        if self.version != "v1":
            return u, u
        return jnp.einsum("...hd,hd->...h", u, self._head_vector("attn_source", u))[..., None], u

    def _head_vector(self, name: str, z: Array) -> Array:
        return getattr(self, name)(z.shape[-1]).astype(z.dtype)

    def _scoring(self) -> Any:
        """The `attn` kind the kernels get: `KERNEL`, None (dot product) or an array marker."""
        if self.alpha == "attention":
            return graph_ops.KERNEL
        return None if self.version == "dot" else ()

    def _attn_vector(self, value: Array) -> Array | None:
        """a_h for GATv2, ones `[H, 1]` for GAT's one-channel form, None (dot product) for 'dot',
        the kernel-score marker for alpha='attention'."""
        if self.alpha == "attention":
            return graph_ops.KERNEL
        if self.version == "v2":
            return self._head_vector("attn", value)
        if self.version == "dot":
            return None
        return jnp.ones((self.num_heads, 1), value.dtype)

    def _biases(self) -> tuple[Array | None, Array | None]:
        if not self.use_relative_bias:
            return None, None
        return self.rel_bias, (self.global_bias if self._has_global_bias else None)

    def _dropout_rng(self, deterministic: bool) -> Array | None:
        if deterministic or self.dropout_rate == 0.0:
            return None
        return self.make_rng("dropout")

    def _head_dims(self) -> tuple[int, int]:
        """(C, D) from head_dim, or from the initialised `source` kernel when head_dim is None."""
        d = self.head_dim
        if d is None:
            params = self.variables.get("params", {})
            if "source" not in params:
                fail("`head_dim` is None and the layer has no parameters yet, so the state shape "
                      "is unknown: set head_dim or call init_state with initialised params")
            d = params["source"]["kernel"].shape[-1]
        if self.alpha == "attention":
            return self.score_dim, d
        return (1 if self.version == "v1" else d), d


def _kl_aux(st: dict[str, Array], kl_weight: float) -> dict[str, Array]:
    """{'kl_sum', 'kl_count'} for the model (which forms one KL over all its layers), plus, for a
    layer used on its own with kl_weight > 0, 'loss/kl' = kl_weight * the layer's mean KL."""
    aux = {"kl_sum": st["kl_sum"], "kl_count": st["kl_count"]}
    if kl_weight:
        aux["loss/kl"] = kl_weight * st["kl_sum"] / jnp.maximum(st["kl_count"], 1.0)
    return aux


class WindowGraphAttention(_GraphAttentionBase):
    """Windowed GATv2 (or GAT, dot-product) graph attention with global nodes; causal variant.

    Node layout of `x`: `[B, L, d]` = `[globals (num_global) ; tokens (N)]`; the model prepends the
    g learned global vectors (htgn.md §5.1). Parameters (stable names): `target/kernel` `[d, H, D]`
    (W_t, v2 and dot), `source/kernel` `[d, H, D]` (W_s, also the message projection),
    `attn/vector` `[H, D]` (v2) or `attn_target/vector`, `attn_source/vector` `[H, D]` (v1; dot
    has no attention vector), `rel_bias`
    `[H, K]` and `global_bias` `[H]` (if use_relative_bias; global_bias only with globals),
    `output/kernel` `[H, D, F]`, `output/bias` `[F]`.

    Attributes:
      num_heads: H.
      head_dim: D per head; None means d // H (d must then be divisible by H).
      window: radius w >= 0; offsets -w..w, or -w..0 when causal.
      num_global: g leading global nodes (0 when causal).
      skip_offsets: multi-scale skip edges beyond the window (the HTGN card's skip connections,
        docs/htgn_options.md): token i also attends to i -/+ s for each s (only i - s when
        causal; on a grid the dilated 8-neighbourhood at distance s), each with its own
        `rel_bias` slot; () = none. The causal state then holds the last max(w, max s) tokens.
      causal: decoder form (offsets -w..0) with `init_state`, `scan` and `step`.
      chunk_size: form of the causal `__call__`: None = the parallel (unfold) form, an int C =
        chunks of C tokens with the window state carried across them (`causal_window_chunked`);
        must be None when not causal.
      grid_width: None, or W for image patches in raster order: the window is then the 2-D
        stencil of radius w (`window_offsets`); not with causal.
      sequence_axis: the mesh axis one sequence is split over (context parallelism by a halo
        exchange, `graph_context_parallel`): `__call__` then runs under `jax.shard_map`, called under
        `jax.set_mesh(mesh)` with L divisible by the axis size and each shard longer than the
        stencil's reach, and gives one device's numbers (the causal `chunk_size` forms too).
        `scan` and `step` are one device's forms whatever it is. None: one device.
      version: 'v2' (GATv2, default), 'v1' (GAT, static attention) or 'dot' (scaled dot
        product, UniMP style); the last two are ablations (htgn.md §5.13).
      use_relative_bias: learned per-head per-offset logit bias (HRPE (c), htgn.md §5.2).
      negative_slope: LeakyReLU slope (None: 0.2; must be None with dot-product scoring).
      dropout_rate: dropout on alpha (active when deterministic=False, rng 'dropout').
      alpha: 'learned' (GAT / GATv2 / dot scores of this layer's own parameters, `version`) or
        'attention' (the card's "alpha derived from self-attention"): the caller passes the
        kernel features (phi(q), phi(k)) of its FAVOR+ attention layer as `features`, and
        alpha_ij = phi(q_i).phi(k_j) e^{b_ij} / sum over N(i) (window + skips + globals; b the
        relative bias). The layer then has no score parameters (no `target`, no `attn`).
      score_dim: M, the feature width of `features` (needed by `init_state` with 'attention').
      activation: the HTGN card's sigma on the aggregated messages before the output projection,
        y_i = W_o sigma(sum_j alpha_ij W_s h_j): 'none' (default) or 'relu' (the card's choice).
      kl_tau: None (the KL term's uniform prior, htgn.md §5.7) or tau > 0 of the distance prior
        pi_i(j) proportional to exp(-dist / tau) (spec `kl_prior = "distance"`; dist = |j - i|,
        or max(|dr|, |dc|) on a grid, 1 to a global node).
      kl_mode: 'prior' (KL to the prior above) or 'neighbour' (KL(alpha_i || alpha_{i-1}),
        `neighbour_kl`).
      kl_weight: lambda of a stand-alone layer: > 0 adds aux['loss/kl'] = lambda * the mean KL
        (the models leave it 0 and weight the KL of all their layers at once).
      out_features: F; None means d.
      dtype: compute dtype (None: promote inputs and params). Softmax and KL are float32, and so
        are the GAT / GATv2 score projections W_t, W_s (and with them the messages) whatever it is.
      param_dtype: parameter dtype.
      kernel_init, attn_init, bias_init: initialisers for projections, attention vectors (None:
        glorot_uniform; GAT only), and
        biases (output bias, rel_bias, global_bias).
    """
    causal: bool = False
    chunk_size: int | None = None
    grid_width: int | None = None
    sequence_axis: Optional[str] = None

    _source_arg = "x"

    def setup(self):
        validation.check_window_graph_fields(self)
        if self.sequence_axis is not None and not isinstance(self.sequence_axis, str):
            fail(f"`sequence_axis` must be a mesh axis name or None, got {self.sequence_axis!r}")
        self._has_global_bias = self.num_global > 0
        self._offsets = graph_ops.window_offsets(self.window, self.causal, self.grid_width,
                                                 self.skip_offsets)
        self._setup_common(len(self._offsets), self._has_global_bias)

    def __call__(self, x: Array, *, mask: Array | None = None, segment_ids: Array | None = None,
                 deterministic: bool = True,
                 features: tuple[Array, Array] | None = None) -> tuple[Array, dict[str, Array]]:
        """Graph attention over the whole sequence.

        Args:
          x: `[B, L, d]`, L = num_global + N (packed: each document `[its g globals ; tokens]`).
          mask: `[B, L]` (True = real node), or None.
          segment_ids: int `[B, L]` packed documents (0 = padding), or None.
          deterministic: no attention dropout when True.
          features: (phi(q), phi(k)), each `[B, L, H, M]`, with alpha='attention' only.

        Returns:
          y `[B, L, F]` (zero at padded nodes) and aux {'kl_sum', 'kl_count'}: the KL term (to the
          prior over heads and valid nodes, or between consecutive rows, per kl_mode; htgn.md §5.7;
          unweighted) as a sum over its `kl_count` terms.
        """
        if self.causal and self.chunk_size is not None and self.sequence_axis is None:
            mask, out, st = self._chunked(x, mask, deterministic, features, segment_ids)
        else:
            mask, out, st = self._attend(x, mask, deterministic, features, segment_ids)
        if segment_ids is not None:
            mask = mask & (jnp.asarray(segment_ids) > 0)
        y = self._output(out, x.shape[-1])
        return jnp.where(mask[..., None], y, 0).astype(y.dtype), _kl_aux(st, self.kl_weight)

    @property
    def span(self) -> int:
        """Tokens held by the causal state: max(window, max skip offset)."""
        return max((self.window,) + tuple(self.skip_offsets))

    def _chunked(self, x: Array, mask: Array | None, deterministic: bool, features=None,
                 segment_ids=None):
        check_tokens("x", x, "[B, T, d]")
        mask = masking.as_bool(mask, x.shape[:2], "mask", "[B, T]")
        packing.check_segment_ids(segment_ids, x.shape[:2])
        if segment_ids is not None:
            mask = mask & (jnp.asarray(segment_ids) > 0)
        q, k, v = self._self_features(masking.zero_padding(x, mask), features)
        out, st, _ = graph_causal.causal_window_chunked(
            q, k, v, self._attn_vector(v), self.init_state(x.shape[0]), chunk_size=self.chunk_size,
            mask=mask, rel_bias=self._biases()[0], negative_slope=self.negative_slope,
            dropout_rate=self.dropout_rate, dropout_rng=self._dropout_rng(deterministic),
            offsets=self._offsets, segment_ids=segment_ids)
        kl_sum, kl_count = graph_causal.causal_window_kl(
            st["probs"], st["log_probs"], st["valid"], window=self.window, kl_tau=self.kl_tau,
            kl_mode=self.kl_mode, skip_offsets=self.skip_offsets)
        return mask, out, {"kl_sum": kl_sum, "kl_count": kl_count}

    def attention_weights(self, x: Array, *, mask: Array | None = None) -> dict[str, Array]:
        """The coefficients alpha that `__call__` uses (deterministic), for analysis.

        Args:
          x, mask: as in `__call__`.

        Returns:
          {'probs': `[B, N, H, K + g]` of the N token nodes over the K window offsets
          (`graph_ops.window_offsets`) and then the g global nodes, 'global_probs': `[B, g, H, L]`
          of each global node over all L = g + N nodes (absent when g = 0), 'mask': `[B, L]`}.
        """
        mask, _, st = self._attend(x, mask, True)
        out = {"probs": st["probs"], "mask": mask}
        if st.get("global_probs") is not None:
            out["global_probs"] = st["global_probs"]
        return out

    def _attend(self, x: Array, mask: Array | None, deterministic: bool, features=None,
                segment_ids=None):
        check_tokens("x", x, "[B, L, d]")
        mask = masking.as_bool(mask, x.shape[:2], "mask", "[B, L]")
        packing.check_segment_ids(segment_ids, x.shape[:2])
        real = mask if segment_ids is None else mask & (jnp.asarray(segment_ids) > 0)
        q, k, v = self._self_features(masking.zero_padding(x, real), features)
        rel_bias, global_bias = self._biases()
        kw = dict(window=self.window, num_global=self.num_global, causal=self.causal,
                  grid_width=self.grid_width, mask=mask, rel_bias=rel_bias,
                  global_bias=global_bias, negative_slope=self.negative_slope,
                  dropout_rate=self.dropout_rate, dropout_rng=self._dropout_rng(deterministic),
                  kl_tau=self.kl_tau, kl_mode=self.kl_mode, skip_offsets=self.skip_offsets,
                  segment_ids=segment_ids)
        if self.sequence_axis is None:
            out, st = graph_ops.window_graph_attention(q, k, v, self._attn_vector(v), **kw)
        else:
            out, st = graph_context_parallel.window_graph_attention(
                q, k, v, self._attn_vector(v), axis_name=self.sequence_axis, **kw)
        return mask, out, st

    def init_state(self, batch_size: int) -> WindowState:
        """Empty rolling cache (causal only): `WindowState` of the last w projected tokens, none
        valid yet (float32; `key` only for GAT v1)."""
        validation.check_window_graph_method(self, "init_state")
        c, d = self._head_dims()
        keyed = self.version == "v1" or self.alpha == "attention"
        return graph_causal.init_window_state(batch_size, self.span, self.num_heads, d,
                                              key_dim=c if keyed else None)

    def scan(self, x: Array, state: WindowState | None = None, *, mask: Array | None = None,
             segment_ids: Array | None = None, deterministic: bool = True,
             features: tuple[Array, Array] | None = None) -> tuple[Array, WindowState]:
        """Causal scan form: projections for the whole sequence, then a token `lax.scan`.

        Args:
          x: `[B, T, d]`.
          state: `WindowState` of earlier tokens, or None (empty).
          mask: optional `[B, T]`, True = real token.
          segment_ids: optional int `[B, T]` packed documents: the state empties at each document
            start (the first token continues `state`).
          deterministic: must be True (or dropout_rate 0): the scan form has no dropout.

        Returns:
          (y `[B, T, F]`, equal to `__call__` from an empty state, zero at padded tokens; final
          state).
        """
        validation.check_window_graph_method(self, "scan")
        check_tokens("x", x, "[B, T, d]")
        if not deterministic and self.dropout_rate:
            raise NotImplementedError("attention dropout is not implemented in the scan form")
        mask = masking.as_bool(mask, x.shape[:2], "mask", "[B, T]")
        packing.check_segment_ids(segment_ids, x.shape[:2])
        if segment_ids is not None:
            mask = mask & (jnp.asarray(segment_ids) > 0)
        q, k, v = self._self_features(masking.zero_padding(x, mask), features)
        if state is None:
            state = self.init_state(x.shape[0])
        else:
            validation.check_window_state(self, state, x.shape[0], (q.shape[-1], v.shape[-1]))
        out, state = graph_causal.causal_window_scan(q, k, v, self._attn_vector(v), state,
                                                     mask=mask, rel_bias=self._biases()[0],
                                                     negative_slope=self.negative_slope,
                                                     offsets=self._offsets,
                                                     segment_ids=segment_ids)
        y = self._output(out, x.shape[-1])
        return jnp.where(mask[..., None], y, 0).astype(y.dtype), state

    def step(self, state: WindowState, x_t: Array,
             features: tuple[Array, Array] | None = None) -> tuple[Array, WindowState]:
        """One decoding step (causal only), O(w H D) attention work per token.

        Args:
          state: `WindowState` from `init_state`, `scan` or the previous `step`.
          x_t: `[B, d]` the new token's features. No position: the window needs no index (the
            state marks which slots hold tokens and the relative bias depends on offsets only).

        Returns:
          (y_t `[B, F]`, new state). Equal to row t of `__call__` on the unpadded prefix.
        """
        validation.check_window_graph_method(self, "step")
        check_rank("x_t", x_t, 2, "[B, d]")
        q, k, v = self._self_features(x_t, features)
        validation.check_window_state(self, state, x_t.shape[0], (q.shape[-1], v.shape[-1]))
        out, state = graph_causal.causal_window_step(q, k, v, state, self._attn_vector(v),
                                                     rel_bias=self._biases()[0],
                                                     negative_slope=self.negative_slope,
                                                     offsets=self._offsets)
        return self._output(out, x_t.shape[-1]), state


class CrossGraphAttention(_GraphAttentionBase):
    """Cross-Graph attention (htgn.md §5.5): decoder node i -> encoder window at c_i + globals.

    c_i = clip(round(rho * i), 0, N_b - 1), with N_b the valid encoder token count per example.
    `memory` is the encoder output `[B, g + N, d_m]` = `[globals ; tokens]` (right-padded tokens).
    Scoring is GATv2: e_ij = a_h^T LeakyReLU(W_t y_i + W_s M_j) + b_h[j - c_i] (or GAT, or the
    dot product <W_t y_i, W_s M_j> / sqrt(D), per `version`); messages W_s M_j.
    Parameter names as in `WindowGraphAttention` (`rel_bias` `[H, 2w+1]`, `global_bias` `[H]`).

    Decoding: `prepare_memory` projects the memory once; `step` then costs O((2w+1+g) H D) per
    token and uses no target length, so it equals the parallel form row by row.

    Attributes:
      num_heads, version, use_relative_bias, negative_slope, dropout_rate, activation, alpha,
      score_dim, kl_tau, kl_mode, out_features, dtype, param_dtype, kernel_init, attn_init,
      bias_init: as in `WindowGraphAttention` (the distance prior measures |j - c_i|; with
      alpha='attention' `__call__` takes `features=(phi(q) [B, T, H, M], phi(k) [B, L, H, M])`,
      `prepare_memory` `key_features` and `step` `query_features` `[B, H, M]`).
      skip_offsets: skip edges c_i -/+ s beside the window (each s > w_x).
      window: w_x >= 0, the encoder window radius.
      head_dim: D per head; None means d_m // H (memory width d_m divisible by H); the decoder
        side uses the same D.
      num_global: g, the encoder globals at the front of `memory`.
      rho: centre ratio (mean source / mean target length, a hyperparameter; 1.0 by default).
      sequence_axis: the mesh axis the decoder's sequence is split over (context parallelism,
        `cross_graph_context_parallel`: each shard reads the whole projected memory): `__call__`
        then runs under `jax.shard_map`, called under `jax.set_mesh(mesh)` with T divisible by the
        axis size, and gives one device's numbers. `step` and `attention_weights` are one device's
        forms whatever it is. None: one device.
    """
    rho: float = 1.0
    sequence_axis: Optional[str] = None

    _source_arg = "memory"

    def setup(self):
        validation.check_cross_graph_fields(self)
        if self.sequence_axis is not None and not isinstance(self.sequence_axis, str):
            fail(f"`sequence_axis` must be a mesh axis name or None, got {self.sequence_axis!r}")
        self._has_global_bias = self.num_global > 0
        self._setup_common(len(graph_ops.window_offsets(self.window,
                                                        skip_offsets=self.skip_offsets)),
                           self._has_global_bias)

    def __call__(self, x: Array, memory: Array, *, mask: Array | None = None,
                 memory_mask: Array | None = None, segment_ids: Array | None = None,
                 kv_segment_ids: Array | None = None, deterministic: bool = True,
                 features: tuple[Array, Array] | None = None) -> tuple[Array, dict[str, Array]]:
        """Cross-Graph attention for a whole (teacher-forced) target sequence.

        Args:
          x: decoder states `[B, T, d]`; row t has decoder index t (packed: its index within its
            document).
          memory: encoder output `[B, g + N, d_m]` (packed: each document `[globals ; tokens]`).
          mask: `[B, T]` decoder mask or None.
          memory_mask: `[B, g + N]` encoder mask or None.
          segment_ids, kv_segment_ids: int `[B, T]` and `[B, g + N]` packed documents (0 =
            padding), both or neither; a query reads the memory document with its id.
          deterministic: no attention dropout when True.

        Returns:
          y `[B, T, F]` (zero at padded rows) and aux {'kl', 'kl_sum', 'kl_count'}.
        """
        qf, kf = (None, None) if features is None else features
        cache = self._memory_cache(x, memory, memory_mask, kf)
        return self._attend(cache, x, None, mask, deterministic, query_features=qf,
                            segments=(segment_ids, kv_segment_ids))

    def attention_weights(self, x: Array, memory: Array, *, mask: Array | None = None,
                          memory_mask: Array | None = None) -> dict[str, Array]:
        """The coefficients alpha that `__call__` uses (deterministic), for analysis.

        Args:
          x, memory, mask, memory_mask: as in `__call__`.

        Returns:
          {'probs': `[B, T, H, 2 w_x + 1 + g]` (window slots around the centre, then the globals),
          'centres': `[B, T]` c_i = round(rho i) clipped to the valid tokens, 'memory_mask':
          `[B, g + N]` bool}.
        """
        cache = self._memory_cache(x, memory, memory_mask)
        st = self._attend(cache, x, None, mask, True, stats_only=True)
        return {"probs": st["probs"], "centres": st["centres"], "memory_mask": cache.mask}

    def _memory_cache(self, x: Array, memory: Array, memory_mask: Array | None,
                      key_features=None) -> CrossGraphCache:
        """`prepare_memory(memory)` for the queries x `[B, T, d]` (checked to fit the memory)."""
        check_tokens("x", x, "[B, T, d]")
        cache = self.prepare_memory(memory, memory_mask=memory_mask, key_features=key_features)
        validation.check_cross_graph_inputs(self, x, memory, cache.mask)
        return cache

    def prepare_memory(self, memory: Array, *, memory_mask: Array | None = None,
                       key_features: Array | None = None) -> CrossGraphCache:
        """Projects the encoder memory once for decoding.

        Args:
          memory: `[B, g + N, d_m]`.
          memory_mask: `[B, g + N]` or None.

        Returns:
          `CrossGraphCache(value [B, L, H, D] = W_s M, mask [B, L] bool, key)`, key `[B, L, H, 1]`
          (a_s . W M) for v1 and None for v2 and dot (whose score key is `value`).
        """
        check_tokens("memory", memory, "[B, L, d_m]")
        memory_mask = masking.as_bool(memory_mask, memory.shape[:2], "memory_mask", "[B, L]")
        k, v = self._source_features(masking.zero_padding(memory, memory_mask), key_features)
        keyed = self.version == "v1" or self.alpha == "attention"
        return CrossGraphCache(v, memory_mask, k if keyed else None)

    def step(self, cache: CrossGraphCache, x_t: Array, *, position: Array | int,
             query_features: Array | None = None) -> tuple[Array, CrossGraphCache]:
        """One decoding step from a `prepare_memory` cache.

        Args:
          cache: from `prepare_memory`.
          x_t: `[B, d]` decoder state of the token at index `position`.
          position: its index i, scalar or `[B]` int (it sets the window centre c_i).

        Returns:
          (y_t `[B, F]`, the cache unchanged).
        """
        check_rank("x_t", x_t, 2, "[B, d]")
        b = x_t.shape[0]
        validation.check_graph_position(position, b)
        pos = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (b,))[:, None]
        qf = None if query_features is None else query_features[:, None]
        y, _ = self._attend(cache, x_t[:, None], pos, None, True, query_features=qf)
        return y[:, 0], cache

    def _attend(self, cache, x, positions, mask, deterministic, stats_only: bool = False,
                query_features=None, segments=(None, None)):
        mask = masking.as_bool(mask, x.shape[:2], "mask", "[B, T]")
        if segments[0] is not None:
            packing.check_segment_ids(segments[0], x.shape[:2])
            mask = mask & (jnp.asarray(segments[0]) > 0)
        x = masking.zero_padding(x, mask)
        v = cache.value
        q = self._query_features(x, v.shape[-1], query_features)
        rel_bias, global_bias = self._biases()
        if self.sequence_axis is not None and positions is None and not stats_only:
            out, st = cross_graph_context_parallel.cross_graph_attention(
                q, v if cache.key is None else cache.key, v, self._attn_vector(v), axis_name=self.sequence_axis,
                window=self.window, num_global=self.num_global, rho=self.rho, mask=mask,
                memory_mask=cache.mask, rel_bias=rel_bias, global_bias=global_bias,
                negative_slope=self.negative_slope, dropout_rate=self.dropout_rate,
                dropout_rng=self._dropout_rng(deterministic), kl_tau=self.kl_tau, kl_mode=self.kl_mode,
                skip_offsets=self.skip_offsets, segment_ids=segments[0], kv_segment_ids=segments[1])
            y = self._output(out, x.shape[-1])
            return jnp.where(mask[..., None], y, 0).astype(y.dtype), _kl_aux(st, self.kl_weight)
        out, st = graph_ops.cross_graph_attention(
            q, v if cache.key is None else cache.key, v, self._attn_vector(v),
            window=self.window, num_global=self.num_global, rho=self.rho, mask=mask,
            memory_mask=cache.mask, positions=positions, rel_bias=rel_bias,
            global_bias=global_bias, negative_slope=self.negative_slope,
            dropout_rate=self.dropout_rate, dropout_rng=self._dropout_rng(deterministic),
            kl_tau=self.kl_tau, kl_mode=self.kl_mode, skip_offsets=self.skip_offsets,
            segment_ids=segments[0], kv_segment_ids=segments[1])
        if stats_only:
            return st
        y = self._output(out, x.shape[-1])
        return jnp.where(mask[..., None], y, 0).astype(y.dtype), _kl_aux(st, self.kl_weight)
