"""The host allocator setting the training commands run under: glibc malloc on huge pages.

XLA's CPU runtime allocates each executable's temporaries with `malloc` on every call. Blocks that
large are fresh `mmap`s, so every 4 KiB page would be faulted and zeroed again on every step. glibc
(>= 2.35) backs its mmaps with transparent huge pages when started with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which removes most of those faults (measurements:
benchmarks/RESULTS.md). The tunable is read only when a process starts, so the training commands
restart themselves once with it set, before anything is parsed or built.

The restart happens only when all of these hold: Linux with glibc, the kernel offers transparent
huge pages (`/sys/kernel/mm/transparent_hugepage/enabled` is not `[never]`), `GLIBC_TUNABLES` does
not already set `glibc.malloc.hugetlb`, and `ZOO_MALLOC` is not `system` (the opt-out). Any other
tunables the user set are kept.

glibc's keep-the-block settings (`arena_max=1:mmap_max=0:trim_threshold=...`) would remove the
remaining per-step faults, but one arena for all of XLA's threads made the steps slower, so they are
not used.

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
