"""`wmt14_en_de`: WMT'14 English -> German from user-provided parallel text, with a SentencePiece vocabulary.

WMT14 cannot be downloaded offline (htgn.md §6), so this dataset reads files the user prepared. Layout of
`source_dir` (UTF-8, one sentence per line, line i of the .en file aligned with line i of the .de file):

    train.en  train.de     e.g. the WMT14 training corpora concatenated (about 4.5M pairs)
    dev.en    dev.de       e.g. newstest2013
    test.en   test.de      e.g. newstest2014

A joint SentencePiece model (the subword vocabulary of the Flax WMT example / T5: one model for both
languages, trained on the training text of both sides) is trained while the dataset is prepared and saved
next to the data as `spm.model`; `load_tokenizer(builder)` returns it. The `sentencepiece` package is
imported only when this dataset is used.

Ids: PAD = 0, BOS = 1, EOS = 2, UNK = 3 (the number_words convention): 'inputs' / 'targets' int32
[max_length] = pieces + [EOS], zero-padded; the decoder gets [BOS] + targets[:-1]. Training pairs whose
source or target (with EOS) exceeds max_length are dropped; validation/test pairs are truncated (keeping
EOS last) so every reference is scored. 'source_text' / 'target_text' hold the raw lines for BLEU
(sacrebleu, default '13a' tokenisation, on `decode`d hypotheses). Counts of dropped / truncated pairs are
in `builder.info.metadata`.
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import os
from typing import Iterable

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base

# The extra and the packages of it that building this dataset imports (zoo_core.extras).
EXTRA = ("text", ("sentencepiece",))

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# split name -> file stem in source_dir.
FILE_STEMS = {"train": "train", "validation": "dev", "test": "test"}
MODEL_FILE = "spm.model"
MODEL_TYPES = ("unigram", "bpe")
_ENCODE_BATCH = 10_000


@dataclasses.dataclass
class WmtConfig(tfds.core.BuilderConfig):
    source_dir: str = ""
    source_lang: str = "en"
    target_lang: str = "de"
    vocab_size: int = 32000
    model_type: str = "unigram"
    max_length: int = 256
    max_vocab_sentences: int = 1_000_000
    max_train_examples: int = 0
    seed: int = 0


def expected_files(config: WmtConfig) -> list[str]:
    """Paths of the six text files `source_dir` must hold."""
    root = os.path.expanduser(config.source_dir)
    return [os.path.join(root, f"{stem}.{lang}") for stem in FILE_STEMS.values()
            for lang in (config.source_lang, config.target_lang)]


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f]


def _read_pairs(config: WmtConfig, split: str) -> tuple[list[str], list[str]]:
    root = os.path.expanduser(config.source_dir)
    stem = FILE_STEMS[split]
    src_path = os.path.join(root, f"{stem}.{config.source_lang}")
    tgt_path = os.path.join(root, f"{stem}.{config.target_lang}")
    src, tgt = _read_lines(src_path), _read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(f"wmt14_en_de: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}")
    if split == "train" and config.max_train_examples:
        src, tgt = src[:config.max_train_examples], tgt[:config.max_train_examples]
    return src, tgt


def train_sentencepiece(sentences: Iterable[str], config: WmtConfig) -> bytes:
    """Trains the joint SentencePiece model on `sentences`; returns the serialized model.

    Ids 0..3 are PAD, BOS, EOS, UNK. `hard_vocab_limit=False` lets tiny corpora end with fewer pieces
    than vocab_size instead of failing.
    """
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    writer = io.BytesIO()
    # Sentence sampling (input_sentence_size) draws from sentencepiece's global generator.
    spm.set_random_generator_seed(config.seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=writer, vocab_size=config.vocab_size,
        model_type=config.model_type, character_coverage=1.0, pad_id=PAD_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, unk_id=UNK_ID, input_sentence_size=config.max_vocab_sentences,
        shuffle_input_sentence=True, hard_vocab_limit=False, num_threads=2,
        minloglevel=2)
    return writer.getvalue()


def load_tokenizer(builder: tfds.core.DatasetBuilder):
    """The `sentencepiece.SentencePieceProcessor` saved with a prepared builder."""
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    path = os.path.join(os.fspath(builder.data_dir), MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"wmt14_en_de: no {MODEL_FILE} in {builder.data_dir}; call download_and_prepare() first")
    return spm.SentencePieceProcessor(model_file=path)


def decode(tokenizer, ids) -> str:
    """Ids -> detokenised text, stopping at the first EOS and skipping PAD/BOS."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in (PAD_ID, BOS_ID):
            out.append(i)
    return tokenizer.decode(out)


def _fit(ids: list[int], max_length: int) -> tuple[np.ndarray, bool]:
    """ids + EOS, truncated (EOS kept last) and zero-padded to max_length; and whether it was cut."""
    cut = len(ids) + 1 > max_length
    ids = ids[:max_length - 1] + [EOS_ID]
    return np.asarray(ids + [PAD_ID] * (max_length - len(ids)), np.int32), cut


class Wmt14EnDe(base.GeneratorBuilder):
    """Parallel text with joint SentencePiece ids: 'inputs', 'targets' int32 [max_length], raw texts."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [WmtConfig(name="default")]

    def _info(self):
        c = self.builder_config
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "inputs": tfds.features.Tensor(shape=(c.max_length,), dtype=np.int32),
                "targets": tfds.features.Tensor(shape=(c.max_length,), dtype=np.int32),
                "source_text": tfds.features.Text(),
                "target_text": tfds.features.Text(),
            }),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        import sentencepiece as spm  # pylint: disable=import-outside-toplevel

        c = self.builder_config
        missing = [p for p in expected_files(c) if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"wmt14_en_de: missing {', '.join(missing)} (source_dir must hold "
                             f"{{train,dev,test}}.{{{c.source_lang},{c.target_lang}}})")
        pairs = {split: _read_pairs(c, split) for split in FILE_STEMS}
        model = train_sentencepiece(itertools.chain(pairs["train"][0], pairs["train"][1]), c)
        # self.data_dir is the temporary directory tfds renames on success, so the model lands next
        # to the data (or nowhere, if preparation fails).
        with open(os.path.join(os.fspath(self.data_dir), MODEL_FILE), "wb") as f:
            f.write(model)
        tokenizer = spm.SentencePieceProcessor(model_proto=model)
        self.info.metadata.update({"vocab_size": int(tokenizer.get_piece_size()), "pad_id": PAD_ID,
                                   "bos_id": BOS_ID, "eos_id": EOS_ID, "unk_id": UNK_ID})
        return {split: self._generate_examples(tokenizer, split, *pairs[split]) for split in FILE_STEMS}

    def _generate_examples(self, tokenizer, split, src, tgt):
        max_length = self.builder_config.max_length
        # Dropped (train) or truncated (validation/test) pairs; metadata is written after generation.
        key = f"{split}_{'dropped' if split == 'train' else 'truncated'}"
        self.info.metadata[key] = 0
        for start in range(0, len(src), _ENCODE_BATCH):
            src_ids = tokenizer.encode(src[start:start + _ENCODE_BATCH])
            tgt_ids = tokenizer.encode(tgt[start:start + _ENCODE_BATCH])
            for i, (s, t) in enumerate(zip(src_ids, tgt_ids), start):
                inputs, cut_s = _fit(s, max_length)
                targets, cut_t = _fit(t, max_length)
                if cut_s or cut_t:
                    self.info.metadata[key] += 1
                    if split == "train":
                        continue
                yield i, {"inputs": inputs, "targets": targets, "source_text": src[i], "target_text": tgt[i]}


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Builder of `wmt14_en_de`.

    Options: source_dir (required to prepare; layout in the module docstring), source_lang ('en'),
    target_lang ('de'), vocab_size (32000, joint), model_type ('unigram' | 'bpe'), max_length (256),
    max_vocab_sentences (1,000,000 sentences sampled to train the vocabulary), max_train_examples
    (0 = all), seed (0).

    Raises:
      ValueError: an unknown option, an invalid value, or (when not yet prepared) missing files, named.
    """
    if options.get("source_dir"):
        options = base.absolute_path_option(options, "source_dir")
    config = base.config_from_options(WmtConfig, options, dataset="wmt14_en_de")
    if config.model_type not in MODEL_TYPES:
        raise ValueError(f"wmt14_en_de: model_type must be one of {MODEL_TYPES}, got {config.model_type!r}")
    if config.max_length < 2 or config.vocab_size < 8:
        raise ValueError(f"wmt14_en_de: need max_length >= 2 and vocab_size >= 8, got {config.max_length}, "
                         f"{config.vocab_size}")
    builder = Wmt14EnDe(data_dir=data_dir, config=config, file_format="array_record")
    if not builder.is_prepared():
        if not config.source_dir:
            raise ValueError("wmt14_en_de: option source_dir is required: a folder with train.en, train.de, "
                             "dev.en, dev.de, test.en, test.de (WMT cannot be downloaded offline)")
        missing = [p for p in expected_files(config) if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"wmt14_en_de: source_dir {config.source_dir!r} must hold train/dev/test."
                             f"{config.source_lang} and .{config.target_lang} (missing: "
                             f"{', '.join(os.path.basename(p) for p in missing)}); "
                             "WMT cannot be downloaded offline")
    return builder
