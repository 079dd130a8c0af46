"""Every attention of the zoo behind one name, as a drop-in for Flax's self-attention.

    from zoo_core import attention
    attn = attention.make("agf", num_heads=8, qkv_features=512)      # instead of
    attn = nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=512)
    y = attn(x, mask=mask, deterministic=not train)                  # x [B, T, E], mask [B, T] bool

`make` returns a Linen module with the call style of `flax.linen.MultiHeadDotProductAttention`
used as self-attention: `layer(inputs_q, *, mask=None, deterministic=True) -> y`, where `mask` is a
bool `[B, T]` key-padding mask (True = valid; the mechanisms are linear in T and never build a
`[T, T]` mask) and y has `out_features` (default: the input width E). Auxiliary losses of the
mechanism (AGF's orthogonality term; the graph KL with `kl_weight` > 0) are sown into the collection 'losses', so a
training loop written outside the zoo collects them with `mutable=['losses']` and adds
`sum(jax.tree_util.tree_leaves(state['losses']))` to its loss.

`layer(name, ...)` takes the same arguments and returns the mechanism's own layer, which follows the
zoo's layer contract (README "Layer contract": `(y, aux)`, and `init_state` / `scan` / `step` on
the causal ones) for recurrent decoding.

The mechanisms live in the architecture packages; this module imports them only when a name is
used, so `zoo_core` stays free of them at import time.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp


class _Entry(NamedTuple):
    module: str                 # where the layer class lives
    cls: str                    # its name
    modes: tuple[bool, ...]     # the values of `causal` it has
    doc: str


_REGISTRY: dict[str, _Entry] = {
    "agf": _Entry("agf_jax.layers", "AGFAttention", (False, True),
                  "Attentive Graph Filter (Wi, Choi, Park, IJCAI 2025); causal: prefix-normalised"),
    "favor": _Entry("htgn_jax.layers", "FavorAttention", (False, True),
                    "FAVOR+ positive random features (Performer, Choromanski et al. 2021)"),
    "window_graph": _Entry("htgn_jax", "WindowGraphAttention", (False, True),
                           "HTGN windowed graph attention with global nodes (GATv2 scoring)"),
    "linear": _Entry("samovar_jax", "LinearAttention", (True,),
                     "causal linear attention without normaliser (SAMoVAR / LinTrans)"),
    "softmax": _Entry("agf_jax.layers", "SoftmaxAttention", (False, True),
                      "exact multi-head softmax attention, O(T^2): the baseline"),
}

# Arguments of `make` itself; everything else goes to the layer and must be one of its fields.
_RESERVED = ("num_heads", "head_dim", "out_features", "causal", "dtype", "param_dtype", "name",
             "parent")


def names() -> tuple[str, ...]:
    """The registered mechanisms, sorted."""
    return tuple(sorted(_REGISTRY))


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; choose one of {names()}")
    return _REGISTRY[name]


def _layer_class(name: str) -> type:
    entry = _entry(name)
    return getattr(importlib.import_module(entry.module), entry.cls)


def _layer_kwargs(name: str, *, num_heads: int, qkv_features: int, out_features: Optional[int],
                  causal: bool, dtype: Any, param_dtype: Any, options: dict) -> tuple[type, dict]:
    """Checks the arguments once and maps them onto the layer's fields."""
    entry = _entry(name)
    if causal not in entry.modes:
        have = "causal" if entry.modes == (True,) else "non-causal"
        raise ValueError(f"attention {name!r} has no causal={causal} mode (it is {have} only)")
    for arg, value in (("num_heads", num_heads), ("qkv_features", qkv_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{arg}` must be an integer >= 1, got {value!r}")
    if qkv_features % num_heads:
        raise ValueError(f"`qkv_features` = {qkv_features} must be divisible by `num_heads` = {num_heads}")
    if out_features is not None and (isinstance(out_features, bool) or not isinstance(out_features, int)
                                     or out_features < 1):
        raise ValueError(f"`out_features` must be None or an integer >= 1, got {out_features!r}")
    cls = _layer_class(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - set(_RESERVED)
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"attention {name!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    kwargs = dict(num_heads=num_heads, head_dim=qkv_features // num_heads, out_features=out_features,
                  dtype=dtype, param_dtype=param_dtype, **options)
    if "causal" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["causal"] = causal
    return cls, kwargs


def layer(name: str, *, num_heads: int, qkv_features: int, out_features: Optional[int] = None,
          causal: bool = False, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
          **options) -> nn.Module:
    """The mechanism's own contract layer (`(y, aux)`; `init_state` / `scan` / `step` if causal).

    Arguments as in `make`. `out_features=None` gives the input width.
    """
    cls, kwargs = _layer_kwargs(name, num_heads=num_heads, qkv_features=qkv_features,
                                out_features=out_features, causal=causal, dtype=dtype,
                                param_dtype=param_dtype, options=options)
    return cls(**kwargs)


class DropInAttention(nn.Module):
    """Self-attention in the call style of `nn.MultiHeadDotProductAttention`; built by `make`.

    Shapes: inputs_q `[B, T, E]` -> `[B, T, out_features or E]`. Parameters sit under `attention`.

    Attributes:
      mechanism: a name of `names()`.
      layer_kwargs: the contract layer's fields (from `make`), as a tuple of (name, value) pairs
        so that the module stays hashable.
    """
    mechanism: str
    layer_kwargs: tuple

    @nn.compact
    def __call__(self, inputs_q: jax.Array, *, mask: Optional[jax.Array] = None,
                 deterministic: bool = True) -> jax.Array:
        """Args: inputs_q `[B, T, E]`; mask bool `[B, T]` (True = valid) or None; deterministic:
        dropout off (on needs the 'dropout' rng). Returns y `[B, T, E']`."""
        if inputs_q.ndim != 3:
            raise ValueError(f"inputs_q must be [B, T, E], got shape {inputs_q.shape}")
        if mask is not None and tuple(mask.shape) != tuple(inputs_q.shape[:2]):
            raise ValueError(f"mask must be a [B, T] = {inputs_q.shape[:2]} key-padding mask, got "
                             f"shape {tuple(mask.shape)}")
        kwargs = dict(self.layer_kwargs)
        if kwargs["out_features"] is None:
            kwargs["out_features"] = inputs_q.shape[-1]
        inner = _layer_class(self.mechanism)(**kwargs, name="attention")
        y, aux = inner(inputs_q, mask=None if mask is None else mask.astype(bool),
                       deterministic=deterministic)
        for key, value in aux.items():
            if key.startswith("loss/"):
                self.sow("losses", key[len("loss/"):], value)
        return y


def make(name: str, *, num_heads: int, qkv_features: int, out_features: Optional[int] = None,
         causal: bool = False, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
         **options) -> nn.Module:
    """A drop-in self-attention module for mechanism `name`.

    Args:
      name: one of `names()`.
      num_heads: H.
      qkv_features: H * D, the width of queries, keys and values (D = qkv_features / H).
      out_features: output width (None: the input width, as Flax's attention).
      causal: causal (autoregressive) attention; a mechanism without that mode raises here.
      dtype: compute dtype (sums and states stay float32).
      param_dtype: parameter dtype.
      **options: the mechanism's own fields (e.g. AGF's `order`, `basis`; FAVOR+'s `num_features`;
        `dropout_rate` where the mechanism has dropout); an unknown one raises, naming the choices.

    Returns:
      A Linen module: `module(inputs_q, *, mask=None, deterministic=True) -> y`.
    """
    _, kwargs = _layer_kwargs(name, num_heads=num_heads, qkv_features=qkv_features,
                              out_features=out_features, causal=causal, dtype=dtype,
                              param_dtype=param_dtype, options=options)
    return DropInAttention(name, tuple(sorted(kwargs.items())))
