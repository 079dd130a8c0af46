"""Every attention of the zoo behind one name, as a drop-in for Flax's `nn.MultiHeadDotProductAttention`.

    from zoo_core import attention
    attn = attention.make("agf", num_heads=8, qkv_features=512)      # instead of
    attn = nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=512)
    y = attn(x, mask=mask, deterministic=not train)                  # x [B, T, E], mask [B, T] bool

`make` returns a Linen module with the call style of `flax.linen.MultiHeadDotProductAttention`
(`DropInAttention`):

* self-attention `attn(inputs_q, *, mask=None, deterministic=True)`, inputs_q `[B, T, E]`, `mask`
  a bool `[B, T]` key-padding mask (True = valid; the mechanisms are linear in T and never build a
  `[T, T]` mask);
* cross-attention `attn(inputs_q, inputs_k, *, mask=None)` or `attn(inputs_q, inputs_kv=memory)`,
  memory `[B, S, E_m]`, `mask` a bool `[B, S]` key-padding mask of the memory;
* `decode=True` (Flax's decoding convention, as flax's examples/wmt drive it): `init` on
  `[B, L, E]` creates the collection 'cache' (the layer's own State, O(1) in L for the linear
  mechanisms, the last w and first g keys/values for Longformer, a key/value cache of L slots for
  softmax, and the step index `cache_index`); each
  `apply(..., mutable=['cache'])` on `[B, 1, E]` is one token and advances it. A causal
  self-attention and a decoder's cross-attention both take it (the Cross-Graph layer reads the
  query's position from the index). After init, a causal self-attention of `prefills()` also takes a
  prompt `[B, L, E]` in one call (its sequence form from the cached state, context-parallel with
  `sequence_axis`: a prompt prefilled over P devices), which advances the cache by L tokens; the
  one-token calls continue from there.

y has `out_features` (default: the width of inputs_q). Auxiliary losses of the mechanism (AGF's
orthogonality term; the graph KL with `kl_weight` > 0) are sown into the collection 'losses', so a
training loop written outside the zoo collects them with `mutable=['losses']` and adds
`sum(jax.tree_util.tree_leaves(state['losses']))` to its loss.

`options(name)` lists a mechanism's own fields (what `**options` may name); `length_option(name)`
names the one a model must set to its longest sequence, if any (Linformer's `max_length`).

`capabilities(name)` says what a mechanism has ('self': non-causal self-attention, 'causal',
'decode', 'cross', and for packed sequences and context parallelism 'segment_ids', 'kv_segment_ids',
'positions', 'context_parallel'); `names('cross')` lists those with a cross form, and so on.

Packed sequences (issue 42; docs/specs/context_parallel.md): `attn(x, segment_ids=ids)` with ids int
`[B, T]` (0 = padding; a token attends only within its document), `positions` int `[B, T]` (restarting
per document) where the mechanism has positions, and in cross-attention `kv_segment_ids` `[B, S]` for
the memory. A mechanism whose form cannot take one refuses it in one line naming it.

`layer(name, ...)` takes the same arguments and returns the mechanism's own self-attention layer,
which follows the zoo's layer contract (README "Layer contract": `(y, aux)`, and `init_state` /
`scan` / `step` on the causal ones) for recurrent decoding.

The mechanisms live in the architecture packages and in `zoo_core.baselines` (Linformer,
Nyströmformer); this module imports them only when a name is used, so `zoo_core` stays free of them
at import time.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from zoo_core.attention import registry
from zoo_core.attention.dropin import DropInAttention
from zoo_core.attention.registry import (
    CAPABILITIES,
    PACKED_ARGS,
    capabilities,
    layer,
    length_option,
    names,
    options,
    prefills,
)

__all__ = ["CAPABILITIES", "PACKED_ARGS", "DropInAttention", "capabilities", "layer", "length_option", "make", "names",
           "options", "prefills"]


def make(name: str, *, num_heads: int, qkv_features: int, out_features: Optional[int] = None,
         causal: bool = False, decode: bool = False, dtype: Any = jnp.float32,
         param_dtype: Any = jnp.float32, sequence_axis: Optional[str] = None, **options) -> nn.Module:
    """A drop-in attention module for mechanism `name`, in the call style of
    `nn.MultiHeadDotProductAttention` (self- or cross-attention, chosen by the call).

    Args:
      name: one of `names()`.
      num_heads: H.
      qkv_features: H * D, the width of queries, keys and values (D = qkv_features / H).
      out_features: output width (None: the width of inputs_q, as Flax's attention).
      causal: causal (autoregressive) self-attention; a mechanism without that mode raises here.
      decode: Flax's decoding convention (the module docstring): a causal self-attention or a
        decoder's cross-attention that takes one token per call and keeps its state in 'cache'.
      dtype: compute dtype (sums and states stay float32).
      param_dtype: parameter dtype.
      sequence_axis: the mesh axis T is split over (context parallelism; None: a single-device
        program, unchanged). The module is then called under `jax.set_mesh(mesh)` with inputs sharded
        along T on that axis and gives the unsharded call's numbers. A mechanism without a
        context-parallel form (`capabilities(name)['context_parallel']`) refuses it in one line.
      **options: the mechanism's own fields (e.g. AGF's `order`, `basis`; FAVOR+'s `num_features`;
        `dropout_rate` where the mechanism has dropout; the Cross-Graph layer's `window`, `rho`); an
        unknown one raises, naming the choices, and one of the other form raises at the call.

    Returns:
      A Linen module `module(inputs_q, inputs_k=None, *, inputs_kv=None, mask=None,
      deterministic=True, segment_ids=None, kv_segment_ids=None, positions=None) -> y`.
    """
    if sequence_axis is not None:
        if not isinstance(sequence_axis, str):
            raise ValueError(f"`sequence_axis` must be a mesh axis name or None, got {sequence_axis!r}")
        options = dict(options, sequence_axis=sequence_axis)
    registry.check(name, num_heads=num_heads, qkv_features=qkv_features, out_features=out_features,
                   causal=causal, decode=decode, options=options)
    return DropInAttention(mechanism=name, num_heads=num_heads, head_dim=qkv_features // num_heads,
                           out_features=out_features, causal=causal, decode=decode, dtype=dtype,
                           param_dtype=param_dtype, options=tuple(sorted(options.items())))
