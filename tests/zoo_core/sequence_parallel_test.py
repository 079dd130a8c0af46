"""`parallel.sequence=P`: the trainer's mesh becomes data x sequence, sequence inputs are split along their
length, and training gives the parameters of P = 1 (the zoo's models in float64, to 1e-10; a test model in
float32). The runs need several devices: one subprocess with 2 host devices (the suite runs on 2 cores)."""
import os
import pathlib
import subprocess
import sys
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.environment import command_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 20


class CPForecaster(nn.Module):
    """A model with a context-parallel layer (samovar's LinearAttention, causal) and a `sequence_axis`
    field, which the trainer sets to 'sequence' with parallel.sequence > 1 (`with_sequence_axis`)."""
    horizon: int = 1
    channels: int = 2
    width: int = 8
    sequence_axis: Optional[str] = None

    @nn.compact
    def __call__(self, batch, *, train=False):
        from samovar_jax.layers import LinearAttention
        x = nn.Dense(self.width, name="embed")(batch["inputs"])                      # [B, T, W]
        y = LinearAttention(num_heads=2, head_dim=4, sequence_axis=self.sequence_axis, name="attention")(x)[0]
        h = jnp.mean(x + y, axis=1)                                                  # [B, W]
        out = nn.Dense(self.horizon * self.channels, name="head")(h)
        return {"forecast": out.reshape(-1, self.horizon, self.channels)}, {}


def _config(data_dir, sequence, kind):
    from zoo_core.configs.agf import uea
    from zoo_core.configs.htgn import number_words
    from zoo_core.configs.samovar import synthetic_var
    c = {"agf": uea, "htgn": number_words}.get(kind, synthetic_var).get_config("smoke")
    c.unlock()
    # htgn: 'inputs' has 15 tokens, which the trainer pads to 16 with the pad id (the encoder's 2 + 16 nodes
    # are padded again, to 18); its dropout of 0.1 stays on, its masks keyed by position.
    c.data.data_dir = data_dir
    c.parallel.cpu_devices = 2
    c.parallel.sequence = sequence
    c.total_steps = STEPS
    c.eval_every_steps = 0
    c.checkpoint_every_steps = 0
    c.log_every_steps = STEPS
    c.checkpoint.best_metric = ""
    if kind == "cp":
        c.model = {}
    else:
        # float64 (the subprocess enables x64): after 20 AdamW steps a float32 rounding difference of
        # the sharded sums is amplified wherever a gradient's second moment is tiny (HTGN: one element
        # of 4,096 off by 2.5e-4 relative), so the zoo's models are compared where the maths is exact.
        c.model.dtype = "float64"
        c.model.param_dtype = "float64"
    return c


def _train(tmp, sequence, kind):
    from samovar_jax import model as samovar_model
    from zoo_core import trainer
    from zoo_core.run import checkpoint as ckpt_lib
    config = _config(os.path.join(tmp, "data"), sequence, kind)
    workdir = os.path.join(tmp, f"{kind}_{sequence}")
    from agf_jax import model as agf_model
    from htgn_jax import model as htgn_model
    build = {"samovar": samovar_model.Model, "agf": agf_model.Model, "htgn": htgn_model.Model}.get(
        kind, lambda **kw: CPForecaster(**kw))
    trainer.train_and_evaluate(config, workdir, build)
    return ckpt_lib.restore_params(workdir)[0]


def _check(tmp):
    from zoo_core.run import sharding
    from zoo_core.testing import assert_trees_close
    assert jax.device_count() == 2, jax.devices()
    mesh = sharding.make_mesh(2)
    assert dict(mesh.shape) == {"data": 1, "sequence": 2}
    batch = sharding.global_batch({"inputs": np.zeros((2, 8, 2), np.float32), "target": np.zeros((2, 1, 2))}, mesh)
    assert batch["inputs"].sharding.spec == P("data", "sequence") and batch["target"].sharding.spec == P("data")
    from zoo_core.run.setup_checks import make_model
    built = make_model(lambda **kw: CPForecaster(**kw), _config(os.path.join(tmp, "data"), 2, "cp"))
    assert built.sequence_axis == "sequence", built   # the layer runs its context-parallel form
    for kind in sys.argv[2:] or ("samovar", "cp", "agf", "htgn"):
        one, two = _train(tmp, 1, kind), _train(tmp, 2, kind)
        assert all(x.dtype == (np.float32 if kind == "cp" else np.float64) for x in jax.tree_util.tree_leaves(one))
        assert_trees_close(two, one, **(dict(rtol=2e-5, atol=2e-6) if kind == "cp" else dict(rtol=1e-10, atol=1e-12)))
        print(f"{kind}: P=2 == P=1")


@pytest.mark.slow
def test_twenty_steps_with_the_sequence_split_over_two_devices_equal_one(tmp_path):
    env = command_env()
    env["JAX_ENABLE_X64"] = "1"
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                 if "device_count" not in f] + ["--xla_force_host_platform_device_count=2"])
    out = subprocess.run([sys.executable, "-m", "tests.zoo_core.sequence_parallel_test", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for kind in ("samovar", "cp", "agf", "htgn"):   # one config of each architecture, and a model of a test's own
        assert f"{kind}: P=2 == P=1" in out.stdout, out.stdout


def test_a_sequence_split_that_does_not_divide_is_one_line():
    from zoo_core.run import sharding
    with pytest.raises(ValueError, match=r"^parallel.sequence=3 must divide the 2 devices( \(CPU devices: "
                                         r"--config.parallel.cpu_devices=3 or a multiple\))?$"):
        sharding.check_sequence(3, 2)
    with pytest.raises(ValueError, match=r"parallel.sequence must be an int >= 1"):
        sharding.check_sequence(0, 2)
    with pytest.raises(ValueError, match=r"^parallel.sequence=2 must divide the length of every sequence "
                                         r"feature the model cannot take padded \(no mask covers added steps\); "
                                         r"'inputs' has 7: use a parallel.sequence that divides 7$"):
        sharding.check_sequence_lengths({"inputs": np.zeros((1, 7, 2))}, 2)
    sharding.check_sequence_lengths({"inputs": np.zeros((1, 8, 2)), "label": np.zeros((1,))}, 2)
    sharding.check_sequence_lengths({"inputs": np.zeros((1, 7))}, 2, {"inputs": 0})   # padded by the trainer


def test_a_length_the_model_cannot_take_padded_names_its_config_fields():
    """AGF's UEA classifier (a flatten head over max_len steps) takes no padding: the line names the fields
    that hold the length, and it comes from check_setup, on the declared shapes, before any data is built."""
    from agf_jax import model as agf_model
    from zoo_core.configs.agf import uea
    from zoo_core.run import setup
    from zoo_core.run.errors import ConfigError
    if jax.device_count() != 2:
        pytest.skip("the suite runs on two host devices")
    c = uea.get_config("smoke")
    c.unlock()
    c.data.options.max_length = c.model.max_len = 25
    c.parallel.sequence = 2
    c.batch_size, c.eval_batch_size = 2, 2
    with pytest.raises(ConfigError, match=r"'inputs' has 25: set model.max_len and data.options.max_length to a "
                                          r"multiple of 2$"):
        setup.check_setup(c, agf_model.Model)


def test_the_trainer_pads_the_features_the_model_takes_padded():
    from zoo_core.run import sharding
    batch = {"inputs": np.ones((2, 15), np.int32), "targets": np.ones((2, 12), np.int32), "label": np.ones((2,))}
    padded = sharding.pad_sequences(batch, 4, {"inputs": 0, "targets": 0, "inputs_segmentation": 0})
    assert padded["inputs"].shape == (2, 16) and padded["targets"] is batch["targets"]
    np.testing.assert_array_equal(padded["inputs"][:, 15], 0)
    np.testing.assert_array_equal(padded["inputs"][:, :15], 1)
    assert sharding.pad_sequences(batch, 1, {"inputs": 0}) is batch


if __name__ == "__main__":
    _check(sys.argv[1])


def test_the_mesh_splits_sequence_features_along_their_length():
    """In the suite's process (two host devices): P = 2 gives a [1, 2] mesh, the sequence features split
    along T and the others along the batch only; P = 1 keeps the 1-D 'data' mesh of every run before."""
    from zoo_core.run import sharding
    if jax.device_count() != 2:
        pytest.skip("the suite runs on two host devices")
    assert sharding.make_mesh(1).axis_names == ("data",)
    mesh = sharding.make_mesh(2)
    assert dict(mesh.shape) == {"data": 1, "sequence": 2}
    host = {"inputs": np.arange(16, dtype=np.int32).reshape(2, 8), "inputs_segmentation": np.ones((2, 8), np.int32),
            "label": np.zeros((2,), np.int32)}
    batch = sharding.global_batch(host, mesh)
    assert batch["inputs"].sharding.spec == P("data", "sequence")
    assert batch["inputs_segmentation"].sharding.spec == P("data", "sequence")
    assert batch["label"].sharding.spec == P("data")
    assert [s.data.shape for s in batch["inputs"].addressable_shards] == [(2, 4), (2, 4)]
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), host["inputs"])


@pytest.mark.parametrize("overrides, fragment", [
    (dict(sequence=2, mode="pmap"), "parallel.sequence > 1 needs parallel.mode='jit'"),
    (dict(sequence=2, batch_size=3, accum=2), "batch_size 3 must be divisible by data-parallel devices "
                                              "(devices / parallel.sequence) (1) x optim.grad_accum_steps (2)"),
])
def test_bad_sequence_settings_are_one_line(overrides, fragment):
    from zoo_core.configs.core import synthetic
    from zoo_core.run.setup_checks import validate_config
    if jax.device_count() != 2:
        pytest.skip("the suite runs on two host devices")
    c = synthetic.get_config("smoke")
    c.unlock()
    c.parallel.sequence = overrides["sequence"]
    c.parallel.mode = overrides.get("mode", "jit")
    c.batch_size = overrides.get("batch_size", 4)
    c.optim.grad_accum_steps = overrides.get("accum", 1)
    with pytest.raises(ValueError) as e:
        validate_config(c)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
