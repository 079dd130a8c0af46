"""The parts of the HTGN configs they share, written into a config by `set_recipe` and `set_favor`.

`set_recipe` sets the training recipe of the htgn.md §5.9: linear warm-up then inverse-sqrt decay,
AdamW (b1 0.9, b2 0.98, eps 1e-9, weight decay 0.01, none on biases, norms and embeddings) or LAMB /
Ranger (lookahead(RAdam), k=6, alpha=0.5), global-norm clipping at 1.0. `set_favor` the FAVOR+
redraw and the ablation fields. Every file follows configs/common.py's style (parse with `htgn_args`,
base_config, set_*, smoke, `finish`).
"""
from __future__ import annotations

import ml_collections

from htgn_jax import model as htgn_model
from htgn_jax import ops, validation
from zoo_core.configs import common

OPTIMIZERS = ("adamw", "lamb", "ranger")
# FAVOR+ random features are redrawn every this many training steps (htgn.md §2.4, §5.4) and frozen
# at evaluation; smoke runs redraw every step so that the short run exercises the redraw.
REDRAW_EVERY = 1000
SMOKE_REDRAW_EVERY = 1


def htgn_args(arg, **defaults) -> ml_collections.ConfigDict:
    """The `:args` shared by the HTGN configs (smoke, attention, ablation, optimizer) plus `defaults`,
    with the names checked against htgn_jax.model."""
    args = common.parse_arg(arg, smoke=False, attention="favor", ablation="none", optimizer="adamw",
                            card=False, qk_rank=0, heads=0, **defaults)
    if args.ablation not in htgn_model.ABLATIONS:
        raise ValueError(f"config argument ablation={args.ablation!r} must be one of "
                         f"{tuple(htgn_model.ABLATIONS)}")
    if args.attention not in htgn_model.encoder_attentions():
        raise ValueError(f"config argument attention={args.attention!r} must be one of "
                         f"{htgn_model.encoder_attentions()}")
    if args.optimizer not in OPTIMIZERS:
        raise ValueError(f"config argument optimizer={args.optimizer!r} must be one of {OPTIMIZERS}")
    if args.attention != "favor" and args.ablation != "none":
        raise ValueError("config argument ablation applies to attention=favor only")
    if args.card and args.attention != "favor":
        raise ValueError("config argument card sets HTGN's own choices, so it needs attention=favor")
    for name in ("qk_rank", "heads"):
        if args[name] < 0:
            raise ValueError(f"config argument {name}={args[name]} must be >= 1 (0: the preset's)")
    return args


# The HTGN card's own choices (docs/htgn_options.md), written by `set_card` for `:card`.
CARD = dict(feature_map="trig", graph_activation="relu", graph_alpha="attention",
            drop_path_start=0.1, drop_path=0.3)
# graph fields: left out with ablation=no_graph
CARD_GRAPH_KEYS = ("graph_activation", "graph_alpha", "skip_offsets")


def set_card(c, args):
    """`:card` (the card's choices, written last so they win over the file's and the ablation's
    sizes) and the sweep arguments `:qk_rank=r` and `:heads=H` (0 = the preset's)."""
    if args.card:
        graph_on = c.model.get("use_graph_conv", True)
        for key, value in CARD.items():
            if graph_on or key not in CARD_GRAPH_KEYS:
                c.model[key] = value
        sizes = htgn_model.VARIANTS[c.model.variant]
        heads = args.heads or c.model.get("num_heads", sizes["num_heads"])
        # the card's r << d: half of the head width
        c.model.qk_rank = c.model.get("d_model", sizes["d_model"]) // heads // 2
        if c.model.get("gat_version", "v2") != "v2":   # ablation=gat_*: keep its learned alpha
            c.model.graph_alpha = "learned"
        if graph_on:   # skip edges at two scales beyond the window (grid: one, the image is small)
            w = c.model.get("window", sizes["window"])
            c.model.skip_offsets = (2 * w,) if c.model.kind == "classifier" else (2 * w, 4 * w)
    if args.heads:
        c.model.num_heads = args.heads
    if args.qk_rank:
        c.model.qk_rank = args.qk_rank
    return c


def set_recipe(c, *, optimizer: str, learning_rate: float, warmup_steps: int):
    """Writes the §5.9 optimiser and schedule into config `c` (unlocked); returns it."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"config argument optimizer={optimizer!r} must be one of {OPTIMIZERS}")
    c.optim.name = optimizer
    c.optim.learning_rate = learning_rate
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-9
    c.optim.weight_decay = 0.01
    c.optim.decay_mask = "no_bias_norm_embed"
    c.optim.grad_clip_norm = 1.0
    c.schedule.name = "warmup_rsqrt"
    c.schedule.warmup_steps = warmup_steps
    return c


def set_favor(c, args):
    """For attention=favor: the redraw period and the ablation's model fields (written last, so they
    win over the file's own); nothing for the softmax baseline."""
    if args.attention != "favor":
        return c
    c.model.redraw_every = SMOKE_REDRAW_EVERY if args.smoke else REDRAW_EVERY
    for key, value in htgn_model.ABLATIONS[args.ablation].items():
        c.model[key] = value
    return c


def finish(c):
    """`common.finish` with HTGN's size presets. Preset keys are skipped where the model would skip
    them (another kind's keys) or refuse them when given (the keys of a part that is switched off:
    graph layers, HRPE, the FAVOR+ features of the softmax baseline), so the model built is the
    same as from the preset."""
    m = c.model
    softmax = m.get("attention", "favor") != "favor"   # softmax or a registry baseline
    if softmax:   # the baseline's defaults, explicit like every other field
        for key, value in {**htgn_model.SOFTMAX_BASELINE_DEFAULTS,
                           **htgn_model.SOFTMAX_BASELINE_KIND_DEFAULTS[m.kind]}.items():
            if key not in m:
                m[key] = value
    off = set()
    if not m.get("use_graph_conv", not softmax):
        off.update(validation.GRAPH_ONLY_KWARGS)
    if not m.get("use_hrpe", not softmax):
        off.update(validation.HRPE_ONLY_KWARGS)
    if softmax:
        off.update(("chunk_size", "num_features"))
    if m.get("feature_map", "softmax") not in ops.RANDOM_FEATURE_MAPS:
        off.add("num_features")
    allowed = [k for k in htgn_model.model_kwargs(m.kind) if k not in off]
    return common.finish(c, htgn_model.VARIANTS, build=htgn_model.Model, allowed=allowed)
