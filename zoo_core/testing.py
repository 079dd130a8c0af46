"""Test helpers shared by every package: fixed tolerances, golden files and their command line
(`golden_parser`, `check_golden_files`: `python -m <package>.convert --check FILE.npz ...`), tree comparison.

Tolerances are constants on purpose: a test that needs a looser one must say why in review,
never loosen it locally (see the developers' guide).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import zipfile
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from zoo_core import checks

# Fixed tolerances (style.md §4.7).
F32_SIMPLE = dict(rtol=1e-5, atol=1e-5)   # single kernels / layers in float32
F32_MODEL = dict(rtol=1e-4, atol=1e-4)    # whole models in float32
BF16 = dict(rtol=1e-2, atol=1e-2)         # bfloat16 against a float32 run
F64 = dict(rtol=1e-6, atol=1e-6)          # float64 (gradient checks)
GOLDEN_ATOL = 1e-5                        # |port - golden| <= GOLDEN_ATOL + GOLDEN_RTOL * |golden|
GOLDEN_RTOL = 1e-5

TESTDATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "testdata"


class Golden:
    """One golden case recorded from an original implementation (see tests/testdata/README.md).

    Attributes:
      meta: the decoded JSON `meta` record.
      inputs: `input/<name>` arrays, keyed by name.
      params: `param/<key>` arrays, keyed by the original state_dict key.
      outputs: `output/<name>` arrays, keyed by name.
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        if not zipfile.is_zipfile(self.path):   # np.load would call any other file pickled data
            raise ValueError(f"{self.path} is not a golden file: not an .npz archive")
        with np.load(self.path, allow_pickle=False) as f:
            if "meta" not in f.files:
                raise ValueError(f"{self.path} is not a golden file: it has no 'meta' record "
                                 "(tests/testdata/README.md)")
            self.meta: dict[str, Any] = json.loads(str(f["meta"]))
            self.inputs = _strip(f, "input/")
            self.params = _strip(f, "param/")
            self.outputs = _strip(f, "output/")


def _strip(f, prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: np.asarray(f[k]) for k in f.files if k.startswith(prefix)}


def golden_excess(actual, expected) -> float:
    """Largest violation of |a - e| <= GOLDEN_ATOL + GOLDEN_RTOL |e| (<= 0 means within tolerance)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: got {a.shape}, golden has {e.shape}")
    return float(np.max(np.abs(a - e) - (GOLDEN_ATOL + GOLDEN_RTOL * np.abs(e)), initial=-np.inf))


def golden_parser(prog: str, description: str, files_help: str) -> argparse.ArgumentParser:
    """The command line of a package's golden check: `--check FILE.npz ...` (each an existing file; a
    leading '~' is the home folder), the usage line on a bad argument."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--check", nargs="+", metavar="FILE.npz", required=True, type=checks.existing_file,
                        help=files_help)
    return parser


def check_golden_files(paths: Sequence[str],
                       check_file: Callable[[str], Iterable[tuple[str, float]]]) -> int:
    """Checks every golden file and prints one line per compared output; the exit status.

    Args:
      paths: golden files (`Golden`).
      check_file: one file -> (description, excess) per output, `excess` as `golden_excess` (<= 0
        is within |port - golden| <= GOLDEN_ATOL + GOLDEN_RTOL |golden|). An exception fails that file
        only: its line says `ERROR` and the other files are still checked.

    Returns:
      0 if every output of every file is within the criterion, else 1 (for `sys.exit`).
    """
    ok = True
    for path in paths:
        try:
            rows = list(check_file(path))
        except Exception as e:  # noqa: BLE001  report every file, then fail
            print(f"{path}: ERROR {type(e).__name__}: {e}")
            ok = False
            continue
        for text, excess in rows:
            ok &= excess <= 0
            print(f"{path}: {text} {'ok' if excess <= 0 else 'FAIL'}")
    print(f"all within {GOLDEN_ATOL:.0e} + {GOLDEN_RTOL:.0e}|golden|".replace("e-0", "e-") if ok
          else "golden check FAILED")
    return 0 if ok else 1


def assert_trees_close(actual: Any, expected: Any, *, rtol: float, atol: float) -> None:
    """Asserts two pytrees have the same structure and allclose leaves, naming the first bad leaf."""
    import jax

    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected)
    if a_def != e_def:
        raise AssertionError(f"tree structures differ:\n{a_def}\n{e_def}")
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol,
                                   atol=atol, err_msg=jax.tree_util.keystr(path))


def assert_refused(call: Callable[[], Any], fragment: str) -> str:
    """Asserts that `call()` refuses its arguments as the zoo's boundary checks do (issue 43, one table per
    package): it raises ValueError or TypeError whose message holds `fragment` and is one line. Returns the
    message."""
    try:
        call()
    except (ValueError, TypeError) as error:
        message = str(error)
    else:
        raise AssertionError(f"no ValueError or TypeError raised; expected a message with {fragment!r}")
    if fragment not in message:
        raise AssertionError(f"{fragment!r} is not in the message: {message}")
    if "\n" in message.strip():
        raise AssertionError(f"the message is not one line: {message!r}")
    return message


def packed_segment_ids(run_lengths: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Packed `segment_ids` `[B, length]` int32 for tests of packing (docs/specs/context_parallel.md): row b
    cycles through the runs `run_lengths[b]`, numbering them 1, 2, ...; every fourth run (counted from b) is
    padding (0). Lengths that are not multiples of a shard size make documents cross shard boundaries."""
    ids = np.zeros((len(run_lengths), length), np.int32)
    for b, lengths in enumerate(run_lengths):
        pos, doc = 0, 0
        while pos < length:
            n = lengths[doc % len(lengths)]
            ids[b, pos:pos + n] = doc + 1 if (doc + b) % 4 else 0
            pos, doc = pos + n, doc + 1
    return ids


def param_shapes(params: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Flattens a parameter tree to {'a/b/kernel': shape}, for parameter-name snapshot tests."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(np.shape(v)) for path, v in flat}



def assert_forms_agree(outputs: Mapping[str, Any], *, rtol: float, atol: float) -> None:
    """Asserts that every form of a computation gives the first form's result.

    Args:
      outputs: {form name: output pytree}, e.g. {'parallel': y, 'chunked(3)': y3, 'scan': ys,
        'step': yt}; all trees must have the same structure. NaNs must sit at the same places.
      rtol, atol: one of this module's fixed tolerances (e.g. `**F32_SIMPLE`).
    """
    if len(outputs) < 2:
        raise ValueError(f"assert_forms_agree needs at least two forms, got {list(outputs)}")
    (ref_name, ref), *rest = outputs.items()
    for name, out in rest:
        try:
            assert_trees_close(out, ref, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"form {name!r} differs from {ref_name!r}: {e}") from None


def exported_program(fn, *args: Any, platform: str = "cuda") -> str:
    """The StableHLO text of `jax.jit(fn)(*args)` as JAX exports it for `platform` ('cuda', 'tpu', 'cpu').

    Needs no accelerator: this is how a test on the CPU sees the program a GPU or TPU would run,
    with `jax.lax.platform_dependent` resolved for that platform. `args` are arrays or
    `jax.ShapeDtypeStruct`s.
    """
    import jax
    from jax import export

    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    return export.export(jax.jit(fn), platforms=[platform])(*specs).mlir_module()


def while_loops(program: str) -> int:
    """How many while loops a StableHLO text holds (a `lax.scan`/`fori_loop` each lowers to one)."""
    return program.count("stablehlo.while")


_COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
               "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collective_bytes(hlo_text: str) -> int:
    """The bytes of the results of every cross-device collective (all-gather, all-reduce,
    collective-permute, all-to-all, reduce-scatter, and their async `-start` forms counted once) in a
    compiled program's text (`jax.jit(f).lower(...).compile().as_text()`): what one call moves between
    devices, per device."""
    import re

    total = 0
    for line in hlo_text.splitlines():
        m = re.search(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        shapes = re.findall(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]", m.group(1))
        if m.group(3):   # an async start returns (operands, results): count the results only
            shapes = shapes[len(shapes) // 2:]
        for dtype, dims in shapes:
            total += _ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total
