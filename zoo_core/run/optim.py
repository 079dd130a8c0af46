"""Optimisers and learning-rate schedules built from `config.optim` and `config.schedule`.

Optimisers: adamw, adam, radam, lamb, ranger (= lookahead(radam), Zhang et al. 2019 + Liu et al. 2020).
Schedules: constant, one_cycle, warmup_linear, warmup_cosine, warmup_rsqrt. `one_cycle` with
`anneal='linear'` is torch's OneCycleLR(anneal_strategy='linear') step for step, optionally with its
default momentum cycling (beta1 moves inversely to the learning rate; `make_momentum_schedule`).
Every option that is set must be used: a weight decay given to an optimiser without decoupled decay,
or an unknown name, raises instead of being ignored.

The optimiser runs on one vector: `make_optimizer` returns a `VectorOptimizer`, whose state and update
are over the parameters raveled into a single `[n]` array (`jax.flatten_util.ravel_pytree`). Per leaf,
optax emits a few dozen HLO ops (moments, decay, lookahead, the trainer's finite-step guard and norms),
and they were more than half of the train step's HLO for a model with 79 parameter arrays (the HTGN
number-words smoke model); on one vector its step compiles in 23.6 s instead of 29.1 s (2-core CPU;
7.3 s instead of 17.6 s under the tests' compile flags). The numbers are the same elementwise; only
the global norms (clipping, LAMB's per-parameter trust ratio as a segment sum, the logged l2 norms) add
their terms in another order. What depends on parameter names (the weight-decay mask) or on the
leaves (LAMB's trust ratio) is built from the tree as constant vectors and reaches the transformations
as the extra arguments `decay_mask` and `segments`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from zoo_core import checks

OPTIMIZERS = ("adamw", "adam", "radam", "lamb", "ranger")
SCHEDULES = ("constant", "one_cycle", "warmup_linear", "warmup_cosine", "warmup_rsqrt")
ANNEALS = ("cos", "linear")
DECAY_MASKS = ("all", "no_bias_norm", "no_bias_norm_embed")


# The schedule fields and their defaults (configs/common.py base_config writes exactly these), and
# below which fields each schedule reads: any other field must keep its default.
SCHEDULE_DEFAULTS = dict(
    warmup_steps=0,
    end_factor=0.0,         # warmup_linear/cosine: final lr as a fraction of the peak
    pct_start=0.3,          # one_cycle: fraction of steps spent rising
    div_factor=25.0,        # one_cycle: initial lr = peak / div_factor
    final_div_factor=1e4,   # one_cycle: final lr = initial / final_div_factor
    anneal="cos",           # one_cycle: cos (optax's cosine one-cycle) | linear (torch's OneCycleLR)
    cycle_momentum=False,   # one_cycle + linear: beta1 cycles as torch's OneCycleLR default
    base_momentum=0.85,     # cycle_momentum: beta1 at the learning-rate peak
    max_momentum=0.95,      # cycle_momentum: beta1 at the start and the end
)
# ranger only (configs/common.py writes these too): lookahead sync period k and slow-weight step size.
LOOKAHEAD_DEFAULTS = dict(lookahead_steps=6, lookahead_alpha=0.5)
_ONE_CYCLE = ("pct_start", "div_factor", "final_div_factor", "anneal", "cycle_momentum", "base_momentum",
              "max_momentum")
SCHEDULE_FIELDS = {"constant": ("warmup_steps",), "one_cycle": _ONE_CYCLE,
                   "warmup_linear": ("warmup_steps", "end_factor"),
                   "warmup_cosine": ("warmup_steps", "end_factor"), "warmup_rsqrt": ("warmup_steps",)}


def _check_unused_schedule_fields(schedule: Any) -> None:
    used = SCHEDULE_FIELDS[schedule.name]
    for key, default in SCHEDULE_DEFAULTS.items():
        if key == "cycle_momentum":   # make_momentum_schedule says what it needs
            continue
        if key not in used and schedule.get(key, default) != default:
            raise ValueError(f"schedule.{key}={schedule.get(key)!r} is not used by schedule.name="
                             f"{schedule.name!r} (it reads {', '.join(used)})")


def make_schedule(schedule: Any, *, learning_rate: float, total_steps: int) -> optax.Schedule:
    """Builds the learning-rate schedule (a function of the optimiser step).

    Args:
      schedule: `config.schedule` with `name` and, per schedule, `warmup_steps`, `end_factor`
        (final lr / peak for linear and cosine decay), `pct_start`, `div_factor`, `final_div_factor`,
        `anneal` (one-cycle: 'cos' is optax's cosine one-cycle, peak at step int(pct_start * T);
        'linear' is torch's OneCycleLR(anneal_strategy='linear'), peak at step pct_start * T - 1).
      learning_rate: the peak learning rate.
      total_steps: length of the run.
    """
    name = schedule.name
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule.name {name!r}; choose one of {', '.join(SCHEDULES)}")
    _check_unused_schedule_fields(schedule)
    warmup = int(schedule.get("warmup_steps", 0))
    if name == "constant":
        if warmup:
            return optax.linear_schedule(0.0, learning_rate, warmup)
        return optax.constant_schedule(learning_rate)
    if name == "one_cycle":
        if schedule.anneal not in ANNEALS:
            raise ValueError(f"unknown schedule.anneal {schedule.anneal!r}; choose one of {', '.join(ANNEALS)}")
        if schedule.anneal == "linear":
            start = learning_rate / schedule.div_factor
            return torch_one_cycle(start, learning_rate, start / schedule.final_div_factor,
                                   total_steps=total_steps, pct_start=schedule.pct_start)
        return optax.cosine_onecycle_schedule(
            transition_steps=total_steps, peak_value=learning_rate, pct_start=schedule.pct_start,
            div_factor=schedule.div_factor, final_div_factor=schedule.final_div_factor)
    if name in ("warmup_linear", "warmup_cosine"):
        if not 0 <= warmup < total_steps:
            raise ValueError(f"schedule.warmup_steps={warmup} must be in [0, total_steps={total_steps})")
        end = learning_rate * schedule.end_factor
        if name == "warmup_linear":
            decay = optax.linear_schedule(learning_rate, end, total_steps - warmup)
        else:
            decay = optax.cosine_decay_schedule(learning_rate, total_steps - warmup, alpha=schedule.end_factor)
        return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup), decay], [warmup])
    if name == "warmup_rsqrt":
        # Vaswani et al. 2017: linear warm-up to the peak, then lr * sqrt(warmup / step).
        if warmup <= 0:
            raise ValueError("schedule.warmup_steps must be > 0 for warmup_rsqrt")

        def rsqrt(step):
            step = jnp.asarray(step, jnp.float32) + 1.0
            return learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))
        return rsqrt
    raise ValueError(f"unknown schedule.name {name!r}; choose one of {', '.join(SCHEDULES)}")


def torch_one_cycle(start: float, peak: float, end: float, *, total_steps: int,
                    pct_start: float) -> optax.Schedule:
    """Two linear ramps with the phase boundaries of torch's OneCycleLR (two-phase, linear anneal).

    start -> peak over steps [0, pct_start * T - 1], then peak -> end at step T - 1 (held after it,
    where torch would raise). The same curve serves the learning rate (initial, max, min lr) and the
    cycled momentum (max, base, max momentum).
    """
    rise_end = float(pct_start * total_steps) - 1.0
    last = float(total_steps - 1)
    if not 0.0 < rise_end <= last:
        raise ValueError(f"schedule.pct_start={pct_start} gives no rising phase over total_steps="
                         f"{total_steps} (torch's OneCycleLR divides by zero there)")
    fall_len = max(last - rise_end, 1.0)  # pct_start = 1: no falling phase within the run

    def lerp(a, b, frac):  # exact at both ends in float32 (no a + (b - a) cancellation at b << a)
        return (1.0 - frac) * a + frac * b

    def curve(step):
        step = jnp.asarray(step, jnp.float32)
        rise = lerp(start, peak, step / rise_end)
        fall = lerp(peak, end, jnp.minimum((step - rise_end) / fall_len, 1.0))
        return jnp.where(step <= rise_end, rise, fall)
    return curve


def make_momentum_schedule(schedule: Any, *, total_steps: int) -> optax.Schedule | None:
    """beta1 as a function of the step when `schedule.cycle_momentum`, else None (beta1 = optim.b1).

    torch's OneCycleLR cycles momentum by default (cycle_momentum=True): for Adam-style optimisers it
    overwrites beta1, max_momentum at the start, base_momentum at the learning-rate peak, back to
    max_momentum at the end; the optimiser's own beta1 is never used.
    """
    if not schedule.get("cycle_momentum", False):
        return None
    if schedule.name != "one_cycle" or schedule.anneal != "linear":
        raise ValueError("schedule.cycle_momentum needs schedule.name='one_cycle' with anneal='linear', "
                         f"got name={schedule.name!r}, anneal={schedule.get('anneal')!r}")
    hi, lo = float(schedule.max_momentum), float(schedule.base_momentum)
    if not 0.0 <= lo <= hi < 1.0:
        raise ValueError(f"schedule.base_momentum={lo} and max_momentum={hi} need 0 <= base <= max < 1")
    return torch_one_cycle(hi, lo, hi, total_steps=total_steps, pct_start=schedule.pct_start)


def decay_mask(params: Any, rule: str) -> Any:
    """Pytree of bools: which parameters receive weight decay.

    'all' decays everything; 'no_bias_norm' decays only tensors of rank >= 2 (kernels) whose name does
    not end in 'bias', so biases (also the [H, D] ones of a DenseGeneral and relative-position biases),
    norm scales and scalar coefficients are spared; 'no_bias_norm_embed' also spares any parameter whose
    path mentions 'embed', 'pos' or 'tokens' (token and position tables, learned global tokens).
    """
    if rule not in DECAY_MASKS:
        raise ValueError(f"unknown optim.decay_mask {rule!r}; choose one of {', '.join(DECAY_MASKS)}")

    def keep(path, leaf):
        if rule == "all":
            return True
        names = [str(getattr(k, "key", k)).lower() for k in path]
        if jnp.ndim(leaf) < 2 or names[-1].endswith("bias"):
            return False
        joined = "/".join(names)
        return not (rule == "no_bias_norm_embed" and any(w in joined for w in ("embed", "pos", "tokens")))
    return jax.tree_util.tree_map_with_path(keep, params)


class VectorOptimizer(NamedTuple):
    """An optax transformation over the parameters raveled into one vector (module docstring).

    Attributes:
      inner: the transformation on `[n]` vectors; its update takes the extra arguments of `layout`.
      decay_rule: `decay_mask`'s rule (which parameters get weight decay).
    """
    inner: optax.GradientTransformationExtraArgs
    decay_rule: str

    def layout(self, params: Any) -> dict[str, Any]:
        """The extra arguments of `inner.update` for this tree (constants, built from shapes only):
        `decay_mask` bool `[n]` (weight decay applies) and `segments` int32 `[n]` (the leaf index of each
        element, in `ravel_pytree` order)."""
        leaves = jax.tree_util.tree_leaves(params)
        sizes = [int(np.prod(jnp.shape(x))) for x in leaves]
        mask = jax.tree_util.tree_leaves(decay_mask(params, self.decay_rule))
        return dict(decay_mask=np.repeat(np.asarray(mask, bool), sizes),
                    segments=np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))

    def init(self, params: Any) -> Any:
        """The optimiser state of the parameter tree `params` (over its raveled vector)."""
        return self.inner.init(ravel_pytree(params)[0])

    def update_vector(self, grads: jax.Array, state: Any, params: jax.Array,
                      layout: dict[str, Any]) -> tuple[jax.Array, Any]:
        """(updates `[n]`, new state) for raveled gradients and parameters `[n]`; `layout` of the tree."""
        return self.inner.update(grads, state, params, **layout)

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """optax's interface on trees: (updates as a tree like `params`, new state)."""
        g, unravel = ravel_pytree(grads)
        updates, state = self.update_vector(g, state, ravel_pytree(params)[0], self.layout(params))
        return unravel(updates), state


def masked_weight_decay(weight_decay: float) -> optax.GradientTransformationExtraArgs:
    """optax's `add_decayed_weights` (u + wd * p) on a vector, where its `decay_mask` argument is True."""
    def update(updates, state, params=None, *, decay_mask, **extra):
        del extra
        return jnp.where(decay_mask, updates + weight_decay * params, updates), state
    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def trust_ratio_by_segment() -> optax.GradientTransformationExtraArgs:
    """optax's `scale_by_trust_ratio` on a vector: each parameter (its `segments` entries) is scaled by
    ||p|| / ||u|| of its own elements (1 where either norm is 0), as LAMB does per parameter array."""
    def update(updates, state, params=None, *, segments, **extra):
        del extra
        num = int(segments[-1]) + 1 if segments.size else 0
        norm = lambda x: jnp.sqrt(jax.ops.segment_sum(x * x, segments, num, indices_are_sorted=True))
        p_norm, u_norm = norm(params), norm(updates)
        ratio = jnp.where((p_norm == 0.0) | (u_norm == 0.0), jnp.ones_like(p_norm), p_norm / u_norm)
        return updates * ratio[segments], state
    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


class LookaheadState(NamedTuple):
    inner: Any
    slow: Any
    count: jax.Array


def lookahead(inner: optax.GradientTransformation, sync_period: int, alpha: float) -> optax.GradientTransformationExtraArgs:
    """Lookahead (Zhang et al. 2019) keeping the slow weights inside the optimiser state.

    Every `sync_period` steps the slow weights move `alpha` of the way to the fast weights and the fast
    weights are reset to them. Unlike `optax.lookahead`, parameters stay a plain tree, so the trainer,
    checkpoints and evaluation need no special case.
    """
    if sync_period < 1 or not 0.0 < alpha <= 1.0:
        raise ValueError(f"lookahead needs sync_period >= 1 and 0 < alpha <= 1, got {sync_period}, {alpha}")

    def init(params):
        return LookaheadState(inner.init(params), jax.tree_util.tree_map(jnp.asarray, params),
                              jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("lookahead needs params in update()")
        fast_updates, inner_state = inner.update(updates, state.inner, params, **extra)
        fast = optax.apply_updates(params, fast_updates)
        count = state.count + 1
        sync = count % sync_period == 0
        slow = jax.tree_util.tree_map(lambda s, f: jnp.where(sync, s + alpha * (f - s), s), state.slow, fast)
        new_params = jax.tree_util.tree_map(lambda s, f: jnp.where(sync, s, f), slow, fast)
        final_updates = jax.tree_util.tree_map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
        return final_updates, LookaheadState(inner_state, slow, count)

    return optax.GradientTransformationExtraArgs(init, update)


def check_ranges(config: Any) -> None:
    """Value ranges of `config.optim` and `config.schedule` (one line naming the field on failure).

    A negative or zero learning rate trains silently to nothing, so it is refused here with the other
    numbers that have a meaningful range.
    """
    o, s = config.optim, config.schedule
    for field, value, known in (("optim.name", o.name, OPTIMIZERS), ("schedule.name", s.name, SCHEDULES),
                                ("optim.decay_mask", o.decay_mask, DECAY_MASKS),
                                ("schedule.anneal", s.get("anneal", "cos"), ANNEALS)):
        if value not in known:
            checks.fail(f"unknown {field} {value!r}; choose one of {', '.join(known)}")
    checks.check_positive("optim.learning_rate", o.learning_rate)
    checks.check_rate("optim.b1", o.b1)
    checks.check_rate("optim.b2", o.b2)
    for name in ("weight_decay", "grad_clip_norm", "eps"):
        checks.check_nonnegative(f"optim.{name}", o[name])
    checks.check_int("optim.grad_accum_steps", o.grad_accum_steps, 1)
    checks.check_int("optim.lookahead_steps", o.get("lookahead_steps", 6), 1)
    alpha = o.get("lookahead_alpha", 0.5)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        checks.fail(f"`optim.lookahead_alpha` must be in (0, 1], got {alpha!r}")
    checks.check_int("schedule.warmup_steps", s.get("warmup_steps", 0), 0)
    end = s.get("end_factor", 0.0)
    if isinstance(end, bool) or not isinstance(end, (int, float)) or not 0 <= end <= 1:
        checks.fail(f"`schedule.end_factor` must be in [0, 1], got {end!r}")
    pct = s.get("pct_start", 0.3)
    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct <= 1:
        checks.fail(f"`schedule.pct_start` must be in (0, 1], got {pct!r}")
    checks.check_positive("schedule.div_factor", s.get("div_factor", 25.0))
    checks.check_positive("schedule.final_div_factor", s.get("final_div_factor", 1e4))
    checks.check_rate("schedule.base_momentum", s.get("base_momentum", 0.85))
    checks.check_rate("schedule.max_momentum", s.get("max_momentum", 0.95))


def make_optimizer(config: Any) -> tuple[VectorOptimizer, optax.Schedule]:
    """Returns (tx, schedule) from `config.optim`, `config.schedule` and `config.total_steps`."""
    check_ranges(config)
    o = config.optim
    schedule = make_schedule(config.schedule, learning_rate=o.learning_rate, total_steps=config.total_steps)
    name = o.name
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if name != "ranger" and any(o.get(k, v) != v for k, v in LOOKAHEAD_DEFAULTS.items()):
        raise ValueError("optim.lookahead_steps/lookahead_alpha apply only to optim.name='ranger'")
    if name == "adam" and o.weight_decay:
        raise ValueError("optim.weight_decay is set but adam has no weight decay: use optim.name='adamw'")

    def build_core(learning_rate, b1):
        # optax's adamw / adam / lamb chains, with the per-leaf steps as their vector forms.
        decay = [masked_weight_decay(o.weight_decay)] if o.weight_decay else []   # adam: refused above
        if name in ("adamw", "adam", "lamb"):
            moments = optax.scale_by_adam(b1=b1, b2=o.b2, eps=o.eps)
        else:  # radam, ranger: RAdam with decoupled weight decay
            moments = optax.scale_by_radam(b1=b1, b2=o.b2, eps=o.eps)
        trust = [trust_ratio_by_segment()] if name == "lamb" else []
        return optax.chain(moments, *decay, *trust, optax.scale_by_learning_rate(learning_rate))

    momentum = make_momentum_schedule(config.schedule, total_steps=config.total_steps)
    if momentum is None:
        core = build_core(schedule, o.b1)
    else:  # both schedules are evaluated at the optimiser's own step count
        core = optax.inject_hyperparams(build_core)(learning_rate=schedule, b1=momentum)
    if name == "ranger":
        core = lookahead(core, o.lookahead_steps, o.lookahead_alpha)
    parts = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm else []
    return VectorOptimizer(optax.chain(*parts, core), o.decay_mask), schedule
