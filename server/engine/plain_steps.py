"""The plain steps of a running decode (:class:`server.engine.decode.RunningDecode`): the steps whose host work
is cut to reading each row's best tokens, chosen when nothing in the decode needs the general step.

* Plain arg-max steps (:meth:`PlainSteps._plain_greedy`): every sentence at beam 1; the model's own arg-max
  feeds the next step (:class:`server.engine.bound_steps.GreedySteps`) and the host reads each row's token
  and score.
* Plain beam steps (:meth:`PlainSteps._plain_beam`): some sentence at a beam of 2 or more, every such sentence
  expanded (a beam-1 sentence is a beam of one row there); the selection runs in plain Python lists
  (:mod:`server.engine.beam_steps`).
* The selection on the device (:meth:`PlainSteps._device_beam`): every sentence at one beam of 2 or more,
  expanded, on a model that keeps its state on a device with ``device_search``; a graph there selects and the
  host reads the done flags (:mod:`server.engine.device_search`).

All run while their steps are *quiet* (no sentence ends, is done or is cancelled; the beam paths finish
hypotheses within them), write the quiet steps into the decode's books together, and hand the first step
that is not quiet back to the general selection, so the results are the general search's, token for token,
scores summed in the same order. None runs for decoding controls, target prefixes, attention or streaming.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.model_format.decoding import normalized_score
from server.engine.beam_select import sentence_done
from server.engine.beam_steps import QuietChoice, quiet_selection
from server.engine.device_search import Books, DeviceBeamRun
from server.engine.row_layout import Layout
from server.engine.search import NEG_INF, StepOutput
from server.types import ScoredSequence, SearchResult


class PlainSteps:
    """The plain steps of :class:`server.engine.decode.RunningDecode`, a part of it kept apart: its methods read
    and write the decode's books (``_sentences``, ``_tokens``, ``_totals``, ``_history``, ``_steps``, ...)."""

    def _plain(self, layout: Layout) -> Callable[..., StepOutput | None] | None:
        """The plain steps that run this step, if any: plain arg-max decoding (:meth:`_plain_greedy`), plain beam
        steps (:meth:`_plain_beam`) or the selection on the device (:meth:`_device_beam`), for a layout that
        allows them (:attr:`Layout.plain`, :attr:`Layout.plain_beam`, :attr:`Layout.device_beam`) past its
        controls' and prefixes' steps, no row at its last step (but where arg-max steps hold ended rows: they end
        such rows themselves), on a model that has them
        (:meth:`server.engine.step_models.OnnxStepModel.greedy_steps`, ``beam_steps``,
        :meth:`server.engine.device_step_model.DeviceStepModel.beam_run`)."""
        age = self._age
        if not (layout.full_for <= age and age >= layout.given_for and self._given is None):
            return None
        room = age < layout.room  # no row at its last step
        if layout.plain and getattr(self.model, "plain_greedy", False) and (room or self.hold_ended):
            return self._plain_greedy
        if not room:
            return None
        if layout.plain_beam and self.plain_beam:
            return self._plain_beam
        if layout.device_beam and self.device_beam:
            return self._device_beam
        return None

    def _plain_greedy(self, layout: Layout, until_leave: bool, stop: Callable[[], bool] | None,
                      ) -> StepOutput | None:
        """Plain arg-max steps (:meth:`_plain`), the host's work per step cut to reading each row's token and
        score (:class:`server.engine.bound_steps.GreedySteps`; on a device, steps launched in blocks and read in
        one copy: :mod:`server.engine.device_greedy`): a step in which no row chose EOS (or nothing)
        and no sentence was cancelled is *quiet*, and the quiet steps go into the books together. Runs one
        step, or with ``until_leave`` steps until one that is not quiet, the step before some row's last, or
        ``stop()`` after a quiet step. Returns the output of the step that was not quiet, for :meth:`step` to
        select from as any other; None when every step was quiet.

        With :attr:`hold_ended` (a device's steps, which cost the same at any row count) a row that chose EOS,
        or that reached its sentence's last step (where only EOS may follow: it takes EOS with EOS's
        log-probability, as the general step forces it), does not end the run: its sentence's hypothesis is made
        at once (:meth:`_hold`; handed to :attr:`on_ended` right away where one is set) and its row runs on unread,
        its position no longer moving, until the run ends, that is when every row is held, at ``stop()``, or at a
        step that is not quiet for another reason. That step goes to the general selection, where the held
        sentences leave."""
        count = layout.room - self._age if until_leave else 1
        limits: dict[int, list[int]] = {}  # a step at which some row reaches its limit -> those rows (held runs)
        ceilings = None  # each row's last position (held runs: the rows held at their limits stay there)
        if self.hold_ended:
            ceilings = layout.limits - 1
            last = (ceilings - self._steps).tolist()  # each row's last step, counted from this run's first
            for row, end in enumerate(last):
                limits.setdefault(end, []).append(row)
            if until_leave:  # to the last row's last step: there every row ends or is held
                count = max(last) + 1
        tokens: list[list[int]] = []  # the quiet steps' tokens and scores, as lists (GreedySteps.read)
        token_scores: list[list[float]] = []
        checks = [s.spec.is_cancelled for s in self._sentences if s.spec.is_cancelled is not None]
        held: set[int] = set()  # rows whose sentence ended during the run (EOS, or its limit)
        with self.model.greedy_steps(self._tokens, self._static, self._state, self._steps, count, ceilings) as run:
            left, block = count, 1
            while left:
                # a block of steps (one, on the host's arrays), read step by step; on a device blocks double while
                # they are read whole, so a run of quiet steps cut short wastes at most as many as it read
                ran = run.run_block(min(left, block))
                left, block = left - ran, 2 * block
                for step in range(ran):
                    chosen, chosen_scores = run.read(step)  # the run now stands after this step
                    self.steps_run += 1
                    for row in held:  # held rows are not read
                        chosen[row], chosen_scores[row] = -1, 0.0
                    at_limit = [row for row in limits.get(len(tokens), ()) if row not in held]
                    if at_limit:  # only EOS may follow
                        eos = run.eos_log_prob.tolist()
                        for row in at_limit:
                            chosen[row], chosen_scores[row] = self.eos_id, eos[row]
                    ending = chosen.count(self.eos_id)
                    cut = NEG_INF in chosen_scores or any(check() for check in checks) or (
                        ending and not self.hold_ended)
                    stopping = not cut and stop is not None and stop()
                    if not cut and (held or ending):  # the held sentences leave when the run ends
                        cut = stopping or len(held) + ending == self.rows or (not left and step == ran - 1)
                    if cut:
                        self._quiet_steps(tokens, token_scores)
                        return StepOutput(run.ids[:, None].copy(), run.scores[:, None].copy(),
                                          run.eos_log_prob.copy(), None, run.state())
                    tokens.append(chosen)
                    token_scores.append(chosen_scores)
                    if ending:
                        ended = [row for row, token in enumerate(chosen) if token == self.eos_id]
                        held.update(ended)
                        self._hold(ended, tokens, token_scores)
                    if stopping:
                        left = 0
                        break
            self._quiet_steps(tokens, token_scores)
            self._tokens, self._state = run.ids.copy(), run.state()
        return None

    def _quiet_steps(self, tokens: list[list[int]], scores: list[list[float]]) -> None:
        """Write the quiet steps of :meth:`_plain_greedy` into the books: each step's tokens and scores."""
        count = len(tokens)
        if not count:
            return
        # a held row runs past its end unread: its last column takes what it writes there
        at = (np.arange(self.rows)[:, None],
              np.minimum(self._steps[:, None] + np.arange(count), self._history.shape[1] - 1))
        step_scores = np.array(scores)  # [steps, R]
        self._history[at], self._history_scores[at] = np.array(tokens, dtype=np.int64).T, step_scores.T
        # summed step by step, as the general step adds them
        self._totals = np.cumsum(np.concatenate([self._totals[None], step_scores]), axis=0)[-1]
        self._steps = self._steps + count
        self._age += count
        for s in self._sentences:
            s.step += count

    def _hold(self, rows: list[int], tokens: list[list[int]], scores: list[list[float]]) -> None:
        """The hypotheses of the sentences whose rows ``rows`` ended in EOS (chosen, or at their limits) at the last
        of the quiet steps ``tokens`` / ``scores`` of :meth:`_plain_greedy` (not yet in the books), made as the
        general step makes them (the scores summed in its order); each sentence leaves with its own when the run
        ends, and where :attr:`on_ended` is set it gets them now."""
        handed = []
        for row in rows:
            s, before = self._sentences[int(self._row_sentence[row])], int(self._steps[row])
            run_tokens, run_scores = [step[row] for step in tokens], [step[row] for step in scores]
            total = float(self._totals[row])
            for score in run_scores:
                total += score
            length = before + len(run_tokens)
            s.ended = SearchResult([ScoredSequence(
                tokens=self._history[row, :before].tolist() + run_tokens,
                token_scores=self._history_scores[row, :before].tolist() + run_scores,
                score=float(normalized_score(total, length, s.spec.length_penalty)))])
            if self.on_ended is not None:
                s.handed = True
                handed.append((s.tag, s.ended))
        if handed:
            self.on_ended(handed)

    def _plain_beam(self, layout: Layout, until_leave: bool, stop: Callable[[], bool] | None,
                    ) -> StepOutput | None:
        """Plain beam steps (:meth:`_plain`, :mod:`server.engine.beam_steps`): each step's hypotheses are chosen
        in plain Python while the step is *quiet*: no sentence leaves (done, cancelled) and no beam-1 sentence
        chooses EOS. Hypotheses that end in EOS join their sentence's finished ones (:class:`_Finished` until
        the books are written), and the quiet steps go into the books together. Runs one step, or with
        ``until_leave`` steps until one that is not quiet, the step before some row's last, or ``stop()`` after
        a quiet step. Returns the output of the step that was not quiet, for :meth:`step` to select from as
        any other; None when every step was quiet."""
        count = layout.room - self._age if until_leave else 1
        run = self.model.beam_steps(self._tokens, self._static, self._state, self._steps, layout.k, count)
        blocks = list(zip(layout.starts.tolist(), [s.beam for s in self._sentences], strict=True))
        checks = [s.spec.is_cancelled for s in self._sentences if s.spec.is_cancelled is not None]
        totals = self._totals.tolist()
        ending = any(s.finished for s in self._sentences)  # some sentence holds finished hypotheses
        steps: list[tuple[list[int], list[int], list[float]]] = []  # each quiet step's origins, tokens, scores
        for _ in range(count):
            run.run()
            self.steps_run += 1
            ids, scores = run.read()
            choice = quiet_selection(ids, scores, totals, blocks, run.width, self.eos_id, run.places)
            if choice is None:
                finished = None
            elif choice.finished or ending:
                finished = self._quiet_finished(choice, blocks, len(steps))
                ending = ending or bool(finished)
            else:  # nothing finished, before or now: no sentence can be done
                finished = {}
            if finished is None or (checks and any(check() for check in checks)):
                self._quiet_beam_steps(steps, totals)
                return StepOutput(*run.outputs(), None, run.state())
            for j, kept in finished.items():
                self._sentences[j].finished = kept
            run.advance(choice.token, choice.origin)
            steps.append((choice.origin, choice.token, choice.token_score))
            totals = choice.total
            if stop is not None and stop():
                break
        self._quiet_beam_steps(steps, totals)
        self._state = run.state()
        self._tokens = run.ids.copy()
        return None

    def _device_beam(self, layout: Layout, until_leave: bool, stop: Callable[[], bool] | None,
                     ) -> StepOutput | None:
        """Beam steps whose selection runs on the device (:mod:`server.engine.device_search`): the step's best
        tokens, the histories, the finished hypotheses and the cache's reorder stay there, and the host reads
        whether some sentence is done. A step in which none is done or cancelled is *quiet*; the quiet steps'
        books come back together at the end of the run. Runs one step, or with ``until_leave`` steps until one
        that is not quiet, the step before some row's last, or ``stop()`` after a quiet step. Returns the output
        of the step that was not quiet (read back, with the state before its reorder), for :meth:`step` to
        select from as any other; None when every step was quiet."""
        count = layout.room - self._age if until_leave else 1
        sentences = self._sentences
        with self.model.beam_run(
                sentences[0].beam, self.eos_id, self.start_id,
                Books(self._tokens, self._totals, self._history, self._history_scores,
                      np.array([s.step for s in sentences], dtype=np.int64), [s.finished for s in sentences]),
                [s.spec.length_penalty for s in sentences], [s.quota for s in sentences], self._static, self._state,
                self._steps, layout.k, count) as run:
            checks = [s.spec.is_cancelled for s in sentences if s.spec.is_cancelled is not None]
            for quiet in range(count):  # the quiet steps before this one
                self.steps_run += 1
                if run.step() or (checks and any(check() for check in checks)):
                    self._device_books(run, quiet)
                    top_ids, top_log_probs, eos_log_prob, state = run.output()
                    return StepOutput(top_ids, top_log_probs, eos_log_prob, None, state)
                run.advance()
                if stop is not None and stop():
                    count = quiet + 1
                    break
            self._device_books(run, count)
            self._state = run.state()
        return None

    def _device_books(self, run: DeviceBeamRun, count: int) -> None:
        """Write the ``count`` quiet steps of :meth:`_device_beam` into the books, from the device."""
        if not count:
            return
        books = run.books()
        self._tokens, self._totals = books.tokens, books.totals
        self._history, self._history_scores = books.history, books.history_scores
        self._steps = self._steps + count
        self._age += count
        for s, finished in zip(self._sentences, books.finished, strict=True):
            s.step += count
            s.finished = finished

    def _quiet_finished(self, choice: QuietChoice, blocks: list[tuple[int, int]], step: int,
                        ) -> dict[int, list[Any]] | None:
        """The finished hypotheses of each sentence that has some after the quiet step ``step`` (of the steps
        :meth:`_plain_beam` runs) chose ``choice``, kept as the general step keeps them (appended in the order
        they were walked, best first, the quota kept); None when a sentence is then done and leaves (the
        general step takes that step)."""
        new: dict[int, list[_Finished]] = {}
        for j, row, eos_score, total in choice.finished:
            s = self._sentences[j]
            score = normalized_score(total, s.step + step + 1, s.spec.length_penalty)
            new.setdefault(j, []).append(_Finished(score, step, row, eos_score))
        kept = {}
        for j, s in enumerate(self._sentences):
            if not s.finished and j not in new:
                continue
            hypotheses = s.finished + new.get(j, [])
            hypotheses.sort(key=_score, reverse=True)
            del hypotheses[s.quota:]
            if sentence_done(choice.total[blocks[j][0]], hypotheses, s.quota, s.step + step + 1,
                             s.spec.length_penalty):
                return None
            kept[j] = hypotheses
        return kept

    def _quiet_beam_steps(self, steps: list[tuple[list[int], list[int], list[float]]], totals: list[float]) -> None:
        """Write the quiet steps of :meth:`_plain_beam` into the books: each step's origins, tokens and scores
        (a row's history follows its origins back), each row's summed log-probability after them, and the
        hypotheses that finished during them (:class:`_Finished` -> :class:`server.types.ScoredSequence`)."""
        for s in self._sentences:
            s.finished = [self._finished_hypothesis(h, steps) if isinstance(h, _Finished) else h for h in s.finished]
        count = len(steps)
        if not count:
            return
        origins, tokens, scores = (np.array(part) for part in zip(*steps, strict=True))  # [steps, R] each
        lineage = np.arange(self.rows)  # the row each final row came from, step by step back
        step_tokens, step_scores = np.empty((self.rows, count), dtype=np.int64), np.empty((self.rows, count))
        for t in range(count - 1, -1, -1):
            step_tokens[:, t], step_scores[:, t] = tokens[t, lineage], scores[t, lineage]
            lineage = origins[t, lineage]
        self._history, self._history_scores = self._history[lineage], self._history_scores[lineage]
        at = (np.arange(self.rows)[:, None], self._steps[:, None] + np.arange(count))
        self._history[at], self._history_scores[at] = step_tokens, step_scores
        self._totals = np.array(totals)
        self._steps = self._steps + count
        self._age += count
        for s in self._sentences:
            s.step += count

    def _finished_hypothesis(self, finished: _Finished, steps: list[tuple[list[int], list[int], list[float]]],
                             ) -> ScoredSequence:
        """The hypothesis that ended in EOS at quiet step ``finished.step``: its row's history back through the
        quiet steps before it, then the books' history of the row it came from (before they are written)."""
        row, tokens, scores = finished.row, [], []
        for origin, step_tokens, step_scores in reversed(steps[:finished.step]):
            tokens.append(step_tokens[row])
            scores.append(step_scores[row])
            row = origin[row]
        start = int(self._steps[row])
        return ScoredSequence(tokens=self._history[row, :start].tolist() + tokens[::-1] + [self.eos_id],
                              score=finished.score,
                              token_scores=self._history_scores[row, :start].tolist() + scores[::-1]
                              + [finished.eos_score])


@dataclass(frozen=True)
class _Finished:
    """A hypothesis that ended in EOS during quiet beam steps, until :meth:`PlainSteps._quiet_beam_steps` writes
    its tokens (its row's history then runs through the steps' origins)."""

    score: float  # normalised, as a ScoredSequence's
    step: int  # the quiet step (of those in the books' write) whose selection finished it
    row: int  # the row it extended at that step
    eos_score: float  # EOS's log-probability


def _score(hypothesis: Any) -> float:
    return hypothesis.score
