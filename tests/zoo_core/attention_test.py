"""`zoo_core.attention`: every mechanism drops into a foreign pre-LN Transformer block and trains."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zoo_core import attention

B, T, E, HEADS = 2, 7, 16, 2

# (name, causal, options): every mode each mechanism has, with small options where the defaults are
# sized for real models.
CASES = [
    ("agf", False, {}),
    ("agf", True, {}),
    ("agf", True, {"chunk_size": 3}),
    ("softmax", False, {}),
    ("softmax", True, {}),
    ("favor", False, {"num_features": 8}),
    ("favor", True, {"num_features": 8, "chunk_size": 3}),
    ("window_graph", False, {"window": 2, "kl_weight": 1e-3}),
    ("window_graph", True, {"window": 2}),
    ("linear", True, {}),
]


class ForeignBlock(nn.Module):
    """A pre-LN Transformer block as a user would write it (not the zoo's): LN, attention,
    residual, LN, MLP with dropout, residual, a per-token linear read-out `[B, T]`."""
    name_: str
    causal: bool
    options: tuple

    @nn.compact
    def __call__(self, x, mask=None, train=False):
        attn = attention.make(self.name_, num_heads=HEADS, qkv_features=E, causal=self.causal,
                              **dict(self.options))
        x = x + attn(nn.LayerNorm()(x), mask=mask, deterministic=not train)
        h = nn.Dense(2 * E)(nn.LayerNorm()(x))
        h = nn.Dropout(0.1)(nn.gelu(h), deterministic=not train)
        x = x + nn.Dense(E)(h)
        return nn.Dense(1)(x)[..., 0]


@functools.lru_cache(maxsize=None)
def _data():
    # numpy, drawn once: each eager op on them would compile per shape
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = np.asarray(jax.random.normal(kx, (B, T, E)))
    mask = np.arange(T)[None, :] < np.array([[T], [T - 2]])
    return x, mask, np.asarray(jax.random.normal(ky, (B, T)))


def test_names():
    assert {"agf", "favor", "window_graph", "linear", "softmax"} <= set(attention.names())
    assert attention.names() == tuple(sorted(attention.names()))


@pytest.mark.parametrize("name,causal,options", CASES, ids=[f"{n}-{'causal' if c else 'full'}-{len(o)}"
                                                            for n, c, o in CASES])
def test_foreign_block_jit_eager_dropout_and_optax(name, causal, options):
    x, mask, target = _data()
    model = ForeignBlock(name, causal, tuple(sorted(options.items())))
    variables = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x, mask)
    params = variables["params"]

    # eager == jit, with and without dropout keys
    def fwd(p, train, key, x=x):
        out, state = model.apply({"params": p}, x, mask, train=train, rngs={"dropout": key},
                                 mutable=["losses"])
        return out, sum(jax.tree_util.tree_leaves(state.get("losses", {})), jnp.zeros(()))
    key = jax.random.PRNGKey(2)
    # Both modes jitted in one program (one compile instead of two).
    both = jax.jit(lambda p, key: (fwd(p, False, key), fwd(p, True, key)))
    jitted = dict(zip((False, True), both(params, key)))
    eager = {}
    for train in (False, True):
        eager[train] = fwd(params, train, key)
        np.testing.assert_allclose(np.asarray(eager[train][0]), np.asarray(jitted[train][0]),
                                   rtol=1e-5, atol=1e-5)
        assert np.all(np.isfinite(np.asarray(eager[train][0])))
    if name == "agf" or options.get("kl_weight"):   # the orthogonality term, the graph KL
        assert float(eager[False][1]) != 0.0

    # padding holding NaN changes nothing valid (eager, the clean run being the one above)
    dirty = np.where(mask[:, :, None], x, np.float32(np.nan))
    clean_out = eager[False][0]
    dirty_out = fwd(params, False, key, x=dirty)[0]
    np.testing.assert_array_equal(np.asarray(dirty_out)[mask], np.asarray(clean_out)[mask])

    # trains with optax, the collected losses included
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def train_step(p, opt, key):
        def loss_fn(p):
            out, aux = fwd(p, True, key)
            err = jnp.where(mask, (out - target) ** 2, 0.0)
            return jnp.sum(err) / jnp.sum(mask) + aux
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss
    losses = []
    for i in range(15):
        params, opt, loss = train_step(params, opt, jax.random.PRNGKey(10 + i))
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


def test_layer_returns_the_contract_layer():
    lay = attention.layer("agf", num_heads=HEADS, qkv_features=E, causal=True)
    x, mask, _ = _data()
    params = lay.init(jax.random.PRNGKey(0), x)
    y, aux = lay.apply(params, x, mask=mask)
    assert y.shape == (B, T, E) and isinstance(aux, dict)
    state = lay.apply(params, B, method="init_state")
    y_scan, _ = lay.apply(params, x, state, method="scan")
    np.testing.assert_allclose(np.asarray(y_scan), np.asarray(lay.apply(params, x)[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,message", [
    (lambda: attention.make("nope", num_heads=2, qkv_features=8), r"unknown attention 'nope'; choose one of \("),
    (lambda: attention.make("linear", num_heads=2, qkv_features=8), r"'linear' has no causal=False mode"),
    (lambda: attention.make("window_graph", num_heads=2, qkv_features=8, causal=True, shift=1),
     r"no option\(s\) \['shift'\]; its options are \["),
    (lambda: attention.make("agf", num_heads=2, qkv_features=8, orderr=3), r"no option\(s\) \['orderr'\]"),
    (lambda: attention.make("agf", num_heads=3, qkv_features=8), r"divisible by `num_heads`"),
    (lambda: attention.make("agf", num_heads=0, qkv_features=8), r"`num_heads` must be an integer >= 1"),
    (lambda: attention.make("softmax", num_heads=2, qkv_features=8, out_features=0), r"`out_features`"),
])
def test_bad_arguments_raise_at_make(call, message):
    with pytest.raises(ValueError, match=message):
        call()
