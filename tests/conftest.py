"""Test-wide JAX settings: CPU only, two fake devices, fast compiles.

They must be set before jax is imported anywhere, which is why they live in the root conftest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache in tests (nor in the commands they run): nothing is written to the
# user's ~/.cache, and every test compiles what it checks.
os.environ["JAX_COMPILATION_CACHE_DIR"] = ""
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)


import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Runs a test with float64 enabled (gradient checks), restoring the previous setting after."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)
