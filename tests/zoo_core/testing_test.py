"""The export helpers that let CPU tests judge the program an accelerator would run."""
import jax
import jax.numpy as jnp
import numpy as np

from zoo_core import testing


def _scan_sum(x):
    return jax.lax.scan(lambda c, row: (c + row.sum(), None), jnp.float32(0), x)[0]


def test_exported_program_resolves_platform_dependent_for_the_target():
    def per_platform(x):
        return jax.lax.platform_dependent(x, cpu=_scan_sum, default=jnp.sum)

    x = np.ones((16, 4), np.float32)
    assert testing.while_loops(testing.exported_program(_scan_sum, x)) == 1
    for platform in ("cuda", "tpu"):
        assert testing.while_loops(testing.exported_program(per_platform, x, platform=platform)) == 0
    assert testing.while_loops(testing.exported_program(per_platform, x, platform="cpu")) == 1
    spec = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    assert "stablehlo.reduce" in testing.exported_program(jnp.sum, spec, platform="tpu")
