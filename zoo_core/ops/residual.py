"""The residual wiring of a Transformer block's sub-layers, written once for the packages' blocks.

A block's sub-layer (attention, MLP) is wrapped as Pre-LN, `x + Drop(f(LN(x)))`, or Post-LN,
`LN(x + Drop(f(x)))` (Xiong et al. 2020 name the two placements); its position-wise MLP is
`W2 Drop(act(W1 x))`. The norm (LayerNorm, RMSNorm, with the paper's epsilon), the dropout and the
dense layers are the block's own modules, so parameter names stay each package's.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax

Array = jax.Array
Fn = Callable[[Array], Array]


def residual(x: Array, branch: Fn, *, norm: Fn, drop: Fn, pre: bool = True) -> Array:
    """Pre-LN `x + drop(branch(norm(x)))`, or Post-LN `norm(x + drop(branch(x)))` (pre=False).

    Args:
      x: `[..., E]` the block's stream.
      branch: the sub-layer, `[..., E] -> [..., E]`.
      norm: the sub-layer's norm module.
      drop: the dropout on the branch output (bound to its `deterministic` flag; identity if none).
      pre: Pre-LN (True) or Post-LN (False).

    Returns:
      `[..., E]`.
    """
    if pre:
        return x + drop(branch(norm(x)))
    return norm(x + drop(branch(x)))


def feed_forward(x: Array, dense_in: Fn, dense_out: Fn, activation: Fn, drop: Optional[Fn] = None) -> Array:
    """The position-wise MLP `dense_out(drop(activation(dense_in(x))))`; `drop` None: no inner dropout.

    Args:
      x: `[..., E]`.
      dense_in, dense_out: the block's E -> F and F -> E dense layers.
      activation: e.g. GELU.
      drop: the dropout between the two (bound to its `deterministic` flag), or None.

    Returns:
      `[..., E]`.
    """
    h = activation(dense_in(x))
    return dense_out(h if drop is None else drop(h))
