"""The host allocator the training commands run under: mimalloc keeping freed pages, else glibc
malloc on huge pages.

XLA's CPU runtime allocates each executable's temporaries with `malloc` on every call, on the
device's worker thread: one block per device per step (421 MB for a ListOps device). glibc serves a
block that large from a fresh `mmap` and returns it with `munmap` on free (a worker thread's arena
cannot hold it, so `glibc.malloc.mmap_max=0` does not keep it either), so every page of it is faulted
and zeroed by the kernel again on every step. Two settings remove that, in this order of preference:

* **mimalloc** (`libmimalloc.so` of the `cmeel-mimalloc` wheel, when it is installed) preloaded with
  `MIMALLOC_PURGE_DELAY=-1`: a freed block stays mapped and the next call reuses its pages, so a
  step faults no page at all. Measured on the 2-core CPU (benchmarks/RESULTS.md): AGF ListOps 1,300
  -> 0 faults and 0.16 -> 0.002 CPU-s of system time per step. Freed memory is kept for the process's
  life (the peak of the steps, which XLA's buffer assignment bounds).
* **glibc on transparent huge pages** (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, glibc >= 2.35):
  the blocks are still fresh every step, but faulted 2 MiB at a time (about 1.3k faults per
  ListOps step instead of 320k).

Both are read only when a process starts (the dynamic loader reads `LD_PRELOAD`, glibc its
tunables), so the training commands restart themselves once with the setting, before anything is
parsed or built.

The restart happens only on Linux with glibc, when `ZOO_MALLOC` is not `system` (the opt-out;
`ZOO_MALLOC=glibc` skips mimalloc), when the environment does not already choose (an `LD_PRELOAD`
naming mimalloc, or `GLIBC_TUNABLES` setting `glibc.malloc.hugetlb`) and never twice. mimalloc is
used where its library is found; otherwise huge pages where the kernel offers them
(`/sys/kernel/mm/transparent_hugepage/enabled` is not `[never]`). The user's own `LD_PRELOAD` and
tunables are kept.

glibc's keep-the-block settings (`arena_max=1:mmap_max=0:trim_threshold=...`) also remove the
faults, but one arena for all of XLA's threads made the steps slower, so they are not used.

This module imports nothing heavy.
"""
from __future__ import annotations

import glob
import os
import platform
import sys
from typing import Optional

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
OPT_OUT = "ZOO_MALLOC"      # ZOO_MALLOC=system: run under the allocator as started; =glibc: no mimalloc
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}   # keep freed pages mapped: no per-step faults
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_RESTARTED = "ZOO_MALLOC_RESTARTED"


def _thp_available(path: str = _THP) -> bool:
    try:
        with open(path) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def mimalloc_library(paths: Optional[list[str]] = None) -> Optional[str]:
    """The path of the `cmeel-mimalloc` wheel's `libmimalloc.so*` on `paths` (default `sys.path`),
    or None. Found by file name, without importing anything."""
    for entry in sys.path if paths is None else paths:
        found = sorted(glob.glob(os.path.join(entry or ".", "cmeel.prefix", "lib", "libmimalloc.so*")))
        if found:
            return found[0]
    return None


def wanted_env(environ: dict[str, str] | None = None, *, system: str | None = None,
               libc: str | None = None, thp: bool | None = None,
               mimalloc: str | None | bool = True) -> dict[str, str] | None:
    """The environment to restart under, or None when the process should run as it is.

    Args:
        environ: the current environment (default `os.environ`).
        system, libc, thp: the platform facts (defaults: `sys.platform`, `platform.libc_ver()`,
            whether the kernel offers transparent huge pages); arguments for tests.
        mimalloc: the mimalloc library to preload; True (default): `mimalloc_library()`; None:
            none is installed.
    """
    environ = dict(os.environ if environ is None else environ)
    system = sys.platform if system is None else system
    libc = platform.libc_ver()[0] if libc is None else libc
    tunables = environ.get("GLIBC_TUNABLES", "")
    preload = environ.get("LD_PRELOAD", "")
    choice = environ.get(OPT_OUT, "")
    if (system != "linux" or libc != "glibc" or TUNABLE in tunables or "mimalloc" in preload
            or choice == "system" or environ.get(_RESTARTED)):
        return None
    library = mimalloc_library() if mimalloc is True else mimalloc
    if library and choice != "glibc":
        environ["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
        for key, value in MIMALLOC_ENV.items():
            environ.setdefault(key, value)
    elif _thp_available() if thp is None else thp:
        environ["GLIBC_TUNABLES"] = f"{tunables}:{SETTING}" if tunables else SETTING
    else:
        return None
    environ[_RESTARTED] = "1"   # never restart twice, whatever the loader or glibc made of the setting
    return environ


def describe(environ: dict[str, str] | None = None) -> str:
    """One line naming the allocator this process runs under (for benchmark printouts)."""
    environ = os.environ if environ is None else environ
    preload = environ.get("LD_PRELOAD", "")
    if "mimalloc" in preload:
        keep = " ".join(f"{k}={environ.get(k)}" for k in MIMALLOC_ENV)
        return f"mimalloc ({keep})"
    return f"glibc (GLIBC_TUNABLES={environ.get('GLIBC_TUNABLES')})"


def restart_with_huge_pages() -> None:
    """Re-executes this process (same interpreter, same `sys.orig_argv`) under `wanted_env()`.

    Returns only when no restart is wanted; otherwise the process image is replaced. Call it first
    thing in a command's `__main__` path, never from library code or inside a test process. (The name
    is kept from when huge pages were the only setting.)
    """
    env = wanted_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
