"""The programs a GPU or TPU would run, read on the CPU through `jax.export` (no accelerator needed).

Every main config's train step (the trainer's own, as `bench.train_step_setup` builds it) and every attention's
training call, non-causal and causal (parallel and chunked), export for cuda and for tpu, and none
holds a while loop: a loop over chunks or tokens runs its control from the host, one iteration at a
time, on an accelerator.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core import attention, testing

PLATFORMS = ("cuda", "tpu")
# (config module, its smoke argument, the Model factory's module)
MAIN_CONFIGS = {
    "agf_listops": ("zoo_core.configs.agf.lra_listops", "smoke", "agf_jax.model"),
    "agf_listops_softmax": ("zoo_core.configs.agf.lra_listops", "attention=softmax,smoke", "agf_jax.model"),
    "samovar_fig4": ("zoo_core.configs.samovar.synthetic_var", "smoke", "samovar_jax.model"),
    "htgn_number_words": ("zoo_core.configs.htgn.number_words", "smoke", "htgn_jax.model"),
}


def _train_step(config, build_model):
    """The step `bench.train_step_setup` builds (the trainer's setup, `run_setup.compile_steps`' jitted
    `train_step`, parallel.mode 'jit', under the run's mesh context), with its state's shapes (replicated, as
    `s.init_state` makes it) and one training batch on the mesh, without the CPU compile and the initial values
    that the setup makes for a benchmark and an export does not need. Returns (step, state, batch, mesh)."""
    from zoo_core.run import setup as run_setup
    from zoo_core.run import sharding

    with config.unlocked():
        config.parallel.mode = "jit"
    s = run_setup.build_setup(config, build_model, has_evaluators=True)
    mesh = sharding.config_mesh(config)
    replicated = sharding.replicated(mesh)
    with sharding.mesh_context(mesh):
        steps = run_setup.compile_steps(s, mesh, replicated, donate=False)
        batch = steps.to_device(sharding.numeric(next(s.train_batches(0))))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), s.abstract)
    return steps.train, state, batch, mesh


@pytest.mark.parametrize("name", sorted(MAIN_CONFIGS))
def test_main_train_steps_export_without_loops(name):
    module, arg, model_module = MAIN_CONFIGS[name]
    config = importlib.import_module(module).get_config(arg)
    step, state, batch, _ = _train_step(config, importlib.import_module(model_module).Model)
    for platform in PLATFORMS:
        program = testing.exported_program(step, state, batch, platform=platform)
        assert testing.while_loops(program) == 0, (name, platform)


def _forms():
    for name in attention.names("self"):
        yield name, dict(causal=False)
    for name in attention.names("causal"):
        yield name, dict(causal=True)
        if "chunk_size" in attention.options(name):
            yield name, dict(causal=True, chunk_size=8)


@pytest.mark.parametrize("name,kw", list(_forms()), ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{v}" for k, v in sorted(v.items())))
def test_attention_training_forms_export_without_loops(name, kw):
    kw = dict(kw)
    causal = kw.pop("causal")
    block = attention.make(name, num_heads=2, qkv_features=16, causal=causal, **kw)
    x = np.random.default_rng(0).normal(size=(2, 32, 16)).astype(np.float32)
    mask = np.arange(32)[None, :] < np.array([[32], [27]])
    params = jax.jit(block.init)(jax.random.PRNGKey(0), x, mask=mask)

    def loss(p, x, mask):
        y = block.apply(p, x, mask=mask, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)},
                        mutable=["losses"])[0]
        return jnp.sum(y * y)

    for platform in PLATFORMS:
        program = testing.exported_program(jax.grad(loss), params, x, mask, platform=platform)
        assert testing.while_loops(program) == 0, (name, kw, platform)


@pytest.mark.parametrize("kind", ["samovar", "cp_layer"])
def test_a_context_parallel_train_step_exports_without_loops(kind, tmp_path):
    """parallel.sequence=2 on the suite's two host devices: the trainer's step over the data x sequence mesh,
    for samovar's model (partitioned by XLA) and for a model whose layer runs its context-parallel form
    (LinearAttention with sequence_axis='sequence': one all_gather of the shards' states), exports for cuda
    and tpu with the batch sharded along T, and holds no while loop over chunks."""
    from jax import export

    from samovar_jax import model as samovar_model
    from tests.zoo_core.sequence_parallel_test import CPForecaster
    from zoo_core.configs.samovar import synthetic_var
    from zoo_core.run import sharding

    if jax.device_count() % 2:
        pytest.skip("needs an even number of devices")
    config = synthetic_var.get_config("smoke")
    config.unlock()
    config.data.data_dir = str(tmp_path)
    config.parallel.sequence = 2
    build = samovar_model.Model
    if kind == "cp_layer":
        config.model = {}
        build = lambda **kw: CPForecaster(**kw)   # noqa: E731
    step, state, batch, mesh = _train_step(config, build)
    assert batch["inputs"].sharding.spec == jax.sharding.PartitionSpec("data", "sequence")
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (state, batch))
    with sharding.mesh_context(mesh):
        for platform in PLATFORMS:
            program = export.export(step, platforms=[platform])(*specs).mlir_module()
            assert testing.while_loops(program) == 0, (kind, platform)
            if kind == "cp_layer":
                assert "all_gather" in program, platform   # the layer's fold of the shards' summaries
