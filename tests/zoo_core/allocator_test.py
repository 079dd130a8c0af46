"""The training commands' allocator restart (zoo_core.run.allocator)."""
import os
import subprocess
import sys

import pytest

from zoo_core.run import allocator

LINUX = dict(system="linux", libc="glibc", thp=True, mimalloc=None)
MIMALLOC = dict(LINUX, mimalloc="/site/cmeel.prefix/lib/libmimalloc.so.3")


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
    ({"LD_PRELOAD": "/x/libmimalloc.so"}, MIMALLOC),                # the user chose
    ({"ZOO_MALLOC": "system"}, MIMALLOC),
    ({}, dict(MIMALLOC, libc="")),
])
def test_no_restart(environ, facts):
    assert allocator.wanted_env(environ, **facts) is None


def test_prefers_mimalloc_and_keeps_the_users_preload():
    env = allocator.wanted_env({"MIMALLOC_PURGE_DELAY": "5"}, **MIMALLOC)
    assert env["LD_PRELOAD"] == MIMALLOC["mimalloc"] and "GLIBC_TUNABLES" not in env
    assert env["MIMALLOC_PURGE_DELAY"] == "5"                       # the user's own setting wins
    env = allocator.wanted_env({"LD_PRELOAD": "/x/libfoo.so"}, **dict(MIMALLOC, thp=False))
    assert env["LD_PRELOAD"] == f"{MIMALLOC['mimalloc']}:/x/libfoo.so"
    assert env["MIMALLOC_PURGE_DELAY"] == "-1"
    assert allocator.describe(env).startswith("mimalloc")


def test_zoo_malloc_glibc_skips_mimalloc():
    env = allocator.wanted_env({"ZOO_MALLOC": "glibc"}, **MIMALLOC)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and "LD_PRELOAD" not in env
    assert allocator.describe(env).startswith("glibc")


def test_mimalloc_library_is_found_by_file_name(tmp_path):
    assert allocator.mimalloc_library([str(tmp_path)]) is None
    lib = tmp_path / "cmeel.prefix" / "lib"
    lib.mkdir(parents=True)
    (lib / "libmimalloc.so.3").write_text("")
    assert allocator.mimalloc_library([str(tmp_path / "none"), str(tmp_path)]) == str(lib / "libmimalloc.so.3")


def test_thp_setting_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always madvise [never]\n")
    assert not allocator._thp_available(str(path))
    path.write_text("always [madvise] never\n")
    assert allocator._thp_available(str(path))
    assert not allocator._thp_available(str(tmp_path / "missing"))


def test_restart_keeps_argv_and_runs_once():
    code = ("import os, sys; from zoo_core.run import allocator; allocator.restart_with_huge_pages(); "
            "print(os.environ.get('GLIBC_TUNABLES'), os.environ.get('LD_PRELOAD'), sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ZOO_MALLOC", "LD_PRELOAD",
                                                            "ZOO_MALLOC_RESTARTED")}
    out = subprocess.run([sys.executable, "-c", code, "x", "--y=1"], env=env, check=True,
                         capture_output=True, text=True).stdout
    want = allocator.wanted_env(env)
    tunables, preload = (want.get("GLIBC_TUNABLES"), want.get("LD_PRELOAD")) if want else (None, None)
    assert out.strip() == f"{tunables} {preload} ['x', '--y=1']"
