"""The README's Python snippets run exactly as printed."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


SNIPPETS = re.findall(r"```python\n(.*?)```", _section("Use in your own model"), flags=re.S)


def test_the_section_has_its_snippets():
    assert len(SNIPPETS) == 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index, capsys):
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()


def test_the_block_takes_every_self_attention_name(capsys):
    """The README says the Block takes any of `attention.names('self')`: run it with each."""
    from zoo_core import attention

    block_snippet = SNIPPETS[0]
    assert 'mechanism: str = "agf"' in block_snippet
    for name in attention.names("self"):
        exec(compile(block_snippet.replace('mechanism: str = "agf"', f'mechanism: str = "{name}"'),
                     f"README.md Block with {name}", "exec"), {"__name__": "__readme__"})
        assert "(2, 16, 64)" in capsys.readouterr().out, name


CONTEXT_PARALLEL = re.findall(r"```python\n(.*?)```", _section("Packed and long sequences"), flags=re.S)


def test_the_context_parallel_recipe_equals_one_device_for_every_name(capsys):
    """On the suite's 2 host devices, `jax.make_mesh`'s default (Explicit) axes, `init` and `apply` jitted under
    `jax.set_mesh`: the recipe with each name of `names('context_parallel')`, causal and not where it has both,
    gives the parameters' one-device layer's numbers, sharded along T."""
    import jax
    import numpy as np

    from zoo_core import attention
    from zoo_core.testing import F32_SIMPLE, assert_trees_close

    recipe = CONTEXT_PARALLEL[0]
    assert len(CONTEXT_PARALLEL) == 2 and '"agf"' in recipe and "causal=True" in recipe and jax.device_count() == 2
    for name in attention.names("context_parallel"):
        caps = attention.capabilities(name)
        for causal in [c for c, has in ((True, caps["causal"]), (False, caps["self"])) if has]:
            scope = {"__name__": "__readme__"}
            exec(compile(recipe.replace('"agf"', f'"{name}"').replace("causal=True", f"causal={causal}"),
                         f"README.md context-parallel recipe with {name}", "exec"), scope)
            assert capsys.readouterr().out.strip() == "(2, 128, 32) P(None, 'sequence', None)", name
            one_device = attention.make(name, num_heads=4, qkv_features=32, causal=causal)
            expected = jax.jit(one_device.apply)(scope["params"], np.asarray(scope["x"]))
            assert_trees_close(scope["y"], expected, **F32_SIMPLE)


def test_the_prefill_then_decode_snippet_runs(capsys):
    exec(compile(CONTEXT_PARALLEL[1], "README.md prefill snippet", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip() == "(2, 128, 32) (2, 1, 32) 144"


def test_the_registry_table_says_what_each_mechanism_can_do():
    """Every row of the README's registry table against `attention.capabilities`: self, causal, decode,
    cross, packed ('self' where the cross-attention takes no kv_segment_ids) and CP."""
    from zoo_core import attention

    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \|((?: [^|]+ \|){6})", _section("Use in your own model"), flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(attention.names())
    for name, cells in rows:
        caps = attention.capabilities(name)
        packed = "-"
        if caps["segment_ids"]:
            packed = "self" if caps["cross"] and not caps["kv_segment_ids"] else "yes"
        expected = ["yes" if caps[k] else "-" for k in ("self", "causal", "decode", "cross")]
        expected += [packed, "yes" if caps["context_parallel"] else "-"]
        assert [c.strip() for c in cells.strip(" |").split("|")] == expected, name
