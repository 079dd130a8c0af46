"""Which attention a block of the AGF models runs: AGF or softmax built with PyTorch's inits, or
any other self-attention of the zoo's registry (`zoo_core.attention`), with the factory's checks.

The names come from the registry when a model or config is built (`attentions()`), so a mechanism
added there is available to the models with no change here (docs/agf_options.md).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from agf_jax import validation
from agf_jax.layers import AGFAttention, SoftmaxAttention, torch_linear_bias_init
from zoo_core import attention as zoo_attention
from zoo_core import checks

Array = jax.Array

# The attentions built here with PyTorch's inits and the reference's parameter names; every other
# registry name comes from `zoo_core.attention`.
OWN_ATTENTIONS = ("agf", "softmax")
# Keyword arguments that only make sense with attention='agf'.
AGF_ONLY_KWARGS = ("graph_filter", "basis", "order", "alpha", "beta", "learn_c0", "ortho_weight")
# Keyword arguments of AGF's polynomial filter, meaningless for graph_filter='uvt' | 'svd'.
FILTER_KWARGS = ("basis", "order", "alpha", "beta", "learn_c0")


def attentions() -> tuple[str, ...]:
    """The names `attention=` takes: every self-attention of the registry, read at call time."""
    return zoo_attention.names("self")


def block_attention(owner: nn.Module, config, *, ortho_scale: float, learn_c0: bool,
                    name: str) -> nn.Module:
    """Builds the attention layer of block `owner` from its `config` (`agf_jax.model.BlockConfig`):
    'agf' and 'softmax' with PyTorch's inits, any other registry name by `registry_attention`."""
    c = config
    if c.attention not in OWN_ATTENTIONS:
        return registry_attention(c.attention, num_heads=c.num_heads, head_dim=c.head_dim,
                                  dtype=c.dtype, param_dtype=c.param_dtype, max_len=c.max_len,
                                  options=dict(c.attention_options),
                                  sequence_axis=c.sequence_axis).clone(parent=owner, name=name)
    init = dict(dtype=c.dtype, param_dtype=c.param_dtype, sequence_axis=c.sequence_axis,
                bias_init=torch_linear_bias_init(c.d_model),
                out_bias_init=torch_linear_bias_init(c.num_heads * c.head_dim), name=name)
    if c.attention == "agf":
        # The reference regulariser counts padded rows of U (agf.md §2.5): kept for parity.
        return AGFAttention(num_heads=c.num_heads, head_dim=c.head_dim, basis=c.basis,
                            order=c.order, alpha=c.alpha, beta=c.beta,
                            learn_c0=learn_c0, ortho_scale=ortho_scale, ortho_count_padding=True,
                            graph_filter=c.graph_filter, **init)
    return SoftmaxAttention(num_heads=c.num_heads, head_dim=c.head_dim,
                            dropout_rate=c.attention_dropout, **init)


def registry_attention(name: str, *, num_heads: int, head_dim: int, dtype: Any, param_dtype: Any,
                       options: dict, max_len: Optional[int] = None,
                       sequence_axis: Optional[str] = None) -> nn.Module:
    """Registry attention `name`, non-causal, in the layer contract (`(y, aux)`), for a block.

    `zoo_core.attention.layer` gives the mechanism's own contract layer; a mechanism whose
    non-causal form it does not offer (linear attention's global form) is built by
    `zoo_core.attention.make`, whose call returns y alone (`call_attention` then takes aux as {}).
    Its own initialisers and defaults, `options` its fields (e.g. FAVOR+'s `num_features`). Where
    the registry names an option that bounds the input length (`zoo_core.attention.length_option`,
    e.g. Linformer's `max_length`) and `options` leaves it unset, it is the model's `max_len`.
    `sequence_axis` (context parallelism) goes to the layer; `validation.check_sequence_axis` has
    refused a mechanism without that form.
    """
    length_option = getattr(zoo_attention, "length_option", None)   # registries that have one
    key = length_option(name) if length_option is not None and max_len is not None else None
    if key is not None and key not in options:
        options = {**options, key: max_len}
    if sequence_axis is not None:
        options = {**options, "sequence_axis": sequence_axis}
    kw = dict(num_heads=num_heads, qkv_features=num_heads * head_dim, dtype=dtype,
              param_dtype=param_dtype, **options)
    try:
        return zoo_attention.layer(name, **kw)
    except ValueError:
        # No causal=False contract layer: the drop-in's global form (or the same error again).
        return zoo_attention.make(name, **kw)


def call_attention(layer: nn.Module, x: Array, *, mask, deterministic: bool) -> tuple[Array, dict]:
    """`(y, aux)` of a block's attention, whether a contract layer or a drop-in (aux {})."""
    out = layer(x, mask=mask, deterministic=deterministic)
    return out if isinstance(out, tuple) else (out, {})


def options_tuple(options: Any) -> Any:
    """A mapping (dict, ConfigDict) of attention options as sorted (name, value) pairs, so that the
    module field stays hashable; anything else is returned for `check_attention_options` to refuse."""
    if hasattr(options, "to_dict"):
        options = options.to_dict()
    return tuple(sorted(options.items())) if isinstance(options, dict) else options


def check_attention_options(args: dict, get: Callable[[str], Any]) -> None:
    """The factory's checks of attention, attention_dropout, graph_filter and attention_options,
    one `error:` line each; `args` are the given kwargs, `get(name)` a field's value or default."""
    name = get("attention")
    checks.check_choice("attention", name, attentions())
    validation.check_sequence_axis(name, get("sequence_axis"))
    checks.check_rate("attention_dropout", get("attention_dropout"))
    given = sorted(k for k in AGF_ONLY_KWARGS if k in args)
    if name != "agf" and given:
        checks.fail(f"{given} apply only to attention='agf' (got attention={name!r})")
    if name != "softmax" and get("attention_dropout"):
        checks.fail(f"`attention_dropout` applies only to attention='softmax' (got attention={name!r}"
                    f"{'' if name == 'agf' else '; pass dropout_rate in attention_options'})")
    checks.check_choice("graph_filter", get("graph_filter"), validation.GRAPH_FILTERS)
    unused = sorted(k for k in FILTER_KWARGS if k in args)
    if get("graph_filter") != "agf" and unused:
        checks.fail(f"{unused} apply only to graph_filter='agf' (got graph_filter="
                    f"{get('graph_filter')!r}, which has no polynomial filter)")
    options = get("attention_options")
    if not isinstance(options, tuple) or not all(isinstance(o, tuple) and len(o) == 2
                                                 for o in options):
        checks.fail(f"`attention_options` must be a mapping of option names to values, got {options!r}")
    if name in OWN_ATTENTIONS and options:
        checks.fail(f"`attention_options` apply to registry attentions other than {OWN_ATTENTIONS} "
                    f"(got attention={name!r}, whose options are model fields)")
    if name not in OWN_ATTENTIONS:   # the registry checks the mechanism's own options, one line each
        head_dim = get("head_dim") or get("d_model") // get("num_heads")
        registry_attention(name, num_heads=get("num_heads"), head_dim=head_dim, dtype=None,
                           param_dtype=jnp.float32, options=dict(options), max_len=get("max_len"))
