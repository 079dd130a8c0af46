"""Corpus-level translation metrics: sacrebleu BLEU and chrF, and exact match (htgn.md §5.9, §6).

sacrebleu is imported on first use (scoring runs offline; only its test-set download needs a network).
For pre-tokenised text (the number-words morphemes, subword-free references) use tokenize='none', so
BLEU counts the given tokens; for detokenised natural text (WMT) use sacrebleu's default '13a'.
"""
from __future__ import annotations

from typing import Sequence


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"hypotheses ({len(hypotheses)}) and references ({len(references)}) differ in number")
    if not hypotheses:
        raise ValueError("hypotheses is empty")


def _text(x) -> str:
    # TFDS Text features come back as bytes.
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], *, tokenize: str = "none",
                effective_order: bool = False) -> float:
    """Corpus BLEU in [0, 100] with one reference per hypothesis (sacrebleu's BLEU, 4-grams, 'exp' smoothing).

    Standard corpus BLEU is 0 when the corpus holds no n-gram of some order <= 4 (e.g. only one- to
    three-token sentences, as number-words with max_number < 1000 gives); `effective_order=True` then
    averages over the orders present (not comparable with published corpus BLEU).
    """
    from sacrebleu.metrics import BLEU  # pylint: disable=import-outside-toplevel

    _check(hypotheses, references)
    metric = BLEU(tokenize=tokenize, effective_order=effective_order)
    return float(metric.corpus_score([_text(h) for h in hypotheses], [[_text(r) for r in references]]).score)


def corpus_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF in [0, 100] (character 6-grams, beta 2; whitespace ignored, so it also scores compounds)."""
    import sacrebleu  # pylint: disable=import-outside-toplevel

    _check(hypotheses, references)
    return float(sacrebleu.corpus_chrf([_text(h) for h in hypotheses], [[_text(r) for r in references]]).score)


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Fraction in [0, 1] of hypotheses equal to their reference up to whitespace."""
    _check(hypotheses, references)
    same = sum(" ".join(_text(h).split()) == " ".join(_text(r).split()) for h, r in zip(hypotheses, references))
    return same / len(hypotheses)


def translation_metrics(hypotheses: Sequence[str], references: Sequence[str], *, tokenize: str = "none",
                        effective_order: bool = False) -> dict[str, float]:
    """{'bleu': [0, 100], 'chrf': [0, 100], 'exact_match': [0, 1]} of a corpus (see `corpus_bleu`)."""
    return {"bleu": corpus_bleu(hypotheses, references, tokenize=tokenize, effective_order=effective_order),
            "chrf": corpus_chrf(hypotheses, references),
            "exact_match": exact_match(hypotheses, references)}
