"""HTGN (Hybrid Transformer-Graph Network) in JAX/Flax: FAVOR+, HRPE, windowed graph attention.

See the shared spec `htgn.md`. Modules by concern: `ops` (FAVOR+ kernels: random features, feature
maps; the causal forms are `zoo_core.ops.linear_attention`), `graph_ops` (window / causal / Cross-Graph
GAT kernels), `layers` (`FavorAttention`), `graph_layers` (`WindowGraphAttention`,
`CrossGraphAttention`), `hrpe` (rotary and spectral encodings), `blocks` (encoder and decoder
blocks, `BlockConfig`), `model` (`Seq2Seq`, `Classifier`, `VARIANTS`, the `Model` factory),
`validation` (the `Model(...)` boundary checks), `decoding` (greedy / beam search, BLEU evaluator),
`analysis` (pictures and error curves). Only light re-exports here.
"""
from htgn_jax.blocks import BlockConfig, DecoderMemory, DecoderState
from htgn_jax.graph_causal import WindowState
from htgn_jax.graph_layers import CrossGraphAttention, CrossGraphCache, WindowGraphAttention
from htgn_jax.layers import FavorAttention
from htgn_jax.model import VARIANTS, Classifier, Model, Seq2Seq
from zoo_core.ops.linear_attention import LinearState  # FAVOR+'s causal state and cross cache (S, z)

__all__ = ["BlockConfig", "Classifier", "CrossGraphAttention", "CrossGraphCache", "DecoderMemory",
           "DecoderState", "FavorAttention", "LinearState", "Model", "Seq2Seq",
           "VARIANTS", "WindowGraphAttention", "WindowState"]
