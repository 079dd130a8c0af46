"""Malformed UEA `.ts` and forecasting CSV files end in a valid parse or the parsers' one-line ValueError.

A seeded generator mutates valid files (characters and lines deleted, duplicated, swapped or replaced by
separators, '?' or binary bytes; truncation; header lines changed or dropped; empty and header-only
files) and feeds each to the parser. Anything but a successful parse or a ValueError (the type every
data module raises and the CLI prints as one `error:` line) fails the test, naming the case.
"""
import random

import numpy as np
import pytest

from zoo_core.data import forecasting, uea

SEED = 20261201
TS_CASES = 700
CSV_CASES = 500

_TS_TEMPLATE = """# a toy UEA file
@problemName Toy
@timeStamps false
@missing true
@univariate false
@dimensions 2
@equalLength false
@seriesLength 5
@classLabel true a b
@data
1.0,2.0,3.0,4.0,5.0:0.5,0.4,?,0.2,0.1:a
2.0,1.0,0.0,1.0,2.0:1.5,1.4,1.3,1.2,1.1:b
0.1,0.2,0.3:0.3,0.2,0.1:a
"""

_CSV_TEMPLATE = "date,a,b,OT\n" + "".join(
    f"2020-01-01 {i:02d}:00,{np.sin(i):.3f},{i * 0.5:.2f},{np.cos(i):.3f}\n" for i in range(40))

_TOKENS = [":", ",", "?", "@", "#", "\n", " ", "nan", "inf", "-", "1e999", "@data", "@classLabel true",
           "@dimensions x", "@timeStamps true", '"', "date", "\x00", "\xff", "é", ";", "\t", "OT"]


def _mutate(text: str, rng: random.Random) -> bytes:
    kind = rng.randrange(10)
    lines = text.split("\n")
    if kind == 0:       # characters deleted
        chars = list(text)
        for _ in range(rng.randint(1, 8)):
            if chars:
                del chars[rng.randrange(len(chars))]
        text = "".join(chars)
    elif kind == 1:     # tokens inserted
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(_TOKENS) + text[i:]
    elif kind == 2:     # a line dropped, duplicated or swapped
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        op = rng.randrange(3)
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(j, lines[i])
        else:
            lines[i], lines[j] = lines[j], lines[i]
        text = "\n".join(lines)
    elif kind == 3:     # truncated
        text = text[:rng.randrange(len(text) + 1)]
    elif kind == 4:     # separators replaced
        a, b = rng.sample([":", ",", "?", " ", "\n", "."], 2)
        text = text.replace(a, b, rng.randint(1, 5))
    elif kind == 5:     # binary bytes
        raw = bytearray(text.encode())
        for _ in range(rng.randint(1, 20) if raw else 0):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    elif kind == 6:     # only the header (or nothing)
        cut = next((k for k, line in enumerate(lines) if line.startswith("@data") or line.startswith("date")), 0)
        text = "\n".join(lines[:cut + rng.randrange(2)])
    elif kind == 7:     # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    elif kind == 8:     # numbers replaced by words or huge values
        words = ["x", "1e400", "-", "", "nan", "True", "?", "0x1"]
        text = "".join(rng.choice(words) if c.isdigit() and rng.random() < 0.1 else c for c in text)
    else:               # several mutations
        out = text
        for _ in range(3):
            out = _mutate(out, rng).decode("utf-8", errors="replace")
        text = out
    return text.encode("utf-8", errors="replace")


def _write(path, content: bytes) -> str:
    with open(path, "wb") as f:
        f.write(content)
    return str(path)


def _accepts(fn, path, name):
    try:
        fn()
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001 - the point of the test
        with open(path, "rb") as f:
            content = f.read()
        pytest.fail(f"{name}: {type(e).__name__}: {e}\n--- file ---\n{content[:600]!r}")


def test_malformed_ts_files_parse_or_raise_value_error(tmp_path):
    rng = random.Random(SEED)
    assert uea.parse_ts(_write(tmp_path / "ok.ts", _TS_TEMPLATE.encode())).labels == ["a", "b", "a"]
    for case in range(TS_CASES):
        path = _write(tmp_path / f"c{case}.ts", _mutate(_TS_TEMPLATE, rng))
        _accepts(lambda: uea.parse_ts(path), path, f"ts case {case}")
    # The whole load (filling, normalisation, padding) on pairs of mutated files.
    for case in range(150):
        folder = tmp_path / f"set{case}" / "Toy"
        folder.mkdir(parents=True)
        for split in ("TRAIN", "TEST"):
            text = _TS_TEMPLATE if rng.random() < 0.3 else _mutate(_TS_TEMPLATE, rng)
            _write(folder / f"Toy_{split}.ts", text if isinstance(text, bytes) else text.encode())
        for normalization in ("standardization", "minmax"):
            _accepts(lambda: uea.load("Toy", str(folder.parent), None, normalization),
                     str(folder / "Toy_TRAIN.ts"), f"ts pair {case} ({normalization})")


def test_malformed_csv_files_parse_or_raise_value_error(tmp_path):
    rng = random.Random(SEED + 1)

    def prepare(path):
        config = forecasting.ForecastingConfig(name="fuzz", source=path, input_length=4, horizon=2)
        return forecasting.prepare_arrays(config)

    ok = prepare(_write(tmp_path / "ok.csv", _CSV_TEMPLATE.encode()))
    assert ok["columns"] == ["a", "b", "OT"]
    for case in range(CSV_CASES):
        path = _write(tmp_path / f"c{case}.csv", _mutate(_CSV_TEMPLATE, rng))
        _accepts(lambda: prepare(path), path, f"csv case {case}")


def test_the_fuzz_covers_at_least_a_thousand_files():
    assert TS_CASES + 2 * 150 + CSV_CASES >= 1000


@pytest.mark.parametrize("content,message", [
    (b"date,a,OT\n", "header but no data rows"),
    (b"", "empty"),
    (bytes(range(256)) * 4, "not UTF-8 text|cannot parse"),
])
def test_csv_messages_name_the_real_problem(tmp_path, content, message):
    path = _write(tmp_path / "x.csv", content)
    with pytest.raises(ValueError, match=message):
        forecasting.prepare_arrays(forecasting.ForecastingConfig(name="x", source=path, input_length=4, horizon=2))
