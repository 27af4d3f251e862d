"""The books of a running decode: each row's hypothesis so far, and the one writer of them.

A row's books are its last token, its step (its sentence's tokens so far), its summed log-probability (the
total), its tokens and their scores so far (the history) and, while some sentence asks for it, its attention
rows. Every way a decode runs its steps (the general step, plain arg-max runs, plain beam runs, the device's
selection) ends by handing what it decided to :meth:`Books.write`, which also counts the steps of the
sentences whose rows they are; so the books read the same whichever path ran a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from common.model_format.decoding import normalized_score
from server.types import ScoredSequence


class Counted(Protocol):
    """A sentence of the decode as the books see it: the steps it has decoded, and its finished hypotheses."""

    step: int
    finished: list[Any]


class Books:
    """The rows' books (see the module docstring), rows in the decode's row order."""

    def __init__(self) -> None:
        self.tokens = np.zeros(0, dtype=np.int64)  # each row's last token: the next step's input
        self.steps = np.zeros(0, dtype=np.int64)  # each row's step: its sentence's tokens so far
        self.totals = np.zeros(0)  # each row's summed log-probability
        self.history = np.zeros((0, 0), dtype=np.int64)  # [R, capacity] tokens so far
        self.history_scores = np.zeros((0, 0))
        self.attention: np.ndarray | None = None  # [R, capacity, S] while a sentence asks for attention

    @property
    def rows(self) -> int:
        return int(self.tokens.size)

    def add(self, tokens: np.ndarray, totals: np.ndarray, step: int, capacity: int) -> None:
        """Rows for sentences that join, one each, after ``step`` tokens, their history at least ``capacity`` long."""
        n = tokens.size
        capacity = max(capacity, self.history.shape[1])
        self.history = _grow(self.history, n, capacity)
        self.history_scores = _grow(self.history_scores, n, capacity)
        if self.attention is not None:
            self.attention = _grow(self.attention, n, capacity)
        self.steps = np.concatenate([self.steps, np.full(n, step, dtype=np.int64)])
        self.tokens = np.concatenate([self.tokens, tokens.astype(np.int64)])
        self.totals = np.concatenate([self.totals, totals])

    def give(self, rows: slice, tokens: np.ndarray, scores: np.ndarray, attention: np.ndarray | None) -> None:
        """The tokens a forced pass decided for the rows just added (:meth:`add`): their history from the start."""
        t = tokens.shape[1]
        self.history[rows, :t], self.history_scores[rows, :t] = tokens, scores
        if attention is not None:
            self.fit_attention(attention.shape[2])
            self.attention[rows, :t, : attention.shape[2]] = attention

    def fit_attention(self, width: int) -> None:
        """Make the attention history hold every row and ``width`` source positions."""
        if self.attention is None:
            self.attention = np.zeros((self.rows, self.history.shape[1], width), dtype=np.float32)
        elif self.attention.shape[2] < width:
            pad = np.zeros((*self.attention.shape[:2], width - self.attention.shape[2]), dtype=np.float32)
            self.attention = np.concatenate([self.attention, pad], axis=2)

    def write(self, count: int, sentences: Sequence[Counted], history: np.ndarray, history_scores: np.ndarray,
              totals: np.ndarray, tokens: np.ndarray | None = None, steps: np.ndarray | None = None,
              finished: list[list[Any]] | None = None) -> None:
        """The one writer of the books after ``count`` steps of ``sentences`` (whose rows these are, in order),
        whichever path ran them: each row's history and token scores, its total, its last token where the steps
        changed it, the rows' steps before these (``steps``, where rows moved; else the books' own), each sentence's
        finished hypotheses where the path kept them apart, and the steps every row and sentence has decoded."""
        self.history, self.history_scores, self.totals = history, history_scores, totals
        if tokens is not None:
            self.tokens = tokens
        self.steps = (self.steps if steps is None else steps) + count
        for i, s in enumerate(sentences):
            s.step += count
            if finished is not None:
                s.finished = finished[i]

    def write_step(self, sentences: Sequence[Counted], origin: np.ndarray | None, tokens: np.ndarray,
                   scores: np.ndarray, totals: np.ndarray, attention: np.ndarray | None) -> None:
        """One general step: row ``r`` continues the row ``origin[r]`` (None: every row its own) with ``tokens[r]``
        of log-probability ``scores[r]``, its total now ``totals[r]`` (``attention``: the step's, [rows, S])."""
        steps, history, history_scores = self.steps, self.history, self.history_scores
        if origin is not None:
            steps, history, history_scores = steps[origin], history[origin], history_scores[origin]
            if self.attention is not None:
                self.attention = self.attention[origin]
        rows = np.arange(tokens.size)
        history[rows, steps] = tokens
        history_scores[rows, steps] = scores
        if self.attention is not None and attention is not None:
            self.attention[rows, steps, : attention.shape[1]] = attention if origin is None else attention[origin]
        self.write(1, sentences, history, history_scores, totals, tokens.astype(np.int64, copy=False), steps)

    def write_greedy_run(self, sentences: Sequence[Counted], tokens: list[list[int]], scores: list[list[float]],
                         last: np.ndarray | None = None) -> None:
        """The steps of a plain arg-max run: each step's token and score of every row (each row its own origin);
        ``last``: each row's last token, where the run goes on from a step it did not hand to the books."""
        count = len(tokens)
        if not count:
            return
        # a held row runs past its end unread: its last column takes what it writes there
        at = (np.arange(self.rows)[:, None],
              np.minimum(self.steps[:, None] + np.arange(count), self.history.shape[1] - 1))
        step_scores = np.array(scores)  # [steps, R]
        self.history[at], self.history_scores[at] = np.array(tokens, dtype=np.int64).T, step_scores.T
        # summed step by step, as the general step adds them
        totals = np.cumsum(np.concatenate([self.totals[None], step_scores]), axis=0)[-1]
        self.write(count, sentences, self.history, self.history_scores, totals, last)

    def write_beam_run(self, sentences: Sequence[Counted], steps: list[tuple[list[int], list[int], list[float]]],
                       totals: list[float], last: np.ndarray | None = None) -> None:
        """The steps of a plain beam run: each step's origins, tokens and scores (a row's history follows its origins
        back), each row's total after them and ``last`` (as :meth:`write_greedy_run`)."""
        count = len(steps)
        if not count:
            return
        origins, tokens, scores = (np.array(part) for part in zip(*steps, strict=True))  # [steps, R] each
        lineage = np.arange(self.rows)  # the row each final row came from, step by step back
        step_tokens, step_scores = np.empty((self.rows, count), dtype=np.int64), np.empty((self.rows, count))
        for t in range(count - 1, -1, -1):
            step_tokens[:, t], step_scores[:, t] = tokens[t, lineage], scores[t, lineage]
            lineage = origins[t, lineage]
        history, history_scores = self.history[lineage], self.history_scores[lineage]
        at = (np.arange(self.rows)[:, None], self.steps[:, None] + np.arange(count))
        history[at], history_scores[at] = step_tokens, step_scores
        self.write(count, sentences, history, history_scores, np.array(totals), last)

    def keep_none(self) -> None:
        """Every sentence left: no rows."""
        self.tokens, self.steps, self.totals = self.tokens[:0], self.steps[:0], self.totals[:0]
        self.history, self.history_scores, self.attention = self.history[:0], self.history_scores[:0], None

    def hypothesis(self, row: int, step: int, token: int, score: float, total: float, length_penalty: float,
                   attention: np.ndarray | None = None, width: int = 0) -> ScoredSequence:
        """The hypothesis of ``row`` after ``step`` tokens ending in ``token`` of log-probability ``score`` now, its
        total ``total``; with this step's ``attention`` ([rows, S]) its attention over ``width`` source positions."""
        rows = None
        if attention is not None and self.attention is not None:
            rows = np.concatenate([self.attention[row, :step, :width], attention[row, None, :width]])
        return ScoredSequence(tokens=self.history[row, :step].tolist() + [token],
                              score=float(normalized_score(total, step + 1, length_penalty)),
                              token_scores=self.history_scores[row, :step].tolist() + [score], attention=rows)


def _grow(array: np.ndarray, rows: int, capacity: int) -> np.ndarray:
    """``array`` [R, C, ...] with ``rows`` zero rows appended and its second axis zero-padded to ``capacity``."""
    shape = array.shape
    if capacity > shape[1]:
        array = np.concatenate([array, np.zeros((shape[0], capacity - shape[1], *shape[2:]), dtype=array.dtype)], 1)
    return np.concatenate([array, np.zeros((rows, *array.shape[1:]), dtype=array.dtype)])


def stable_length(live: np.ndarray, finished: Sequence[ScoredSequence]) -> int:
    """How many leading tokens ``live`` ([live hypotheses, tokens so far]) and ``finished`` all share: the stable
    prefix of a sentence in a beam search, the tokens no later step can change (its result is one of its finished
    hypotheses or a continuation of a live one). With one live hypothesis and none finished, every token so far."""
    length = live.shape[1]
    if live.shape[0] > 1:
        agree = (live == live[0]).all(axis=0)
        length = length if agree.all() else int(np.argmin(agree))
    for done in finished:
        n = min(length, len(done.tokens))
        same = np.asarray(done.tokens[:n]) == live[0, :n]
        length = n if same.all() else int(np.argmin(same))
    return length
