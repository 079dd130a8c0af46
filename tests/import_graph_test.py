"""The repository's module graph: no import circle among the first-party modules, and no module of
a package, the configs, the benchmarks or the examples over 650 lines.

Every first-party module is parsed with `ast` (nothing is imported): an edge A -> B for each
`import B`, `from B import x` and `from P import B` (a submodule B of P) anywhere in A, a function-level
import included, since a deferred import is still a circle between two modules' concerns. A package's
`__init__` that imports its own submodules is no circle with them: `from P import m` is an edge to P.m.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("zoo_core", "agf_jax", "samovar_jax", "htgn_jax", "benchmarks")
MAX_LINES = 650
SIZE_CHECKED = PACKAGES + ("examples",)


def _modules() -> dict[str, pathlib.Path]:
    """{dotted module name: path} of every first-party .py file."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The first-party modules `name` imports."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolved against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from P import m` imports the submodule P.m where there is one, else the name m of P.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        for target in targets:
            # The module itself, or the nearest first-party package above it (`import a.b.c` runs a, a.b).
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path
    a -> b -> ... -> a."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:   # walk inside the component until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in component)
            if nxt in seen:
                cycles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def test_the_graph_sees_the_imports_it_should():
    graph = _graph()
    assert "zoo_core.costs" in graph["zoo_core.bench.train_step"] and "zoo_core.costs" in graph["zoo_core.run.setup"]
    assert "zoo_core.run.setup" in graph["zoo_core.bench.train_step"]   # the benchmark's step is the trainer's
    assert "zoo_core.run.main" in graph["agf_jax.train"]
    assert "zoo_core.data.pipeline" in graph["zoo_core.run.loop"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_trainer_and_the_harness_are_packages_in_layers():
    """zoo_core.run holds the trainer and zoo_core.bench the harness; `costs` is the leaf both read, the
    harness builds on the trainer, never the reverse, and `run/__init__` imports nothing (the public
    facade is zoo_core.trainer)."""
    graph = _graph()
    run = {m for m in graph if m.startswith("zoo_core.run.")}
    bench = {m for m in graph if m == "zoo_core.bench" or m.startswith("zoo_core.bench.")}
    assert {"zoo_core.run.main", "zoo_core.run.setup", "zoo_core.run.loop", "zoo_core.run.steps"} <= run
    assert {"zoo_core.bench.timing", "zoo_core.bench.sweep", "zoo_core.bench.report"} <= bench
    assert not graph["zoo_core.run"]
    assert not {m for m in graph["zoo_core.costs"] if m.startswith("zoo_core.")}
    assert not [(a, b) for a in run for b in graph[a] if b in bench]
    # No flat trainer or harness module is left beside the packages.
    flat = {"zoo_core." + m for m in ("loop", "steps", "run_setup", "setup_checks", "resume", "prepare",
                                      "evaluation", "run_guard", "run_log", "errors", "main", "flag_errors",
                                      "bench_timing", "bench_sweep", "bench_report")}
    assert not flat & set(graph)


def test_the_zoo_core_top_level_holds_packages_and_a_few_leaves():
    """The architecture shows in the folders: the maths (`ops`), the mechanisms (`attention`,
    `baselines`), the trainer (`run`), the harness (`bench`), `data`, `tasks`, `study`, the shipped
    `configs`; at the top only the boundary checks, the cost leaf, the extras, the test helpers, the
    trainer's facade and self-test, and the table of the 0.1.0 paths that moved."""
    root = pathlib.Path(__file__).resolve().parents[1] / "zoo_core"
    leaves = {p.stem for p in root.glob("*.py")} - {"__init__"}
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert leaves == {"checks", "costs", "extras", "testing", "trainer", "train", "mlp_classifier", "moved"}
    assert packages == {"ops", "attention", "baselines", "run", "bench", "data", "tasks", "study", "configs"}


def test_no_import_circle_among_first_party_modules():
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_exceeds_650_lines():
    too_long = {}
    for package in SIZE_CHECKED:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
