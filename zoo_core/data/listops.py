"""`lra_listops`: ListOps generated with the Long Range Arena algorithm (Tay et al., ICLR 2021).

Follows `lra_benchmarks/data/listops.py` (htgn.md §4.1): a random tree of operators MIN, MAX, MED
(floor of the median) and SM (sum mod 10) over digits 0-9. A node at depth < max_depth is a digit
with probability 1 - VALUE_P = 0.75, otherwise an operator with U{2..max_args} children; at max_depth
it is always a digit; the root is at depth 1. The length of a tree is its token count (operator,
digits and closing brackets; LRA's "( )" pair parentheses are not tokens) and roots are rejection
sampled with min_length < length < max_length (strict, as LRA). Examples are deduplicated over all
three splits and split in generation order (LRA: set iteration order, equally arbitrary).

Tokenisation as `lra_benchmarks/listops/input_pipeline.py` after the bracket fix (issues #6, #14):
parentheses stripped, the closing bracket kept as a token. Fixed ids (LRA's are in set order):

  0 = padding, 1..10 = digits 0..9, 11 = [MIN, 12 = [MAX, 13 = [MED, 14 = [SM, 15 = ]

so VOCAB_SIZE = 16 (LRA's encoder also reserves an OOV id, which generated data never uses).

Features: 'inputs' int32 [max_length] (0 = padding, so the mask is inputs != 0), 'label' int64 in
[0, 10). Splits 'train', 'validation', 'test'.

Settings: the defaults are the standard LRA 2K task (96k/2k/2k, lengths in (500, 2000), depth 10,
10 arguments). CPU_SMALL_OPTIONS is a small setting (2k/256/256, lengths in (20, 200)) that builds
in about a second.

LRA's released files instead of a fresh draw: the option `source_dir` names a directory with
`basic_train.tsv`, `basic_val.tsv` and `basic_test.tsv` (lra_release/listops-1000, the draw behind LRA's
published ListOps numbers). Lines are `Source<TAB>Target` under a header, Source in
LRA's serialisation ("( ( ( [MAX 2 ) 9 ) ] )", see `lra_source`), tokenised as above and truncated
to max_length as LRA's pipeline does. The generation options (min_length, max_depth, max_args,
num_*, seed) describe a draw, so with source_dir they must stay at their defaults.

Generation differs from LRA's loop only in speed: a tree is abandoned as soon as it reaches
max_length tokens. That changes which random numbers the rejected trees consume, but not the
distribution of accepted trees (the stopping rule only looks at the part already drawn).
"""
from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base

PAD_ID = 0
DIGIT_IDS = tuple(range(1, 11))  # digit d -> d + 1
MIN_ID, MAX_ID, MED_ID, SM_ID, END_ID = 11, 12, 13, 14, 15
OPERATOR_IDS = (MIN_ID, MAX_ID, MED_ID, SM_ID)  # LRA's OPERATORS order; FIRST/LAST are disabled there
VOCAB_SIZE = 16
NUM_CLASSES = 10
TOKENS = {PAD_ID: "<pad>", **{d + 1: str(d) for d in range(10)},
          MIN_ID: "[MIN", MAX_ID: "[MAX", MED_ID: "[MED", SM_ID: "[SM", END_ID: "]"}

VALUE_P = 0.25  # LRA: a node below max_depth is an operator with probability VALUE_P

# LRA's released file of each split (lra_release/listops-1000, task name 'basic').
RELEASED_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}
GENERATION_OPTIONS = ("min_length", "max_depth", "max_args", "num_train", "num_validation",
                      "num_test", "seed")
_TOKEN_IDS = {name: i for i, name in TOKENS.items() if i != PAD_ID}

CPU_SMALL_OPTIONS = dict(max_length=200, min_length=20, num_train=2000, num_validation=256,
                         num_test=256)


@dataclasses.dataclass
class ListOpsConfig(tfds.core.BuilderConfig):
    max_length: int = 2000
    min_length: int = 500
    max_depth: int = 10
    max_args: int = 10
    num_train: int = 96_000
    num_validation: int = 2_000
    num_test: int = 2_000
    seed: int = 0
    source_dir: str = ""


def apply_operator(op: int, args: list[int]) -> int:
    """The value of operator token `op` on digit values `args` (LRA's `to_value`)."""
    if op == MIN_ID:
        return min(args)
    if op == MAX_ID:
        return max(args)
    if op == MED_ID:
        # int(np.median(args)): the mean of the two middle values for an even count, truncated.
        s = sorted(args)
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == SM_ID:
        return sum(args) % 10
    raise ValueError(f"token id {op} is not an operator")


class _TooLong(Exception):
    pass


_MAX_STALL = 200_000


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, limit: int,
          out: list[int]) -> int:
    """Appends one random subtree's token ids to `out` and returns its value.

    Raises _TooLong as soon as len(out) reaches `limit` (the tree would be rejected anyway).
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        value = rng.randrange(10)
        out.append(value + 1)
        if len(out) >= limit:
            raise _TooLong
        return value
    # Same draw order as LRA: argument count, then the children, then the operator.
    num_args = rng.randint(2, max_args)
    slot = len(out)
    out.append(PAD_ID)  # the operator token; written once it is drawn
    args = [_tree(rng, depth + 1, max_depth, max_args, limit, out) for _ in range(num_args)]
    op = OPERATOR_IDS[rng.randrange(len(OPERATOR_IDS))]
    out[slot] = op
    out.append(END_ID)
    if len(out) >= limit:
        raise _TooLong
    return apply_operator(op, args)


def generate(num_examples: int, *, max_length: int, min_length: int, max_depth: int, max_args: int,
             seed: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """Distinct random ListOps expressions with min_length < len < max_length tokens.

    Returns:
      (token id tuples in generation order, their labels in [0, 10)).
    """
    rng = random.Random(seed)
    examples: dict[tuple[int, ...], int] = {}
    stalled = 0  # draws since the last new expression: guards settings with too few distinct ones
    while len(examples) < num_examples:
        stalled += 1
        if stalled > _MAX_STALL:
            raise ValueError(f"only {len(examples)} distinct ListOps expressions found after {_MAX_STALL} "
                             f"draws in a row without a new one; {num_examples} requested: widen "
                             f"min_length={min_length}..max_length={max_length} or ask for fewer examples")
        out: list[int] = []
        try:
            value = _tree(rng, 1, max_depth, max_args, max_length, out)
        except _TooLong:
            continue
        if len(out) > min_length:
            key = tuple(out)
            if key not in examples:
                examples[key] = value
                stalled = 0
    return list(examples), list(examples.values())


def decode(ids) -> str:
    """Token ids -> the expression as text, padding dropped (e.g. '[MAX 2 9 [MIN 4 7 ] 0 ]')."""
    return " ".join(TOKENS[int(i)] for i in ids if int(i) != PAD_ID)


def _pad(ids, max_length: int) -> np.ndarray:
    """Token ids (at most max_length) -> int32 [max_length], zero padding after them."""
    out = np.zeros((max_length,), np.int32)
    out[:len(ids)] = ids
    return out


def lra_source(ids) -> str:
    """Token ids -> LRA's serialised Source string, the inverse of `parse_lra_source`.

    LRA stores an operator node as the left-nested pairs ((((op, a1), a2), ...), ']') and writes
    every pair as '( left right )', so '[MAX 2 9 ]' is '( ( ( [MAX 2 ) 9 ) ] )'.
    """
    ids = [int(i) for i in ids if int(i) != PAD_ID]
    pos = 0

    def node() -> str:
        nonlocal pos
        tok = ids[pos]
        pos += 1
        if tok not in OPERATOR_IDS:
            return TOKENS[tok]
        args = []
        while ids[pos] != END_ID:
            args.append(node())
        pos += 1
        return "( " * (len(args) + 1) + TOKENS[tok] + " " + " ) ".join(args) + " ) ] )"

    try:
        text = node()
    except IndexError:
        raise ValueError(f"unterminated expression: {decode(ids)!r}") from None
    if pos != len(ids):
        raise ValueError(f"ids hold more than one expression: {decode(ids)!r}")
    return text


def parse_lra_source(source: str, max_length: int) -> np.ndarray:
    """LRA's Source string -> int32 [max_length] ids: '(' and ')' dropped, truncated, zero-padded.

    Raises:
      KeyError: a token that is not a digit, an operator or ']' (the caller names file and line).
    """
    return _pad([_TOKEN_IDS[tok] for tok in source.split() if tok not in ("(", ")")][:max_length],
                max_length)


def read_released(path: str, max_length: int):
    """Yields (ids int32 [max_length], label) from one of LRA's released ListOps TSV files."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if line_no == 1 and line.split("\t") == ["Source", "Target"]:
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(f"{path}, line {line_no}: expected 'Source<TAB>Target', got "
                                 f"{len(fields)} field(s)")
            source, target = fields
            try:
                ids = parse_lra_source(source, max_length)
            except KeyError as e:
                raise ValueError(f"{path}, line {line_no}: unknown ListOps token {e.args[0]!r}") from None
            if target.strip() not in [str(d) for d in range(NUM_CLASSES)]:
                raise ValueError(f"{path}, line {line_no}: target {target[:20]!r} is not a digit 0-9")
            yield ids, int(target)


def _released_candidates(source_dir: str) -> list[str]:
    return [os.path.join(source_dir, name) for _, name in sorted(RELEASED_FILES.items())]


def released_paths(source_dir: str) -> dict[str, str]:
    """{split: path} of LRA's released files in `source_dir`; a one-line error names missing ones."""
    paths = {split: os.path.join(source_dir, name) for split, name in RELEASED_FILES.items()}
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"lra_listops: missing {', '.join(missing)}; source_dir={source_dir!r} must hold "
                         f"LRA's released {', '.join(RELEASED_FILES.values())} "
                         f"(lra_release/listops-1000)")
    return paths


class LraListops(base.GeneratorBuilder):
    """LRA ListOps: 'inputs' int32 [max_length] (0 = pad), 'label' int64 in [0, 10)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [ListOpsConfig(name="default")]

    def _info(self):
        c = self.builder_config
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "inputs": tfds.features.Tensor(shape=(c.max_length,), dtype=np.int32),
                "label": tfds.features.Scalar(dtype=np.int64),
            }),
            supervised_keys=("inputs", "label"),
            metadata=tfds.core.MetadataDict(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES,
                                            tokens={str(k): v for k, v in TOKENS.items()}),
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        if c.source_dir:
            return {split: self._read(path, c.max_length)
                    for split, path in released_paths(c.source_dir).items()}
        sizes = {"train": c.num_train, "validation": c.num_validation, "test": c.num_test}
        seqs, labels = generate(sum(sizes.values()), max_length=c.max_length, min_length=c.min_length,
                                max_depth=c.max_depth, max_args=c.max_args, seed=c.seed)
        splits, start = {}, 0
        for name, n in sizes.items():
            splits[name] = self._generate_examples(seqs[start:start + n], labels[start:start + n],
                                                   c.max_length)
            start += n
        return splits

    def _generate_examples(self, seqs, labels, max_length):
        for i, (seq, label) in enumerate(zip(seqs, labels)):
            yield i, {"inputs": _pad(seq, max_length), "label": label}

    def _read(self, path, max_length):
        for i, (inputs, label) in enumerate(read_released(path, max_length)):
            yield i, {"inputs": inputs, "label": label}


def _check(c: ListOpsConfig) -> None:
    if not isinstance(c.source_dir, str):
        raise ValueError(f"source_dir must be a directory path, got {c.source_dir!r}")
    if c.source_dir:
        changed = [f"{name}={getattr(c, name)!r}" for name in GENERATION_OPTIONS
                   if getattr(c, name) != getattr(ListOpsConfig, name)]
        if changed:
            raise ValueError(f"lra_listops: {', '.join(changed)} describe a generated draw and do not apply "
                             f"to the released files in source_dir={c.source_dir!r}; leave them at their defaults")
        if c.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {c.max_length}")
        return
    if c.max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {c.max_depth}")
    if c.max_args < 2:
        raise ValueError(f"max_args must be >= 2, got {c.max_args}")
    if not 0 <= c.min_length < c.max_length - 1:
        raise ValueError(f"need 0 <= min_length < max_length - 1 (lengths are strictly between them), "
                         f"got min_length={c.min_length}, max_length={c.max_length}")
    if c.max_depth == 1 and c.min_length >= 1:
        raise ValueError(f"max_depth=1 only yields single digits (length 1); min_length={c.min_length} "
                         f"rejects them all")
    for name in ("num_train", "num_validation", "num_test"):
        if getattr(c, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(c, name)}")


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Returns the (unprepared) ListOps builder.

    Options: max_length (2000), min_length (500), max_depth (10), max_args (10), num_train (96000),
    num_validation (2000), num_test (2000), seed (0); or source_dir with LRA's released files (then
    only max_length applies). See CPU_SMALL_OPTIONS for a small setting.
    """
    config = base.config_from_options(ListOpsConfig, options, dataset="lra_listops")
    _check(config)
    if config.source_dir and all(os.path.isfile(p) for p in _released_candidates(config.source_dir)):
        # Keyed by the released files' contents too: replaced files are prepared again.
        config = base.config_from_options(ListOpsConfig, options, dataset="lra_listops",
                                          sources=_released_candidates(config.source_dir))
    elif config.source_dir:
        config = base.find_prepared(data_dir, LraListops.name, config) or config
    return LraListops(data_dir=data_dir, config=config, file_format="array_record")
