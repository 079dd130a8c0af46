"""The JAX environment of the tests and of the commands they start, in one place so that both compile alike.

Compiling is most of the suite's time, and a test's programs are tiny, so the tests trade XLA's CPU code
quality for compile speed. Results stay within every tolerance; what may change is how two different
programs round, so a bit-for-bit comparison compares programs that must be one:

- `JAX_DISABLE_MOST_OPTIMIZATIONS`: XLA's optimisation passes off;
- `--xla_cpu_use_fusion_emitters=false`: the CPU backend's elemental emitters instead of its MLIR fusion
  emitters. Measured on the 2-core CI machine: a random normal, a small MLP gradient and a scan compile
  in 70 / 48 / 34 ms instead of 138 / 120 / 59 ms, and tests/htgn_jax/graph_test.py runs in 67 s instead
  of 109 s.

`tests/conftest.py` calls `fast_compile_xla_flags` once per run (the xdist workers inherit the answer) and
keeps a flag only if this jaxlib knows it: XLA aborts the process on an unknown flag.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from zoo_core import allocator

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPILE_SPEED_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
_ENV_KEY = "ZOO_TEST_FAST_COMPILE_XLA_FLAGS"


def fast_compile_xla_flags() -> str:
    """The `COMPILE_SPEED_FLAGS` this jaxlib accepts, as one XLA_FLAGS string (probed once per run, in a
    subprocess: an unknown flag is a fatal error, not an exception)."""
    if _ENV_KEY not in os.environ:
        flags = " ".join(COMPILE_SPEED_FLAGS)
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                               env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags), timeout=120)
        os.environ[_ENV_KEY] = flags if probe.returncode == 0 else ""
    return os.environ[_ENV_KEY]


def command_env(**extra: str) -> dict[str, str]:
    """The environment of a command a test starts: this process's (so also the run's compilation cache),
    on one CPU device as a user's plain CPU run (not the conftest's two), the repository importable, fast
    compiles; `extra` last."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=fast_compile_xla_flags(), JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # Started under the allocator setting the training commands would restart into (zoo_core.allocator),
    # so that they do not: a restart imports jax twice, 2.5 s per command.
    env = allocator.wanted_env(env) or env
    env.update(extra)
    return env
