"""Optimisers, schedules, weight-decay masks and lookahead."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zoo_core.configs import common
from zoo_core.run import optim


def _config(**optim_fields):
    c = common.base_config()
    c.total_steps = 100
    for k, v in optim_fields.items():
        if k.startswith("schedule_"):
            c.schedule[k[len("schedule_"):]] = v
        else:
            c.optim[k] = v
    return c


def test_warmup_rsqrt_schedule_values():
    c = _config(learning_rate=1.0, schedule_name="warmup_rsqrt", schedule_warmup_steps=4)
    _, schedule = optim.make_optimizer(c)
    # step s (0-based) uses n = s + 1: min(n / w, sqrt(w / n)).
    np.testing.assert_allclose([schedule(s) for s in (0, 3, 15)], [0.25, 1.0, 0.5], rtol=1e-6)


def test_warmup_linear_and_cosine_reach_peak_then_end():
    for name in ("warmup_linear", "warmup_cosine"):
        c = _config(learning_rate=2.0, schedule_name=name, schedule_warmup_steps=10, schedule_end_factor=0.1)
        _, schedule = optim.make_optimizer(c)
        np.testing.assert_allclose(schedule(0), 0.0, atol=1e-7)
        np.testing.assert_allclose(schedule(10), 2.0, rtol=1e-6)
        np.testing.assert_allclose(schedule(100), 0.2, rtol=1e-5)


def test_one_cycle_peaks_at_pct_start():
    c = _config(learning_rate=1.0, schedule_name="one_cycle", schedule_pct_start=0.3)
    _, schedule = optim.make_optimizer(c)
    values = np.array([schedule(s) for s in range(100)])
    assert values.argmax() == 30 and values[0] == pytest.approx(1.0 / 25.0)


def test_decay_mask_rules():
    params = {"embed": {"embedding": jnp.ones((5, 3))}, "dense": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)},
              "norm": {"scale": jnp.ones(3)}}
    m = optim.decay_mask(params, "no_bias_norm")
    assert m["dense"]["kernel"] and not m["dense"]["bias"] and not m["norm"]["scale"] and m["embed"]["embedding"]
    m = optim.decay_mask(params, "no_bias_norm_embed")
    assert m["dense"]["kernel"] and not m["embed"]["embedding"]
    assert all(jax.tree_util.tree_leaves(optim.decay_mask(params, "all")))
    # Biases of any rank (DenseGeneral's [H, D], relative-position [H, K]) and learned global tokens.
    more = {"query": {"kernel": jnp.ones((3, 2, 4)), "bias": jnp.ones((2, 4))}, "rel_bias": jnp.ones((2, 5)),
            "global_tokens": jnp.ones((2, 3))}
    m = optim.decay_mask(more, "no_bias_norm")
    assert m["query"]["kernel"] and not m["query"]["bias"] and not m["rel_bias"] and m["global_tokens"]
    assert not optim.decay_mask(more, "no_bias_norm_embed")["global_tokens"]


def test_adamw_decays_only_masked_leaves():
    c = _config(learning_rate=0.1, weight_decay=0.5)
    tx, _ = optim.make_optimizer(c)
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.05 * np.ones((2, 2)), rtol=1e-6)
    np.testing.assert_allclose(updates["bias"], np.zeros(2))


def test_lookahead_syncs_slow_weights_every_k_steps():
    inner = optax.sgd(1.0)
    tx = optim.lookahead(inner, sync_period=2, alpha=0.5)
    params = jnp.array([0.0])
    state = tx.init(params)
    g = jnp.array([-1.0])  # sgd moves +1 per step
    u, state = tx.update(g, state, params)
    params = params + u
    np.testing.assert_allclose(params, [1.0])          # fast step
    u, state = tx.update(g, state, params)
    params = params + u
    np.testing.assert_allclose(params, [1.0])          # fast reaches 2, slow = 0 + 0.5 * (2 - 0) = 1
    np.testing.assert_allclose(state.slow, [1.0])


@pytest.mark.parametrize("name", ["adamw", "adam", "radam", "lamb", "ranger"])
def test_every_optimizer_decreases_a_quadratic(name):
    c = _config(name=name, learning_rate=0.05, weight_decay=0.0 if name == "adam" else 1e-4)
    tx, _ = optim.make_optimizer(c)
    params = {"w": jnp.array([3.0, -2.0])}
    state = tx.init(params)
    loss = lambda p: jnp.sum(p["w"] ** 2)

    @jax.jit   # one compile instead of 100 eager dispatches of every op of the update (radam: 6.6 s)
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(100):
        params, state = step(params, state)
    assert loss(params) < 13.0 * 0.5


def test_bad_optimizer_settings_raise():
    with pytest.raises(ValueError, match="unknown optim.name 'sgdd'"):
        optim.make_optimizer(_config(name="sgdd"))
    with pytest.raises(ValueError, match="adam has no weight decay"):
        optim.make_optimizer(_config(name="adam", weight_decay=0.1))
    with pytest.raises(ValueError, match="unknown schedule.name"):
        optim.make_optimizer(_config(schedule_name="step"))
    with pytest.raises(ValueError, match="decay_mask"):
        optim.decay_mask({"a": jnp.ones(2)}, "nope")


def test_clipping_bounds_the_update():
    c = _config(name="adamw", learning_rate=1.0, grad_clip_norm=1e-3, b1=0.0, b2=0.0, eps=0.0)
    tx, _ = optim.make_optimizer(c)
    params = {"w": jnp.zeros(4)}
    updates, _ = tx.update({"w": jnp.full(4, 100.0)}, tx.init(params), params)
    # Adam with b1 = b2 = 0 normalises the (clipped) gradient to sign: |update| = lr.
    np.testing.assert_allclose(np.abs(updates["w"]), 1.0, rtol=1e-4)


def _torch_one_cycle_by_hand(step, total, pct, peak, div=25.0, final_div=1e4):
    """torch.optim.lr_scheduler.OneCycleLR(anneal_strategy='linear') written out (two phases)."""
    rise_end, last = pct * total - 1, total - 1
    start = peak / div
    if step <= rise_end:
        frac = step / rise_end
        return start + (peak - start) * frac, 0.95 + (0.85 - 0.95) * frac
    frac = (step - rise_end) / (last - rise_end)
    return peak + (start / final_div - peak) * frac, 0.85 + (0.95 - 0.85) * frac


def test_linear_one_cycle_matches_torch_formula_with_cycled_beta1():
    c = _config(learning_rate=1e-4, schedule_name="one_cycle", schedule_anneal="linear",
                schedule_pct_start=0.2, schedule_cycle_momentum=True)
    _, schedule = optim.make_optimizer(c)
    momentum = optim.make_momentum_schedule(c.schedule, total_steps=c.total_steps)
    for step in (0, 1, 10, 19, 20, 50, 99):
        lr, b1 = _torch_one_cycle_by_hand(step, 100, 0.2, 1e-4)
        np.testing.assert_allclose(schedule(step), lr, rtol=1e-5)
        np.testing.assert_allclose(momentum(step), b1, rtol=1e-6)
    assert int(np.argmax([schedule(s) for s in range(100)])) == 19  # peak at pct * T - 1


def test_cycled_beta1_reaches_adamw():
    """With cycle_momentum the optimiser's first moment uses the scheduled beta1, not optim.b1."""
    c = _config(learning_rate=1.0, schedule_name="one_cycle", schedule_anneal="linear",
                schedule_pct_start=0.5, schedule_cycle_momentum=True)
    tx, schedule = optim.make_optimizer(c)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    grads = [jnp.full(3, g) for g in (1.0, -2.0, 0.5)]
    mu, nu = np.zeros(3), np.zeros(3)
    for t, g in enumerate(grads):
        updates, state = tx.update({"w": g}, state, params)
        _, b1 = _torch_one_cycle_by_hand(t, 100, 0.5, 1.0)
        mu = b1 * mu + (1 - b1) * np.asarray(g)
        nu = 0.999 * nu + 0.001 * np.asarray(g) ** 2
        m_hat, v_hat = mu / (1 - b1 ** (t + 1)), nu / (1 - 0.999 ** (t + 1))
        expected = -float(schedule(t)) * m_hat / (np.sqrt(v_hat) + c.optim.eps)
        np.testing.assert_allclose(updates["w"], expected, rtol=1e-5)


def test_cycle_momentum_needs_linear_one_cycle():
    c = _config(schedule_name="warmup_linear", schedule_warmup_steps=10, schedule_cycle_momentum=True)
    with pytest.raises(ValueError, match="cycle_momentum needs"):
        optim.make_optimizer(c)
    c = _config(schedule_name="one_cycle", schedule_anneal="triangle")
    with pytest.raises(ValueError, match="schedule.anneal"):
        optim.make_optimizer(c)
    c = _config(schedule_name="one_cycle", schedule_anneal="linear", schedule_pct_start=0.005)
    with pytest.raises(ValueError, match="pct_start"):
        optim.make_optimizer(c)


def test_schedule_defaults_match_the_base_config_and_unused_fields_raise():
    from zoo_core.configs import common
    base = common.base_config()
    assert {k: base.schedule[k] for k in optim.SCHEDULE_DEFAULTS} == optim.SCHEDULE_DEFAULTS
    sched = common.base_config().schedule
    sched.name, sched.warmup_steps = "one_cycle", 100    # one_cycle rises over pct_start instead
    with pytest.raises(ValueError, match=r"schedule.warmup_steps=100 is not used by schedule.name='one_cycle'"):
        optim.make_schedule(sched, learning_rate=1e-3, total_steps=1000)
    c = common.base_config()
    c.optim.lookahead_steps = 4
    with pytest.raises(ValueError, match="apply only to optim.name='ranger'"):
        optim.make_optimizer(c)


def _tree_reference(name, c):
    """optax's own per-leaf optimiser for the config `c` (what the vector optimiser must reproduce)."""
    o = c.optim
    mask = lambda p: optim.decay_mask(p, o.decay_mask)
    if name == "adamw":
        core = optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    elif name == "lamb":
        core = optax.lamb(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    else:
        core = optax.chain(optax.scale_by_radam(b1=o.b1, b2=o.b2, eps=o.eps),
                           optax.add_decayed_weights(o.weight_decay, mask=mask),
                           optax.scale_by_learning_rate(o.learning_rate))
        if name == "ranger":
            core = optim.lookahead(core, o.lookahead_steps, o.lookahead_alpha)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), core)


@pytest.mark.parametrize("name", ["adamw", "lamb", "radam", "ranger"])
def test_the_vector_optimiser_equals_optax_per_leaf(name):
    # Mixed ranks and names (decayed kernels, spared biases and norms, a zero-norm leaf for LAMB's
    # trust ratio), the clip active on some steps: 7 steps, past one lookahead sync (every 3).
    c = _config(name=name, learning_rate=0.05, weight_decay=0.1, grad_clip_norm=1.5,
                schedule_name="constant", decay_mask="no_bias_norm",
                **({"lookahead_steps": 3} if name == "ranger" else {}))
    tx, _ = optim.make_optimizer(c)
    ref = _tree_reference(name, c)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"dense": {"kernel": jax.random.normal(keys[0], (4, 3)), "bias": jnp.zeros(3)},
              "norm": {"scale": jnp.ones(3)}, "query": {"kernel": jax.random.normal(keys[1], (3, 2, 2))}}
    p_vec, p_ref = params, params
    s_vec, s_ref = tx.init(params), ref.init(params)
    for i in range(7):
        g = jax.tree_util.tree_map(lambda x: jax.random.normal(jax.random.fold_in(keys[2], i), x.shape)
                                   * (0.2 + i % 3), params)
        u_vec, s_vec = jax.jit(tx.update)(g, s_vec, p_vec)
        u_ref, s_ref = jax.jit(ref.update)(g, s_ref, p_ref)
        p_vec, p_ref = optax.apply_updates(p_vec, u_vec), optax.apply_updates(p_ref, u_ref)
        for a, b in zip(jax.tree_util.tree_leaves(p_vec), jax.tree_util.tree_leaves(p_ref)):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)
    assert jax.tree_util.tree_structure(p_vec) == jax.tree_util.tree_structure(params)


def test_the_vector_layout_follows_ravel_order():
    tx, _ = optim.make_optimizer(_config(decay_mask="no_bias_norm", weight_decay=0.1))
    params = {"b": {"bias": jnp.ones(2)}, "a": {"kernel": jnp.ones((2, 3))}}   # ravel order: a, then b
    layout = tx.layout(params)
    np.testing.assert_array_equal(layout["decay_mask"], [True] * 6 + [False] * 2)
    np.testing.assert_array_equal(layout["segments"], [0] * 6 + [1] * 2)
