"""Beam search's selection rule: which continuations of a group of sentences finish and which live on.

:mod:`server.engine.decode` keeps the books (rows, histories, finished hypotheses, who leaves); this module only
picks, on arrays, the way fairseq's ``Search.step`` picks for its ``SequenceGenerator``. The rules are
those of :mod:`common.model_format.decoding`, as in the PyTorch reference ``training/search.py``:

* a sentence's ``2 * beam`` best continuations are among its rows' ``2 * beam`` best tokens, ranked by
  the hypothesis' summed log-probability (a forced prefix's tokens add nothing to it);
* they are walked in order: those ending in EOS finish, the others are kept until ``beam`` are live
  (a continuation behind the ``beam``-th live one neither finishes nor lives);
* a sentence is done (:func:`sentence_done`) once nothing is live, or once it holds its quota of
  finished hypotheses and its best live one, scored as if it ended now, is no better than the worst.

Shapes: ``n`` sentences of one beam size ``beam``, each holding ``width`` rows (1 before its first
expansion, then ``beam``); the step gave each row its ``K >= 2 * beam`` best tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.model_format.decoding import normalized_score
from server.engine.step_model import NEG_INF
from server.types import ScoredSequence


@dataclass
class BeamChoice:
    """The selection for ``n`` sentences; ``C = 2 * beam`` candidates each, best first."""

    scores: np.ndarray  # [n, C] the candidate hypothesis' summed log-probability (NEG_INF: none)
    tokens: np.ndarray  # [n, C] the token it appends
    token_scores: np.ndarray  # [n, C] that token's log-probability
    origins: np.ndarray  # [n, C] the row it extends
    finish: np.ndarray  # [n, C] bool: it ends in EOS and finishes
    chosen: np.ndarray  # [n, beam] the candidates that live on (indices into C), best first; -1: none
    best_live: np.ndarray  # [n] the best live candidate's summed log-probability (NEG_INF: none live)


def select_beam(totals: np.ndarray, tokens: np.ndarray, token_scores: np.ndarray, rows: np.ndarray,
                given: np.ndarray | None, beam: int, eos_id: int) -> BeamChoice:
    """Select the next hypotheses of ``n`` sentences of beam ``beam``.

    ``totals`` [R]: each row's summed log-probability; ``tokens``/``token_scores`` [R, K]: each row's best
    tokens and their log-probabilities, best first (NEG_INF: not allowed); ``rows`` [n, width]: each
    sentence's rows; ``given`` [n]: the sentence's step is part of a forced prefix (its token adds nothing
    to the summed score; None: no sentence's is)."""
    n = rows.shape[0]
    per_row = min(2 * beam, tokens.shape[1])
    block_tokens = tokens[rows][:, :, :per_row]
    block_scores = token_scores[rows][:, :, :per_row]
    added = block_scores if given is None else np.where(given[:, None, None] & (block_scores > NEG_INF), 0.0,
                                                         block_scores)
    candidates = (totals[rows][:, :, None] + added).reshape(n, -1)
    order = np.argsort(-candidates, axis=1, kind="stable")[:, : 2 * beam]
    # one flat index gathers every [n, C] field with np.take: the same values as fancy indexing with the
    # sentence index or np.take_along_axis, with a fraction of their Python overhead
    flat = order + np.arange(0, candidates.size, candidates.shape[1])[:, None]
    scores = np.take(candidates, flat)
    token = np.take(block_tokens, flat)
    valid = scores > NEG_INF
    is_eos = (token == eos_id) & valid
    live = ~is_eos & valid
    live_before = np.cumsum(live, axis=1) - live
    keep = live & (live_before < beam)
    chosen = np.full((n, beam), -1)
    kj, kc = np.nonzero(keep)
    chosen[kj, live_before[kj, kc]] = kc  # a kept candidate's rank among the live ones is its slot
    first = chosen[:, 0]
    best_live = np.where(first >= 0, np.take(scores, np.maximum(first, 0) + np.arange(0, scores.size, 2 * beam)),
                         NEG_INF)
    return BeamChoice(scores, token, np.take(block_scores, flat), np.take(rows, flat // per_row),
                      is_eos & (live_before < beam), chosen, best_live)


def sentence_done(best_live: float, finished: list[ScoredSequence], quota: int, length: int,
                  length_penalty: float) -> bool:
    """Whether a sentence stops: nothing is live (``best_live`` NEG_INF), or it holds ``quota`` finished
    hypotheses (``finished``, best first) and its best live one, normalised at ``length`` tokens, is no
    better than the worst of them."""
    if best_live == NEG_INF:
        return True
    return len(finished) == quota and normalized_score(best_live, length, length_penalty) <= finished[-1].score
