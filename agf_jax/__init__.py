"""AGF (Attentive Graph Filter) in JAX/Flax: Wi, Choi, Park, "Learning Advanced Self-Attention for
Linear Transformers in the Singular Value Domain", IJCAI 2025 (arXiv 2505.08516).

Modules: `ops` (pure AGF kernels, all forms incl. the causal extension), `softmax` (the baseline's
kernels and its `KVCache`), `layers` (`AGFAttention`, `SoftmaxAttention`, the zoo's layer
contract), `model` (`Model` factory, LRA/UEA models), `convert` (reference PyTorch weights, golden
checker CLI), `analysis` (filter responses, implicit attention, frequency content, over-smoothing).
"""
from agf_jax.layers import AGFAttention, SoftmaxAttention
from agf_jax.model import VARIANTS, LRAClassifier, LRARetrieval, Model, UEAClassifier
from agf_jax.ops import AGFState
from agf_jax.softmax import KVCache

__all__ = ["AGFAttention", "SoftmaxAttention", "AGFState", "KVCache", "Model", "VARIANTS",
           "LRAClassifier", "LRARetrieval", "UEAClassifier"]
