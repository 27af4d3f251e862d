"""The running decode: a batched beam search (greedy = beam 1) that sentences join and leave between steps.

:func:`beam_search` (the static batch) is a running decode that admits every sentence
before its first step; the continuous scheduler (:mod:`server.core.continuous`) admits sentences whenever
rows are free. Both run the same selection code, so a sentence gets the same hypotheses and scores
whichever companions it decodes with and whenever it joined: every rule below reads only the
sentence's own rows and its own step.

Rows. A sentence owns ``width`` contiguous rows: 1 before its first expansion, then its beam size.
The sentences that stay keep their rows from step to step; when one leaves, the last sentence moves
into its rows if it needs as many (:func:`server.engine.row_layout.fill_holes`), so the state's in-place
buffers move one sentence's rows instead of every row behind the one that left. What a step reads of
its sentences' settings (:class:`server.engine.row_layout.Layout`) is worked out again only when sentences
join, leave or first expand.
Sentences of different beam sizes, lengths, penalties, controls, target prefixes and source lengths
share one decode; each step runs the model once on all rows, with each row's own step as its target
position (``positions``; models that cannot take per-row positions only ever decode sentences that
started together). The step asks for the ``2 x beam`` best tokens of the widest beam; a sentence
reads the ``2 x beam`` best of its own rows.

Search rules. The selection is :mod:`server.engine.beam_select` (which continuations finish, which live on,
when a sentence is done; a sentence's quota of finished hypotheses is ``round(beam x patience)``); this
module keeps the books around it. With ``beam_size == 1`` the rules reduce to arg-max decoding (the best
token is kept; when it is EOS the sentence is done), which runs through a lean path of a few array
operations per step instead of the general candidate bookkeeping. When every sentence decodes that way
without controls, prefix, attention or streaming, the model's own arg-max steps run instead
(:meth:`RunningDecode._plain_greedy`): the host reads each row's token and score, and only the step in
which a sentence may leave goes through the selection. When some sentence searches a beam of 2 or more,
none has those, and the wider beams have expanded, the quiet steps are plain beam steps
(:meth:`RunningDecode._plain_beam`, :mod:`server.engine.host_runs`): the same selection in plain Python
lists while no EOS is among a sentence's best, and only the others go through
:func:`server.engine.beam_select.select_beam`.

Source width. Joining sentences pad every row's encoder outputs to the widest source in the decode;
when the widest sentences leave, the padding is cut again (:meth:`RunningDecode._trim_sources`).

Attention. The attention graph runs while any sentence in the decode asked for attention (the
attention output costs 0-3 % of a step, benchmarks/README.md); only those sentences keep it. A
hypothesis' attention is [its tokens, its own source length]: it never depends on its companions.

Given tokens. A forced target prefix is decoded like any token (one row, its token whatever its
probability) but adds nothing to the hypothesis' score, whose length counts it (CTranslate2's rule). A
sentence may also join after its first ``T`` tokens were decided by a forced pass (:mod:`server.engine.forced`,
:class:`server.engine.step_model.Resume`): it starts at step ``T`` from the pass's state; when the pass already ran
step ``T`` (``Resume.first``), the decode reads that step off it instead of calling the model, which
requires those sentences to be all the decode holds (the static batch); ``first=None`` joins anywhere.

Leaving. After each step every sentence's ``is_cancelled`` is polled once; finished and cancelled
sentences leave at once and :meth:`RunningDecode.step` returns them (``None`` for a cancelled one),
so their rows are free for the next admission. With ``hold_ended`` (a device, whose step costs the same at
any row count) a sentence that ends in plain arg-max steps, by EOS or at its output limit, leaves when the run of
steps ends instead, its row running on unread meanwhile (:meth:`RunningDecode._plain_greedy`; such runs go on
past the rows' limits, so one run decodes a static batch whatever its sentences' limits): the static batch's
results come back together at its end anyway, and continuous batching hands each such sentence's result to
``on_ended`` at the step it ended, so its caller does not wait for the run's end (the next admission, in practice).

Stable prefix. After each step, a sentence that streams (``BeamSentence.on_stable``) is told its stable
prefix when it grew (:func:`server.engine.books.stable_length`).

Books. Each row's hypothesis so far is kept in :class:`server.engine.books.Books`; every path below hands the
steps it ran to their one writer.


Plain runs. When nothing in the decode needs the general step, its steps run as a plain run whose host work is
cut to reading each row's best tokens (:meth:`RunningDecode._plain` picks one):

* plain arg-max steps (:meth:`RunningDecode._plain_greedy`): every sentence at beam 1; the model's own arg-max
  feeds the next step (:class:`server.engine.host_runs.GreedySteps`) and the host reads each row's token
  and score;
* plain beam steps (:meth:`RunningDecode._plain_beam`): some sentence at a beam of 2 or more, every such sentence
  expanded (a beam-1 sentence is a beam of one row there); the selection runs in plain Python lists
  (:mod:`server.engine.host_runs`);
* the selection on the device (:meth:`RunningDecode._device_beam`): every sentence at one beam of 2 or more,
  expanded, on a model that keeps its state on a device and selects there; the host reads the done flags
  (:mod:`server.engine.device_runs`).

All run while their steps are *quiet* (no sentence ends, is done or is cancelled; the beam paths finish
hypotheses within them), write the quiet steps into the books together, and hand the first step that is not
quiet back to the general selection (:meth:`RunningDecode._greedy`, :meth:`RunningDecode._beam`), so the results
are the general search's, token for token, scores summed in the same order. None runs for decoding controls,
target prefixes, attention or streaming. Which runs a model has, it declares
(:class:`server.engine.step_model.Capabilities`).

"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from common.model_format.decoding import normalized_score
from server.controls import Controls, process, sample, top_k
from server.engine.beam_select import select_beam, sentence_done
from server.engine.books import Books, stable_length
from server.engine.constraints import ConstrainedRows, Progress, Terms, select_constrained
from server.engine.device_runs import DeviceBeamRun, DeviceBooks
from server.engine.host_runs import QuietChoice, quiet_selection
from server.engine.row_layout import Layout, fill_holes, lay_out
from server.engine.step_model import NEG_INF, BeamSentence, Resume, StepModel, StepOutput
from server.types import ScoredSequence, SearchResult


def beam_search(
    model: StepModel,
    encoded: dict[str, Any],
    sentences: Sequence[BeamSentence],
    *,
    start_id: int,
    eos_id: int,
    beam_size: int | None = None,
    need_attention: bool | None = None,
    lean_greedy: bool = True,
    plain_beam: bool = True,
    resume: Resume | None = None,
    joiners: frozenset[int] = frozenset(),
) -> list[SearchResult | None]:
    """Decode ``len(sentences)`` sentences together (the static batch: a running decode that admits them
    all before its first step), each with ``beam_size`` and ``need_attention`` (None: each sentence's own);
    ``encoded`` holds every static input and the initial value of every state entry, batch first
    (``resume``: start after tokens already decided; ``joiners``: see :class:`RunningDecode`). Returns one result
    per sentence, ``None`` for a sentence whose ``is_cancelled`` turned true."""
    # a device's step costs the same at any row count: a row that runs on after its sentence ended costs nothing
    # there, where ending the run costs the host 0.5-0.9 ms (benchmarks/README.md, "decode cuts"); a CPU's step
    # costs about its rows, and the results come back together at the end of the batch either way
    decode = RunningDecode(model, start_id=start_id, eos_id=eos_id, lean_greedy=lean_greedy, plain_beam=plain_beam,
                           hold_ended=model.capabilities.on_device, joiners=joiners)
    overrides = ({} if beam_size is None else {"beam_size": beam_size}) | (
        {} if need_attention is None else {"need_attention": need_attention})
    decode.admit(encoded, [replace(s, **overrides) for s in sentences], range(len(sentences)), resume)
    results: list[SearchResult | None] = [None] * len(sentences)
    while decode.rows:
        for index, result in decode.step(until_leave=True):
            results[index] = result
    return results


@dataclass(eq=False)
class _Sentence:
    """One sentence in the decode: its settings, its step and its finished hypotheses."""

    tag: Any  # the caller's handle, returned with the result
    spec: BeamSentence
    beam: int
    attention: bool
    limit: int
    quota: int  # finished hypotheses kept (beam x patience)
    rng: np.random.Generator | None
    full_until: float  # steps that need the whole distribution: those a control reshapes
    # (Controls.reshapes_until), the forced prefix and the partial word it ends with
    forced_length: int  # the forced prefix's steps: their tokens add nothing to the score
    penalised: bool  # a repetition penalty: steps after the first need the logits
    reshaped_until: float = 0.0  # the steps whose distribution its controls change (constraints read it whole)
    step: int = 0  # tokens decoded so far
    joined_at: int = 0  # its step when it joined (> 0 after a forced pass): it holds 1 row until it expands
    finished: list[ScoredSequence] = field(default_factory=list)
    stable: int = 0  # tokens of its stable prefix reported so far (spec.on_stable)
    ended: SearchResult | None = None  # its result, when it ended in plain arg-max steps that held its row
    handed: bool = False  # its result went to on_ended already: it leaves without it
    terms: Terms | None = None  # its constraints (server.engine.constraints), if any
    progress: list[Progress] = field(default_factory=list)  # each of its rows' way through them, in row order
    unmet: list[ScoredSequence] = field(default_factory=list)  # hypotheses ended at its limit without them

    @property
    def controls(self) -> Controls:
        return self.spec.controls

    def cancelled(self) -> bool:
        return self.spec.is_cancelled is not None and self.spec.is_cancelled()


class RunningDecode:
    """A resumable batched search over ``model``: :meth:`admit` sentences, then :meth:`step` until
    :attr:`rows` is 0 (see the module docstring)."""

    def __init__(self, model: StepModel, *, start_id: int, eos_id: int, lean_greedy: bool = True,
                 plain_beam: bool = True, hold_ended: bool = False,
                 on_ended: Callable[[list[tuple[Any, SearchResult]]], None] | None = None,
                 joiners: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.start_id, self.eos_id = start_id, eos_id
        self.joiners = joiners  # the target pieces that continue a word: none follows a glossary term's end
        # a sentence that ends in plain arg-max steps leaves when the run ends, its row running on unread
        # meanwhile (_plain_greedy); on_ended gets its (tag, result) at the step it ended
        self.hold_ended, self.on_ended = hold_ended, on_ended
        self.lean_greedy = lean_greedy  # False: beam-1 sentences take the general path (tests compare both)
        capabilities = model.capabilities
        self.plain_beam = plain_beam and capabilities.beam_steps  # False: beam sentences
        # take the general step every step (tests compare both)
        self.device_beam = plain_beam and capabilities.device_beam  # their selection on the
        # device (server.engine.device_runs)
        self.per_row_positions = capabilities.per_row_positions
        self.greedy_steps = capabilities.greedy_steps
        self._sentences: list[_Sentence] = []  # one per row block, in row order
        self._row_sentence = np.zeros(0, dtype=np.int64)  # index into _sentences of each row
        self._static: dict[str, Any] | None = None
        self._own_static = False  # False while _static holds the caller's arrays (the first admission's)
        self._state: dict[str, Any] | None = None
        self.books = Books()  # each row's hypothesis so far (server.engine.books)
        self._given: StepOutput | None = None  # the next step, already run by a forced pass (Resume.first)
        self._layout: Layout | None = None  # None: work it out at the next step (server.engine.row_layout)
        self._age = 0  # steps run since the layout was worked out
        self.steps_run = 0  # decoding steps run so far
        self.selections_run = 0  # of which the general selection chose the hypotheses

    @property
    def rows(self) -> int:
        """Decoder rows in use (a sentence holds 1 before its first step, then its beam size)."""
        return self.books.rows

    @property
    def reserved_rows(self) -> int:
        """Rows the decoding sentences hold once expanded (each its beam size): what admission counts. A sentence
        whose result was handed out holds none: it leaves at the end of the run of steps, before any joins."""
        return sum(s.beam for s in self._sentences if not s.handed)

    @property
    def sentences(self) -> int:
        return len(self._sentences)

    def tags(self) -> list[Any]:
        """The tags of the sentences decoding, in row order."""
        return [s.tag for s in self._sentences]

    def source_lengths(self) -> list[int]:
        """Each decoding sentence's source length (EOS included), in row order (those handed out left out)."""
        return [s.spec.source_length for s in self._sentences if not s.handed]

    def steps(self) -> list[int]:
        """Each decoding sentence's step (tokens decoded), in row order (those handed out left out)."""
        return [s.step for s in self._sentences if not s.handed]

    def admit(self, encoded: dict[str, Any], sentences: Sequence[BeamSentence], tags: Sequence[Any],
              resume: Resume | None = None) -> None:
        """Add sentences before the next step: ``encoded`` holds their static inputs and initial state,
        one row each (batch first, as the model's encoder returns them); with ``resume`` they start after
        their given tokens, from its state (see the module docstring)."""
        if not sentences:
            return
        if resume is not None and resume.first is not None and self._sentences:
            raise ValueError("a resume whose first step was run by the forced pass joins only an empty decode")
        for s in sentences:
            if not 1 <= s.num_hypotheses <= s.beam_size:
                raise ValueError("need 1 <= num_hypotheses <= beam_size")
            if s.beam_size > 1 and s.controls.samples:
                raise ValueError("sampling needs beam_size 1")
            if s.controls.constraints and s.beam_size < 2:
                raise ValueError("constraints need beam_size 2 or more")
        if self._sentences and not self.per_row_positions:
            raise ValueError("this model decodes all rows at one step: sentences join only an empty decode")
        static = {name: encoded[name] for name in self.model.static_names}
        state = resume.state if resume is not None else {name: encoded[name] for name in self.model.state_names}
        if not self._sentences:
            self._static, self._state, self._own_static = static, state, False
        else:
            self._static = self.model.concat_rows(self._static, static)
            self._state = self.model.concat_rows(self._state, state)
            self._own_static = True
        first = len(self._sentences)
        self._layout = None
        for s, tag in zip(sentences, tags, strict=True):
            attention = s.need_attention or bool(s.controls.constraint_sources)  # a glossary's placement reads it
            self._sentences.append(_Sentence(
                tag, s, s.beam_size, attention, s.limit(), max(s.beam_size, round(s.beam_size * s.patience)),
                s.controls.rng() if s.controls.samples else None, _full_until(s.controls), len(s.controls.forced),
                s.controls.repetition_penalty != 1.0, _reshaped_until(s.controls)))
            if s.controls.constraints:
                added = self._sentences[-1]
                added.terms = Terms(s.controls.constraints, s.controls.constraint_sources, self.joiners)
                added.progress = [added.terms.start() if resume is None else
                                  added.terms.follow(resume.tokens[len(self._sentences) - 1 - first])]
        n = len(sentences)
        capacity = max(s.limit for s in self._sentences[first:])
        self._row_sentence = np.concatenate([self._row_sentence, np.arange(first, first + n)])
        if resume is None:
            self.books.add(np.full(n, self.start_id), np.zeros(n), 0, capacity)
            return
        t = resume.tokens.shape[1]
        rows = slice(self.rows, self.rows + n)  # the new rows: one per sentence
        forced = np.array([s.forced_length for s in self._sentences[first:]])
        scores = resume.token_scores.astype(np.float64)
        self.books.add(resume.tokens[:, -1], np.where(np.arange(t) < forced[:, None], 0.0, scores).sum(1), t, capacity)
        self.books.give(rows, resume.tokens, scores, resume.attention)
        for s in self._sentences[first:]:
            s.step = s.joined_at = t
        self._given = resume.first

    def step(self, until_leave: bool = False, stop: Callable[[], bool] | None = None,
             ) -> list[tuple[Any, SearchResult | None]]:
        """One decoding step of every row; with ``until_leave``, plain greedy steps (:meth:`_plain_greedy`) go
        on until a sentence leaves or ``stop()`` (asked after each step) is true. Returns the sentences that
        left: (tag, result), result None for a cancelled sentence, except those whose results went to
        :attr:`on_ended` already. :attr:`steps_run` counts the steps, :attr:`selections_run` those whose
        hypotheses the general selection chose."""
        sentences = self._sentences
        if not sentences:
            return []
        if self._layout is None:
            self._layout, self._age = lay_out(sentences, self._row_sentence, self.lean_greedy), 0
        layout, age, steps = self._layout, self._age, self.books.steps
        if not layout.attention:  # no sentence asks for attention any longer
            self.books.attention = None
        plain_steps = self._plain(layout)
        if plain_steps is not None:
            out, processed = plain_steps(layout, until_leave, stop), None
            if out is None:  # every step was quiet
                return []
            age, steps = self._age, self.books.steps
        else:
            out, processed = self._model_step(steps, layout, age)
            self.steps_run += 1
        self._state = out.state
        self.selections_run += 1
        row_tokens, row_scores = np.asarray(out.top_ids, dtype=np.int64), out.top_log_probs.astype(np.float64)
        if age >= layout.room and (forced := layout.limits - 1 == steps).any():  # out of room: only EOS may follow
            row_tokens = row_tokens.copy()
            row_tokens[forced] = self.eos_id
            row_scores[forced] = NEG_INF
            row_scores[forced, 0] = out.eos_log_prob[forced]
        attention = out.attention
        if attention is not None:
            self.books.fit_attention(attention.shape[1])

        left: list[tuple[Any, SearchResult | None]] = []
        kept: list[int] = []  # sentences that stay, in their new row order
        parts: list[tuple[np.ndarray, ...]] = []  # (origin row, token, token score, total) of the new rows
        prefix = age < layout.given_for  # some sentence decodes its forced prefix
        if layout.lean.size:
            parts.append(self._greedy(layout.lean, layout.starts, row_tokens, row_scores, processed, attention,
                                      prefix, left, kept))
        constrained: list[int] = []
        for beam, width, group in layout.groups:
            free = group if not layout.constrained else np.array(
                [j for j in group.tolist() if self._sentences[j].terms is None], dtype=np.int64)
            if free.size:
                parts.append(self._beam(free, beam, width, layout.starts, row_tokens, row_scores, attention, prefix,
                                        left, kept))
            if free.size < group.size:
                constrained += [j for j in group.tolist() if self._sentences[j].terms is not None]
        if constrained:
            parts += self._constrained(constrained, layout.starts, processed, row_tokens, row_scores, attention,
                                       left, kept)
        self._advance(kept, parts, layout, attention)
        self._age += 1
        self._report_stable()
        return left

    def _report_stable(self) -> None:
        """Give each streaming sentence (``on_stable``) its stable prefix when it grew
        (:func:`server.engine.books.stable_length`)."""
        streaming = [j for j, s in enumerate(self._sentences) if s.spec.on_stable is not None]
        if not streaming:
            return
        ends = np.searchsorted(self._row_sentence, np.arange(len(self._sentences) + 1))  # a sentence's rows are
        for j in streaming:  # one block, sentences in row order
            s = self._sentences[j]
            if s.controls.min_length >= s.limit:  # no hypothesis can end: the result is empty, nothing was stable
                continue
            first = int(ends[j])
            length = stable_length(self.books.history[first:int(ends[j + 1]), : s.step], s.finished)
            if length > s.stable:
                s.stable = length
                rows = self.books.attention[first, :length, : s.spec.source_length].copy() if (
                    s.spec.need_attention and self.books.attention is not None) else None
                s.spec.on_stable(self.books.history[first, :length].tolist(),
                                 self.books.history_scores[first, :length].tolist(), rows)

    # ---- one step --------------------------------------------------------------------------------

    def _model_step(self, steps: np.ndarray, layout: Layout, age: int) -> tuple[StepOutput, np.ndarray | None]:
        """The model's step under the rows' controls (``age``: steps since ``layout`` was worked out). When a
        control is active the top k and the EOS log-probability are those of the processed distribution,
        which is returned too (else None)."""
        k = layout.k
        if self._given is not None:  # a forced pass ran this step (its whole distribution)
            out, self._given = self._given, None
            full = True
        else:
            extra = {"positions": steps} if self.per_row_positions else {}
            full = age < layout.full_for
            logits = layout.penalised and any(s.penalised and s.step > 0 for s in self._sentences)
            out = self.model.step(self.books.tokens, self._static, self._state, layout.attention, k, **extra,
                                  **({"full": True} if full else {}), **({"logits": True} if logits else {}))
        if not full:
            return out, None
        if out.top_ids.shape[1] >= min(k, out.log_probs.shape[1]) and all(
                s.step >= s.reshaped_until for s in self._sentences):
            return out, out.log_probs  # the model's own top k, and nothing changes it (constraints read it whole)
        sentences = [self._sentences[j] for j in self._row_sentence]
        processed = np.empty(out.log_probs.shape)
        for t in np.unique(steps):  # controls read a row's history and its step: one call per step
            rows = np.flatnonzero(steps == t)
            processed[rows] = process(out.log_probs[rows], self.books.history[rows],
                                      [sentences[r].controls for r in rows], int(t), self.eos_id,
                                      out.logits[rows] if out.logits is not None else None)
        out.top_ids, out.top_log_probs = top_k(processed, k)
        out.eos_log_prob = processed[:, self.eos_id]
        return out, processed

    def _advance(self, kept: list[int], parts: list[tuple[np.ndarray, ...]], layout: Layout,
                 attention: np.ndarray | None) -> None:
        """Lay out the rows of the sentences that stay (``parts``, in the order of ``kept``) for the next step
        (``layout``: this step's)."""
        old = self._sentences
        origin, tokens, scores, totals = parts[0] if len(parts) == 1 else (
            np.concatenate([p[i] for p in parts]) for i in range(4))
        stay = len(kept) == len(old)  # nobody left
        beams = [old[j].beam for j in kept]  # the rows each holds next step
        order = fill_holes(kept, layout.widths, beams, len(old))
        if order != kept:
            offset = dict(zip(kept, np.cumsum([0, *beams]).tolist(), strict=False))
            perm = np.concatenate([np.arange(offset[j], offset[j] + old[j].beam) for j in order])
            origin, tokens, scores, totals = origin[perm], tokens[perm], scores[perm], totals[perm]
            kept = order
        if stay:
            row_sentence = self._row_sentence[origin]
            if self._layout is not None and not self._layout.settled:  # a sentence expanded this step
                self._layout = None
        else:
            position = np.full(len(old), -1)
            position[kept] = np.arange(len(kept))
            row_sentence = position[self._row_sentence[origin]]
            self._layout = None
        self._sentences = [old[j] for j in kept]
        if not self._sentences:
            self._static = self._state = None
            self.model.release()
            self._row_sentence = row_sentence
            self.books.keep_none()
            return
        # only beam-1 sentences, all staying: each keeps its one row
        moved = not (stay and not layout.groups) and (
            origin.size != self.rows or bool((origin != np.arange(origin.size)).any()))
        self.books.write_step(self._sentences, origin if moved else None, tokens, scores, totals, attention)
        if moved:
            self._state = self.model.select_rows(self._state, origin)
            self._select_static(origin)
        self._row_sentence = row_sentence

    def _select_static(self, origin: np.ndarray) -> None:
        """The static inputs of the rows ``origin`` when sentences moved. A sentence's rows hold the same
        static values, so a row that stays with its sentence keeps its values (it selects itself); once the
        arrays are the decode's own, the rows that change move within them."""
        held = self._row_sentence  # the sentence of each row this step
        n = min(origin.size, held.size)
        stays = held[origin[:n]] == held[:n]
        if origin.size == held.size and stays.all():
            return
        rows = origin.copy()
        rows[:n][stays] = np.flatnonzero(stays)
        self._static = self._trim_sources(self.model.select_rows(self._static, rows, in_place=self._own_static))
        self._own_static = True

    def _trim_sources(self, static: dict[str, Any]) -> dict[str, Any]:
        """``static`` cut on its source axis (the model's ``static_src_axes``) to the widest source still
        decoding, once that is a quarter narrower or more: every row's step then costs what its companions'
        sources need, not what the widest sentence that ever joined needed. Only the padding is cut (zeros,
        that no row reads), so no row's result changes; NumPy arrays only."""
        widest = max(s.spec.source_length for s in self._sentences)
        trimmed = dict(static)
        for name, axis in self.model.static_src_axes.items():
            value = static.get(name)
            if isinstance(value, np.ndarray) and 4 * widest <= 3 * value.shape[axis]:
                trimmed[name] = np.ascontiguousarray(value[(slice(None),) * axis + (slice(0, widest),)])
        return trimmed

    def _plain(self, layout: Layout) -> Callable[..., StepOutput | None] | None:
        """The plain steps that run this step, if any: plain arg-max decoding (:meth:`_plain_greedy`), plain beam
        steps (:meth:`_plain_beam`) or the selection on the device (:meth:`_device_beam`), for a layout that
        allows them (:attr:`Layout.plain`, :attr:`Layout.plain_beam`, :attr:`Layout.device_beam`) past its
        controls' and prefixes' steps, no row at its last step (but where arg-max steps hold ended rows: they end
        such rows themselves), on a model that has them
        (:meth:`server.engine.onnx_step_model.OnnxStepModel.greedy_steps`, ``beam_steps``,
        :meth:`server.engine.device_step_model.DeviceStepModel.beam_run`)."""
        age = self._age
        if not (layout.full_for <= age and age >= layout.given_for and self._given is None):
            return None
        room = age < layout.room  # no row at its last step
        if layout.plain and self.greedy_steps and (room or self.hold_ended):
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
        score (:class:`server.engine.host_runs.GreedySteps`; on a device, steps launched in blocks and read in
        one copy: :mod:`server.engine.device_runs`): a step in which no row chose EOS (or nothing)
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
            last = (ceilings - self.books.steps).tolist()  # each row's last step, counted from this run's first
            for row, end in enumerate(last):
                limits.setdefault(end, []).append(row)
            if until_leave:  # to the last row's last step: there every row ends or is held
                count = max(last) + 1
        tokens: list[list[int]] = []  # the quiet steps' tokens and scores, as lists (GreedySteps.read)
        token_scores: list[list[float]] = []
        checks = [s.spec.is_cancelled for s in self._sentences if s.spec.is_cancelled is not None]
        held: set[int] = set()  # rows whose sentence ended during the run (EOS, or its limit)
        books = self.books
        with self.model.greedy_steps(books.tokens, self._static, self._state, books.steps, count, ceilings) as run:
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
                        self._wrote(len(tokens))
                        self.books.write_greedy_run(self._sentences, tokens, token_scores)
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
            self._state = run.state()
            self._wrote(len(tokens))
            self.books.write_greedy_run(self._sentences, tokens, token_scores, run.ids.copy())
        return None

    def _wrote(self, count: int) -> None:
        """Count the ``count`` steps a plain run wrote into the books as steps since the layout was worked out."""
        self._age += count

    def _hold(self, rows: list[int], tokens: list[list[int]], scores: list[list[float]]) -> None:
        """The hypotheses of the sentences whose rows ``rows`` ended in EOS (chosen, or at their limits) at the last
        of the quiet steps ``tokens`` / ``scores`` of :meth:`_plain_greedy` (not yet in the books), made as the
        general step makes them (the scores summed in its order); each sentence leaves with its own when the run
        ends, and where :attr:`on_ended` is set it gets them now."""
        handed = []
        for row in rows:
            s, before = self._sentences[int(self._row_sentence[row])], int(self.books.steps[row])
            run_tokens, run_scores = [step[row] for step in tokens], [step[row] for step in scores]
            total = float(self.books.totals[row])
            for score in run_scores:
                total += score
            length = before + len(run_tokens)
            s.ended = SearchResult([ScoredSequence(
                tokens=self.books.history[row, :before].tolist() + run_tokens,
                token_scores=self.books.history_scores[row, :before].tolist() + run_scores,
                score=float(normalized_score(total, length, s.spec.length_penalty)))])
            if self.on_ended is not None:
                s.handed = True
                handed.append((s.tag, s.ended))
        if handed:
            self.on_ended(handed)

    def _plain_beam(self, layout: Layout, until_leave: bool, stop: Callable[[], bool] | None,
                    ) -> StepOutput | None:
        """Plain beam steps (:meth:`_plain`, :mod:`server.engine.host_runs`): each step's hypotheses are chosen
        in plain Python while the step is *quiet*: no sentence leaves (done, cancelled) and no beam-1 sentence
        chooses EOS. Hypotheses that end in EOS join their sentence's finished ones (:class:`_Finished` until
        the books are written), and the quiet steps go into the books together. Runs one step, or with
        ``until_leave`` steps until one that is not quiet, the step before some row's last, or ``stop()`` after
        a quiet step. Returns the output of the step that was not quiet, for :meth:`step` to select from as
        any other; None when every step was quiet."""
        count = layout.room - self._age if until_leave else 1
        run = self.model.beam_steps(self.books.tokens, self._static, self._state, self.books.steps, layout.k, count)
        blocks = list(zip(layout.starts.tolist(), [s.beam for s in self._sentences], strict=True))
        checks = [s.spec.is_cancelled for s in self._sentences if s.spec.is_cancelled is not None]
        totals = self.books.totals.tolist()
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
        self._state = run.state()  # puts the rows back in the decode's order, their last tokens too
        self._quiet_beam_steps(steps, totals, run.ids.copy())
        return None

    def _device_beam(self, layout: Layout, until_leave: bool, stop: Callable[[], bool] | None,
                     ) -> StepOutput | None:
        """Beam steps whose selection runs on the device (:mod:`server.engine.device_runs`): the step's best
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
                DeviceBooks(self.books.tokens, self.books.totals, self.books.history, self.books.history_scores,
                      np.array([s.step for s in sentences], dtype=np.int64), [s.finished for s in sentences]),
                [s.spec.length_penalty for s in sentences], [s.quota for s in sentences], self._static, self._state,
                self.books.steps, layout.k, count) as run:
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
        assert len(books.finished) == len(self._sentences)
        self._wrote(count)
        self.books.write(count, self._sentences, books.history, books.history_scores, books.totals, books.tokens,
                         finished=books.finished)

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

    def _quiet_beam_steps(self, steps: list[tuple[list[int], list[int], list[float]]], totals: list[float],
                          tokens: np.ndarray | None = None) -> None:
        """Write the quiet steps of :meth:`_plain_beam` into the books (each step's origins, tokens and scores, each
        row's total after them, its last token where the run goes on from there), the hypotheses that finished
        during them first (:class:`_Finished` -> :class:`server.types.ScoredSequence`: they read the books before)."""
        for s in self._sentences:
            s.finished = [self._finished_hypothesis(h, steps) if isinstance(h, _Finished) else h for h in s.finished]
        self._wrote(len(steps))
        self.books.write_beam_run(self._sentences, steps, totals, tokens)

    def _finished_hypothesis(self, finished: _Finished, steps: list[tuple[list[int], list[int], list[float]]],
                             ) -> ScoredSequence:
        """The hypothesis that ended in EOS at quiet step ``finished.step``: its row's history back through the
        quiet steps before it, then the books' history of the row it came from (before they are written)."""
        row, tokens, scores = finished.row, [], []
        for origin, step_tokens, step_scores in reversed(steps[:finished.step]):
            tokens.append(step_tokens[row])
            scores.append(step_scores[row])
            row = origin[row]
        start = int(self.books.steps[row])
        return ScoredSequence(tokens=self.books.history[row, :start].tolist() + tokens[::-1] + [self.eos_id],
                              score=finished.score,
                              token_scores=self.books.history_scores[row, :start].tolist() + scores[::-1]
                              + [finished.eos_score])

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
        totals = self.books.totals[at] + (scores if given is None else np.where(given, 0.0, scores))
        stop = (tokens == self.eos_id) | (scores == NEG_INF)  # EOS, or nothing left to choose
        stay = []
        for i, (j, r, stops) in enumerate(zip(group.tolist(), rows.tolist(), stop.tolist(), strict=True)):
            s = self._sentences[j]
            if s.rng is not None and scores[i] > NEG_INF and s.step < s.limit - 1:
                tokens[i] = sample(processed[r], s.controls, s.rng)
                scores[i] = processed[r, tokens[i]]
                totals[i] = self.books.totals[r] + (0.0 if given is not None and given[i] else scores[i])
                stops = tokens[i] == self.eos_id
            if s.ended is not None:  # its row was held after its EOS (_plain_greedy)
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
        choice = select_beam(self.books.totals, row_tokens, row_scores, starts[group][:, None] + np.arange(width),
                             given, beam, self.eos_id)
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

    def _constrained(self, js: list[int], starts: np.ndarray, processed: np.ndarray, row_tokens: np.ndarray,
                     row_scores: np.ndarray, attention: np.ndarray | None, left: list[tuple[Any, SearchResult | None]],
                     kept: list[int]) -> list[tuple[np.ndarray, ...]]:
        """The step of the sentences ``js``, which have constraints
        (:func:`server.engine.constraints.select_constrained` on their rows' top k and processed distribution),
        then their books. At its last step a hypothesis without its terms ends too, kept apart: the result holds
        such hypotheses only when none met them, each flagged (``ScoredSequence.terms_met``)."""
        sentences = [self._sentences[j] for j in js]
        choices = select_constrained(
            [ConstrainedRows(s.terms, s.progress, int(starts[j]), s.step < s.forced_length, s.beam,
                             s.step >= s.limit - 1, s.spec.source_length) for j, s in zip(js, sentences, strict=True)],
            self.books.totals, processed, row_tokens, row_scores, self.eos_id, attention)
        parts = []
        for j, s, choice in zip(js, sentences, choices, strict=True):
            first = int(starts[j])
            for r, total, eos_score, met in choice.finished:
                hypothesis = self._hypothesis(s, first + r, self.eos_id, eos_score, total, attention)
                if met:
                    s.finished.append(hypothesis)
                else:
                    s.unmet.append(replace(hypothesis, terms_met=False))
            if s.finished:
                s.finished.sort(key=_score, reverse=True)
                del s.finished[s.quota:]
            if s.cancelled():
                left.append((s.tag, None))
            elif sentence_done(choice.best_live, s.finished, s.quota, s.step + 1, s.spec.length_penalty):
                ended = s.finished or sorted(s.unmet, key=_score, reverse=True)
                left.append((s.tag, SearchResult(ended[: s.spec.num_hypotheses])))
            else:
                kept.append(j)
                live = choice.live + [(0, self.start_id, NEG_INF, NEG_INF, s.terms.start())] * (
                    s.beam - len(choice.live))
                s.progress = [p for *_, p in live]
                parts.append((np.array([first + r for r, *_ in live], dtype=np.int64),
                              np.array([t for _, t, *_ in live]), np.array([c[2] for c in live]),
                              np.array([c[3] for c in live])))
        if not parts:  # every one left
            empty = np.zeros(0, dtype=np.int64)
            parts.append((empty, empty, np.zeros(0), np.zeros(0)))
        return parts

    def _hypothesis(self, s: _Sentence, row: int, token: int, score: float, total: float,
                    attention: np.ndarray | None) -> ScoredSequence:
        """The hypothesis of ``row`` (of ``s``) ending in ``token`` this step (``attention``: the step's)."""
        return self.books.hypothesis(row, s.step, token, score, total, s.spec.length_penalty,
                                     attention if s.spec.need_attention else None, s.spec.source_length)


def _full_until(c: Controls) -> float:
    """The steps before which a sentence under ``c`` needs the whole distribution (see ``_Sentence``): those
    :func:`_reshaped_until`, and every step under constraints (the tokens that advance them may lie outside the
    best few)."""
    return math.inf if c.constraints else _reshaped_until(c)


def _reshaped_until(c: Controls) -> float:
    """The steps before which ``c`` changes the distribution: its reshaping controls, the forced prefix and the
    partial word it ends with."""
    return max(c.reshapes_until, len(c.forced),
               c.completion.start + c.completion.steps() if c.completion is not None else 0)


@dataclass(frozen=True)
class _Finished:
    """A hypothesis that ended in EOS during quiet beam steps, until :meth:`RunningDecode._quiet_beam_steps` writes
    its tokens (its row's history then runs through the steps' origins)."""

    score: float  # normalised, as a ScoredSequence's
    step: int  # the quiet step (of those in the books' write) whose selection finished it
    row: int  # the row it extended at that step
    eos_score: float  # EOS's log-probability


def _score(hypothesis: Any) -> float:
    return hypothesis.score
