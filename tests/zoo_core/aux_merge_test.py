"""The two ways a stack merges its layers' aux (zoo_core/ops/aux_merge.py): summed, or stacked per layer."""
import jax.numpy as jnp
import numpy as np

from zoo_core.ops.aux_merge import stack_aux, sum_aux


def test_sum_aux_sums_each_key_over_the_dicts_that_hold_it():
    merged = sum_aux({"kl_sum": 1.0, "kl_count": 2.0}, {}, {"kl_sum": 3.0, "loss/x": 0.5})
    assert merged == {"kl_sum": 4.0, "kl_count": 2.0, "loss/x": 0.5}
    assert sum_aux() == {}


def test_stack_aux_sums_losses_and_stacks_diagnostics_per_layer():
    layers = [{"loss/orthogonality": jnp.float32(i), "filter/coefficients": jnp.full((3,), i, jnp.float32)}
              for i in (1, 2)]
    merged = stack_aux(layers)
    assert merged["loss/orthogonality"].shape == () and float(merged["loss/orthogonality"]) == 3.0
    np.testing.assert_array_equal(merged["filter/coefficients"], [[1, 1, 1], [2, 2, 2]])
    assert stack_aux([]) == {}
