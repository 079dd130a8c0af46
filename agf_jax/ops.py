"""Pure AGF (Attentive Graph Filter) kernels: singular factors, polynomial filter, all forms.

Paper: H. Wi, J. Choi, N. Park, "Learning Advanced Self-Attention for Linear Transformers in the
Singular Value Domain", IJCAI 2025 (arXiv 2505.08516); reference code jeongwhanchoi/agf
(`AGF_LRA/attention_svd.py`, `AGF_LRA/polyconv.py`, `AGF_UEA/models/AGF_Attention.py`). Section
numbers below refer to the project spec `agf.md`, which was checked against the reference code
(the paper's own equation numbers were not available to the spec writers).

Notation (shape letters of the zoo): B batch, T sequence, H heads, D head width of the singular
vectors, M value head width, K polynomial order.

Non-causal AGF, per head (agf.md §2.2-2.3):

        U = softmax_D(Z_U)                     left singular vectors, each token's row sums to 1
        V = softmax_T(Z_V - 1e9 (1 - mask))    right singular vectors, each column sums to 1 over T
        s = sigmoid(Z_S)                       token-specific "singular values", in (0, 1)^D
        g = sum_k c_k P_k(s)                   elementwise polynomial filter, c_k = tanh(theta_k)
        O = (U * g) (V^T Val)                  O(T D M); the implicit T x T matrix is never formed

with the implicit attention matrix H_tj = sum_k U_tk g_tk V_jk (token-specific spectrum diag(g_t)).
The orthogonality regulariser (agf.md §2.5, pitfall 5) is, per sample,
mean_{H,D,D} |U^T U - I| + mean_{H,D,D} |V^T V - I|.

**Causal AGF (an extension; the paper and the reference code do not have it).** For
autoregressive use the right factor of token t is normalised over the prefix only,

        V^(t)_jk = exp(Z_V[j,k]) / sum_{i<=t} exp(Z_V[i,k])   for j <= t,
        O_t = (U_t * g_t) (V^(t)T Val_{<=t}) = sum_k A_tk N_t[k, :] / z_t[k],   A = U * g,

with N_t = sum_{j<=t} exp(Z_V[j]) (x) Val_j [D, M] and z_t = sum_{j<=t} exp(Z_V[j]) [D]. This is an
online softmax per (head, feature k), so the recurrent state is (N, z, m) with a running maximum m
for stability: O(D M) per head, O(T D M) for the whole sequence. U, s and g are token-local and need
no change. At the last position V^(T) equals the non-causal V, so the final causal output equals
the non-causal one. Four forms compute the same numbers: `agf_parallel(causal=True)`
(associative scan over the online-softmax monoid), `agf_chunked` (exact intra-chunk sums with
per-row maxima plus the state of the previous chunks: `agf_chunked_scan` carries it through a
`lax.scan` on the CPU, `agf_chunked_parallel` computes every chunk's state at once on GPUs and
TPUs), `agf_scan` (`jax.lax.scan`) and `agf_step`.

*Packed sequences* (`segment_ids` int `[B, T]`, 0 = padding; docs/agf_options.md): every form computes
each document as if alone. Causal forms cut (N, z, m) at each document start by a gated merge; the
global form normalises V per document and reads it as packed global linear attention; the
regulariser is each document's alone, a row's value the mean over its documents. *Context
parallelism* (`agf_jax.context_parallel`): the same merges over the shards of a `sequence` mesh axis.

*Regulariser in causal mode (design choice, documented here once).* `orthogonality_loss` is the same
function in both modes: U is token-local, and V is taken as the whole-sequence softmax, which is
V^(T), the right factor of the last (full) prefix. We do not average a per-prefix penalty: V^(t) has
only t rows, so for t < D the columns cannot be orthonormal and |V^(t)T V^(t) - I| has a floor that
would dominate early positions and make the penalty's scale depend on T. The regulariser only enters
the loss, so it leaks no future information into any output. The recurrent forms (`agf_scan`,
`agf_step`) are inference forms and do not compute it.

Masking is NaN-safe (the zoo's layer contract): padded V logits and values are replaced with
`jnp.where` (`masked_logits`, `zoo_core.ops.masking.zero_padding`), never multiplied by 0, so a padded position holding
NaN or 1e30 changes no valid output; the chunked form also replaces a non-finite Z_V / Val at a
valid position and sets every output at or after it to NaN, as the recurrence gives. Finite inputs
give the reference's numbers bit for bit.

All attention maths runs in float32 (float64 stays float64) whatever the input dtype, as the
reference does under AMP (agf.md §2.3, pitfall 8); outputs are returned in that float type and callers
cast back.

The code lives in one module per concern, and every name is importable from here:

* `agf_jax.basis`: the polynomial basis, its recurrences and the filter coefficients;
* `agf_jax.factors`: the masked V logits, the singular factors and the orthogonality regulariser;
* `agf_jax.fused`: the non-causal training form with its hand-written backward pass;
* `agf_jax.forms`: the parallel, chunked, recurrent and step forms, and the explicit matrix.
"""

from __future__ import annotations

from agf_jax.basis import (
                           BASES,
                           JACOBI_DEFAULT_ALPHA,
                           JACOBI_DEFAULT_BETA,
                           basis_and_derivative_iter,
                           basis_iter,
                           filter_coefficients,
                           graph_filter,
                           jacobi_abc,
                           polynomial_basis,
                           resolve_basis,
)
from agf_jax.factors import (
                           MASK_OFFSET,
                           AGFFactors,
                           agf_factors,
                           as_float,
                           check_projections,
                           left_factor,
                           masked_logits,
                           orthogonality_loss,
)
from agf_jax.forms import (
                           AGFState,
                           agf_attention_matrix,
                           agf_chunked,
                           agf_chunked_parallel,
                           agf_chunked_scan,
                           agf_parallel,
                           agf_scan,
                           agf_step,
                           init_state,
)
from agf_jax.fused import agf_with_orthogonality, agf_with_orthogonality_plain
from zoo_core import moved

__all__ = ["BASES", "JACOBI_DEFAULT_ALPHA", "JACOBI_DEFAULT_BETA", "MASK_OFFSET", "AGFFactors",
           "AGFState", "agf_attention_matrix", "agf_chunked",
           "agf_chunked_parallel", "agf_chunked_scan", "agf_factors", "agf_parallel",
           "agf_scan", "agf_step", "agf_with_orthogonality",
           "agf_with_orthogonality_plain", "as_float", "basis_and_derivative_iter",
           "basis_iter", "check_projections", "filter_coefficients", "graph_filter",
           "init_state", "jacobi_abc", "left_factor", "masked_logits",
           "orthogonality_loss", "polynomial_basis", "resolve_basis"]


# The names of 0.1.0 that were renamed warn and give the new function (zoo_core.moved.RENAMED).
__getattr__ = moved.renamed_getattr(__name__)
