"""Boundary checks of SAMoVAR's `Forecaster` fields, called once by `Model(...)` (model.py).

Every check raises `ValueError` with one line naming the field (zoo_core.checks wording).
"""
from __future__ import annotations

import jax.numpy as jnp

from zoo_core import checks

FORECASTER_KINDS = ("samovar", "lintrans", "fixedvar")
# `Forecaster` fields that apply to some kinds only: another kind with a non-default value raises.
KIND_ONLY_FIELDS = {"use_qv_norm": ("samovar",), "use_key_proj": ("samovar",), "structural": ("samovar", "fixedvar"),
                    "shortcut_inside": ("samovar", "fixedvar"), "fixed_max_tokens": ("fixedvar",)}


def check_dtype(name: str, value) -> None:
    try:
        value is None or jnp.dtype(value)
    except TypeError:
        checks.fail(f"`{name}` must be a dtype or its name (e.g. 'bfloat16'), got {value!r}")


def check_forecaster(m) -> None:
    """Every field of a `Forecaster` `m`, and the sizes they resolve to."""
    for name in ("dtype", "param_dtype"):
        check_dtype(name, getattr(m, name))
    for name, low in (("num_channels", 1), ("input_len", 2), ("patch_len", 1), ("num_layers", 1),
                      ("mlp_ratio", 1), ("num_targets", 0), ("width", 0), ("num_heads", 0),
                      ("max_patches", 0), ("horizon", 0), ("fixed_max_tokens", 2)):
        checks.check_int(name, getattr(m, name), low)
    checks.check_choice("kind", m.kind, FORECASTER_KINDS)
    checks.check_chunk_size(m.chunk_size)
    checks.check_rate("dropout", m.dropout)
    checks.check_choice("norm_mean", m.norm_mean, ("last_patch", "window"))
    checks.check_choice("position_overflow", m.position_overflow, ("error", "clamp"))
    checks.check_choice("structural", m.structural, (None, "lu", "lu_inverse", "none"))
    if m.sequence_axis is not None and not isinstance(m.sequence_axis, str):
        checks.fail(f"`sequence_axis` must be a mesh axis name or None, got {m.sequence_axis!r}")
    if not isinstance(m.channel_drop, bool):
        checks.fail(f"`channel_drop` must be True or False, got {m.channel_drop!r}")
    if not m.ar_loss_weight >= 0 or m.num_targets > m.num_channels:
        checks.fail(f"`ar_loss_weight` must be >= 0 and `num_targets` <= C, got {m.ar_loss_weight}, "
                    f"{m.num_targets}")
    for name, kinds in KIND_ONLY_FIELDS.items():
        if m.kind not in kinds and getattr(m, name) != type(m).__dataclass_fields__[name].default:
            checks.fail(f"`{name}` applies to kind in {kinds} only, got kind={m.kind!r}")
    if m.kind == "lintrans" and m.num_heads == 0:
        checks.fail("`num_heads`=0 (automatic) is not available for kind='lintrans'; give num_heads > 0")
    r = m.resolved
    checks.check_divisible("width", r.width, "num_heads", r.num_heads)
    if r.max_patches < r.num_patches or (m.kind == "fixedvar" and 2 * r.num_patches > m.fixed_max_tokens):
        checks.fail(f"`max_patches` / `fixed_max_tokens` do not fit the {r.num_patches} input patches")
    if r.horizon_patches > 1 and r.num_targets != m.num_channels:
        checks.fail(f"`horizon` {r.horizon} > patch_len needs num_targets == num_channels, got {r.num_targets}")
    if m.ar_loss_weight > 0 and r.num_patches < 2:
        checks.fail(f"`ar_loss_weight` > 0 needs at least 2 patches, got {r.num_patches} (input_len / patch_len)")
    check_positions(m, r, r.num_patches + r.horizon_patches - 1)


def check_positions(m, res, patches: int) -> None:
    """Raises if `patches` patches do not fit the position tables (unless clamping)."""
    if m.position_overflow != "clamp" and (
            patches > res.max_patches or (m.kind == "fixedvar" and 2 * patches > m.fixed_max_tokens)):
        checks.fail(f"{patches} patches (input + rollout) exceed `max_patches`={res.max_patches} or "
                    f"`fixed_max_tokens`={m.fixed_max_tokens}; raise them or set position_overflow='clamp'")
