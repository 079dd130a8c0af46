"""HTGN (Hybrid Transformer-Graph Network) in JAX/Flax: FAVOR+, HRPE, windowed graph attention.

See /shared specs `htgn.md`: `ops` (FAVOR+ kernels), `hrpe` (rotary and spectral encodings),
`layers` (Flax modules), `graph` (window / Cross-Graph GAT), `model` (encoder-decoder and
classifier, `Model` factory), `decoding` (greedy / beam search, BLEU evaluator). Only light
re-exports here.
"""
from htgn_jax.layers import FavorAttention
from htgn_jax.model import VARIANTS, Classifier, Model, Seq2Seq

__all__ = ["Classifier", "FavorAttention", "Model", "Seq2Seq", "VARIANTS"]
