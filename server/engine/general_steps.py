"""The general step's selection of :class:`server.engine.decode.RunningDecode`, kept apart: arg-max decoding of its
beam-1 sentences (:meth:`GeneralSelection._greedy`, sampling included) and the beam search of the others
(:meth:`GeneralSelection._beam`, :func:`server.engine.beam_select.select_beam`), each writing the finished
hypotheses and choosing who leaves; the decode lays out the rows that stay."""

from __future__ import annotations

from typing import Any

import numpy as np

from common.model_format.decoding import normalized_score
from server.controls import sample
from server.engine.beam_select import select_beam, sentence_done
from server.engine.search import NEG_INF
from server.types import ScoredSequence, SearchResult


class GeneralSelection:
    """The selection of :class:`server.engine.decode.RunningDecode`'s general step, a part of it kept apart: its
    methods read and write the decode's books (``_sentences``, ``_totals``, ``_history``, ``_attention``, ...)."""

    def _greedy(self, group: np.ndarray, starts: np.ndarray, row_tokens: np.ndarray, row_scores: np.ndarray,
                processed: np.ndarray | None, attention: np.ndarray | None, prefix: bool,
                left: list[tuple[Any, SearchResult | None]], kept: list[int]) -> tuple[np.ndarray, ...]:
        """Arg-max decoding of the beam-1 sentences ``group`` (one row each; ``prefix``: some sentence of
        the decode may be in its forced prefix)."""
        every = len(group) == len(row_tokens)  # every row is a beam-1 sentence's: its rows are all, in order
        rows = np.arange(len(group)) if every else starts[group]
        at = slice(None) if every else rows
        tokens, scores = row_tokens[at, 0], row_scores[at, 0]
        given = np.array([self._sentences[j].step < self._sentences[j].forced_length for j in group.tolist()]
                         ) if prefix else None
        # a forced prefix's tokens are given, not scored
        totals = self._totals[at] + (scores if given is None else np.where(given, 0.0, scores))
        stop = (tokens == self.eos_id) | (scores == NEG_INF)  # EOS, or nothing left to choose
        stay = []
        for i, (j, r, stops) in enumerate(zip(group.tolist(), rows.tolist(), stop.tolist(), strict=True)):
            s = self._sentences[j]
            if s.rng is not None and scores[i] > NEG_INF and s.step < s.limit - 1:
                tokens[i] = sample(processed[r], s.controls, s.rng)
                scores[i] = processed[r, tokens[i]]
                totals[i] = self._totals[r] + (0.0 if given is not None and given[i] else scores[i])
                stops = tokens[i] == self.eos_id
            if s.ended is not None:  # its row was held after its EOS (PlainSteps._plain_greedy)
                if not s.handed:
                    left.append((s.tag, s.ended))
            elif s.spec.is_cancelled is not None and s.spec.is_cancelled():
                left.append((s.tag, None))
            elif stops:
                hypotheses = [] if scores[i] == NEG_INF else [
                    self._hypothesis(s, r, int(tokens[i]), float(scores[i]), float(totals[i]), attention)]
                left.append((s.tag, SearchResult(hypotheses)))
            else:
                stay.append(i)
                kept.append(j)
        if len(stay) == len(rows):
            return rows, tokens, scores, totals
        stay_rows = np.array(stay, dtype=np.int64)
        return rows[stay_rows], tokens[stay_rows], scores[stay_rows], totals[stay_rows]

    def _beam(self, group: np.ndarray, beam: int, width: int, starts: np.ndarray, row_tokens: np.ndarray,
              row_scores: np.ndarray, attention: np.ndarray | None, prefix: bool,
              left: list[tuple[Any, SearchResult | None]], kept: list[int]) -> tuple[np.ndarray, ...]:
        """The general step of sentences ``group``, all of beam ``beam`` holding ``width`` rows each: the
        selection (:func:`server.engine.beam_select.select_beam`), then its books (``prefix``: some sentence of
        the decode may be in its forced prefix)."""
        sentences = [self._sentences[j] for j in group.tolist()]
        given = np.array([s.step < s.forced_length for s in sentences]) if prefix else None
        choice = select_beam(self._totals, row_tokens, row_scores, starts[group][:, None] + np.arange(width), given,
                             beam, self.eos_id)
        for j, c in zip(*np.nonzero(choice.finish), strict=True):
            s = sentences[j]
            s.finished.append(self._hypothesis(s, int(choice.origins[j, c]), self.eos_id,
                                               float(choice.token_scores[j, c]), float(choice.scores[j, c]), attention))
        survivors = []
        for j, s in enumerate(sentences):
            if s.finished:
                s.finished.sort(key=lambda hyp: hyp.score, reverse=True)
                del s.finished[s.quota:]
            if s.cancelled():
                left.append((s.tag, None))
            elif sentence_done(choice.best_live[j], s.finished, s.quota, s.step + 1,
                               s.spec.length_penalty):
                left.append((s.tag, SearchResult(s.finished[: s.spec.num_hypotheses])))
            else:
                survivors.append(j)
                kept.append(int(group[j]))
        keep_rows = np.array(survivors, dtype=np.int64)
        picked = choice.chosen[keep_rows]  # [n', beam]
        alive = picked >= 0
        at = (keep_rows[:, None], np.maximum(picked, 0))
        new_origin = np.where(alive, choice.origins[at], choice.origins[keep_rows, :1])
        new_token = np.where(alive, choice.tokens[at], self.start_id)
        new_totals = np.where(alive, choice.scores[at], NEG_INF)
        step_scores = choice.token_scores[at]
        return new_origin.reshape(-1), new_token.reshape(-1), step_scores.reshape(-1), new_totals.reshape(-1)

    def _hypothesis(self, s: Any, row: int, token: int, score: float, total: float,
                    attention: np.ndarray | None) -> ScoredSequence:
        """The hypothesis of ``row`` (of ``s``, one of the decode's sentences) ending in ``token`` this step."""
        t = s.step
        rows = None
        if s.attention and attention is not None:
            width = s.spec.source_length
            rows = np.concatenate([self._attention[row, :t, :width], attention[row, None, :width]])
        return ScoredSequence(tokens=self._history[row, :t].tolist() + [token],
                              score=float(normalized_score(total, t + 1, s.spec.length_penalty)),
                              token_scores=self._history_scores[row, :t].tolist() + [score], attention=rows)
