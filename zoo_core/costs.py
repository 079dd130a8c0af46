"""XLA's own accounting of a compiled function: FLOPs and bytes (`cost_of`) and buffer sizes (`memory_of`).

A leaf module: the trainer reads a step's FLOPs from it (`zoo_core.run.setup.step_flops`) and the benchmark
harness (`zoo_core.bench`) its costs and memory, without either importing the other.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax


def compile_timed(fn: Callable, args: Sequence[Any]) -> tuple[Any, float]:
    """Lowers and compiles `jax.jit(fn)` for `args` (arrays or `jax.ShapeDtypeStruct`s): (executable, seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _cost_dict(compiled: Any) -> dict[str, float]:
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):
        return {}
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per computation
        cost = cost[0] if cost else None
    return dict(cost or {})


def cost_of(fn: Callable, *args: Any, compiled: Any = None) -> dict[str, float | None]:
    """XLA's cost analysis of `jax.jit(fn).lower(*args).compile()` (or of `compiled`).

    Args:
      fn: a function of arrays (jitted or not), ignored when `compiled` is given.
      *args: arrays or `jax.ShapeDtypeStruct`s.
      compiled: an already compiled executable (`jax.jit(f).lower(...).compile()`), or a lowering
        (`jax.jit(f).lower(...)`: XLA's count before optimisation, no compile).

    Returns:
      dict(flops, bytes_accessed, transcendentals): per call, None where the backend does not count
      (e.g. custom calls such as cuDNN attention count 0 FLOPs).
    """
    if compiled is None:
        compiled, _ = compile_timed(fn, args)
    cost = _cost_dict(compiled)

    def get(key):
        v = cost.get(key)
        return float(v) if v is not None and v > 0 else None

    return dict(flops=get("flops"), bytes_accessed=get("bytes accessed"),
                transcendentals=get("transcendentals"))


def flops_of(compiled: Any) -> float | None:
    """XLA's FLOP count of a compiled executable or a lowering, None where the backend counts none."""
    return cost_of(None, compiled=compiled)["flops"]


_MEMORY_FIELDS = dict(argument_bytes="argument_size_in_bytes", output_bytes="output_size_in_bytes",
                      temp_bytes="temp_size_in_bytes", alias_bytes="alias_size_in_bytes",
                      generated_code_bytes="generated_code_size_in_bytes")


def memory_of(compiled: Any) -> dict[str, int | None]:
    """`compiled_memory`'s dict for an already compiled executable (`jit(f).lower(...).compile()`)."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):  # some backends do not implement it
        stats = None
    out: dict[str, int | None] = {k: None for k in _MEMORY_FIELDS}
    out["total_bytes"] = None
    if stats is None:
        return out
    for key, attr in _MEMORY_FIELDS.items():
        value = getattr(stats, attr, None)
        out[key] = None if value is None else int(value)
    # Aliased (donated) buffers are counted both as argument and output: subtract them once.
    # `peak_memory_in_bytes` is not used: on CPU it leaves out the temp buffers.
    parts = [out[k] for k in ("argument_bytes", "output_bytes", "temp_bytes")]
    if None not in parts:
        out["total_bytes"] = (sum(parts) + (out["generated_code_bytes"] or 0)
                              - (out["alias_bytes"] or 0))
    return out


def compiled_memory(fn: Callable, *args: Any) -> dict[str, int | None]:
    """XLA's memory analysis of `jax.jit(fn).lower(*args).compile()`, without running it.

    Args:
      fn: a function of arrays.
      *args: arrays or `jax.ShapeDtypeStruct`s (nothing is allocated for the latter).

    Returns:
      dict of ints (or all None when the backend does not report): argument_bytes, output_bytes,
      temp_bytes, alias_bytes, generated_code_bytes and total_bytes = argument + output + temp +
      generated code - alias, the estimate of the executable's peak footprint.
    """
    compiled, _ = compile_timed(fn, args)
    return memory_of(compiled)
