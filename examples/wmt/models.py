"""Transformer encoder-decoder in the layout of flax's examples/wmt/models.py (Vaswani et al. 2017),
with each `nn.MultiHeadDotProductAttention` replaced by `zoo_core.attention.make`.

Three attention roles, each a mechanism name of `attention.names()`:

* encoder self-attention `attn(x, mask=src_mask)` (one of `attention.names('self')`);
* decoder causal self-attention with Flax's `decode` cache (`attention.names('causal', 'decode')`);
* decoder cross-attention `attn(y, encoded, mask=src_mask)` (`attention.names('cross')`), also built
  with `decode`, since the Cross-Graph layer reads the query's position from the cache.

Shapes: inputs `[B, S]` int, targets `[B, T]` int (0 = padding) -> logits `[B, T, V]`.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from zoo_core import attention
from zoo_core.ops.positions import sinusoidal_table


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters (flax's wmt names) and the three attention mechanisms with their options
    (tuples of (name, value) pairs, so that the config stays hashable)."""
    vocab_size: int
    output_vocab_size: int
    emb_dim: int = 32
    num_heads: int = 2
    num_layers: int = 1
    qkv_dim: int = 32
    mlp_dim: int = 64
    max_len: int = 64
    dropout_rate: float = 0.0
    deterministic: bool = False
    decode: bool = False
    encoder_attention: str = "softmax"
    decoder_attention: str = "softmax"
    cross_attention: str = "softmax"
    encoder_options: tuple = ()
    decoder_options: tuple = ()
    cross_options: tuple = ()

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


def shift_right(x: jnp.ndarray, bos: int) -> jnp.ndarray:
    """Teacher forcing: `[B, T]` -> `[bos, x_0, ..., x_{T-2}]`."""
    return jnp.concatenate([jnp.full(x.shape[:1] + (1,), bos, x.dtype), x[:, :-1]], axis=1)


class AddPositionEmbs(nn.Module):
    """Adds sinusoidal positions; with `decode`, one position per call from its own cache index."""
    config: TransformerConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        table = jnp.asarray(sinusoidal_table(self.config.max_len, x.shape[-1]))
        if not self.decode:
            return x + table[None, :x.shape[1]]
        initialised = self.has_variable("cache", "cache_index")
        index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        if not initialised:   # init on the whole length
            return x + table[None, :x.shape[1]]
        i = index.value
        index.value = i + 1
        return x + table[i][None, None]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        cfg = self.config
        y = nn.relu(nn.Dense(cfg.mlp_dim)(x))
        y = nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
        y = nn.Dense(x.shape[-1])(y)
        return nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)


class Encoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        cfg = self.config
        # was: nn.MultiHeadDotProductAttention(num_heads=..., qkv_features=...)(y, mask=attention_mask)
        attn = attention.make(cfg.encoder_attention, num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim,
                              **dict(cfg.encoder_options))
        y = attn(nn.LayerNorm()(x), mask=mask, deterministic=cfg.deterministic)
        x = x + nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
        return x + MlpBlock(cfg)(nn.LayerNorm()(x))


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, y: jnp.ndarray, encoded: jnp.ndarray, encoder_mask: jnp.ndarray) -> jnp.ndarray:
        cfg = self.config
        self_attn = attention.make(cfg.decoder_attention, num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim,
                                   causal=True, decode=cfg.decode, **dict(cfg.decoder_options))
        z = self_attn(nn.LayerNorm()(y), deterministic=cfg.deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(z, deterministic=cfg.deterministic)
        cross_attn = attention.make(cfg.cross_attention, num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim,
                                    decode=cfg.decode, **dict(cfg.cross_options))
        z = cross_attn(nn.LayerNorm()(y), encoded, mask=encoder_mask, deterministic=cfg.deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(z, deterministic=cfg.deterministic)
        return y + MlpBlock(cfg)(nn.LayerNorm()(y))


class Encoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        cfg = self.config
        mask = inputs > 0
        x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(inputs.astype(jnp.int32))
        x = AddPositionEmbs(cfg)(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=cfg.deterministic)
        for i in range(cfg.num_layers):
            x = Encoder1DBlock(cfg, name=f"encoderblock_{i}")(x, mask)
        return nn.LayerNorm(name="encoder_norm")(x)


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, encoded: jnp.ndarray, encoder_mask: jnp.ndarray,
                 decoder_inputs: jnp.ndarray) -> jnp.ndarray:
        """decoder_inputs `[B, T]` (shifted right; `[B, 1]` per step with decode) -> logits."""
        cfg = self.config
        y = nn.Embed(cfg.output_vocab_size, cfg.emb_dim)(decoder_inputs.astype(jnp.int32))
        y = AddPositionEmbs(cfg, decode=cfg.decode)(y)
        y = nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
        for i in range(cfg.num_layers):
            y = EncoderDecoder1DBlock(cfg, name=f"encoderdecoderblock_{i}")(y, encoded, encoder_mask)
        y = nn.LayerNorm(name="encoderdecoder_norm")(y)
        return nn.Dense(cfg.output_vocab_size, name="logitdense")(y)


class Transformer(nn.Module):
    """`encode(inputs)`, `decode(encoded, inputs, decoder_inputs)`, and both in `__call__`."""
    config: TransformerConfig

    def setup(self):
        self.encoder = Encoder(self.config)
        self.decoder = Decoder(self.config)

    def encode(self, inputs: jnp.ndarray) -> jnp.ndarray:
        return self.encoder(inputs)

    def decode(self, encoded: jnp.ndarray, inputs: jnp.ndarray,
               decoder_inputs: jnp.ndarray) -> jnp.ndarray:
        return self.decoder(encoded, inputs > 0, decoder_inputs)

    def __call__(self, inputs: jnp.ndarray, decoder_inputs: jnp.ndarray) -> jnp.ndarray:
        return self.decode(self.encode(inputs), inputs, decoder_inputs)
