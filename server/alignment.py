"""Words of tokenized texts, and subword attention -> word-level attention matrix and hard word alignments."""

from __future__ import annotations

import numpy as np

from common.model_format.tokenizer import WORD_START
from server.types import Attention, WordAlignment


def word_groups(pieces: list[str]) -> list[list[int]]:
    """Indices of the pieces forming each word: a new word starts at a piece beginning with '▁'.

    A group that spells nothing (bare '▁' marks, as SentencePiece emits before a digit or at the end of an
    output) is no word: its pieces join the word before it, or the one after it when it comes first, and
    pieces that spell nothing at all form no word.
    """
    groups: list[list[int]] = []
    for i, piece in enumerate(pieces):
        if not groups or piece.startswith(WORD_START):
            groups.append([i])
        else:
            groups[-1].append(i)
    kept: list[list[int]] = []
    pending: list[int] = []  # pieces of empty groups before the first word
    for group in groups:
        if any(pieces[i] != WORD_START * len(pieces[i]) for i in group):
            kept.append(pending + group)
            pending = []
        elif kept:
            kept[-1].extend(group)
        else:
            pending.extend(group)
    return kept


def word_count(pieces: list[str]) -> int:
    """How many words :func:`word_groups` makes of ``pieces``."""
    return len(word_groups(pieces))


def words(pieces: list[str], groups: list[list[int]]) -> list[str]:
    """The pieces of each group joined, without the word-boundary marker."""
    return ["".join(pieces[i] for i in group).replace(WORD_START, "") for group in groups]


def segment_words(pieces: list[str], text: str = "") -> list[str]:
    """The words of ``text``, tokenized as ``pieces``: one word per word group of the pieces.

    ``text.split()`` when it has as many words as the pieces have groups (it keeps characters the
    tokenizer maps to ``<unk>``), else the pieces merged at word starts.
    """
    split = text.split()
    return split if len(split) == word_count(pieces) else words(pieces, word_groups(pieces))


def merge_to_words(
    subword_weights: np.ndarray,
    source_pieces: list[str],
    target_pieces: list[str],
    source_words: list[str] | None = None,
    target_words: list[str] | None = None,
) -> Attention:
    """Merge a [target pieces (+EOS), source pieces (+EOS)] attention matrix into words.

    The end-of-sentence row and column are dropped; a source word receives the attention mass of
    its pieces (sum), a target word the mean of its pieces' rows; rows are renormalised to sum to 1.
    Each target word is aligned to the source word it attends to most. The matrix's words are
    ``source_words`` / ``target_words`` (one per word group, see :func:`segment_words`), by default
    the pieces merged at word starts.
    """
    source_groups, target_groups = word_groups(source_pieces), word_groups(target_pieces)
    core = np.asarray(subword_weights, dtype=np.float64)[: len(target_pieces), : len(source_pieces)]
    matrix = np.zeros((len(target_groups), len(source_groups)))
    for j, source_group in enumerate(source_groups):
        column = core[:, source_group].sum(axis=1)
        for i, target_group in enumerate(target_groups):
            matrix[i, j] = column[target_group].mean()
    totals = matrix.sum(axis=1, keepdims=True)
    uniform = np.full_like(matrix, 1.0 / max(1, matrix.shape[1]))
    matrix = np.where(totals > 1e-12, matrix / np.where(totals > 1e-12, totals, 1.0), uniform)
    alignments = [WordAlignment(source_index=int(row.argmax()), target_index=i) for i, row in enumerate(matrix)]
    return Attention(
        source_words=words(source_pieces, source_groups) if source_words is None else source_words,
        target_words=words(target_pieces, target_groups) if target_words is None else target_words,
        weights=matrix.astype(np.float32),
        alignments=alignments if matrix.shape[1] else [],
        subword_weights=np.asarray(subword_weights, dtype=np.float32),
    )
