"""Argument checks of the AGF layers, softmax kernels and model batches, kept out of the maths.

Each public entry point of `agf_jax.layers` and `agf_jax.softmax` calls one function here: the
field checks run in `setup()` (`check_agf_fields`, `check_softmax_fields`), the call checks at the
start of `__call__` / `factors` / `init_state` / `scan` / `step`; the models of `agf_jax.model`
check their batch with `check_lra_batch` / `check_uea_batch` (their options are checked once, by
`agf_jax.model.Model`). All raise `ValueError` with one line that names the argument and what is
expected.

Shapes: x `[B, T, E]`, x_t `[B, E]`, mask `[B, T]`; kernel inputs q, k `[B, T, H, D]`,
v `[B, T, H, M]`; step inputs q_t, k_t `[B, H, D]`, v_t `[B, H, M]`.
"""
from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp

from agf_jax import ops
from zoo_core import checks
from zoo_core.ops import masking

# ---------------------------------------------------------------------------------------------
# Layer fields (run in setup()).
# ---------------------------------------------------------------------------------------------


def _check_common_fields(layer: Any) -> None:
    """The fields both attention layers have: H, D, chunk_size (causal only), dropout_rate."""
    checks.check_int("num_heads", layer.num_heads, 1)
    checks.check_int("head_dim", layer.head_dim, 1)
    checks.check_chunk_size(layer.chunk_size, layer.causal)
    checks.check_rate("dropout_rate", layer.dropout_rate)


GRAPH_FILTERS = ("agf", "uvt", "svd")


def check_agf_fields(layer: Any) -> None:
    """`AGFAttention`'s fields: the common ones, graph_filter, order K >= 0, and the basis with its
    alpha/beta."""
    _check_common_fields(layer)
    checks.check_choice("graph_filter", layer.graph_filter, GRAPH_FILTERS)
    if layer.graph_filter != "agf" and layer.learn_c0:
        checks.fail(f"`learn_c0` applies only to graph_filter='agf' (got graph_filter="
                    f"{layer.graph_filter!r}, which has no polynomial filter)")
    checks.check_int("order", layer.order, 0)
    ops.resolve_basis(layer.basis, layer.alpha, layer.beta, layer.order)


def check_softmax_fields(layer: Any) -> None:
    """`SoftmaxAttention`'s fields: the common ones and max_length (causal only, >= 1)."""
    _check_common_fields(layer)
    checks.check_optional_int("max_length", layer.max_length)
    if layer.max_length is not None and not layer.causal:
        checks.fail("`max_length` applies only to causal=True (it sizes the KV cache)")


# ---------------------------------------------------------------------------------------------
# Layer calls.
# ---------------------------------------------------------------------------------------------


def require_causal(layer: Any, method: str) -> None:
    """`layer.<method>` (init_state / scan / step) exists only for causal=True."""
    if not layer.causal:
        checks.fail(f"{type(layer).__name__}.{method} exists only for causal=True")


def check_inputs(x: Any, mask: Optional[Any]) -> None:
    """x `[B, T, E]` and mask None or `[B, T]`."""
    checks.check_tokens("x", x, "[B, T, E]")
    masking.check_mask(mask, jnp.shape(x)[:2])


def check_scan(layer: Any, x: Any, mask: Optional[Any]) -> None:
    """`layer.scan(x, mask=mask)`: a causal layer, x `[B, T, E]`, mask None or `[B, T]`."""
    require_causal(layer, "scan")
    check_inputs(x, mask)


def check_step(layer: Any, x_t: Any) -> None:
    """`layer.step(state, x_t)`: a causal layer, x_t `[B, E]`."""
    require_causal(layer, "step")
    checks.check_rank("x_t", x_t, 2, "[B, E]")


def check_cache_size(layer: Any) -> None:
    """`SoftmaxAttention.init_state`: a causal layer with `max_length` (the KV-cache size)."""
    require_causal(layer, "init_state")
    if layer.max_length is None:
        checks.fail("SoftmaxAttention.init_state needs `max_length` (the KV-cache size)")


def check_softmax_scan(layer: Any, x: Any, mask: Optional[Any], state: Optional[Any]) -> None:
    """`SoftmaxAttention.scan`: as `check_scan`; without a state, T <= max_length slots."""
    check_scan(layer, x, mask)
    if state is None:
        check_cache_size(layer)
        if x.shape[1] > layer.max_length:
            checks.fail(f"x has {x.shape[1]} tokens, more than max_length = {layer.max_length}")


# ---------------------------------------------------------------------------------------------
# Softmax kernels (`agf_jax.softmax`).
# ---------------------------------------------------------------------------------------------


def check_kernel_inputs(q: Any, k: Any, v: Optional[Any], mask: Optional[Any]) -> None:
    """q, k `[B, T, H, D]`, v None or `[B, T, H, M]`, mask None or `[B, T]` (any dtype)."""
    ops.check_projections(q, k, None, v)
    masking.check_mask(mask, jnp.shape(q)[:2])


def check_cache(cache: Any, q_t: Any, k_t: Any, v_t: Any) -> None:
    """One decoding token against a `KVCache` (key `[B, L, H, D]`, value `[B, L, H, M]`)."""
    ops.check_projections(q_t, k_t, None, v_t, rank=3)
    if cache.key.shape[0] != q_t.shape[0] or cache.key.shape[2:] != q_t.shape[1:] \
            or cache.value.shape[-1] != v_t.shape[-1]:
        raise ValueError(f"cache key {cache.key.shape} / value {cache.value.shape} do not match "
                         f"q_t {q_t.shape}, v_t {v_t.shape}")


# ---------------------------------------------------------------------------------------------
# Model batches (`agf_jax.model`).
# ---------------------------------------------------------------------------------------------


def check_sequence_axis(attention: str, sequence_axis: Any) -> None:
    """A model's `sequence_axis`: None, or a mesh axis name with an attention that has a
    context-parallel form (`zoo_core.attention.names('context_parallel')`)."""
    from zoo_core import attention as zoo_attention  # the registry imports this package's layers
    if sequence_axis is None:
        return
    if not isinstance(sequence_axis, str):
        checks.fail(f"`sequence_axis` must be a mesh axis name or None, got {sequence_axis!r}")
    if not zoo_attention.capabilities(attention)["context_parallel"]:
        checks.fail(f"sequence_axis={sequence_axis!r}: attention={attention!r} has no context-parallel form; "
                    f"these have one: {list(zoo_attention.names('context_parallel'))}")


def _check_batch_key(batch: dict, key: str, doc: str) -> None:
    if key not in batch:
        checks.fail(f"`batch` must contain {key!r} ({doc}), got keys {sorted(batch)}")


def check_lra_batch(batch: dict, key: str, max_len: int) -> None:
    """`batch[key]` holds int token ids `[B, T]` with T <= max_len (0 = padding)."""
    _check_batch_key(batch, key, "int [B, T], 0 = padding")
    ids = jnp.asarray(batch[key])
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] > max_len:
        checks.fail(f"`batch[{key!r}]` must be int [B, T <= max_len = {max_len}], got "
                    f"{ids.dtype} {ids.shape}")


def check_uea_batch(batch: dict, max_len: int, feat_dim: int) -> None:
    """`batch['inputs']` is `[B, max_len, feat_dim]`; `batch['mask']`, if given, `[B, max_len]`."""
    _check_batch_key(batch, "inputs", "float [B, T, C]")
    x = jnp.asarray(batch["inputs"])
    checks.check_shape("batch['inputs']", x, (x.shape[0] if x.ndim else 0, max_len, feat_dim),
                       "[B, max_len, feat_dim]")
    if batch.get("mask") is not None:
        masking.check_mask(jnp.asarray(batch["mask"]), x.shape[:2], "batch['mask']")
