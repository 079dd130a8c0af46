"""The training commands' allocator restart (zoo_core.run.allocator)."""
import os
import subprocess
import sys

import pytest

from zoo_core.run import allocator

LINUX = dict(system="linux", libc="glibc", thp=True)


def test_sets_the_tunable_and_keeps_the_users_own():
    assert allocator.wanted_env({}, **LINUX)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env = allocator.wanted_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"}, **LINUX)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env["A"] == "b"


@pytest.mark.parametrize("environ, facts", [
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, LINUX),          # the user chose
    ({"ZOO_MALLOC": "system"}, LINUX),                              # the opt-out
    ({"ZOO_MALLOC_RESTARTED": "1"}, LINUX),                         # never twice
    ({}, dict(LINUX, system="darwin")),
    ({}, dict(LINUX, libc="")),                                      # musl and others
    ({}, dict(LINUX, thp=False)),                                    # THP set to [never]
])
def test_no_restart(environ, facts):
    assert allocator.wanted_env(environ, **facts) is None


def test_thp_setting_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always madvise [never]\n")
    assert not allocator._thp_available(str(path))
    path.write_text("always [madvise] never\n")
    assert allocator._thp_available(str(path))
    assert not allocator._thp_available(str(tmp_path / "missing"))


def test_restart_keeps_argv_and_runs_once():
    code = ("import os, sys; from zoo_core.run import allocator; allocator.restart_with_huge_pages(); "
            "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ZOO_MALLOC",
                                                            "ZOO_MALLOC_RESTARTED")}
    out = subprocess.run([sys.executable, "-c", code, "x", "--y=1"], env=env, check=True,
                         capture_output=True, text=True).stdout
    want = allocator.wanted_env(env)
    tunables = want["GLIBC_TUNABLES"] if want else None
    assert out.strip() == f"{tunables} ['x', '--y=1']"
