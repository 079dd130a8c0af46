"""The attentions the seed papers compare against (docs/specs/baselines.md), one module each.

* `linformer`: Linformer (Wang et al., 2020), keys and values projected along the sequence.
* `nystromformer`: Nyströmformer (Xiong et al., 2021), landmarks and an iterative pseudo-inverse.
* `reformer`: Reformer (Kitaev et al., 2020), shared-QK LSH attention in sorted chunks.
* `longformer`: Longformer (Beltagy et al., 2020), a sliding window plus global tokens.

Each module holds the maths as pure `jnp` functions and a Flax layer that follows the zoo's layer
contract (README "Layer contract"); the registry (`zoo_core.attention`) names them. The layers
share `ProjectedAttention`: the projections of the softmax baseline (`agf_jax.layers.SoftmaxAttention`),
with the same names, shapes and initialisers, so that a baseline takes softmax's parameters and the
equality properties of the spec can be checked on them:

    query, key, value   kernel [E, H, D], bias [H, D]
    out                 kernel [H, D, E'], bias [E']
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo_core import checks
from zoo_core.ops import masking, xla_forms
from zoo_core.ops.dropout import Dropout, keep_mask

Array = jax.Array
Initializer = Callable[..., Array]

# What a refusal of `segment_ids` offers instead: softmax-based mechanisms that keep packed documents apart.
PACKING_BASELINES = "softmax, longformer (or a linear mechanism: linear, favor, agf)"

# PyTorch's nn.Linear weight init (kaiming-uniform, a = sqrt 5): the softmax baseline's default.
TORCH_LINEAR_KERNEL_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class ProjectedAttention(nn.Module):
    """Fields and projections shared by the baseline layers (not a layer itself).

    Attributes:
      num_heads: H.
      head_dim: D (queries, keys and values).
      out_features: E' (None: the input width E).
      dropout_rate: dropout on the attention weights (the softmax baseline's `dropout_rate`).
      dtype: compute dtype of the projections (None: inferred); softmax statistics, normalisers and
        the attention maths are float32.
      param_dtype: parameter dtype.
      kernel_init, bias_init, out_bias_init: initialisers, as in the softmax baseline.
    """
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = TORCH_LINEAR_KERNEL_INIT
    bias_init: Initializer = nn.initializers.zeros_init()
    out_bias_init: Optional[Initializer] = None
    # False where the definition mixes the whole sequence, so that `segment_ids` is refused (the registry's
    # capabilities read it).
    keeps_documents_apart: ClassVar[bool] = True

    def _check_common(self) -> None:
        checks.check_int("num_heads", self.num_heads, 1)
        checks.check_int("head_dim", self.head_dim, 1)
        checks.check_optional_int("out_features", self.out_features, 1)
        checks.check_rate("dropout_rate", self.dropout_rate)

    def _projection(self, name: str, dtype: Any = None) -> nn.Module:
        """The per-head projection `name`, computing in `dtype` (None: the layer's)."""
        return xla_forms.DenseGeneral(features=(self.num_heads, self.head_dim), dtype=dtype or self.dtype,
                                      param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                      bias_init=self.bias_init, name=name)

    def _qkv_layers(self) -> None:
        """Declares `query`, `key`, `value` and the weight dropout (call from `setup`)."""
        self.query, self.key = self._projection("query"), self._projection("key")
        self.value = self._projection("value")
        self.dropout = Dropout(self.dropout_rate)

    @nn.compact
    def _out(self, o: Array, width: int) -> Array:
        # E' defaults to the input width, unknown in setup(): declared in this compact method.
        return xla_forms.DenseGeneral(self.out_features or width, axis=(-2, -1), dtype=self.dtype,
                                      param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                      bias_init=self.out_bias_init or self.bias_init, name="out")(o)

    def _compute_dtype(self, x: Array):
        return self.dtype if self.dtype is not None else jnp.result_type(x, self.param_dtype)

    def _finish(self, o: Array, x: Array) -> Array:
        """o `[B, T, H, D]` float32 -> y `[B, T, E']` in the compute dtype."""
        return self._out(o.astype(self._compute_dtype(x)), x.shape[-1])

    def _weights_dropout(self, deterministic: bool) -> Optional[Callable[[Array], Array]]:
        """`w -> dropout(w)` on attention weights, or None when no dropout applies."""
        if deterministic or self.dropout_rate == 0.0:
            return None
        return lambda w: self.dropout(w, deterministic=False)

    def _indexed_dropout(self, deterministic: bool) -> Optional[Callable[[Array, int], Array]]:
        """`(w, index) -> dropout(w)` for kernels that drop several weight arrays of one call (each
        index its own bits, folded into one 'dropout' key), or None when no dropout applies."""
        if deterministic or self.dropout_rate == 0.0:
            return None
        rng, keep = self.make_rng("dropout"), 1.0 - self.dropout_rate

        def drop(w, index):
            return jnp.where(keep_mask(jax.random.fold_in(rng, index), keep, w.shape), w / keep, 0.0)
        return drop

    @staticmethod
    def _refuse_segments(segment_ids: Optional[Any], name: str, what: str) -> None:
        """One line for a baseline whose definition mixes the whole sequence (`what`: its projections,
        landmarks or buckets), so that packed documents (`segment_ids`, issue 42) would read each other."""
        if segment_ids is not None:
            checks.fail(f"{name} mixes the whole sequence in its {what}; it cannot keep packed documents "
                        f"apart: unpack, or use one of {PACKING_BASELINES}")

    @staticmethod
    def _check_inputs(x: Any, mask: Optional[Any]) -> None:
        checks.check_tokens("x", x, "[B, T, E]")
        masking.check_mask(mask, jnp.shape(x)[:2])
