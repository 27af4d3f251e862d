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
(:meth:`RunningDecode._plain_beam`, :mod:`server.engine.beam_steps`): the same selection in plain Python
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
:class:`server.engine.search.Resume`): it starts at step ``T`` from the pass's state; when the pass already ran
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
prefix when it grew (:mod:`server.engine.stable_prefix`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from server.controls import Controls, process, top_k
from server.engine.general_steps import GeneralSelection
from server.engine.plain_steps import PlainSteps
from server.engine.row_layout import Layout, fill_holes, lay_out
from server.engine.search import NEG_INF, BeamSentence, Resume, StepModel, StepOutput
from server.engine.stable_prefix import stable_length
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
) -> list[SearchResult | None]:
    """Decode ``len(sentences)`` sentences together (the static batch: a running decode that admits them
    all before its first step), each with ``beam_size`` and ``need_attention`` (None: each sentence's own);
    ``encoded`` holds every static input and the initial value of every state entry, batch first
    (``resume``: start after tokens already decided). Returns one result per sentence, ``None`` for a
    sentence whose ``is_cancelled`` turned true."""
    # a device's step costs the same at any row count: a row that runs on after its sentence ended costs nothing
    # there, where ending the run costs the host 0.5-0.9 ms (benchmarks/README.md, "decode cuts"); a CPU's step
    # costs about its rows, and the results come back together at the end of the batch either way
    decode = RunningDecode(model, start_id=start_id, eos_id=eos_id, lean_greedy=lean_greedy, plain_beam=plain_beam,
                           hold_ended=getattr(model, "device", "cpu") != "cpu")
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
    full_until: float  # steps that need the whole distribution: all (a control reshapes it), or the forced
    # prefix and the partial word it ends with
    forced_length: int  # the forced prefix's steps: their tokens add nothing to the score
    penalised: bool  # a repetition penalty: steps after the first need the logits
    step: int = 0  # tokens decoded so far
    joined_at: int = 0  # its step when it joined (> 0 after a forced pass): it holds 1 row until it expands
    finished: list[ScoredSequence] = field(default_factory=list)
    stable: int = 0  # tokens of its stable prefix reported so far (spec.on_stable)
    ended: SearchResult | None = None  # its result, when it ended in plain arg-max steps that held its row
    handed: bool = False  # its result went to on_ended already: it leaves without it

    @property
    def controls(self) -> Controls:
        return self.spec.controls

    def cancelled(self) -> bool:
        return self.spec.is_cancelled is not None and self.spec.is_cancelled()


class RunningDecode(PlainSteps, GeneralSelection):
    """A resumable batched search over ``model``: :meth:`admit` sentences, then :meth:`step` until
    :attr:`rows` is 0 (see the module docstring)."""

    def __init__(self, model: StepModel, *, start_id: int, eos_id: int, lean_greedy: bool = True,
                 plain_beam: bool = True, hold_ended: bool = False,
                 on_ended: Callable[[list[tuple[Any, SearchResult]]], None] | None = None) -> None:
        self.model = model
        self.start_id, self.eos_id = start_id, eos_id
        # a sentence that ends in plain arg-max steps leaves when the run ends, its row running on unread
        # meanwhile (PlainSteps._plain_greedy); on_ended gets its (tag, result) at the step it ended
        self.hold_ended, self.on_ended = hold_ended, on_ended
        self.lean_greedy = lean_greedy  # False: beam-1 sentences take the general path (tests compare both)
        self.plain_beam = plain_beam and bool(getattr(model, "plain_beam", False))  # False: beam sentences
        # take the general step every step (tests compare both)
        self.device_beam = plain_beam and bool(getattr(model, "device_beam", False))  # their selection on the
        # device (server.engine.device_search)
        self.per_row_positions = bool(getattr(model, "per_row_positions", False))
        self._sentences: list[_Sentence] = []  # one per row block, in row order
        self._row_sentence = np.zeros(0, dtype=np.int64)  # index into _sentences of each row
        self._static: dict[str, Any] | None = None
        self._own_static = False  # False while _static holds the caller's arrays (the first admission's)
        self._state: dict[str, Any] | None = None
        self._tokens = np.zeros(0, dtype=np.int64)  # previous token of each row
        self._steps = np.zeros(0, dtype=np.int64)  # each row's step: its sentence's tokens so far
        self._totals = np.zeros(0)  # summed log-probability of each row's hypothesis
        self._history = np.zeros((0, 0), dtype=np.int64)  # [R, capacity] tokens so far
        self._history_scores = np.zeros((0, 0))
        self._attention: np.ndarray | None = None  # [R, capacity, S] while a sentence asks for attention
        self._given: StepOutput | None = None  # the next step, already run by a forced pass (Resume.first)
        self._layout: Layout | None = None  # None: work it out at the next step (server.engine.row_layout)
        self._age = 0  # steps run since the layout was worked out
        self.steps_run = 0  # decoding steps run so far
        self.selections_run = 0  # of which the general selection chose the hypotheses

    @property
    def rows(self) -> int:
        """Decoder rows in use (a sentence holds 1 before its first step, then its beam size)."""
        return int(self._tokens.size)

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
            self._sentences.append(_Sentence(
                tag, s, s.beam_size, s.need_attention, s.limit(), max(s.beam_size, round(s.beam_size * s.patience)),
                s.controls.rng() if s.controls.samples else None, _full_until(s.controls), len(s.controls.forced),
                s.controls.repetition_penalty != 1.0))
        n = len(sentences)
        capacity = max(self._history.shape[1], *(s.limit for s in self._sentences[first:]))
        self._row_sentence = np.concatenate([self._row_sentence, np.arange(first, first + n)])
        self._history = _grow(self._history, n, capacity)
        self._history_scores = _grow(self._history_scores, n, capacity)
        if self._attention is not None:
            self._attention = _grow(self._attention, n, capacity)
        t = 0 if resume is None else resume.tokens.shape[1]
        self._steps = np.concatenate([self._steps, np.full(n, t, dtype=np.int64)])
        if resume is None:
            self._tokens = np.concatenate([self._tokens, np.full(n, self.start_id, dtype=np.int64)])
            self._totals = np.concatenate([self._totals, np.zeros(n)])
            return
        rows = slice(self.rows, self.rows + n)  # the new rows: one per sentence
        forced = np.array([s.forced_length for s in self._sentences[first:]])
        scores = resume.token_scores.astype(np.float64)
        self._tokens = np.concatenate([self._tokens, resume.tokens[:, -1].astype(np.int64)])
        self._totals = np.concatenate([self._totals, np.where(np.arange(t) < forced[:, None], 0.0, scores).sum(1)])
        self._history[rows, :t], self._history_scores[rows, :t] = resume.tokens, scores
        if resume.attention is not None:
            self._fit_attention(resume.attention.shape[2])
            self._attention[rows, :t, : resume.attention.shape[2]] = resume.attention
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
        layout, age, steps = self._layout, self._age, self._steps
        if not layout.attention:
            self._attention = None
        plain_steps = self._plain(layout)
        if plain_steps is not None:
            out, processed = plain_steps(layout, until_leave, stop), None
            if out is None:  # every step was quiet
                return []
            age, steps = self._age, self._steps
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
            self._fit_attention(attention.shape[1])

        left: list[tuple[Any, SearchResult | None]] = []
        kept: list[int] = []  # sentences that stay, in their new row order
        parts: list[tuple[np.ndarray, ...]] = []  # (origin row, token, token score, total) of the new rows
        prefix = age < layout.given_for  # some sentence decodes its forced prefix
        if layout.lean.size:
            parts.append(self._greedy(layout.lean, layout.starts, row_tokens, row_scores, processed, attention,
                                      prefix, left, kept))
        for beam, width, group in layout.groups:
            parts.append(self._beam(group, beam, width, layout.starts, row_tokens, row_scores, attention, prefix,
                                    left, kept))
        self._advance(kept, parts, layout, attention)
        self._age += 1
        self._report_stable()
        return left

    def _report_stable(self) -> None:
        """Give each streaming sentence (``on_stable``) its stable prefix when it grew
        (:func:`server.engine.stable_prefix.stable_length`)."""
        streaming = [j for j, s in enumerate(self._sentences) if s.spec.on_stable is not None]
        if not streaming:
            return
        ends = np.searchsorted(self._row_sentence, np.arange(len(self._sentences) + 1))  # a sentence's rows are
        for j in streaming:  # one block, sentences in row order
            s = self._sentences[j]
            if s.controls.min_length >= s.limit:  # no hypothesis can end: the result is empty, nothing was stable
                continue
            first = int(ends[j])
            length = stable_length(self._history[first:int(ends[j + 1]), : s.step], s.finished)
            if length > s.stable:
                s.stable = length
                rows = self._attention[first, :length, : s.spec.source_length].copy() if (
                    s.attention and self._attention is not None) else None
                s.spec.on_stable(self._history[first, :length].tolist(), self._history_scores[first, :length].tolist(),
                                 rows)

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
            out = self.model.step(self._tokens, self._static, self._state, layout.attention, k, **extra,
                                  **({"full": True} if full else {}), **({"logits": True} if logits else {}))
        if not full:
            return out, None
        sentences = [self._sentences[j] for j in self._row_sentence]
        processed = np.empty(out.log_probs.shape)
        for t in np.unique(steps):  # controls read a row's history and its step: one call per step
            rows = np.flatnonzero(steps == t)
            processed[rows] = process(out.log_probs[rows], self._history[rows], [sentences[r].controls for r in rows],
                                      int(t), self.eos_id, out.logits[rows] if out.logits is not None else None)
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
            self._row_sentence, self._tokens, self._totals = row_sentence, tokens.astype(np.int64), totals
            self._steps = self._steps[:0]
            self._history = self._history[:0]
            self._history_scores = self._history_scores[:0]
            self._attention = None
            return
        # only beam-1 sentences, all staying: each keeps its one row
        moved = not (stay and not layout.groups) and (
            origin.size != self.rows or bool((origin != np.arange(origin.size)).any()))
        steps = self._steps[origin] if moved else self._steps  # the step each row decoded
        rows = np.arange(origin.size)
        if moved:
            self._history, self._history_scores = self._history[origin], self._history_scores[origin]
            if self._attention is not None:
                self._attention = self._attention[origin]
        self._history[rows, steps] = tokens
        self._history_scores[rows, steps] = scores
        if self._attention is not None and attention is not None:
            self._attention[rows, steps, : attention.shape[1]] = attention[origin]
        if moved:
            self._state = self.model.select_rows(self._state, origin)
            self._select_static(origin)
        self._row_sentence, self._tokens, self._totals = row_sentence, tokens.astype(np.int64, copy=False), totals
        self._steps = steps + 1
        for s in self._sentences:
            s.step += 1

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
        for name, axis in getattr(self.model, "static_src_axes", {}).items():
            value = static.get(name)
            if isinstance(value, np.ndarray) and 4 * widest <= 3 * value.shape[axis]:
                trimmed[name] = np.ascontiguousarray(value[(slice(None),) * axis + (slice(0, widest),)])
        return trimmed

    def _fit_attention(self, width: int) -> None:
        """Make the attention history hold every row and ``width`` source positions."""
        if self._attention is None:
            self._attention = np.zeros((self.rows, self._history.shape[1], width), dtype=np.float32)
        elif self._attention.shape[2] < width:
            pad = np.zeros((*self._attention.shape[:2], width - self._attention.shape[2]), dtype=np.float32)
            self._attention = np.concatenate([self._attention, pad], axis=2)


def _full_until(c: Controls) -> float:
    """The steps before which a sentence under ``c`` needs the whole distribution (see ``_Sentence``)."""
    if c.reshapes:
        return math.inf
    return max(len(c.forced), c.completion.start + c.completion.steps() if c.completion is not None else 0)


def _grow(array: np.ndarray, rows: int, capacity: int) -> np.ndarray:
    """``array`` [R, C, ...] with ``rows`` zero rows appended and its second axis zero-padded to ``capacity``."""
    shape = array.shape
    if capacity > shape[1]:
        array = np.concatenate([array, np.zeros((shape[0], capacity - shape[1], *shape[2:]), dtype=array.dtype)], 1)
    return np.concatenate([array, np.zeros((rows, *array.shape[1:]), dtype=array.dtype)])
