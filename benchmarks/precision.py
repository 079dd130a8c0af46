"""The bfloat16 precision envelope of every attention of the zoo: bf16 compute against a float64 reference.

Run from the repo root:

    python -m benchmarks.precision                          # T = 256 and 8K, 64K for the long forms
    python -m benchmarks.precision --lengths 256 --names agf,window_graph

For every registry name (`zoo_core.attention.names()`) and SAMoVAR's VAR chain (`var_chain`,
`samovar_jax.VARChain`, 3 layers), each mode it has ('full' = non-causal self-attention, 'causal',
'cross' for the cross-only Cross-Graph layer) and each form of that mode ('parallel' = `__call__`
without `chunk_size`, 'chunked' = `chunk_size` = 64, 'scan' = the token recurrence `scan`), one layer
of H = 4 heads x D = 16 (E = 64) on x ~ N(0, 1) `[B, T, E]` is run twice with the same parameters and
inputs:

* bf16: `dtype=bfloat16`, `param_dtype=float32` (what a mixed-precision training step runs; the layers
  keep their states, normalisers and softmax statistics in float32), float32 inputs, default JAX
  (x64 off);
* reference: `dtype=param_dtype=float64` under `jax.enable_x64`, the same parameters and inputs cast to
  float64.

What is compared: the output y `[B, T, E]` (the VAR chain: every layer's output `[L, B, T, H, D]`), and
the vector-Jacobian product of y with one fixed cotangent g ~ N(0, 1) (the gradient of sum(y * g), so
every output position weighs alike): the input gradient dx (cross: queries and memory together) and
every parameter's gradient. Auxiliary losses (AGF's orthogonality term, the graph KL) are not part of it.

Relative error of a tensor a against its reference r (both as float64, over the whole tensor):

    rel(a, r) = ||a - r||_2 / ||r||_2        (Frobenius norms)

Parameter gradients: a leaf counts when its reference norm exceeds 1e-3 of the norm of the whole
reference gradient (`LEAF_FRACTION`), so that mathematically-zero gradients (softmax's key bias: a
constant added to every logit of a row) and their rounding noise are left out. 'params' is rel over the
counted leaves together (their concatenation); 'worst leaf' the largest rel of one counted leaf.

Forms whose compiled programs would exceed the memory guard (`--max_gib`, XLA's own estimate, checked
before running) are recorded as skipped with that reason, as are cases once `--budget_s` is spent. Writes
benchmarks/results/precision.json (or --out) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from zoo_core import attention, bench, checks
from zoo_core.attention import registry

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
HEADS, HEAD_DIM = 4, 16
WIDTH = HEADS * HEAD_DIM
CHUNK = 64
VAR_LAYERS = 3
LEAF_FRACTION = 1e-3
LENGTHS = (256, 8192)
LONG_LENGTHS = (65536,)
# The causal chunked forms of the linear mechanisms, the ones measured at LONG_LENGTHS too: their state
# runs across the whole sequence, which is where a low-precision state would drift.
LONG_FORMS = (("linear", "causal", "chunked"), ("favor", "causal", "chunked"), ("agf", "causal", "chunked"),
              ("var_chain", "causal", "chunked"))
VAR_CHAIN = "var_chain"
# Sizes where the layer's defaults are sized for other models (the rest use their defaults).
OPTIONS: dict[str, dict[str, Any]] = {}


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured program: mechanism `name`, `mode` ('full', 'causal', 'cross'), `form` ('parallel',
    'chunked', 'scan')."""
    name: str
    mode: str
    form: str

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode} {self.form}"


def cases(names: Optional[list[str]] = None) -> list[Case]:
    """Every (name, mode, form) of the registry and the VAR chain, in registry order."""
    out = []
    for name in (names or list(attention.names()) + [VAR_CHAIN]):
        if name == VAR_CHAIN:
            out += [Case(name, "causal", f) for f in ("parallel", "chunked", "scan")]
            continue
        entry, caps = registry.lookup(name), attention.capabilities(name)
        if entry.self_form is None:
            out.append(Case(name, "cross", "parallel"))
            continue
        if caps["self"]:
            out.append(Case(name, "full", "parallel"))
        if caps["causal"]:
            forms = ["parallel"]
            if "chunk_size" in attention.options(name):
                forms.append("chunked")
            if entry.recurrent:
                forms.append("scan")
            out += [Case(name, "causal", f) for f in forms]
    return out


class Layer:
    """The layer of a case at one length and dtype: `init(key, inputs) -> variables` and
    `forward(variables, inputs) -> y`, inputs a tuple of `[B, T, E]` arrays (x, and the memory in
    cross-attention)."""

    def __init__(self, case: Case, t: int, dtype: Any, param_dtype: Any, chunk_size: int = CHUNK):
        opts = dict(OPTIONS.get(case.name, {}))
        if case.form == "chunked":
            opts["chunk_size"] = chunk_size
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.method, self.returns_aux, self.cross = "scan" if case.form == "scan" else "__call__", True, False
        if case.name == VAR_CHAIN:
            from samovar_jax import VARChain

            self.module = VARChain(width=WIDTH, num_heads=HEADS, num_layers=VAR_LAYERS, **opts, **kw)
        elif case.mode == "cross":
            self.module = attention.make(case.name, num_heads=HEADS, qkv_features=WIDTH, **opts, **kw)
            self.returns_aux, self.cross = False, True
        else:
            if attention.length_option(case.name):   # Linformer's longest input
                opts[attention.length_option(case.name)] = t
            if case.form == "scan" and "max_length" in attention.options(case.name):   # softmax's KV cache
                opts["max_length"] = t
            causal = case.mode == "causal"
            if not causal and registry.lookup(case.name).global_call is not None:   # linear's global form
                causal, self.method, self.returns_aux = True, "global_self", False
            self.module = attention.layer(case.name, num_heads=HEADS, qkv_features=WIDTH, causal=causal,
                                          **opts, **kw)

    def _call(self, fn, first, inputs):
        if self.cross:
            return fn(first, inputs[0], inputs_kv=inputs[1])
        if self.method == "scan" and fn == self.module.apply:
            return fn(first, inputs[0], self._state(first, inputs[0]), method="scan")
        return fn(first, inputs[0], method=self.method)

    def _state(self, variables, x):
        """The zero state, its floats in at least float32 (float64 in the reference: softmax's KV cache
        is float32 whatever the dtype, which a float64 scan cannot carry)."""
        state = self.module.apply(variables, x.shape[0], method="init_state")
        acc = jnp.promote_types(self.module.dtype, jnp.float32)
        return jax.tree.map(lambda a: a.astype(acc) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)

    def init(self, key, inputs):
        return self._call(self.module.init, key, inputs)

    def forward(self, variables, inputs):
        out = self._call(self.module.apply, variables, inputs)
        return out[0] if self.returns_aux else out


def value_and_grads(forward: Callable, variables: Any, inputs: tuple, cot: Any):
    """(y, input gradients, parameter gradients): y and its VJP with cotangent `cot` (y is cast to
    cot's dtype first, so the bf16 run's gradient enters as a bf16 cotangent, as in training)."""
    def f(params, inputs):
        return forward(dict(variables, params=params), inputs).astype(cot.dtype)
    y, pull = jax.vjp(f, variables["params"], inputs)
    g_params, g_inputs = pull(cot)
    return y, g_inputs, g_params


def rel(a: Any, ref: Any) -> float:
    """||a - ref|| / ||ref|| over the whole tensor, in float64; inf when a is not finite."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def param_errors(grads: Any, ref: Any, fraction: float = LEAF_FRACTION) -> dict[str, Any]:
    """The parameter-gradient errors (module docstring): 'params' over the leaves whose reference norm
    exceeds `fraction` of the whole reference gradient's, 'worst_leaf' the worst such leaf, 'leaves'
    every counted leaf's error by its path."""
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    names = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
    a = [np.asarray(x, np.float64) for _, x in flat]
    r = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(ref)]
    norms = np.array([np.linalg.norm(x) for x in r])
    keep = np.flatnonzero(norms > fraction * np.linalg.norm(norms))
    errors = {names[i]: rel(a[i], r[i]) for i in keep}
    overall = rel(np.concatenate([a[i].ravel() for i in keep]), np.concatenate([r[i].ravel() for i in keep]))
    worst = max(errors, key=errors.get)
    return dict(params=overall, worst_leaf=errors[worst], worst_leaf_name=worst, leaves=errors,
                leaves_counted=len(keep), leaves_total=len(r))


def _float64(a):
    a = np.asarray(a)
    return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a


def _cat(arrays) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in arrays])


def measure(case: Case, t: int, *, batch: int = 2, seed: int = 0, chunk_size: int = CHUNK,
            max_bytes: Optional[int] = None) -> dict[str, Any]:
    """One record of `case` at length `t`: the errors of the module docstring ('output', 'inputs',
    'params', 'worst_leaf', ...), or status 'skipped' and the reason when a compiled program's memory
    (XLA's estimate) exceeds `max_bytes`."""
    record: dict[str, Any] = dict(name=case.name, mode=case.mode, form=case.form, t=t, batch=batch)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    inputs = tuple(rng.standard_normal((batch, t, WIDTH), dtype=np.float32)
                   for _ in range(2 if case.mode == "cross" else 1))
    low_layer = Layer(case, t, jnp.bfloat16, jnp.float32, chunk_size)
    variables = jax.tree.map(np.asarray, jax.jit(low_layer.init)(jax.random.PRNGKey(seed), inputs))
    y = jax.eval_shape(low_layer.forward, variables, inputs)
    cot = rng.standard_normal(y.shape, dtype=np.float32)
    low = jax.jit(functools.partial(value_and_grads, low_layer.forward)).lower(variables, inputs, cot).compile()
    with jax.enable_x64(True):
        high_layer = Layer(case, t, jnp.float64, jnp.float64, chunk_size)
        args64 = jax.tree.map(_float64, (variables, inputs, cot))
        high = jax.jit(functools.partial(value_and_grads, high_layer.forward)).lower(*args64).compile()
        need = max(bench.memory_of(c)["total_bytes"] or 0 for c in (low, high))
        record["est_gib"] = round(need / 2**30, 3)
        if max_bytes is not None and need > max_bytes:
            return dict(record, status="skipped", reason=f"compiled memory {need / 2**30:.1f} GiB > the guard's "
                                                         f"{max_bytes / 2**30:.1f} GiB")
        ref = jax.tree.map(np.asarray, high(*args64))
    got = jax.tree.map(np.asarray, low(variables, inputs, cot))
    return dict(record, status="ok", output=rel(got[0], ref[0]), inputs=rel(_cat(got[1]), _cat(ref[1])),
                **param_errors(got[2], ref[2]), seconds=round(time.perf_counter() - t0, 2))


def plan(args: argparse.Namespace) -> list[tuple[Case, int]]:
    """(case, T) in the order measured: every case at each of --lengths, the `LONG_FORMS` at each
    of --long_lengths too; shorter lengths first."""
    selected = cases(args.names)
    runs = [(c, t) for t in args.lengths for c in selected]
    runs += [(c, t) for t in args.long_lengths for c in selected if (c.name, c.mode, c.form) in LONG_FORMS]
    return sorted(runs, key=lambda ct: ct[1])


def format_table(records: list[dict[str, Any]]) -> str:
    """The markdown table of the records: a row per (mechanism, mode, form), a column per length, each cell
    'output / input gradient / parameter gradients / worst leaf (its name)' (or why the case was skipped)."""
    lengths = sorted({r["t"] for r in records})
    rows: dict[tuple, dict[int, dict]] = {}
    for r in records:
        rows.setdefault((r["name"], r["mode"], r["form"]), {})[r["t"]] = r
    head = ["mechanism", "mode", "form"] + [f"T = {_k(t)}" for t in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (name, mode, form), by_t in rows.items():
        cells = [name, mode, form]
        for t in lengths:
            r = by_t.get(t)
            if r is None:
                cells.append("")
            elif r["status"] != "ok":
                cells.append(f"{r['status']}: {r.get('reason', '')}")
            else:
                cells.append(f"{r['output']:.1e} / {r['inputs']:.1e} / {r['params']:.1e} / "
                             f"{r['worst_leaf']:.1e} ({r['worst_leaf_name']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _k(t: int) -> str:
    return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=checks.positive_ints, default=list(LENGTHS),
                   help="comma-separated sequence lengths T of every form")
    p.add_argument("--long_lengths", type=_lengths_or_none, default=list(LONG_LENGTHS),
                   help="comma-separated lengths of the causal chunked linear forms only ('none': no such run)")
    p.add_argument("--names", default=None,
                   help=f"comma-separated subset of {list(attention.names()) + [VAR_CHAIN]} (default all)")
    p.add_argument("--batch", type=checks.positive_int, default=2)
    p.add_argument("--seed", type=checks.nonnegative_int, default=0)
    p.add_argument("--max_gib", type=checks.positive_float, default=None,
                   help="memory guard on XLA's estimate of each program, GiB (default: 50%% of available RAM)")
    p.add_argument("--budget_s", type=checks.positive_float, default=3600.0,
                   help="time budget; the cases left once it is spent are recorded as skipped")
    p.add_argument("--out", default=str(RESULTS / "precision.json"))
    args = p.parse_args(argv)
    if args.names is not None:
        args.names = checks.choice_list(p, "--names", args.names, list(attention.names()) + [VAR_CHAIN])
    checks.check_output_paths(p, args, files=["out"])
    return args


def _lengths_or_none(text: str) -> list[int]:
    return [] if text.strip().lower() == "none" else checks.positive_ints(text)


def main(argv=None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    max_bytes = int(args.max_gib * 2**30) if args.max_gib else bench.default_max_bytes(0.5)
    deadline = time.monotonic() + args.budget_s
    meta = dict(benchmark="precision", heads=HEADS, head_dim=HEAD_DIM, chunk_size=CHUNK, var_layers=VAR_LAYERS,
                leaf_fraction=LEAF_FRACTION, batch=args.batch, seed=args.seed, max_bytes=max_bytes,
                error="||a - ref||_2 / ||ref||_2 over the tensor; ref = float64",
                load_before=bench.machine_meta()["loadavg"])
    print(f"load average before: {meta['load_before']}")
    records = []
    for case, t in plan(args):
        if time.monotonic() > deadline:
            record = dict(name=case.name, mode=case.mode, form=case.form, t=t, batch=args.batch,
                          status="skipped", reason=f"--budget_s {args.budget_s:g} spent")
        else:
            record = measure(case, t, batch=args.batch, seed=args.seed, max_bytes=max_bytes)
        records.append(record)
        shown = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in record.items() if k != "leaves"}
        print(shown, flush=True)
    meta["load_after"] = bench.machine_meta()["loadavg"]
    path = bench.write_records(args.out, records, meta)
    print(format_table(records))
    print(f"each cell: output / input gradient / parameter gradients / worst leaf, each ||bf16 - float64|| / "
          f"||float64|| over the tensor; 'params' over the leaves above {LEAF_FRACTION:g} of the gradient's norm; "
          f"load average after: {meta['load_after']}")
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
