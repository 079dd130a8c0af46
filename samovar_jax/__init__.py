"""SAMoVAR in JAX/Flax: linear transformers read as VAR models (Lu & Yang, ICML 2025, arXiv:2502.07244).

Modules: `ops` (pure kernels: the VAR attention chain and causal linear attention in parallel,
chunked, recurrent and single-step forms; structural matrix; instance norm and patching),
`layers` (Flax layers), `model` (`Model(**config.model)`, `VARIANTS`), `convert` (reference
PyTorch state_dict -> Flax params, golden check CLI), `analysis` (effective lag matrices, path
weights, VAR-coefficient recovery).
"""
from samovar_jax.layers import (ARXEmbedding, ARXTokenizer, LinearAttentionBlock, LinTransBlock, MLPBlock,
                                MultiHeadRMSNorm, RMSNorm, StructuralMatrix, VARChain)
from samovar_jax.model import KINDS, VARIANTS, Model

__all__ = ["ARXEmbedding", "ARXTokenizer", "KINDS", "LinTransBlock", "LinearAttentionBlock", "MLPBlock",
           "Model", "MultiHeadRMSNorm", "RMSNorm", "StructuralMatrix", "VARChain", "VARIANTS"]
