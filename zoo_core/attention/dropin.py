"""`DropInAttention`: the module `zoo_core.attention.make` returns (self, cross and decoding calls).

The forms it calls are the layers' own (`__call__`, `step`, `init_state`, `cross`,
`prepare_memory`), each through the call convention its registry row declares (`calls`): nothing
here depends on which mechanism it is.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo_core.attention import calls, registry
from zoo_core.checks import check_tokens

Array = jax.Array


class DropInAttention(nn.Module):
    """Attention in the call style of `nn.MultiHeadDotProductAttention`; built by `make`.

    Shapes: inputs_q `[B, T, E]` (memory `[B, S, E_m]` in cross-attention) ->
    `[B, T, out_features or E]`. Parameters sit under `attention`, the same in every call path
    (with and without `decode`).

    Attributes:
      mechanism: a name of `names()`.
      num_heads: H.
      head_dim: D.
      out_features: output width (None: the width of inputs_q).
      causal: causal self-attention.
      decode: one token per call, the state in the collection 'cache' (package docstring).
      dtype, param_dtype: compute and parameter dtype.
      options: the mechanism's own fields, as (name, value) pairs so that the module stays hashable.
    """
    mechanism: str
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    causal: bool = False
    decode: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    options: tuple = ()

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_k: Optional[Array] = None,
                 inputs_v: Optional[Array] = None, *, inputs_kv: Optional[Array] = None,
                 mask: Optional[Array] = None, deterministic: bool = True,
                 segment_ids: Optional[Array] = None, kv_segment_ids: Optional[Array] = None,
                 positions: Optional[Array] = None) -> Array:
        """Self-attention `attn(inputs_q)` or cross-attention `attn(inputs_q, inputs_k)` (or
        `inputs_kv=`; `inputs_v`, if given, must be inputs_k: keys and values come from one memory).

        Args:
          inputs_q: `[B, T, E]` (`[B, 1, E]` in a decoding step).
          inputs_k: None (self-attention) or the memory `[B, S, E_m]`.
          inputs_v: None or inputs_k.
          inputs_kv: the memory, as `inputs_k`.
          mask: bool `[B, T]` (self) or `[B, S]` (cross) key-padding mask, True = valid; None in a
            decoding step of self-attention.
          deterministic: dropout off (on needs the 'dropout' rng); decoding steps have no dropout.
          segment_ids: int `[B, T]` documents of a packed row (0 = padding), for the queries.
          kv_segment_ids: int `[B, S]` documents of the memory (cross-attention).
          positions: int `[B, T]` positions restarting per document (mechanisms with positions).
          Each goes to the mechanism's layer; a form that cannot take it refuses in one line.

        Returns:
          y `[B, T, E']`.
        """
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError("pass the memory as inputs_kv or as inputs_k, not both")
            inputs_k = inputs_kv
        if inputs_v is not None and inputs_v is not inputs_k:
            raise ValueError("keys and values come from one memory in every mechanism of the zoo: "
                             "pass inputs_k (or inputs_kv) alone")
        check_tokens("inputs_q", inputs_q, "[B, T, E]")
        if mask is not None:
            mask = jnp.asarray(mask)
            keys = inputs_q if inputs_k is None else inputs_k
            if tuple(mask.shape) != tuple(keys.shape[:2]):
                raise ValueError(f"mask must be a [B, {'T' if inputs_k is None else 'S'}] = "
                                 f"{tuple(keys.shape[:2])} key-padding mask, got shape {tuple(mask.shape)}")
            mask = mask.astype(bool)
        packed = {"segment_ids": segment_ids, "positions": positions}
        if inputs_k is None:
            if kv_segment_ids is not None:
                raise ValueError("kv_segment_ids are the memory's documents in cross-attention; self-attention "
                                 "takes segment_ids")
            return self._self_attention(inputs_q, mask, deterministic, packed)
        return self._cross_attention(inputs_q, inputs_k, mask, deterministic,
                                     dict(packed, kv_segment_ids=kv_segment_ids))

    # --- shared pieces ---------------------------------------------------------------------

    def _inner(self, form, width: int, causal: Optional[bool], **extra) -> nn.Module:
        """The mechanism's layer for `form`, named 'attention'; options of the other form raise."""
        options = dict(self.options)
        foreign = sorted(set(options) - registry.options_of(form))
        if foreign:
            other = "self-attention" if form is registry.lookup(self.mechanism).cross_form else "cross"
            raise ValueError(f"option(s) {foreign} of {self.mechanism!r} apply to its {other} form only")
        kwargs = registry.form_kwargs(form, num_heads=self.num_heads, head_dim=self.head_dim,
                                      out_features=self.out_features or width, causal=causal,
                                      dtype=self.dtype, param_dtype=self.param_dtype,
                                      options={**options, **extra})
        return registry.layer_class(form)(**kwargs, name="attention")

    def _sow(self, aux: dict) -> None:
        for key, value in aux.items():
            if key.startswith("loss/"):
                self.sow("losses", key[len("loss/"):], value)

    @staticmethod
    def _token(x: Array, deterministic: bool) -> None:
        """Checks one decoding step's input."""
        if x.shape[1] != 1:
            raise ValueError(f"decode=True: after init, each call takes one token [B, 1, E]; got shape "
                             f"{tuple(x.shape)}")
        if not deterministic:
            raise ValueError("decode=True: decoding steps run without dropout; call with deterministic=True")

    def _index(self) -> Any:
        return self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))

    # --- self-attention --------------------------------------------------------------------

    def _self_attention(self, x: Array, mask: Optional[Array], deterministic: bool, packed: dict) -> Array:
        entry = registry.lookup(self.mechanism)
        if entry.self_form is None:
            raise ValueError(f"attention {self.mechanism!r} is cross-attention only: call it as "
                             f"attn(inputs_q, inputs_k); self-attention: {registry.names('self')}")
        width = x.shape[-1]
        if not self.causal and entry.global_call is not None:
            call, causal = entry.global_call, None
        else:
            call, causal = calls.self_call, self.causal
        registry.check_packed(self.mechanism, entry.self_form, call, packed, "self-attention")
        packed = {k: v for k, v in packed.items() if v is not None}
        if self.decode:
            return self._decode_step(entry, x, mask, deterministic, packed)
        inner = self._inner(entry.self_form, width, causal)
        y, aux = call(inner, x, None, mask, deterministic=deterministic, **packed)
        self._sow(aux)
        return y

    def _decode_step(self, entry, x: Array, mask: Optional[Array], deterministic: bool, packed: dict) -> Array:
        """Flax's decode convention: the first call (init, `[B, L, E]`) creates the cache and
        returns the causal call; later calls take `[B, 1, E]` and advance the layer's State, or, for
        a layer with `prefill` (`attention.prefills()`), a prompt `[B, L, E]` that advances it by L."""
        if not self.causal:
            raise ValueError(f"decode=True self-attention needs causal=True ({self.mechanism!r} was built "
                             f"with causal=False)")
        cached = self.has_variable("cache", "state")
        extra = {}
        cls = registry.layer_class(entry.self_form)
        if "max_length" in registry.fields(cls) and "max_length" not in dict(self.options):
            # A key/value cache of L slots, L the length init saw.
            extra["max_length"] = (self.get_variable("cache", "state").key.shape[1] if cached
                                   else x.shape[1])
        inner = self._inner(entry.self_form, x.shape[-1], True, **extra)
        if not cached:
            y, aux = inner(x, mask=mask, deterministic=deterministic, **packed)
            self._sow(aux)
            self.variable("cache", "state", lambda: inner.init_state(x.shape[0]))
            self._index()
            return y
        state, index = self.variable("cache", "state"), self._index()
        if x.shape[1] > 1:
            if not hasattr(inner, "prefill"):
                raise ValueError(f"decode=True: after init, each call of {self.mechanism!r} takes one token "
                                 f"[B, 1, E], got shape {tuple(x.shape)}; these also take a prompt [B, L, E] "
                                 f"(prefill): {list(registry.prefills())}")
            return self._prefill(inner, state, index, x, mask, deterministic, packed)
        self._token(x, deterministic)
        if mask is not None or packed:
            raise ValueError("decode=True: a self-attention step takes no mask, segment_ids or positions (every "
                             "token given is valid, the next of one document)")
        position = {"position": index.value} if getattr(inner, "use_rotary", False) else {}
        y_t, state.value = inner.step(state.value, x[:, 0], **position)
        index.value = index.value + 1
        return y_t[:, None]

    def _prefill(self, inner, state, index, x: Array, mask: Optional[Array], deterministic: bool,
                 packed: dict) -> Array:
        """A prompt `[B, L, E]` after init: the layer's `prefill` (its sequence form, context-parallel
        with `sequence_axis`) from the cached state, which it advances by L tokens; steps continue from
        there (the last document of each row, when packed)."""
        if not deterministic:
            raise ValueError("decode=True: a prompt (prefill) runs without dropout; call with deterministic=True")
        rotary = getattr(inner, "use_rotary", False)
        if rotary and packed:
            raise ValueError("decode=True with rotary positions: a prompt takes no segment_ids or positions (the "
                             "cache's index places every token)")
        extra = {"positions": index.value + jnp.arange(x.shape[1])} if rotary else {}
        y, state.value = inner.prefill(x, state.value, mask=mask, deterministic=True, **packed, **extra)
        index.value = index.value + x.shape[1]
        return y

    # --- cross-attention -------------------------------------------------------------------

    def _cross_attention(self, x: Array, memory: Array, mask: Optional[Array],
                         deterministic: bool, packed: dict) -> Array:
        entry = registry.lookup(self.mechanism)
        if entry.cross_form is None:
            raise ValueError(f"attention {self.mechanism!r} has no cross-attention form; these have one: "
                             f"{registry.names('cross')}")
        if self.causal:
            raise ValueError(f"cross-attention is not causal: build {self.mechanism!r} with causal=False "
                             f"to call attn(inputs_q, inputs_k)")
        check_tokens("inputs_k", memory, "[B, S, E]")
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"inputs_q {tuple(x.shape)} and inputs_k {tuple(memory.shape)} differ in "
                             f"batch size")
        registry.check_packed(self.mechanism, entry.cross_form, entry.cross_call, packed, "cross-attention")
        packed = {k: v for k, v in packed.items() if v is not None}
        inner = self._inner(entry.cross_form, x.shape[-1], False)
        step = self.decode and self.has_variable("cache", "cache_index")
        if step:
            self._token(x, deterministic)
            if packed:
                raise ValueError("decode=True: a cross-attention step takes no segment_ids, kv_segment_ids or "
                                 "positions (one query of one document)")
        index = self._index() if self.decode else None
        # A step passes the query's position, which only the cache knows (a window may follow it).
        y, aux = entry.cross_call(inner, x, memory, mask, deterministic=deterministic,
                                  position=index.value if step else None, **packed)
        self._sow(aux)
        if step:
            index.value = index.value + 1
        return y
