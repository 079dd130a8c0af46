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


def test_the_packed_and_long_sequences_snippet_runs(capsys):
    """On the suite's 2 host devices: the sequence split in two."""
    import jax

    (snippet,) = re.findall(r"```python\n(.*?)```", _section("Packed and long sequences"), flags=re.S)
    exec(compile(snippet, "README.md context-parallel snippet", "exec"), {"__name__": "__readme__"})
    t = 64 * jax.device_count()
    assert jax.device_count() == 2 and capsys.readouterr().out.strip() == f"(1, {t}, 4, 16) (1, {t}, 4)"


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
