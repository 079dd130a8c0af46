"""The module paths of 0.1.0 that moved, importable from their old place until `REMOVED_IN`.

`import zoo_core.masking` (or `from zoo_core import masking`) warns once with a `DeprecationWarning`
naming the new path and gives the new module itself, so `zoo_core.masking is zoo_core.ops.masking` and
every name of it works. A function renamed in a module that kept its path (`RENAMED`, e.g.
`agf_jax.ops.agf_recurrent` -> `agf_scan`) warns the same way through the module's `__getattr__`. One table (`MOVED`) and one `sys.meta_path` finder serve every old path; the
finder is installed by `zoo_core/__init__`, which every package of the zoo imports before its own
modules, so an old path under `samovar_jax` works whichever package is imported first.

The configs that 0.1.0 installed as a top-level package `configs` are not aliased: that generic name is
what must leave a user's site-packages; they are `zoo_core.configs`.

This module imports only the standard library.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVED_IN = "0.3.0"

# old module path (0.1.0) -> its place since 0.2.0.
MOVED = {
    # zoo_core.ops: the shared maths.
    "zoo_core.context_parallel": "zoo_core.ops.context_parallel",
    "zoo_core.dropout": "zoo_core.ops.dropout",
    "zoo_core.linear_attention": "zoo_core.ops.linear_attention",
    "zoo_core.masking": "zoo_core.ops.masking",
    "zoo_core.packing": "zoo_core.ops.packing",
    "zoo_core.positions": "zoo_core.ops.positions",
    "zoo_core.remat": "zoo_core.ops.remat",
    "zoo_core.xla_forms": "zoo_core.ops.xla_forms",
    # zoo_core.run: the trainer.
    "zoo_core.allocator": "zoo_core.run.allocator",
    "zoo_core.checkpoint": "zoo_core.run.checkpoint",
    "zoo_core.errors": "zoo_core.run.errors",
    "zoo_core.evaluation": "zoo_core.run.evaluation",
    "zoo_core.flag_errors": "zoo_core.run.flag_errors",
    "zoo_core.loop": "zoo_core.run.loop",
    "zoo_core.main": "zoo_core.run.main",
    "zoo_core.metrics": "zoo_core.run.metrics",
    "zoo_core.optim": "zoo_core.run.optim",
    "zoo_core.prepare": "zoo_core.run.prepare",
    "zoo_core.resume": "zoo_core.run.resume",
    "zoo_core.run_guard": "zoo_core.run.guard",
    "zoo_core.run_log": "zoo_core.run.log",
    "zoo_core.run_setup": "zoo_core.run.setup",
    "zoo_core.setup_checks": "zoo_core.run.setup_checks",
    "zoo_core.sharding": "zoo_core.run.sharding",
    "zoo_core.steps": "zoo_core.run.steps",
    # zoo_core.bench: the benchmark harness.
    "zoo_core.bench_report": "zoo_core.bench.report",
    "zoo_core.bench_sweep": "zoo_core.bench.sweep",
    "zoo_core.bench_timing": "zoo_core.bench.timing",
    # zoo_core.tasks.
    "zoo_core.textmetrics": "zoo_core.tasks.textmetrics",
    # samovar_jax: "blocks" means only HTGN's encoder and decoder blocks.
    "samovar_jax.blocks": "samovar_jax.modules",
}

# old name (0.1.0) -> its new name, where a module kept its path and a function of it was renamed. The module
# ends with `__getattr__ = moved.renamed_getattr(__name__)`.
RENAMED = {
    "agf_jax.ops.agf_recurrent": "agf_jax.ops.agf_scan",
    "agf_jax.analysis.filter_coefficients": "agf_jax.analysis.filter_coefficients_of",
    "agf_jax.model.merge_aux": "zoo_core.ops.aux_merge.stack_aux",
    "samovar_jax.ops.var_chain_recurrent": "samovar_jax.ops.var_chain_scan",
    "zoo_core.bench.write_json": "zoo_core.bench.write_records",
}


def message(old: str) -> str:
    """The warning of old path `old`: '<old> is deprecated and will be removed in 0.3.0; import <new>'."""
    return f"{old} is deprecated and will be removed in {REMOVED_IN}; import {MOVED[old]}"


def renamed_getattr(module_name: str):
    """The module-level `__getattr__` (PEP 562) of module `module_name`: each of its old names in `RENAMED`
    warns with a DeprecationWarning naming the new one and gives the new object."""
    def __getattr__(name: str):
        old = f"{module_name}.{name}"
        if old not in RENAMED:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        new = RENAMED[old]
        warnings.warn(f"{old} is deprecated and will be removed in {REMOVED_IN}; use {new}", DeprecationWarning,
                      stacklevel=2)
        module, _, attribute = new.rpartition(".")
        return getattr(importlib.import_module(module), attribute)
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED`; loading one warns and hands over the new module object."""

    def __init__(self):
        self._specs = {}   # new module name -> its own spec

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        # stacklevel 2: the importing line (warnings skips the import machinery's frames).
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias's spec on the module it was given: the module keeps its own.
        module.__spec__ = self._specs.pop(module.__name__)


def install() -> None:
    """Puts the finder on `sys.meta_path` (once; later calls do nothing)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
