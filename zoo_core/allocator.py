"""The host allocator setting the training commands run under: glibc malloc on huge pages.

XLA's CPU runtime allocates each executable's temporaries (about 1.5 GiB for the AGF ListOps step)
with `malloc` on every call. Blocks that large are fresh `mmap`s, so every 4 KiB page is
page-faulted and zeroed again on every step: 320k faults and 0.75 CPU-s of system time per ListOps
step, measured. glibc (>= 2.35) backs its mmaps with transparent huge pages when started with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: about 1k faults per step and 1.17 -> 0.76 s per ListOps
step (README "Speed"). The tunable is read only when a process starts, so the training commands
restart themselves once with it set, before anything is parsed or built.

The restart happens only when all of these hold: Linux with glibc, the kernel offers transparent
huge pages (`/sys/kernel/mm/transparent_hugepage/enabled` is not `[never]`), `GLIBC_TUNABLES` does
not already set `glibc.malloc.hugetlb`, and `ZOO_MALLOC` is not `system` (the opt-out). Any other
tunables the user set are kept.

What huge pages leave: XLA still allocates each call's temporaries afresh, one block per device (401 MB
for a ListOps device), so their pages are faulted and zeroed on every step: 1.1-1.3k faults and
0.07-0.17 CPU-s of system time per ListOps or SAMoVAR Fig. 4 step (of 0.8-1.5 CPU-s), measured
2026-12-03. glibc can keep such a block instead (`arena_max=1:mmap_max=0:trim_threshold=4294967295`:
it then comes from the main heap and stays there), and that removes the faults, but with one arena
for all of XLA's threads the steps got slower: SAMoVAR 0.47-0.50 -> 0.59-0.63 s with 8x the context
switches; ListOps 0.59 -> 1.33 s (with `tcache_count=4000` as well) at 1.2 CPU-s of system time per
step. So it is not used.

This module imports nothing heavy.
"""
from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
OPT_OUT = "ZOO_MALLOC"      # ZOO_MALLOC=system: run under the allocator as started
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_RESTARTED = "ZOO_MALLOC_RESTARTED"


def _thp_available(path: str = _THP) -> bool:
    try:
        with open(path) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def wanted_env(environ: dict[str, str] | None = None, *, system: str | None = None,
               libc: str | None = None, thp: bool | None = None) -> dict[str, str] | None:
    """The environment to restart under, or None when the process should run as it is.

    Args:
        environ: the current environment (default `os.environ`).
        system, libc, thp: the platform facts (defaults: `sys.platform`, `platform.libc_ver()`,
            whether the kernel offers transparent huge pages); arguments for tests.
    """
    environ = dict(os.environ if environ is None else environ)
    system = sys.platform if system is None else system
    libc = platform.libc_ver()[0] if libc is None else libc
    thp = _thp_available() if thp is None else thp
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (system != "linux" or libc != "glibc" or not thp or TUNABLE in tunables
            or environ.get(OPT_OUT, "") == "system" or environ.get(_RESTARTED)):
        return None
    environ["GLIBC_TUNABLES"] = f"{tunables}:{SETTING}" if tunables else SETTING
    environ[_RESTARTED] = "1"   # never restart twice, whatever glibc made of the setting
    return environ


def restart_with_huge_pages() -> None:
    """Re-executes this process (same interpreter, same `sys.orig_argv`) under `wanted_env()`.

    Returns only when no restart is wanted; otherwise the process image is replaced. Call it first
    thing in a command's `__main__` path, never from library code or inside a test process.
    """
    env = wanted_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
