"""HTGN models: hybrid FAVOR+ / graph-attention encoder-decoder and encoder-only classifier.

Design: HTGN spec (`htgn.md`) §5.1 (block order), §5.2 (HRPE at linear cost), §5.4 (FAVOR+),
§5.5 (Cross-Graph), §5.6 (FFN, norms, dropout, tied embeddings), §5.7 (KL smoothness term),
§5.8 (DropPath), §5.12 (presets) and §5.13 (ablation switches). FAVOR+ is Performer (Choromanski
et al., ICLR 2021, Eqs. 5-7, `htgn_jax.ops` / `htgn_jax.layers`); the graph convolution is
GATv2 (Brody et al., ICLR 2022) or GAT (Velickovic et al., ICLR 2018) on a window + global-node
stencil graph (`htgn_jax.graph_ops`, `htgn_jax.graph_layers`).

Blocks (`htgn_jax.blocks`, one `BlockConfig` built from the model's fields): the encoder hybrid
block (FAVOR+ -> WinGAT -> FFN) and the decoder hybrid + Cross-Graph block (causal chunked FAVOR+ ->
causal WinGAT -> FAVOR+ cross-attention -> Cross-Graph GAT -> FFN), Pre-LN or Post-LN, DropPath.
Options are validated once, by `Model(...)` (`htgn_jax.validation`).

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
(htgn.md §5.7), `gat_version='v1'|'v2'|'dot'`, `feature_map` ('softmax' FAVOR+, 'relu', 'elu',
'exact'). `attention='softmax'` is the vanilla Transformer baseline on the same code: exact softmax
attention (`ops.exact_softmax_attention`), graph layers and HRPE off by default.

Interface (the zoo's model contract): `apply(variables, batch, train=False, rngs={'dropout': k})` returns
`(outputs, aux)` (the trainer passes `feature_step=`, the training-step index, to a model that
`uses_feature_step`; the model passes it on to its layers):

* kind='seq2seq': batch['inputs'] int [B, S] (ids + EOS, then `pad_id`), batch['targets'] int
  [B, T] (same convention), optional batch['inputs_mask'] bool [B, S] (default inputs != pad_id).
  The decoder is fed [BOS] + targets[:, :-1]. outputs = {'logits': float32 [B, T, V_tgt]}.
* kind='classifier': batch['image'] (or batch['inputs']) float [B, H, W, C].
  outputs = {'logits': float32 [B, num_classes]}.

aux: 'loss/kl' = kl_weight * L_KL (a scalar the trainer adds to the task loss; 0 when disabled
or without graph layers) and 'graph/kl' = L_KL unweighted, the mean over every graph-attention
layer's terms (§5.7), formed once here from the sums of the layers' 'kl_sum' / 'kl_count' aux:
KL(alpha_i || pi_i) per (head, valid node), pi uniform or the distance prior (`kl_tau`), or
KL(alpha_i || alpha_{i-1}) per (head, consecutive pair) with kl_mode='neighbour'.

Random features: Omega is `FavorAttention`'s deterministic draw, one for all self-attention
layers and one (seed + 1) for all cross-attention layers, unless `per_layer_features=True`. With
`redraw_every = k > 0` (htgn.md §2.4, §5.4: k = 1000) the model `uses_feature_step`: every public
method takes `feature_step=` (the training-step index, passed down to the layers) and the draw in
force is Omega(feature_step // k), a pure function of the seed and the index; the shared trainer
passes the update's index while training and the last update's index at evaluation, so evaluation
and decoding use the features the parameters were last trained with (frozen between redraws). With
k = 0 it is draw 0 throughout and `feature_step` is not needed. (`step` names only one-token methods:
`DecoderBlock.step`, `decode_step`.)

Decoding (`htgn_jax.decoding`) uses `Seq2Seq`'s `encode`, `decode`, `init_cache` and `decode_step`: the
FAVOR+ (S, z) state, the causal graph layer's rolling window, the cross memory projections computed once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from htgn_jax import hrpe, validation
from htgn_jax.blocks import BlockConfig, DecoderBlock, Encoder, drop_path_rate, packed_layout, with_globals
from htgn_jax.validation import ATTENTIONS, encoder_attentions  # noqa: F401  (read by the configs)
from zoo_core.checks import constructor_kwargs, fail
from zoo_core.ops.aux_merge import sum_aux
from zoo_core.ops.dropout import Dropout
from zoo_core.ops.remat import call_block
from zoo_core.ops.shard_padding import pad_end, padded_length

Array = jax.Array
# The keys of a packed batch (zoo_core/data/packing.py: flax's wmt names).
PACKED_KEYS = ("inputs_segmentation", "inputs_position", "targets_segmentation", "targets_position")

# Sizes (htgn.md §5.12). Keys not used by a kind are dropped for it (e.g. cross_window, chunk_size
# for the classifier). `num_layers` is the depth of each stack (L_e = L_d for seq2seq).
VARIANTS: dict[str, dict[str, Any]] = {
    # tiny-cpu: d=64, H=4, m=32, L_e=L_d=2, d_ff=128, w=4, g=2, w_x=4, K_pe=8, DropPath 0, C=16.
    "tiny": dict(d_model=64, num_heads=4, num_features=32, num_layers=2, mlp_dim=128, window=4,
                 num_global=2, cross_window=4, num_pe=8, drop_path=0.0, chunk_size=16),
    # base-mt: d=512, H=8, m=256, L=6, d_ff=2048, w=8, g=4, w_x=8, K_pe=16, p_max 0.1, C=64.
    "base": dict(d_model=512, num_heads=8, num_features=256, num_layers=6, mlp_dim=2048, window=8,
                 num_global=4, cross_window=8, num_pe=16, drop_path=0.1, chunk_size=64),
    # image-patch encoder for the 8x8 digits (4x4 grid of 2x2 patches; 2-D stencil r=1, the
    # 8-neighbourhood, htgn.md §5.12).
    "digits": dict(d_model=64, num_heads=4, num_features=32, num_layers=2, mlp_dim=128, window=1,
                   num_global=1, num_pe=8, drop_path=0.0, image_size=8, patch_size=2),
    # Test size.
    "test": dict(d_model=16, num_heads=2, num_features=8, num_layers=2, mlp_dim=32, window=2,
                 num_global=2, cross_window=2, num_pe=4, drop_path=0.0, chunk_size=4),
}


def _aux(m, aux: dict) -> dict[str, Array]:
    """The model's aux: 'loss/kl' = kl_weight * L_KL and 'graph/kl' = L_KL, the mean over every
    graph layer's (row, head) terms (htgn.md §5.7), formed once from the summed 'kl_sum'/'kl_count'."""
    zero = jnp.zeros((), jnp.float32)
    kl = aux.get("kl_sum", zero) / jnp.maximum(aux.get("kl_count", zero), 1.0)
    # A registry encoder attention's own losses (e.g. AGF's 'loss/orth'), summed over the layers.
    own = {k: v for k, v in aux.items() if k.startswith("loss/") and k != "loss/kl"}
    return {**own, "loss/kl": jnp.asarray(m.kl_weight, jnp.float32) * kl, "graph/kl": kl}


class _HTGNModel(nn.Module, kw_only=True):
    """The fields and properties shared by `Seq2Seq` and `Classifier` (documented in `Seq2Seq`).

    Keyword-only, as are the two models: each declares its own fields after these, so a
    positional order would follow this class rather than the model's docstring.
    """
    d_model: int
    num_heads: int
    mlp_dim: int
    num_layers: int
    attention: str = "favor"
    feature_map: str = "softmax"
    num_features: int = 32
    qk_rank: Optional[int] = None
    redraw_every: int = 0
    window: int = 4
    num_global: int = 2
    skip_offsets: tuple[int, ...] = ()
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
    drop_path_start: float = 0.0
    graph_activation: str = "none"
    graph_alpha: str = "learned"
    norm: str = "pre"
    per_layer_features: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: bool = False
    sequence_axis: Optional[str] = None

    @property
    def uses_feature_step(self) -> bool:
        """Whether the forward pass depends on the training-step index (the trainer then passes it as
        `feature_step=`)."""
        return self.redraw_every > 0


class Seq2Seq(_HTGNModel, kw_only=True):
    """HTGN encoder-decoder for translation (htgn.md §5.1), or the vanilla Transformer baseline.

    batch: 'inputs' int [B, S], 'targets' int [B, T], optional 'inputs_mask' bool [B, S].
    outputs: {'logits': float32 [B, T, target_vocab_size]}; aux: see the module docstring.

    Attributes:
      source_vocab_size, target_vocab_size: vocabulary sizes (specials included).
      d_model, num_heads, mlp_dim: d, H (d_h = d / H), d_ff.
      num_layers: depth of both stacks unless num_encoder_layers / num_decoder_layers are set.
      num_encoder_layers, num_decoder_layers: L_e, L_d (None = num_layers).
      attention: 'favor' (HTGN) | 'softmax' (vanilla Transformer: exact softmax attention) | any
        other self-attention of the zoo registry with a non-causal layer (`encoder_attentions()`,
        e.g. 'agf', 'window_graph'; the card's baselines 'reformer', 'longformer' once
        registered), built by `zoo_core.attention.layer` for the encoder self-attention only; the
        decoder (causal self- and cross-attention) then uses exact softmax, and the baseline
        defaults of 'softmax' apply (no graph layers, no HRPE, unless given).
      feature_map: FAVOR+ map: 'softmax' (positive random features), 'trig' (random Fourier
        sin/cos features of the softmax kernel, Performer's trig map; docs/htgn_options.md),
        'relu', 'elu', 'exact'.
      num_features: m random features (feature_map 'softmax' or 'trig').
      qk_rank: r, per-head width of the query/key projections (the card's low-rank W^Q, W^K,
        r <= d_h; None = d_h, the full-rank default); every attention layer.
      window: WinGAT radius w (encoder +-w, decoder -w..0).
      num_global: g encoder global nodes.
      skip_offsets: multi-scale skip edges (e.g. (8, 16)) beside the window in every graph
        layer: token i also attends to i -/+ s (decoder: i - s; Cross-Graph: c_i -/+ s; classifier
        grid: the dilated 8-neighbourhood at distance s), each s > window (and > cross_window),
        one relative-bias slot each (HRPE (c) sees the same graph). Cost O(N (2w + 1 + 2|s| + g)).
      cross_window: Cross-Graph radius w_x.
      rho: Cross-Graph centre ratio (mean source length / mean target length).
      cross_graph_layers: 'all' | 'last' decoder blocks with Cross-Graph attention.
      num_pe: K_pe spectral encodings; pe_basis: 'laplacian' | 'adjacency'.
      use_graph_conv, use_hrpe, gat_version, kl_weight: ablation switches (htgn.md §5.13).
      kl_tau: None for the KL term's uniform prior, or tau > 0 of the spec's alternative
        `kl_prior = "distance"`, pi_i(j) proportional to exp(-dist / tau) with dist = |j - i|
        (max(|dr|, |dc|) on the classifier's grid, 1 to a global node; htgn.md §5.7).
      kl_mode: 'prior' (KL(alpha_i || pi_i)) or 'neighbour' (KL(alpha_i || alpha_{i-1}) of
        consecutive rows aligned by offset, `graph_kl.neighbour_kl`; htgn.md §5.7).
      dropout_rate: embeddings, residual branches and FFN; attention_dropout: GAT probabilities.
      drop_path: p_max of the DropPath schedule (htgn.md §5.8), the deepest block's rate.
      drop_path_start: the first block's rate p_0 (the card: "from 0.1 to 0.3"); each stack
        (encoder, decoder) goes linearly from p_0 to drop_path (default 0: the spec's 0 -> p_max).
      graph_activation: sigma after the graph convolution, applied to the aggregated messages
        sum_j alpha_ij W_s h_j before the heads' output projection (the card's
        h = sigma(sum_j alpha_ij W_g h_j), sigma = ReLU): 'none' (default, spec §3.4) | 'relu';
        window, causal window and Cross-Graph layers alike.
      graph_alpha: 'learned' (default: GAT/GATv2 scores, `gat_version`) | 'attention' (the card's
        "alpha derived from self-attention": alpha_ij = phi(q_i).phi(k_j) e^{b_ij} renormalised
        over N(i), with phi the block's FAVOR+ features: its self-attention for the window graphs,
        its cross-attention for Cross-Graph; needs attention='favor', a kernel feature_map).
      norm: 'pre' | 'post'.
      chunk_size: C of the chunked causal FAVOR+.
      per_layer_features: a FAVOR+ projection per layer (default: one shared by all layers).
      redraw_every: redraw the FAVOR+ features every k training steps (0 = one fixed draw); then
        every public method takes `feature_step=` (see the module docstring).
      share_embeddings: one table for source, target and output (needs equal vocab sizes).
      max_source_len: longest accepted source; rows of the learned source position table
        (use_hrpe=False).
      max_target_len: N_ref of the decoder spectral PE, or rows of the learned target position
        table; targets and decoded sequences must not be longer.
      pad_id, bos_id, eos_id: special ids (number_words / wmt convention 0, 1, 2).
      dtype, param_dtype: compute and parameter dtypes.
      remat: recompute each encoder and decoder block's forward pass in the backward pass
        (`zoo_core.ops.remat`; decoding is not rematerialised).
      sequence_axis: the mesh axis both sequences are split over (context parallelism under `jax.set_mesh`;
        attention='favor', a kernel feature map): every attention and graph layer runs its CP form, the stacks
        padded to a multiple of the shards (masked; `encode` gives the padded memory); decoding steps are not.
    """
    source_vocab_size: int
    target_vocab_size: int
    num_encoder_layers: Optional[int] = None
    num_decoder_layers: Optional[int] = None
    cross_window: int = 4
    rho: float = 1.0
    cross_graph_layers: str = "all"
    pe_basis: str = "laplacian"
    chunk_size: int = 64
    share_embeddings: bool = False
    max_source_len: int = 256
    max_target_len: int = 256
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    # ------------------------------------------------------------------------------------------

    @property
    def encoder_layers(self) -> int:
        return self.num_layers if self.num_encoder_layers is None else self.num_encoder_layers

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def sequence_padding(self) -> dict[str, int]:
        """With `sequence_axis`, the features the trainer may pad (masked: no output changes) and their pad
        values (`zoo_core.run.sharding.pad_sequences`)."""
        pads = {"inputs": self.pad_id, "targets": self.pad_id, "inputs_mask": False, **dict.fromkeys(PACKED_KEYS, 0)}
        return {} if self.sequence_axis is None else pads

    @property
    def supports_cache(self) -> bool:
        """Whether `init_cache` / `decode_step` exist (exact softmax has no constant-size state)."""
        return self.attention == "favor" and self.feature_map != "exact"

    def setup(self):
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
            # h = W_in [E(x) sqrt(d) ; U] + b_in, W_in [(d + K_pe), d] (htgn.md §5.2 (b)).
            self.encoder_input = nn.Dense(d, name="encoder_input", **dense)
            self.decoder_input = nn.Dense(d, name="decoder_input", **dense)
        else:
            init = nn.initializers.normal(0.02)
            self.source_pos_embed = self.param("source_pos_embed", init,
                                               (self.max_source_len, d), self.param_dtype)
            self.target_pos_embed = self.param("target_pos_embed", init,
                                               (self.max_target_len, d), self.param_dtype)
        self.dropout = Dropout(self.dropout_rate, position_axis=1)  # keyed by position: padding to P shards changes no mask
        config = BlockConfig.from_module(self)
        self.encoder = Encoder(config, self.encoder_layers, self.drop_path,
                               self.per_layer_features, name="encoder")
        n_dec = self.decoder_layers
        self.decoder_blocks = [
            DecoderBlock(config, drop_path_rate(self.drop_path, i, n_dec, self.drop_path_start),
                         2 * (self.encoder_layers + i) + 2 if self.per_layer_features else 0,
                         self.cross_graph_layers == "all" or i == n_dec - 1,
                         name=f"decoder_block_{i:02d}")
            for i in range(n_dec)]
        if self.norm == "pre":
            self.decoder_norm = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype,
                                             param_dtype=self.param_dtype, name="decoder_norm")

    # --- embeddings -----------------------------------------------------------------------------

    def _embed(self, table: nn.Embed, ids: Array) -> Array:
        return table(ids) * math.sqrt(self.d_model)

    def _source_tokens(self, inputs: Array, mask: Array, deterministic: bool,
                       segment_ids: Optional[Array] = None, positions: Optional[Array] = None) -> Array:
        """ids `[B, S]` -> `[B, S, d]`; packed (`segment_ids`, `positions` `[B, S]`), each document's own
        path PE (or position embeddings)."""
        x = self._embed(self.source_embed, inputs)
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}
        if self.use_hrpe:
            if self.skip_offsets:   # HRPE (b) on the graph the graph layers use
                pe = hrpe.masked_skip_path_graph_pe(mask, self.num_pe, tuple(self.skip_offsets),
                                                    basis=self.pe_basis, dtype=x.dtype, **seg)
            else:
                pe = hrpe.masked_path_graph_pe(mask, self.num_pe, basis=self.pe_basis,
                                               dtype=x.dtype, **seg)
            x = self.encoder_input(jnp.concatenate([x, pe], axis=-1))
        elif positions is not None:
            x = x + jnp.take(self.source_pos_embed, positions, axis=0).astype(x.dtype)
        else:   # (rows past the table: the padding of context parallelism, `validation.source`)
            x = x + pad_end(self.source_pos_embed[:inputs.shape[1]], inputs.shape[1], axis=0).astype(x.dtype)[None]
        return self.dropout(x, deterministic=deterministic)

    def _decoder_pe(self) -> Array:
        """`[max_target_len, K_pe]`: the path PE on the fixed N_ref = max_target_len nodes."""
        if self.skip_offsets:
            return hrpe.skip_path_graph_pe(self.max_target_len, self.num_pe,
                                           tuple(self.skip_offsets), basis=self.pe_basis)
        return hrpe.path_graph_pe(self.max_target_len, self.num_pe, basis=self.pe_basis)

    def _target_tokens(self, ids: Array, positions: Array, deterministic: bool) -> Array:
        """ids `[B, T]` at decoder indices `positions` `[T]` (or `[B, T]`, packed) -> `[B, T, d]`."""
        y = self._embed(self.target_embed, ids)
        if self.use_hrpe:
            pe = jnp.take(self._decoder_pe(), positions, axis=0).astype(y.dtype)
            pe = jnp.broadcast_to(pe if positions.ndim == 2 else pe[None], ids.shape + pe.shape[-1:])
            y = self.decoder_input(jnp.concatenate([y, pe], axis=-1))
        else:
            pos = jnp.take(self.target_pos_embed, positions, axis=0).astype(y.dtype)
            y = y + (pos if positions.ndim == 2 else pos[None])
        return self.dropout(y, deterministic=deterministic)

    def _logits(self, y: Array) -> Array:
        if self.norm == "pre":
            y = self.decoder_norm(y)
        return self.target_embed.attend(y).astype(jnp.float32)   # tied output embedding

    # --- public methods (`feature_step`: the trainer's training-step index, passed down to the layers)

    def _encode(self, inputs: Array, mask: Array, deterministic: bool, feature_step: Optional[Array]):
        tokens = self._source_tokens(inputs, mask, deterministic)
        memory, aux = self.encoder(tokens, mask, deterministic=deterministic, feature_step=feature_step)
        return memory, pad_end(with_globals(mask, self.num_global), memory.shape[1], value=False), aux

    def encode(self, inputs: Array, inputs_mask: Optional[Array] = None, *,
               feature_step: Optional[Array] = None) -> tuple[Array, Array]:
        """Encoder (deterministic): inputs int `[B, S]` -> (memory `[B, g+S, d]`, memory mask
        `[B, g+S]`). `feature_step`: the feature draw (required iff redraw_every > 0)."""
        validation.check_feature_step(self, feature_step)
        inputs, mask = validation.source(self, inputs, inputs_mask)
        memory, memory_mask, _ = self._encode(inputs, mask, True, feature_step)
        return memory, memory_mask

    def _decode(self, decoder_inputs: Array, memory: Array, memory_mask: Array,
                deterministic: bool, feature_step: Optional[Array]):
        t = decoder_inputs.shape[1]
        # context parallelism: positions past the table are padding (`validation.target_length`), and T is
        # padded (masked) to a multiple of the shards; causal, so no output changes
        y = self._target_tokens(decoder_inputs, jnp.minimum(jnp.arange(t), self.max_target_len - 1), deterministic)
        length = padded_length(t, self.sequence_axis)
        y, mask = pad_end(y, length), pad_end(decoder_inputs != self.pad_id, length, value=False)
        auxes = []
        for block in self.decoder_blocks:
            y, aux = call_block(block, y, memory, mask=mask, memory_mask=memory_mask,
                                deterministic=deterministic, feature_step=feature_step, remat=self.remat)
            auxes.append(aux)
        return self._logits(y[:, :t]), sum_aux(*auxes)

    def decode(self, decoder_inputs: Array, memory: Array, memory_mask: Array, *,
               feature_step: Optional[Array] = None) -> Array:
        """Teacher-forced decoder (deterministic): decoder_inputs int `[B, T]` (BOS first)
        -> logits float32 `[B, T, V]`. Position t depends only on decoder_inputs[:, :t+1].
        `feature_step`: the feature draw (required iff redraw_every > 0)."""
        validation.check_feature_step(self, feature_step)
        decoder_inputs = validation.int_array("decoder_inputs", decoder_inputs, 2, "[B, T]")
        validation.target_length(self, decoder_inputs.shape[1], "decoder_inputs")
        return self._decode(decoder_inputs, memory, memory_mask, True, feature_step)[0]

    def init_cache(self, memory: Array, memory_mask: Array, *,
                   feature_step: Optional[Array] = None) -> tuple[list, list]:
        """([`DecoderMemory`], [`DecoderState`]) per decoder block (`DecoderBlock.init_cache`).
        `feature_step`: the feature draw (required iff redraw_every > 0)."""
        if not self.supports_cache:
            fail("init_cache needs attention='favor' with a kernel feature_map (exact softmax "
                 "has no constant-size state); decode by recomputation instead")
        validation.check_feature_step(self, feature_step)
        pairs = [block.init_cache(memory, memory_mask, feature_step=feature_step)
                 for block in self.decoder_blocks]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def decode_step(self, static: list, dynamic: list, token: Array,
                    position: Array, *, feature_step: Optional[Array] = None) -> tuple[Array, list]:
        """One decoding step: token int `[B]` at decoder index `position` (int scalar, <
        max_target_len) -> (logits float32 `[B, V]`, new dynamic cache). Equal to row
        `position` of `decode` on the same prefix. `feature_step`: the feature draw `init_cache` used
        (required iff redraw_every > 0)."""
        validation.check_feature_step(self, feature_step)
        if isinstance(position, int) and not 0 <= position < self.max_target_len:
            # (A traced position cannot be checked: past the table it reads jnp.take's NaN fill.)
            fail(f"position must be in [0, max_target_len={self.max_target_len}), got {position}")
        position = jnp.asarray(position, jnp.int32)
        y = self._target_tokens(token[:, None], position[None], True)[:, 0]
        new_dynamic = []
        for block, memory, state in zip(self.decoder_blocks, static, dynamic):
            y, state = block.step(state, y, memory, position=position, feature_step=feature_step)
            new_dynamic.append(state)
        return self._logits(y), new_dynamic

    def __call__(self, batch: dict, *, train: bool = False, feature_step: Optional[Array] = None):
        """Teacher-forced forward pass (see the class docstring); `feature_step` is the
        training-step index (required iff redraw_every > 0: the update's index while training)."""
        validation.check_feature_step(self, feature_step)
        if any(k in batch for k in PACKED_KEYS):
            return self._packed_call(batch, not train, feature_step)
        inputs, mask, targets = validation.seq2seq_batch(self, batch)
        det = not train
        memory, memory_mask, enc_aux = self._encode(inputs, mask, det, feature_step)
        bos = jnp.full(targets.shape[:1] + (1,), self.bos_id, targets.dtype)
        decoder_inputs = jnp.concatenate([bos, targets[:, :-1]], axis=1)
        logits, dec_aux = self._decode(decoder_inputs, memory, memory_mask, det, feature_step)
        return {"logits": logits}, _aux(self, sum_aux(enc_aux, dec_aux))

    def _packed_call(self, batch: dict, det: bool, feature_step: Optional[Array]):
        """`__call__` on a packed batch (zoo_core/data/packing.py, flax's wmt keys): 'inputs' `[B, S]` and
        'targets' `[B, T]` rows of several examples, with 'inputs_segmentation' / 'targets_segmentation'
        (1, 2, ... per example, the same number for an example's source and target; 0 = padding) and
        'inputs_position' / 'targets_position' (restarting per example). Every layer takes the segment
        ids; the encoder lays each document out as `[its globals ; its tokens]` (`packed_layout`), RoPE
        and the decoder's path PE read the positions, the source path PE each document's own length, and
        the decoder is fed [BOS] + the document's previous targets. Each example's logits are those it
        gets alone (tests/htgn_jax/model_test.py)."""
        missing = [k for k in PACKED_KEYS if k not in batch]
        if missing:
            fail(f"a packed batch needs {list(PACKED_KEYS)}; it lacks {missing}")
        lacking = _packing_missing(self)
        if lacking:
            fail(f"HTGN Seq2Seq cannot take packed batches here: these parts take no segment_ids: "
                 f"{', '.join(lacking)} (train with data.packing=False)")
        # A packed row may be wider than max_source_len / max_target_len (data.packing_factor > 1): the
        # positions restart per document, and each document is at most the data's stored width.
        inputs = validation.int_array("inputs", batch["inputs"], 2, "[B, S]")
        targets = validation.int_array("targets", batch["targets"], 2, "[B, T]")
        src_seg, src_pos, tgt_seg, tgt_pos = (validation.int_array(k, batch[k], 2, "[B, L]") for k in PACKED_KEYS)
        if (src_seg.shape != inputs.shape or src_pos.shape != inputs.shape or tgt_seg.shape != targets.shape
                or tgt_pos.shape != targets.shape or inputs.shape[0] != targets.shape[0]):
            fail(f"a packed batch's segmentation and positions must have the shapes of 'inputs' "
                 f"{tuple(inputs.shape)} and 'targets' {tuple(targets.shape)} (one batch size)")
        mask = (inputs != self.pad_id) & (src_seg > 0)
        tokens = self._source_tokens(inputs, mask, det, segment_ids=src_seg, positions=src_pos)
        memory, enc_aux = self.encoder(tokens, mask, deterministic=det, feature_step=feature_step,
                                       segment_ids=src_seg, positions=src_pos)
        memory_ids = pad_end(packed_layout(src_seg, src_pos, self.num_global)[2], memory.shape[1])
        prev = jnp.concatenate([jnp.full_like(targets[:, :1], self.pad_id), targets[:, :-1]], axis=1)
        decoder_inputs = jnp.where(tgt_seg > 0, jnp.where(tgt_pos == 0, self.bos_id, prev), self.pad_id)
        y = self._target_tokens(decoder_inputs, tgt_pos, det)
        t, length = y.shape[1], padded_length(y.shape[1], self.sequence_axis)   # context parallelism: `_decode`
        y, tgt_seg, tgt_pos = pad_end(y, length), pad_end(tgt_seg, length), pad_end(tgt_pos, length)
        auxes = []
        for block in self.decoder_blocks:
            y, aux = call_block(block, y, memory, mask=tgt_seg > 0, memory_mask=memory_ids > 0,
                                deterministic=det, feature_step=feature_step, remat=self.remat,
                                segment_ids=tgt_seg, kv_segment_ids=memory_ids,
                                positions=tgt_pos if self.use_hrpe else None)
            auxes.append(aux)
        return {"logits": self._logits(y[:, :t])}, _aux(self, sum_aux(enc_aux, *auxes))


def _packing_missing(m: Seq2Seq) -> list[str]:
    """The parts `m` uses whose call takes no `segment_ids` in this installation (packing needs them all)."""
    import inspect

    from htgn_jax.graph_layers import CrossGraphAttention, WindowGraphAttention
    from htgn_jax.layers import FavorAttention
    from zoo_core import attention as zoo_attention
    calls = {"FavorAttention": FavorAttention.__call__, "FavorAttention.cross": FavorAttention.cross}
    if m.use_graph_conv:
        calls.update({"WindowGraphAttention": WindowGraphAttention.__call__,
                      "CrossGraphAttention": CrossGraphAttention.__call__})
    if m.use_hrpe:
        calls["hrpe.masked_path_graph_pe"] = hrpe.masked_path_graph_pe
        if m.skip_offsets:
            calls["hrpe.masked_skip_path_graph_pe"] = hrpe.masked_skip_path_graph_pe
    lacking = [name for name, fn in calls.items() if "segment_ids" not in inspect.signature(fn).parameters]
    if m.attention not in ("favor", "softmax") and not zoo_attention.capabilities(m.attention)["segment_ids"]:
        lacking.append(f"the encoder attention {m.attention!r}")
    return lacking


class Classifier(_HTGNModel, kw_only=True):
    """HTGN encoder-only image classifier (htgn.md §5.1 "Classification", §5.12 image-patch).

    The image `[B, H, W, C]` is cut into non-overlapping p x p patches in raster order (N =
    (H/p)(W/p) tokens); with HRPE each patch vector is concatenated with the 2-D grid spectral
    encodings (`hrpe.grid_graph_pe`) and projected to d ('patch_embed'); without HRPE a learned
    position table ('pos_embed') is added. The WinGAT graph is the 2-D stencil of radius `window`
    on the W_p x W_p patch grid (htgn.md §5.12; `window=1`: the 8-neighbourhood and self), plus the
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
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    pool: str = "cls"
    window: int = 1        # image defaults of two shared fields: a 3x3 stencil, one CLS global
    num_global: int = 1

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    def setup(self):
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.patch_embed = nn.Dense(self.d_model, name="patch_embed", **dense)
        if not self.use_hrpe:
            self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02),
                                        (self.grid ** 2, self.d_model), self.param_dtype)
        self.dropout = Dropout(self.dropout_rate, position_axis=1)  # keyed by position: padding to P shards changes no mask
        config = BlockConfig.from_module(
            self, grid_width=self.grid if self.use_graph_conv else None)
        self.encoder = Encoder(config, self.num_layers, self.drop_path, self.per_layer_features,
                               name="encoder")
        self.head = nn.Dense(self.num_classes, name="head", **dense)

    def __call__(self, batch: dict, *, train: bool = False, feature_step: Optional[Array] = None):
        """Forward pass (see the class docstring); `feature_step` as in `Seq2Seq.__call__`."""
        validation.check_feature_step(self, feature_step)
        x = validation.image(self, batch)
        b, p, gr = x.shape[0], self.patch_size, self.grid
        patches = x.reshape(b, gr, p, gr, p, self.channels).transpose(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(b, gr * gr, p * p * self.channels)
        patches = patches.astype(self.dtype or jnp.promote_types(x.dtype, jnp.float32))
        if self.use_hrpe:
            pe = (hrpe.skip_grid_graph_pe(gr, gr, self.num_pe, tuple(self.skip_offsets),
                                          dtype=patches.dtype) if self.skip_offsets
                  else hrpe.grid_graph_pe(gr, gr, self.num_pe, dtype=patches.dtype))
            h = self.patch_embed(jnp.concatenate(
                [patches, jnp.broadcast_to(pe[None], (b,) + pe.shape)], axis=-1))
        else:
            h = self.patch_embed(patches) + self.pos_embed.astype(patches.dtype)[None]
        det = not train
        h = self.dropout(h, deterministic=det)
        mask = jnp.ones((b, gr * gr), bool)
        memory, aux = self.encoder(h, mask, deterministic=det, feature_step=feature_step)
        memory = memory[:, :self.num_global + gr * gr]   # without the padding of context parallelism
        pooled = memory[:, 0] if self.pool == "cls" else jnp.mean(memory[:, self.num_global:], 1)
        logits = self.head(pooled).astype(jnp.float32)
        return {"logits": logits}, _aux(self, aux)


# ---------------------------------------------------------------------------------------------
# Factory (the only place that reads config values).
# ---------------------------------------------------------------------------------------------

KINDS: dict[str, type] = {"seq2seq": Seq2Seq, "classifier": Classifier}

# Defaults that attention='softmax' (the vanilla Transformer baseline) changes unless given. The
# seq2seq baseline also has no learned global tokens (a vanilla encoder-decoder has none); the
# classifier keeps its one global token as the ViT-style CLS token it pools.
SOFTMAX_BASELINE_DEFAULTS = {"use_graph_conv": False, "use_hrpe": False, "kl_weight": 0.0}
SOFTMAX_BASELINE_KIND_DEFAULTS = {"seq2seq": {"num_global": 0}, "classifier": {}}

# Model kwargs that name an ablation (htgn.md §5.13), for the configs.
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


def model_kwargs(kind: str) -> tuple[str, ...]:
    """The constructor kwargs accepted by `Model(kind=kind, ...)` besides `kind` and `variant`."""
    if kind not in KINDS:
        fail(f"kind must be one of {tuple(KINDS)}, got {kind!r}")
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
        None leaves a field unset and dtypes may be named (`zoo_core.checks.constructor_kwargs`).

    Returns:
      An unbound Linen module: `apply(variables, batch, train=...)` -> ({'logits'}, aux).

    Raises:
      ValueError: unknown kind, variant or kwarg, or an invalid value (named), before any compile.
    """
    kwargs = constructor_kwargs(kwargs)
    allowed = model_kwargs(kind)
    if variant is not None and variant not in VARIANTS:
        fail(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        fail(f"unknown Model kwargs for kind={kind!r}: {unknown}; allowed: {list(allowed)}")
    args = {k: v for k, v in (VARIANTS[variant] if variant else {}).items() if k in allowed}
    if kwargs.get("attention", "favor") != "favor":
        for k, v in {**SOFTMAX_BASELINE_DEFAULTS, **SOFTMAX_BASELINE_KIND_DEFAULTS[kind]}.items():
            if k not in kwargs:
                args[k] = v
    args.update(kwargs)
    if isinstance(args.get("skip_offsets"), list):   # a config's list: a hashable module field
        args["skip_offsets"] = tuple(args["skip_offsets"])
    validation.check_switched_off(kwargs, args)
    fields = {f.name: f for f in dataclasses.fields(KINDS[kind])}
    missing = [n for n in allowed if fields[n].default is dataclasses.MISSING and n not in args]
    if missing:
        fail(f"Model(kind={kind!r}) is missing required kwargs {missing}")
    module = KINDS[kind](**args)
    resolved = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)}
    validation.check_common(resolved)   # raise on bad values now, not at the first trace
    (validation.check_seq2seq if kind == "seq2seq" else validation.check_classifier)(resolved)
    return module
