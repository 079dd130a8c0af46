"""`sharding.cpu_device_count`: the CPU devices a training command starts JAX with."""
import pytest

from zoo_core.run import sharding


@pytest.mark.parametrize("requested, batch, eval_batch, accum, cores, want", [
    (1, 32, 32, 1, 2, 1),      # the default: one device whatever the cores
    (3, 32, 32, 1, 2, 3),      # an explicit count is used as given (validate_config checks the batch)
    (0, 32, 32, 1, 2, 2),      # one per core
    (0, 32, 500, 1, 4, 4),
    (0, 3, 3, 1, 2, 1),        # no count > 1 divides the batch
    (0, 6, 4, 1, 4, 2),        # the largest count <= cores dividing both batches
    (0, 8, 8, 4, 4, 2),        # each device gets accum_steps micro-batches
    (0, 32, 32, 1, 1, 1),
])
def test_cpu_device_count(requested, batch, eval_batch, accum, cores, want):
    assert sharding.cpu_device_count(requested, batch_size=batch, eval_batch_size=eval_batch,
                                     accum_steps=accum, cores=cores) == want


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_cpu_device_count_refuses_a_bad_value(bad):
    with pytest.raises(ValueError, match="parallel.cpu_devices must be an int >= 0"):
        sharding.cpu_device_count(bad, batch_size=8, eval_batch_size=8)


def test_one_per_core_counts_the_cores_this_process_may_use():
    n = sharding.cpu_device_count(0, batch_size=2 ** 10, eval_batch_size=2 ** 10)
    assert 1 <= n and 2 ** 10 % n == 0
