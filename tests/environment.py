"""The JAX environment of the tests and of the commands they start, in one place so that both compile alike.

Compiling is most of the suite's time, and a test's programs are tiny, so the tests trade XLA's CPU code
quality for compile speed. Results stay within every tolerance; what may change is how two different
programs round, so a bit-for-bit comparison compares programs that must be one:

- `JAX_DISABLE_MOST_OPTIMIZATIONS`: XLA's optimisation passes off;
- `--xla_cpu_use_fusion_emitters=false`: the CPU backend's elemental emitters instead of its MLIR fusion
  emitters. Measured on the 2-core CI machine: a random normal, a small MLP gradient and a scan compile
  in 70 / 48 / 34 ms instead of 138 / 120 / 59 ms, and tests/htgn_jax/graph_test.py runs in 67 s instead
  of 109 s;
- `--xla_cpu_parallel_codegen_split_count=1`: one LLVM module per program instead of several compiled
  on a thread pool, which for a tiny program costs more than it saves and competes with the other
  xdist worker: 40 small gradient programs compile in 39 instead of 51 ms each, and
  `pytest -n 2 tests/htgn_jax tests/agf_jax` takes 136-137 s instead of 154-155 s (alternating runs).
  Like the flag above it may change the last bit of some values (an AGF smoke model's gradient:
  1,851 of 7,188 values differ, by at most 4.8e-7 on values up to 6.2), never beyond a tolerance.

`tests/conftest.py` calls `fast_compile_xla_flags` once per run (the xdist workers inherit the answer) and
keeps a flag only if this jaxlib knows it: XLA aborts the process on an unknown flag.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from zoo_core.run import allocator

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPILE_SPEED_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
_ENV_KEY = "ZOO_TEST_FAST_COMPILE_XLA_FLAGS"


def fast_compile_xla_flags() -> str:
    """The `COMPILE_SPEED_FLAGS` this jaxlib accepts, as one XLA_FLAGS string (probed once per run, in a
    subprocess: an unknown flag is a fatal error, not an exception)."""
    if _ENV_KEY not in os.environ:
        flags = " ".join(COMPILE_SPEED_FLAGS)
        if not _accepted(flags):   # then one by one: keep what this jaxlib knows
            flags = " ".join(f for f in COMPILE_SPEED_FLAGS if _accepted(f))
        os.environ[_ENV_KEY] = flags
    return os.environ[_ENV_KEY]


def _accepted(flags: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags), timeout=120)
    return probe.returncode == 0


def command_env(**extra: str) -> dict[str, str]:
    """The environment of a command a test starts: this process's (so also the run's compilation cache),
    on one CPU device as a user's plain CPU run (not the conftest's two), the repository importable, fast
    compiles; `extra` last."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=fast_compile_xla_flags(), JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # Started under the allocator setting the training commands would restart into (zoo_core.run.allocator),
    # so that they do not: a restart imports jax twice, 2.5 s per command.
    env = allocator.wanted_env(env) or env
    env.update(extra)
    return env


def host_devices_env(count: int, **extra: str) -> dict[str, str]:
    """`command_env` on `count` host CPU devices (`--xla_force_host_platform_device_count`), for a command that
    runs a sharded program: the suite itself runs on two."""
    env = command_env(**extra)
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                + [f"--xla_force_host_platform_device_count={count}"])
    return env


def run_on_host_devices(module: str, count: int = 8, timeout: float = 600, args: tuple[str, ...] = ()) -> list[str]:
    """Runs `python -m module *args` from the repository root on `count` host CPU devices; asserts that it exits
    with 0 (showing its stderr's tail) and returns the words it printed. The module's `__main__` starts with
    `assert_host_devices(count)`."""
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=host_devices_env(count), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def run_two_processes(module: str, timeout: float = 600) -> list[str]:
    """Runs `python -m module PROCESS_ID PORT` twice from the repository root, processes 0 and 1 of a
    jax.distributed group on a free local port, each on 2 host CPU devices; asserts that both exit with 0
    (showing stderr's tail) and returns each one's printed lines."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", module, str(i), str(port)], cwd=ROOT, env=host_devices_env(2),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outputs.append(out.splitlines())
    return outputs


def assert_host_devices(count: int) -> None:
    """In a module run by `run_on_host_devices`: it got `count` CPU devices."""
    import jax

    assert jax.device_count() == count and os.environ.get("JAX_PLATFORMS") == "cpu", jax.devices()


def sequence_mesh(p: int, axis_type=None):
    """A mesh of the first `p` devices over one axis, "sequence" (the context-parallel layers' default
    `sequence_axis`), of `axis_type` (default `jax.sharding.AxisType.Auto`)."""
    import jax

    axis_type = jax.sharding.AxisType.Auto if axis_type is None else axis_type
    return jax.make_mesh((p,), ("sequence",), devices=jax.devices()[:p], axis_types=(axis_type,))


def run_entry_in_process(prog: str, build_model, argv, capfd, evaluators_fn=None) -> tuple[int, str, str]:
    """Runs `python -m <prog> <argv>` in this process: the function its `__main__` calls
    (`zoo_core.run.main.run(build_model, evaluators_fn)`), flag parsing and all, without a JAX import
    per case; returns (exit status, stdout, stderr) as `capfd` captured them."""
    from absl import flags

    from zoo_core.run import main

    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)     # ml_collections registers one flag per config field on parsing
    flags.FLAGS.unparse_flags()
    old = sys.argv
    sys.argv = [prog, *map(str, argv)]
    capfd.readouterr()
    try:
        main.run(build_model, evaluators_fn=evaluators_fn)
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    out, err = capfd.readouterr()
    return status, out, err
