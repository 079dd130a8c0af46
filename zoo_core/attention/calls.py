"""How `DropInAttention` calls a mechanism's layer: the call conventions a registry row declares.

Each is a plain function `call(inner, x, memory, mask, *, deterministic, position, **packed) -> (y, aux)`:
`inner` the mechanism's layer (bound, named 'attention'), x `[B, T, E]` the queries (`[B, 1, E]` in a
decoding step), `memory` None (self-attention) or `[B, S, E_m]`, `mask` the bool key-padding mask
(`[B, T]` self, `[B, S]` cross) or None, `position` the decoding step's index (a cross-attention
step) or None (every other call), `packed` the packed-sequence arguments the caller gave (`segment_ids`,
`kv_segment_ids`, `positions`: docs/specs/context_parallel.md), passed on to the layer's method, which
`METHOD` names (the drop-in checks that the method takes them). y is `[B, T, E']`; aux holds the
layer's `loss/...` scalars.

A new mechanism whose layer follows the contract needs none of its own: `self_call` for its self
form and, where its layer has a `cross(x, memory, *, memory_mask, deterministic) -> (y, aux)` method,
`cross_method`. The others describe the layers of the zoo that differ.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax

Array = jax.Array
Call = Callable[..., tuple[Array, dict]]


def self_call(inner: Any, x: Array, memory: None, mask: Optional[Array], *, deterministic: bool,
              position: Optional[Array] = None, **packed) -> tuple[Array, dict]:
    """Self-attention by the contract layer's own `__call__(x, *, mask, deterministic)`."""
    del memory, position
    return inner(x, mask=mask, deterministic=deterministic, **packed)


def global_self(inner: Any, x: Array, memory: None, mask: Optional[Array], *, deterministic: bool,
                position: Optional[Array] = None, **packed) -> tuple[Array, dict]:
    """Non-causal self-attention by the layer's global form `global_self(x, *, mask, deterministic)`
    returning y alone (linear attention without normaliser: `linear_attention.noncausal`)."""
    del memory, position
    return inner.global_self(x, mask=mask, deterministic=deterministic, **packed), {}


def cross_method(inner: Any, x: Array, memory: Array, mask: Optional[Array], *, deterministic: bool,
                 position: Optional[Array] = None, **packed) -> tuple[Array, dict]:
    """Cross-attention by the layer's `cross(x, memory, *, memory_mask, deterministic) -> (y, aux)`;
    a decoding step is the same call on one query (the memory is whole at every step)."""
    del position
    return inner.cross(x, memory, memory_mask=mask, deterministic=deterministic, **packed)


def cross_method_y(inner: Any, x: Array, memory: Array, mask: Optional[Array], *, deterministic: bool,
                   position: Optional[Array] = None, **packed) -> tuple[Array, dict]:
    """`cross_method` for a layer whose `cross` returns y alone (no aux)."""
    del position
    return inner.cross(x, memory, memory_mask=mask, deterministic=deterministic, **packed), {}


def cross_positional(inner: Any, x: Array, memory: Array, mask: Optional[Array], *, deterministic: bool,
                     position: Optional[Array] = None, **packed) -> tuple[Array, dict]:
    """Cross-attention whose window follows the query's position (HTGN's Cross-Graph layer): the
    full call `inner(x, memory, *, memory_mask, deterministic)`; in a decoding step, which only the
    cache's index places, `prepare_memory` and `step(cache, x_t, position=index)`."""
    if position is None:
        return inner(x, memory, memory_mask=mask, deterministic=deterministic, **packed)
    cache = inner.prepare_memory(memory, memory_mask=mask)
    return inner.step(cache, x[:, 0], position=position)[0][:, None], {}


# The layer method each call convention calls (its keyword arguments say which packed-sequence
# arguments the call can pass on: `registry.capabilities`).
METHOD = {self_call: "__call__", global_self: "global_self", cross_method: "cross", cross_method_y: "cross",
          cross_positional: "__call__"}
