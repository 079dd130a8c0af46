"""The registry of `zoo_core.attention`: one row (`_Entry`) per mechanism, and the checks of
`make` / `layer`, each problem in one line (see the package docstring).

A row declares everything the drop-in needs: the self-attention layer and the values of `causal` it
has, the cross-attention layer, and how each is called (`calls`); `capabilities`, `names`,
`options` and `DropInAttention` read the row and nothing else. Adding a mechanism whose layer
follows the contract (non-causal here) is one line in `_REGISTRY`:

    "name": _Entry(_Form("package.module", "LayerClass"), (False,), None, "one-line description"),

`(False, True)` when the layer also has `causal=True` (with `init_state` / `step`: then decoding too;
`recurrent=False` for a causal layer without them), and `cross_form=..., cross_call=calls.cross_method`
when it has a `cross` method.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax.numpy as jnp

from zoo_core.attention import calls


class _Form(NamedTuple):
    """One layer class of a mechanism: where it lives (a module path and class name, imported when
    the name is used; or the class itself), the fields the registry fixes, and those it hides
    (meaningless in this form, so not offered as options)."""
    module: Optional[str]
    cls: Any
    fixed: tuple = ()
    hidden: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One mechanism, one row: its layers and how `make`'s module calls them (`calls`).

    Attributes:
      self_form: the self-attention contract layer (None: cross-attention only).
      modes: the values of `causal` the self-attention layer has itself (its non-causal `__call__`
        is `calls.self_call`, its causal forms `__call__` / `init_state` / `step`).
      cross_form: the cross-attention layer (None: no cross form).
      doc: one line: the mechanism and its paper.
      global_call: non-causal self-attention by another call of a layer that is causal only
        (linear attention's global form); None: none, or the layer's own non-causal `__call__`.
      cross_call: how the cross layer is called (a full call and, with `decode=True`, each step).
      length_option: the option that bounds the input length of the non-causal self-attention and
        that a model sets to its longest sequence (Linformer's `max_length`), or None.
      recurrent: the causal layer has the recurrent forms `init_state` / `scan` / `step` (and so
        `decode=True`); False for a causal layer with `__call__` only (Reformer: its buckets move with
        the prefix).
    """
    self_form: Optional[_Form]
    modes: tuple[bool, ...]
    cross_form: Optional[_Form]
    doc: str
    global_call: Optional[calls.Call] = None
    cross_call: Optional[calls.Call] = None
    length_option: Optional[str] = None
    recurrent: bool = True

    def __post_init__(self):
        if (self.cross_form is None) != (self.cross_call is None):
            raise ValueError(f"a registry row declares cross_form and cross_call together: {self.doc}")
        if self.global_call is not None and (self.self_form is None or False in self.modes):
            raise ValueError(f"global_call is for a causal-only self layer: {self.doc}")
        if self.self_form is None and self.modes:
            raise ValueError(f"a row without self_form has no modes: {self.doc}")

    def self_modes(self) -> tuple[bool, ...]:
        """The values of `causal` that `make` offers for self-attention."""
        return tuple(sorted(set(self.modes) | ({False} if self.global_call else set())))


_FAVOR = _Form("htgn_jax.layers", "FavorAttention")
_REGISTRY: dict[str, _Entry] = {
    "agf": _Entry(_Form("agf_jax.layers", "AGFAttention"), (False, True), None,
                  "Attentive Graph Filter (Wi, Choi, Park, IJCAI 2025); causal: prefix-normalised"),
    "cross_graph": _Entry(None, (), _Form("htgn_jax", "CrossGraphAttention"),
                          "HTGN Cross-Graph attention: query i -> a memory window around round(rho i)",
                          cross_call=calls.cross_positional),
    "favor": _Entry(_FAVOR, (False, True), _FAVOR,
                    "FAVOR+ positive random features (Performer, Choromanski et al. 2021)",
                    cross_call=calls.cross_method),
    "longformer": _Entry(_Form("zoo_core.baselines.longformer", "LongformerAttention"), (False, True), None,
                         "Longformer (Beltagy et al. 2020): sliding-window + global-token softmax, O(T (w + g))"),
    "linformer": _Entry(_Form("zoo_core.baselines.linformer", "LinformerAttention"), (False,), None,
                        "Linformer (Wang et al. 2020): keys and values projected along the sequence",
                        length_option="max_length"),
    "linear": _Entry(_Form("samovar_jax", "LinearAttention"), (True,), _Form("samovar_jax", "LinearAttention"),
                     "linear attention without normaliser (SAMoVAR / LinTrans); non-causal: global",
                     global_call=calls.global_self, cross_call=calls.cross_method_y),
    "nystromformer": _Entry(_Form("zoo_core.baselines.nystromformer", "NystromformerAttention"), (False,), None,
                            "Nystromformer (Xiong et al. 2021): segment-mean landmarks, iterative pinv"),
    "reformer": _Entry(_Form("zoo_core.baselines.reformer", "ReformerAttention"), (False, True), None,
                       "Reformer (Kitaev et al. 2020): shared-QK LSH attention in sorted chunks",
                       recurrent=False),
    "softmax": _Entry(_Form("agf_jax.layers", "SoftmaxAttention"), (False, True),
                      _FAVOR._replace(fixed=(("feature_map", "exact"),), hidden=(
                          "chunk_size", "num_features", "redraw_every", "use_rotary", "rotary_base",
                          "eps", "projection_seed")),
                      "exact multi-head softmax attention, O(T^2): the baseline",
                      cross_call=calls.cross_method),
    "window_graph": _Entry(_Form("htgn_jax", "WindowGraphAttention"), (False, True), None,
                           "HTGN windowed graph attention with global nodes (GATv2 scoring)"),
}

# Arguments of `make` itself; everything else goes to the layer and must be one of its fields.
_RESERVED = ("num_heads", "head_dim", "out_features", "causal", "dtype", "param_dtype", "name",
             "parent")
# The call arguments of packed sequences (issue 42; docs/specs/context_parallel.md).
PACKED_ARGS = ("segment_ids", "kv_segment_ids", "positions")
CAPABILITIES = ("self", "causal", "decode", "cross") + PACKED_ARGS + ("context_parallel",)


def capabilities(name: str) -> dict[str, bool]:
    """What mechanism `name` has: {'self': non-causal self-attention, 'causal': causal
    self-attention, 'decode': `decode=True` (one token per call through the 'cache' collection, in
    a causal self-attention or a cross-attention), 'cross': cross-attention,
    'segment_ids': packed sequences in every self-attention form (cross-only: the queries' segment_ids),
    'kv_segment_ids': the memory's segment ids in its cross-attention, 'positions': per-token positions
    (restarting per document) in every self-attention form, 'context_parallel': a `sequence_axis` field
    on every layer (`make(..., sequence_axis=...)`)}.

    The last four are read from the layers themselves (the keyword arguments of the method each call
    convention calls, `calls.METHOD`, and the layers' fields), so they follow the layers as they grow;
    they import the mechanism's module.
    """
    entry = lookup(name)
    causal = True in entry.modes
    out = {"self": False in entry.self_modes(), "causal": causal,
           "decode": (causal and entry.recurrent) or entry.cross_form is not None,
           "cross": entry.cross_form is not None}
    paths = self_paths(entry)
    cross = [(entry.cross_form, entry.cross_call)] if entry.cross_form is not None else []
    out["segment_ids"] = all(accepts(f, c, "segment_ids") for f, c in (paths or cross))
    out["kv_segment_ids"] = bool(cross) and all(accepts(f, c, "kv_segment_ids") for f, c in cross)
    out["positions"] = bool(paths) and all(accepts(f, c, "positions") for f, c in paths)
    out["context_parallel"] = all("sequence_axis" in fields(layer_class(f))
                                  for f in (entry.self_form, entry.cross_form) if f is not None)
    return out


def self_paths(entry: _Entry) -> list[tuple[_Form, calls.Call]]:
    """(layer form, call convention) of each self-attention mode `make` offers."""
    if entry.self_form is None:
        return []
    return [(entry.self_form, entry.global_call if not causal and entry.global_call else calls.self_call)
            for causal in entry.self_modes()]


def accepts(form: _Form, call: calls.Call, arg: str) -> bool:
    """Whether the layer method that `call` calls takes keyword `arg` (segment ids: and does not refuse
    them, `keeps_documents_apart`)."""
    cls = layer_class(form)
    if arg in ("segment_ids", "kv_segment_ids") and not getattr(cls, "keeps_documents_apart", True):
        return False
    return arg in inspect.signature(getattr(cls, calls.METHOD[call])).parameters


def check_packed(name: str, form: _Form, call: calls.Call, packed: dict, what: str) -> None:
    """Raises one line naming the mechanism when its `what` call cannot take a given packed argument."""
    for arg, value in packed.items():
        if value is not None and not accepts(form, call, arg):
            have = names(arg) if arg in CAPABILITIES else ()
            raise ValueError(f"attention {name!r} takes no {arg} in its {what} (packed sequences); these "
                             f"do: {list(have)}")


def names(*required: str) -> tuple[str, ...]:
    """The registered mechanisms, sorted; with `required` (of CAPABILITIES) those that have them all,
    e.g. `names('cross')`, `names('causal', 'decode')`, `names('segment_ids')`."""
    bad = sorted(set(required) - set(CAPABILITIES))
    if bad:
        raise ValueError(f"unknown capability {bad}; choose from {CAPABILITIES}")
    return tuple(n for n in sorted(_REGISTRY) if all(capabilities(n)[c] for c in required))


def prefills() -> tuple[str, ...]:
    """The mechanisms whose causal self-attention layer has `prefill(x, state)` (its sequence form from a
    state, returning the final one; context-parallel with `sequence_axis`): with `decode=True`, a
    prompt `[B, L, E]` after init advances the cache by L tokens in one call."""
    return tuple(n for n in names("causal", "decode") if hasattr(layer_class(lookup(n).self_form), "prefill"))


def options(name: str) -> tuple[str, ...]:
    """The options (`**options` of `make`) of mechanism `name`: its layers' own fields, sorted."""
    return tuple(sorted(_options_of_entry(lookup(name))))


def _options_of_entry(entry: _Entry) -> set[str]:
    return set().union(*(options_of(f) for f in (entry.self_form, entry.cross_form) if f))


def length_option(name: str) -> Optional[str]:
    """The option of mechanism `name` that must cover the input length of its non-causal
    self-attention (set it to the longest sequence: Linformer's `max_length`), or None."""
    return lookup(name).length_option


def lookup(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; choose one of {names()}")
    return _REGISTRY[name]


def layer_class(form: _Form) -> type:
    if form.module is None:
        return form.cls
    return getattr(importlib.import_module(form.module), form.cls)


def fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def options_of(form: _Form) -> set[str]:
    return fields(layer_class(form)) - set(_RESERVED) - set(form.hidden) - {k for k, _ in form.fixed}


def form_kwargs(form: _Form, *, num_heads: int, head_dim: int, out_features: Optional[int],
                causal: Optional[bool], dtype: Any, param_dtype: Any, options: dict) -> dict:
    """The fields of `form`'s layer: the common ones, `causal` where it has one, the fixed ones and
    `options` (all of them its own; `make` checked them)."""
    kwargs = dict(num_heads=num_heads, head_dim=head_dim, out_features=out_features, dtype=dtype,
                  param_dtype=param_dtype, **dict(form.fixed), **options)
    if causal is not None and "causal" in fields(layer_class(form)):
        kwargs["causal"] = causal
    return kwargs


def check(name: str, *, num_heads: int, qkv_features: int, out_features: Optional[int], causal: bool,
           decode: bool, options: dict) -> _Entry:
    """Checks the arguments of `make` / `layer` once, each problem in one line."""
    entry = lookup(name)
    caps = capabilities(name)
    if causal and not caps["causal"]:
        have = "cross-attention only" if entry.self_form is None else "non-causal only"
        raise ValueError(f"attention {name!r} has no causal=True mode (it is {have})")
    if not causal and not caps["self"] and not caps["cross"]:
        raise ValueError(f"attention {name!r} has no causal=False mode (it is causal only)")
    if decode and not caps["decode"]:
        raise ValueError(f"attention {name!r} has no decode=True form; these have one: {names('decode')}")
    if decode and not causal and not caps["cross"]:
        raise ValueError(f"decode=True on {name!r} needs causal=True (it has no cross form, the other "
                         f"use of decode)")
    for arg, value in (("num_heads", num_heads), ("qkv_features", qkv_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{arg}` must be an integer >= 1, got {value!r}")
    if qkv_features % num_heads:
        raise ValueError(f"`qkv_features` = {qkv_features} must be divisible by `num_heads` = {num_heads}")
    if out_features is not None and (isinstance(out_features, bool) or not isinstance(out_features, int)
                                     or out_features < 1):
        raise ValueError(f"`out_features` must be None or an integer >= 1, got {out_features!r}")
    allowed = _options_of_entry(entry)
    if options.get("sequence_axis") is not None and not capabilities(name)["context_parallel"]:
        raise ValueError(f"attention {name!r} has no context-parallel form (sequence_axis); these have one: "
                         f"{list(names('context_parallel'))}")
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"attention {name!r} has no option(s) {unknown}; its options are {sorted(allowed)}")
    return entry


def layer(name: str, *, num_heads: int, qkv_features: int, out_features: Optional[int] = None,
          causal: bool = False, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
          **options) -> nn.Module:
    """The mechanism's own self-attention contract layer (`(y, aux)`; `init_state` / `scan` /
    `step` if causal).

    Arguments as in `make`. `out_features=None` gives the input width. A mode the layer has only
    through `make` (linear's global form) or a cross-only mechanism raises.
    """
    entry = check(name, num_heads=num_heads, qkv_features=qkv_features, out_features=out_features,
                   causal=causal, decode=False, options=options)
    if entry.self_form is None or causal not in entry.modes:
        raise ValueError(f"attention {name!r} has no causal={causal} contract layer; `make` builds "
                         f"its {'cross' if entry.self_form is None else 'global'} form")
    extra = sorted(set(options) - options_of(entry.self_form))
    if extra:
        raise ValueError(f"option(s) {extra} of {name!r} apply to its cross form only")
    cls = layer_class(entry.self_form)
    return cls(**form_kwargs(entry.self_form, num_heads=num_heads, head_dim=qkv_features // num_heads,
                             out_features=out_features, causal=causal, dtype=dtype,
                             param_dtype=param_dtype, options=options))
