"""`number_words`: number-words translation English -> German, generated offline (htgn.md §6).

The HTGN spec's small CPU seq2seq task. A number n in [0, max_number] (at most 999,999) is written out by
`num2words` (pure Python, rule-based): source = `num2words(n, lang='en')` with '-' and ',' split off as
tokens, target = `num2words(n, lang='de')` (one compound word) segmented into morphemes by greedy
longest match over a fixed list. Example, 777777:

    seven hundred and seventy - seven thousand , seven hundred and seventy - seven
    -> sieben hundert sieben und siebzig tausend sieben hundert sieben und siebzig

so the model must reorder locally ("seventy-seven" -> "sieben und siebzig"), delete ("and", ",") and
insert ("und"). With `max_numbers_per_example` = k > 1, an example is 1..k numbers joined by ';'
(longer sequences, multi-word BLEU). `direction='de_en'` swaps source and target.

Splits 'train', 'validation', 'test' use disjoint sets of numbers: one seeded draw without replacement
is cut into the three splits' first numbers; the further numbers of a multi-number example are drawn
from its own split's set.

Vocabularies (fixed, deterministic; independent of the options so model sizes are constants):
  ids 0..3 = PAD, BOS, EOS, UNK, then the words of `EN_WORDS` (34 with ';', so |EN_VOCAB| = 38) or the
  morphemes of `DE_MORPHEMES` (33 with ';', |DE_VOCAB| = 37).

Sequence convention (what the decoder uses):
  * 'inputs'  int32 [S_max] = source ids + [EOS], then 0 (PAD);
  * 'targets' int32 [T_max] = target ids + [EOS], then 0 (PAD); no BOS is stored. The decoder is fed
    `decoder_inputs(targets)` = [BOS] + targets[:-1] (teacher forcing) and starts generation from BOS;
    decoding stops at the first EOS (`decode`).
  S_max / T_max are the exact worst cases: 14 English tokens and 11 German morphemes per number, plus
  one ';' between numbers, plus EOS (15 / 12 for one number, en_de).

Text features for BLEU: 'source_text' (the raw num2words source, numbers joined by '; ') and
'target_text' (the target tokens joined by single spaces, e.g. the German morphemes). Score
`ids_to_text(predicted_ids)` against 'target_text' with `zoo_core.tasks.textmetrics.translation_metrics`
(sacrebleu BLEU with tokenize='none', chrF, exact match): word BLEU on unsegmented compounds would be
degenerate (htgn.md §6). 'numbers' int64 [k] holds the example's numbers (-1 padded).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base

# The extra and the packages of it that building this dataset imports (zoo_core.extras).
EXTRA = ("text", ("num2words",))

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SEPARATOR = ";"

_UNITS_EN = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS_EN = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
             "eighteen", "nineteen")
_TENS_EN = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
EN_WORDS = ("zero",) + _UNITS_EN + _TEENS_EN + _TENS_EN + ("hundred", "thousand", "and", ",", "-", SEPARATOR)

DE_MORPHEMES = (
    "null", "eins", "ein", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun",
    "zehn", "elf", "zwölf",
    "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn",
    "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig",
    "hundert", "tausend", "und", SEPARATOR)

EN_VOCAB = SPECIALS + EN_WORDS
DE_VOCAB = SPECIALS + DE_MORPHEMES
VOCABS = {"en": EN_VOCAB, "de": DE_VOCAB}
DIRECTIONS = {"en_de": ("en", "de"), "de_en": ("de", "en")}
# Worst-case tokens for one number in [0, 999999] (e.g. 777777), used for the fixed shapes.
MAX_TOKENS_PER_NUMBER = {"en": 14, "de": 11}
MAX_NUMBER = 999_999

# Greedy longest match tries longer morphemes first.
_MORPHEMES_BY_LENGTH = sorted((m for m in DE_MORPHEMES if m != SEPARATOR), key=len, reverse=True)


# ----------------------------------------------------------------------------------------------------
# Tokenisation, vocabularies.

def build_vocab(lang: str) -> dict[str, int]:
    """token -> id for 'en' or 'de' (ids 0..3 are PAD, BOS, EOS, UNK)."""
    if lang not in VOCABS:
        raise ValueError(f"number_words: lang must be one of {sorted(VOCABS)}, got {lang!r}")
    return {token: i for i, token in enumerate(VOCABS[lang])}


def vocab_sizes(direction: str = "en_de") -> tuple[int, int]:
    """(source vocabulary size, target vocabulary size) for a direction, specials included."""
    src, tgt = DIRECTIONS[direction]
    return len(VOCABS[src]), len(VOCABS[tgt])


def segment_german(word: str) -> list[str]:
    """Splits a num2words German compound into morphemes by greedy longest match.

    Raises:
      ValueError: a part of `word` matches no morpheme.
    """
    out, i = [], 0
    while i < len(word):
        for morpheme in _MORPHEMES_BY_LENGTH:
            if word.startswith(morpheme, i):
                out.append(morpheme)
                i += len(morpheme)
                break
        else:
            raise ValueError(f"number_words: cannot segment {word!r} at {word[i:]!r}")
    return out


def tokenize(text: str, lang: str) -> list[str]:
    """num2words text (numbers optionally joined by ';') -> tokens.

    English: whitespace split with '-' and ',' as their own tokens. German: each compound segmented into
    morphemes. ';' separates numbers in both.
    """
    text = text.replace(SEPARATOR, f" {SEPARATOR} ")
    if lang == "en":
        return text.replace("-", " - ").replace(",", " , ").split()
    if lang == "de":
        tokens = []
        for word in text.split():
            tokens.extend([word] if word == SEPARATOR else segment_german(word))
        return tokens
    raise ValueError(f"number_words: lang must be 'en' or 'de', got {lang!r}")


def detokenize(tokens: Sequence[str], lang: str) -> str:
    """Inverse of `tokenize`: tokens -> the num2words spelling ('; ' between numbers)."""
    numbers, current = [], []
    for token in list(tokens) + [SEPARATOR]:
        if token != SEPARATOR:
            current.append(token)
            continue
        if lang == "de":
            numbers.append("".join(current))
        else:
            numbers.append(" ".join(current).replace(" - ", "-").replace(" ,", ","))
        current = []
    return "; ".join(numbers)


def encode(tokens: Sequence[str], lang: str, *, length: int | None = None, add_eos: bool = True) -> np.ndarray:
    """Tokens -> int32 ids (unknown tokens -> UNK), + EOS, zero-padded to `length` if given.

    Raises:
      ValueError: the sequence does not fit in `length`.
    """
    vocab = build_vocab(lang)
    ids = [vocab.get(t, UNK_ID) for t in tokens] + ([EOS_ID] if add_eos else [])
    if length is not None:
        if len(ids) > length:
            raise ValueError(f"number_words: {len(ids)} ids do not fit in length {length}: {' '.join(tokens)!r}")
        ids = ids + [PAD_ID] * (length - len(ids))
    return np.asarray(ids, np.int32)


def decode(ids: Iterable[int], lang: str) -> list[str]:
    """Ids -> tokens, stopping at the first EOS and skipping PAD and BOS."""
    vocab = VOCABS[lang]
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i in (PAD_ID, BOS_ID):
            continue
        out.append(vocab[i] if 0 <= i < len(vocab) else UNK)
    return out


def ids_to_text(ids: Iterable[int], lang: str) -> str:
    """Ids -> tokens joined by single spaces: the form of 'target_text' that BLEU compares."""
    return " ".join(decode(ids, lang))


def decoder_inputs(targets: np.ndarray) -> np.ndarray:
    """Teacher-forcing decoder inputs: [BOS] + targets[..., :-1], for 'targets' [..., T]."""
    targets = np.asarray(targets)
    bos = np.full(targets.shape[:-1] + (1,), BOS_ID, targets.dtype)
    return np.concatenate([bos, targets[..., :-1]], axis=-1)


@functools.lru_cache(maxsize=None)
def _below_thousand(n: int, lang: str) -> str:
    from num2words import num2words  # pylint: disable=import-outside-toplevel

    return num2words(n, lang=lang)


def number_text(n: int, lang: str) -> str:
    """num2words spelling of n in [0, 999999] ('en' or 'de').

    Numbers >= 1000 are assembled from num2words's spellings of their thousands and units, following
    num2words's own joining rules (so the data builds ~3x faster); this equals `num2words(n, lang)` for
    every n in [0, 999999] with num2words 0.5.14, checked exhaustively, and on a sample in the tests:
      en: "<a> thousand" + ("" | " and <b>" if b < 100 | ", <b>"),
      de: ("ein" if a == 1 else "<a>") + "tausend" + ("" | "<b>"), e.g. 101000 -> einhunderteinstausend.
    """
    n = int(n)
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"number_words: {n} is outside [0, {MAX_NUMBER}]")
    if n < 1000:
        return _below_thousand(n, lang)
    a, b = divmod(n, 1000)
    if lang == "en":
        units = _below_thousand(b, lang)
        rest = "" if b == 0 else (f" and {units}" if b < 100 else f", {units}")
        return f"{_below_thousand(a, lang)} thousand{rest}"
    if lang == "de":
        head = "ein" if a == 1 else _below_thousand(a, lang)
        return f"{head}tausend{_below_thousand(b, lang) if b else ''}"
    raise ValueError(f"number_words: lang must be 'en' or 'de', got {lang!r}")


def max_lengths(direction: str, max_numbers_per_example: int) -> tuple[int, int]:
    """(S_max, T_max): worst-case token counts of k numbers, k - 1 separators and EOS."""
    k = max_numbers_per_example
    src, tgt = DIRECTIONS[direction]
    return (k * MAX_TOKENS_PER_NUMBER[src] + k, k * MAX_TOKENS_PER_NUMBER[tgt] + k)


# ----------------------------------------------------------------------------------------------------
# Split generation.

@dataclasses.dataclass
class NumberWordsConfig(tfds.core.BuilderConfig):
    direction: str = "en_de"
    num_train: int = 50000
    num_validation: int = 2000
    num_test: int = 2000
    max_number: int = MAX_NUMBER
    max_numbers_per_example: int = 1
    seed: int = 0


def split_numbers(config: NumberWordsConfig) -> dict[str, list[list[int]]]:
    """Numbers of every example per split; first numbers are distinct, split sets disjoint.

    Returns:
      {'train': [[n, ...], ...], 'validation': ..., 'test': ...}; an example has 1..k numbers.
    """
    c = config
    rng = np.random.default_rng(c.seed)
    sizes = {"train": c.num_train, "validation": c.num_validation, "test": c.num_test}
    pool = rng.choice(c.max_number + 1, size=sum(sizes.values()), replace=False)
    out, start = {}, 0
    for split, size in sizes.items():
        own = pool[start:start + size]
        start += size
        counts = rng.integers(1, c.max_numbers_per_example + 1, size=size)
        extra = rng.choice(own, size=(size, c.max_numbers_per_example - 1))
        out[split] = [[int(first)] + [int(x) for x in extra[i, :k - 1]]
                      for i, (first, k) in enumerate(zip(own, counts))]
    return out


class NumberWords(base.GeneratorBuilder):
    """num2words translation: 'inputs' int32 [S_max] -> 'targets' int32 [T_max], with the texts."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [NumberWordsConfig(name="default")]

    def _info(self):
        c = self.builder_config
        s_max, t_max = max_lengths(c.direction, c.max_numbers_per_example)
        src, tgt = vocab_sizes(c.direction)
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "inputs": tfds.features.Tensor(shape=(s_max,), dtype=np.int32),
                "targets": tfds.features.Tensor(shape=(t_max,), dtype=np.int32),
                "source_text": tfds.features.Text(),
                "target_text": tfds.features.Text(),
                "numbers": tfds.features.Tensor(shape=(c.max_numbers_per_example,), dtype=np.int64),
            }),
            metadata=tfds.core.MetadataDict(
                source_vocab_size=src, target_vocab_size=tgt, max_source_length=s_max,
                max_target_length=t_max, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID),
        )

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(examples)
                for split, examples in split_numbers(self.builder_config).items()}

    def _generate_examples(self, examples):
        c = self.builder_config
        src, tgt = DIRECTIONS[c.direction]
        s_max, t_max = max_lengths(c.direction, c.max_numbers_per_example)
        for i, numbers in enumerate(examples):
            yield i, make_example(numbers, src, tgt, s_max, t_max, c.max_numbers_per_example)


def make_example(numbers: Sequence[int], src: str, tgt: str, s_max: int, t_max: int, k_max: int) -> dict:
    """One record for `numbers` (see the module docstring for the features)."""
    texts = {lang: "; ".join(number_text(n, lang) for n in numbers) for lang in (src, tgt)}
    target_tokens = tokenize(texts[tgt], tgt)
    return {
        "inputs": encode(tokenize(texts[src], src), src, length=s_max),
        "targets": encode(target_tokens, tgt, length=t_max),
        "source_text": texts[src],
        "target_text": " ".join(target_tokens),
        "numbers": np.asarray(list(numbers) + [-1] * (k_max - len(numbers)), np.int64),
    }


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Builder of `number_words`.

    Options: direction ('en_de' | 'de_en'), num_train (50000), num_validation (2000), num_test (2000),
    max_number (999999, the largest the vocabularies cover), max_numbers_per_example (k = 1; examples
    then hold 1..k numbers joined by ';'), seed (0).

    Raises:
      ValueError: an unknown option or invalid value (named).
    """
    config = base.config_from_options(NumberWordsConfig, options, dataset="number_words")
    if config.direction not in DIRECTIONS:
        raise ValueError(f"number_words: direction must be one of {sorted(DIRECTIONS)}, got {config.direction!r}")
    if not 0 < config.max_number <= MAX_NUMBER:
        raise ValueError(f"number_words: max_number must be in [1, {MAX_NUMBER}], got {config.max_number}")
    if config.max_numbers_per_example < 1:
        raise ValueError(f"number_words: max_numbers_per_example must be >= 1, got "
                         f"{config.max_numbers_per_example}")
    sizes = (config.num_train, config.num_validation, config.num_test)
    if min(sizes) < 1 or sum(sizes) > config.max_number + 1:
        raise ValueError(f"number_words: split sizes {sizes} must be >= 1 and sum to at most max_number + 1 = "
                         f"{config.max_number + 1} distinct numbers")
    return NumberWords(data_dir=data_dir, config=config, file_format="array_record")
