"""SAMoVAR in JAX/Flax: linear transformers read as VAR models (Lu & Yang, ICML 2025, arXiv:2502.07244).

Modules: `ops` (pure kernels: the VAR attention chain in parallel, chunked, scan and single-step
forms on `zoo_core.ops.linear_attention`; structural matrix; instance norm and patching), `layers` (the
causal attention layers `LinearAttention`, `LinTransBlock`, `VARChain` and their states), `modules`
(norms, MLP, ARX tokeniser and embeddings, structural matrix), `model` (`Model(**config.model)`,
`Forecaster`, `VARIANTS`), `baselines` (DLinear), `evaluation` (test-split evaluator), `convert`
(reference PyTorch state_dict -> Flax params, golden check CLI), `analysis` (effective lag matrices,
path weights, VAR-coefficient recovery).
"""
from samovar_jax.baselines import DLinear
from samovar_jax.layers import LinearAttention, LinearState, LinTransBlock, VARChain, VARChainState
from samovar_jax.model import KINDS, VARIANTS, Forecaster, Model
from samovar_jax.modules import ARXEmbedding, ARXTokenizer, MLPBlock, MultiHeadRMSNorm, RMSNorm, StructuralMatrix

__all__ = ["ARXEmbedding", "ARXTokenizer", "DLinear", "Forecaster", "KINDS", "LinTransBlock", "LinearAttention",
           "LinearState", "MLPBlock", "Model", "MultiHeadRMSNorm", "RMSNorm", "StructuralMatrix", "VARChain",
           "VARChainState", "VARIANTS"]
