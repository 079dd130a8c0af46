"""zoo_core.ops.remat: `remat=True` recomputes every block in the backward pass and changes nothing else.

One small model of each package, in training mode (dropout on, the same rng): the same parameters,
outputs and gradients with and without remat, and the gradient program holds the rematerialised
blocks. The bfloat16 runs against float32 are in `test_bfloat16_model_tracks_float32`.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import model as agf_model
from htgn_jax import model as htgn_model
from samovar_jax import model as samovar_model
from zoo_core.testing import BF16, F32_MODEL, assert_trees_close

B = 2
_rng = np.random.default_rng(0)
CASES = {
    "agf": (agf_model.Model, dict(kind="lra_classifier", variant="tiny", num_classes=3, vocab_size=12,
                                  max_len=16, order=2, dropout_rate=0.1),
            {"inputs": np.concatenate([_rng.integers(1, 12, (B, 12)), np.zeros((B, 4), int)], 1)
             .astype(np.int32)}),
    "samovar": (samovar_model.Model, dict(kind="samovar", num_channels=2, input_len=10, patch_len=2,
                                          variant="tiny", width=8, dropout=0.1, chunk_size=2),
                {"inputs": _rng.normal(size=(B, 10, 2)).astype(np.float32)}),
    "htgn": (htgn_model.Model, dict(kind="classifier", variant="digits", num_classes=10, d_model=16,
                                    num_heads=2, mlp_dim=32, num_features=8, num_layers=2),
             {"image": _rng.random((B, 8, 8, 1)).astype(np.float32)}),
}


def _loss(model, batch):
    """A training loss of the model's main output (dropout on, a fixed rng) plus its auxiliary losses."""
    def loss(params):
        out, aux = model.apply({"params": params}, batch, train=True,
                               rngs={"dropout": jax.random.key(1)})
        main = out["logits"] if "logits" in out else out["forecast"]
        extra = sum(v for k, v in aux.items() if k.startswith("loss/"))
        return 0.5 * jnp.mean(jnp.square(main.astype(jnp.float32))) + extra
    return loss


def _run_traced(model, batch, params):
    """(the jaxpr of value_and_grad of `_loss` as text, its value): traced once for both."""
    traced = jax.jit(jax.value_and_grad(_loss(model, batch))).trace(params)
    return str(traced.jaxpr), traced.lower().compile()(params)


@functools.lru_cache(maxsize=None)
def _float32_reference(name):
    """(params, (loss, gradients), program) of the plain float32 model, which both tests compare against:
    computed once per process (and compiled once per run, through the persistent compilation cache)."""
    factory, kw, batch = CASES[name]
    model = factory(**kw)
    # Initialised as one compiled program: eagerly, every initialiser and every jitted helper of the
    # forward pass compiles on its own, which made these tests several times slower.
    params = jax.jit(model.init)(jax.random.key(0), batch)["params"]
    program, value_and_grads = _run_traced(model, batch, params)
    return params, value_and_grads, program


@pytest.mark.parametrize("name", sorted(CASES))
def test_remat_changes_no_parameter_value_or_gradient(name):
    factory, kw, batch = CASES[name]
    remat = factory(**kw, remat=True)
    params, want, plain_program = _float32_reference(name)
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           jax.jit(remat.init)(jax.random.key(0), batch)["params"], params)
    program, got = _run_traced(remat, batch, params)
    assert_trees_close(got, want, **F32_MODEL)
    assert "remat" in program or "checkpoint" in program
    assert "remat" not in plain_program


@functools.partial(jax.jit, static_argnums=0)
def _main_output(model, params, batch):
    out, _ = model.apply({"params": params}, batch)
    return (out["logits"] if "logits" in out else out["forecast"]).astype(jnp.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_model_tracks_float32(name):
    # The dtype policy end to end: bfloat16 compute (float32 parameters, sums and states) gives the
    # float32 model's outputs and training loss to bfloat16 precision, and float32 gradients that
    # point the same way. The gradients are compared by direction, not elementwise: the backward
    # pass rounds every cotangent to bfloat16 and sums many of them with cancellation (a bias
    # gradient is a sum over all positions), so single entries carry relative errors of several
    # percent (measured 1-13% for the whole vector over three seeds) while the descent direction
    # is the same.
    factory, kw, batch = CASES[name]
    f32, bf16 = factory(**kw), factory(**kw, dtype="bfloat16")
    params, (loss32, grads32), _ = _float32_reference(name)
    out32, out16 = _main_output(f32, params, batch), _main_output(bf16, params, batch)
    assert float(jnp.linalg.norm(out16 - out32) / jnp.linalg.norm(out32)) < BF16["rtol"]
    loss16, grads16 = jax.jit(jax.value_and_grad(_loss(bf16, batch)))(params)
    np.testing.assert_allclose(loss16, loss32, rtol=BF16["rtol"])
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads16))
    g16, g32 = (jnp.concatenate([jnp.ravel(g) for g in jax.tree_util.tree_leaves(t)])
                for t in (grads16, grads32))
    cosine = float(jnp.dot(g16, g32) / (jnp.linalg.norm(g16) * jnp.linalg.norm(g32)))
    assert cosine > 0.99
