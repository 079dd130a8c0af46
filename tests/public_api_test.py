"""The public API (docs/api.md) against its snapshot, tests/testdata/public_api.txt.

The public names are: the `__all__` of every module of `PUBLIC_MODULES` (each must have one); the same
names at the modules that define the architecture packages' names (`agf_jax.model:Model`, since
`agf_jax.Model` is defined there); the commands (`python -m <module>`); and the `get_config` /
`get_study` of every shipped config. The snapshot lists them as `module:name` (a command as `module`)
with the version it was taken at, which is setup.cfg's.

Changing the public names fails here until the snapshot is regenerated (`REGENERATE`). A name that
leaves the snapshot stays in it as `removed <version> module:name`, and CHANGELOG.md's section of that
version must name it (`module.name`): a removal or a rename is released with its changelog line. The
module paths that moved (zoo_core.moved.MOVED) are named in that section too.
"""
from __future__ import annotations

import ast
import configparser
import importlib
import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "tests" / "testdata" / "public_api.txt"
REGENERATE = "python -m tests.public_api_test --write"

# Each has an `__all__`: its public names.
PUBLIC_MODULES = (
    "zoo_core.attention", "zoo_core.trainer", "zoo_core.run.main", "zoo_core.study", "zoo_core.configs",
    "zoo_core.extras",
    "zoo_core.ops.linear_attention", "zoo_core.ops.packing", "zoo_core.ops.context_parallel",
    "zoo_core.ops.masking", "zoo_core.ops.positions", "zoo_core.ops.xla_forms",
    "zoo_core.baselines.linformer", "zoo_core.baselines.nystromformer", "zoo_core.baselines.reformer",
    "zoo_core.baselines.longformer",
    "agf_jax", "agf_jax.ops", "agf_jax.softmax", "agf_jax.context_parallel", "agf_jax.analysis",
    "samovar_jax", "samovar_jax.ops", "samovar_jax.context_parallel", "samovar_jax.analysis",
    "htgn_jax", "htgn_jax.ops", "htgn_jax.graph_ops", "htgn_jax.hrpe", "htgn_jax.decoding", "htgn_jax.analysis",
    "htgn_jax.context_parallel",
)
# Packages whose names are public also where they are defined (the layers' and models' modules).
PACKAGES = ("agf_jax", "samovar_jax", "htgn_jax")
# `python -m <module>`.
COMMANDS = (
    "agf_jax.train", "samovar_jax.train", "htgn_jax.train", "zoo_core.train", "agf_jax.convert",
    "samovar_jax.convert", "zoo_core.study", "zoo_core.data.download", "zoo_core.data.lra_prepare",
)
# The shipped configs' folders (zoo_core/configs/<folder>/<name>.py, `configs/<folder>/<name>.py` to a command).
CONFIG_FOLDERS = ("agf", "core", "htgn", "samovar", "studies")
CONFIG_ENTRIES = ("get_config", "get_study")


def setup_version() -> str:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "setup.cfg")
    return parser["metadata"]["version"]


def _config_names() -> list[str]:
    """`zoo_core.configs.<folder>.<name>:get_config` (or `get_study`) of every shipped config file (read
    with `ast`: nothing is imported)."""
    out = []
    for folder in CONFIG_FOLDERS:
        for path in sorted((ROOT / "zoo_core" / "configs" / folder).glob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name in CONFIG_ENTRIES:
                    out.append(f"zoo_core.configs.{folder}.{path.stem}:{node.name}")
    return out


def current_names() -> list[str]:
    """The public names of this checkout, sorted (every module imported, every name looked up)."""
    names = set(_config_names())
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        public = getattr(module, "__all__", None)
        assert public is not None, f"{module_name} is public: give it an `__all__` (docs/api.md)"
        assert len(set(public)) == len(public), f"{module_name}.__all__ names a name twice"
        for name in public:
            value = getattr(module, name)   # an AttributeError here: __all__ names what is not there
            names.add(f"{module_name}:{name}")
            defined_in = getattr(value, "__module__", None)
            if module_name in PACKAGES and defined_in and defined_in.startswith(module_name + "."):
                names.add(f"{defined_in}:{name}")
    for command in COMMANDS:
        assert importlib.util.find_spec(command) is not None, f"no module {command}"
        names.add(command)
    return sorted(names)


def read_snapshot() -> tuple[str, list[str], dict[str, str]]:
    """(version, the public names, {removed name: the version it was removed in})."""
    version, names, removed = None, [], {}
    for line in SNAPSHOT.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("version "):
            version = line.split()[1]
        elif line.startswith("removed "):
            _, when, name = line.split()
            removed[name] = when
        else:
            names.append(line.strip())
    return version, names, removed


def write_snapshot() -> tuple[list[str], list[str]]:
    """Rewrites the snapshot from this checkout; returns (added, removed) against the old one."""
    version = setup_version()
    old_names, old_removed = (read_snapshot()[1:] if SNAPSHOT.exists() else ([], {}))
    names = current_names()
    added = sorted(set(names) - set(old_names))
    dropped = sorted(set(old_names) - set(names))
    removed = {name: when for name, when in old_removed.items() if name not in names}
    removed.update({name: version for name in dropped})
    lines = ["# The public names of linear-attention-zoo (docs/api.md): `module:name`, a command as `module`.",
             f"# Changed on purpose? Regenerate: {REGENERATE}",
             "# A name removed stays as `removed <version> module:name`, named in CHANGELOG.md's section of that version.",
             f"version {version}", *names]
    lines += [f"removed {when} {name}" for name, when in sorted(removed.items())]
    SNAPSHOT.write_text("\n".join(lines) + "\n")
    return added, dropped


def changelog_section(version: str) -> str:
    """The text of CHANGELOG.md's `## <version>` section ('' if it has none)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    match = re.search(rf"^## {re.escape(version)}\b.*?(?=^## |\Z)", text, flags=re.M | re.S)
    return match.group(0) if match else ""


def test_the_snapshot_is_of_this_version():
    import zoo_core

    version = read_snapshot()[0]
    assert version == setup_version() == zoo_core.__version__, (
        f"snapshot {version}, setup.cfg {setup_version()}, zoo_core.__version__ {zoo_core.__version__}: "
        f"bump them together and regenerate the snapshot: {REGENERATE}")
    assert changelog_section(version), f"CHANGELOG.md has no '## {version}' section"


def test_the_public_names_are_the_snapshot():
    snapshot = read_snapshot()[1]
    names = current_names()
    gone = sorted(set(snapshot) - set(names))
    new = sorted(set(names) - set(snapshot))
    assert not gone and not new, (
        f"the public API changed: removed {gone}, added {new}. A removed or renamed name is deprecated first "
        f"(A public name, once released, is removed only after a deprecation) and named in CHANGELOG.md. If the "
        f"change is meant, regenerate the snapshot: {REGENERATE}")


def test_every_removed_name_is_in_its_changelog_section():
    for name, version in read_snapshot()[2].items():
        dotted = name.replace(":", ".")
        assert dotted in changelog_section(version), (
            f"{name} left the public API in {version}: CHANGELOG.md's '## {version}' section must name `{dotted}`")


def test_the_moved_module_paths_are_in_the_changelog():
    from zoo_core import moved

    section = changelog_section(setup_version())
    missing = [f"{old} -> {new}" for old, new in moved.MOVED.items() if old not in section or new not in section]
    assert not missing, f"CHANGELOG.md's {setup_version()} section does not name these moves: {missing}"


def test_docs_api_names_every_public_module_and_command():
    text = (ROOT / "docs" / "api.md").read_text()
    modules = set(PUBLIC_MODULES) | set(COMMANDS) | {n.split(":")[0] for n in current_names()
                                                     if not n.startswith("zoo_core.configs.")}
    missing = sorted(m for m in modules if not any(f"{start}{m}{end}" in text for start in ("`", "python -m ")
                                                   for end in "`. :"))
    assert not missing, f"docs/api.md does not name these public modules: {missing}"


def test_the_writer_keeps_a_removed_name_and_drops_a_restored_one(tmp_path, monkeypatch):
    """The snapshot's bookkeeping on a copy: a name that leaves is recorded as removed at this version, and
    a removed name that comes back is public again."""
    copy = tmp_path / "public_api.txt"
    version = setup_version()
    copy.write_text(f"version {version}\nzoo_core.attention:make\nzoo_core.attention:gone\n"
                    f"removed 0.0.1 zoo_core.attention:names\n")
    monkeypatch.setitem(globals(), "SNAPSHOT", copy)
    added, dropped = write_snapshot()
    _, names, removed = read_snapshot()
    assert dropped == ["zoo_core.attention:gone"] and "zoo_core.attention:make" not in added
    assert removed == {"zoo_core.attention:gone": version}
    assert "zoo_core.attention:names" in names and "zoo_core.attention:names" in added


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {REGENERATE}")
    added, dropped = write_snapshot()
    print(f"wrote {SNAPSHOT.relative_to(ROOT)} (version {setup_version()}): {len(added)} added, "
          f"{len(dropped)} removed")
    for name in dropped:
        print(f"removed: {name} (name `{name.replace(':', '.')}` in CHANGELOG.md's {setup_version()} section)")
