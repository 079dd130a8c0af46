"""Test-wide JAX settings: CPU only, two fake devices, fast compiles.

They must be set before jax is imported anywhere, which is why they live in the root conftest.
"""
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No test reaches the network: every fetch fails at once as offline (zoo_core.data.fetch), here and in the
# commands the tests start; the fetch tests serve their files from a local HTTP server and clear it.
os.environ["ZOO_OFFLINE"] = "1"
# One persistent compilation cache for the whole run, in a fresh temporary folder that the run
# removes at its end (never the user's ~/.cache): the xdist workers and the commands the tests start
# inherit it, so a program that several tests or parametrisations compile (the same HLO) is compiled
# once. Compiling is most of the suite's time; a hit is the executable of exactly that program.
# The controller creates it; its workers find it in the environment they inherit. Two workers may
# write one entry at once; an entry read half-written fails its decompression, which jax reports as a
# warning and answers by compiling.
if not os.environ.get("ZOO_TEST_XLA_CACHE"):
    os.environ["ZOO_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="zoo_test_xla_")
    _OWN_CACHE = True
else:
    _OWN_CACHE = False
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["ZOO_TEST_XLA_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Fast compiles (tests/environment.py says why and what they cost), here and in the commands the tests start.
from tests.environment import fast_compile_xla_flags  # noqa: E402

_flags = os.environ.get("XLA_FLAGS", "")
_flags += "".join(f" {f}" for f in fast_compile_xla_flags().split() if f not in _flags)
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=2"
os.environ["XLA_FLAGS"] = _flags.strip()

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


def pytest_collection_finish(session):
    """The objects every test shares (jax, flax, the collected modules) are frozen out of the cyclic
    collector, and it runs less often (thresholds 700, 10, 10 -> 20,000, 20, 20): JAX's tracing makes
    many short-lived objects, and each collection of the older generations walked the whole heap.
    Measured on tests/htgn_jax and tests/samovar_jax (`pytest -n 2`): 8.6 s of collector time (3% of the
    CPU time) -> 2.2 s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def pytest_unconfigure(config):
    """The run's compilation cache goes with the run (the process that made it removes it)."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["ZOO_TEST_XLA_CACHE"], ignore_errors=True)
