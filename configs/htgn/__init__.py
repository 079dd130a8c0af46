"""Configs of HTGN (`python -m htgn_jax.train --config configs/htgn/<file>.py[:args]`).

`apply_recipe` sets the training recipe of the HTGN spec §5.9 shared by the files here: linear
warm-up then inverse-sqrt decay, AdamW (b1 0.9, b2 0.98, eps 1e-9, weight decay 0.01, none on
biases, norms and embeddings) or LAMB / Ranger (lookahead(RAdam), k=6, alpha=0.5), global-norm
clipping at 1.0.
"""

OPTIMIZERS = ("adamw", "lamb", "ranger")
# FAVOR+ random features are redrawn every this many training steps (htgn.md §2.4, §5.4) and frozen
# at evaluation; smoke runs redraw every step so that the short run exercises the redraw.
REDRAW_EVERY = 1000
SMOKE_REDRAW_EVERY = 1


def apply_recipe(c, *, optimizer: str, learning_rate: float, warmup_steps: int):
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
