"""Batched beam search (greedy = beam 1) in NumPy, shared by every architecture.

The model is reached only through :class:`StepModel`; the search never knows whether it drives a
Transformer or an RNN. Length and scoring rules are those of :mod:`nmt.model_format.decoding`, as in
the PyTorch reference (``training/search.py``). Each step walks the ``2 * beam`` best continuations
of a sentence in order, finishing those that end in EOS and keeping the others until ``beam`` are
live; a sentence is done once it holds ``beam`` finished hypotheses and its best live beam, scored
as if it ended now, is no better than the worst of them (or nothing is live). Finished and
cancelled sentences leave the batch, so later steps run on fewer rows.

With ``beam_size == 1`` these rules reduce to arg-max decoding (the best token is kept; when it is
EOS the sentence is done, since no live continuation can beat it), which :func:`beam_search` runs
through a lean loop of a few array operations per step instead of the general candidate bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from nmt.model_format.decoding import max_target_length, normalized_score
from server.controls import Controls, needs_full, process, sample, top_k

NEG_INF = -np.inf


@dataclass
class StepOutput:
    """One decoding step of ``R`` rows, as the search reads it: the best few tokens of each row, not
    the whole distribution (exported decoders compute them in the graph with ``TopK``)."""

    top_ids: np.ndarray  # int64 [R, k]: each row's k most likely next tokens, best first (ties: lower id)
    top_log_probs: np.ndarray  # float [R, k]: their log-probabilities
    eos_log_prob: np.ndarray  # float [R]: log-probability of EOS (for rows out of room)
    attention: np.ndarray | None  # float32 [R, S] cross-attention, when asked for
    state: dict[str, Any]  # next recurrent state [R, ...], kept where the model keeps it
    log_probs: np.ndarray | None = None  # float [R, V]: the whole distribution, when asked for (``full``)


class StepModel(Protocol):
    """What beam search needs from a model.

    Shapes: ``R`` live rows (sentences x their live beams), ``S`` source length, ``V`` vocabulary.
    The ``static`` and ``state`` tensors are whatever the model keeps them as (NumPy arrays, or
    buffers on a GPU): the search only hands them back and picks rows through :meth:`select_rows`.
    """

    static_names: list[str]  # encoder outputs fed unchanged every step, [N, ...] per sentence
    state_names: list[str]  # recurrent state, [R, ...] per row

    def step(
        self, tokens: np.ndarray, static: dict[str, Any], state: dict[str, Any], need_attention: bool, k: int,
        full: bool = False, positions: np.ndarray | None = None,
    ) -> StepOutput:
        """``tokens`` int64 [R] (previous token of each row), ``static`` tensors [R, ...], ``state``
        tensors [R, ...], ``k`` >= 1 -> the ``min(k, V)`` best tokens of each row and their
        log-probabilities, the EOS log-probability, attention [R, S] (or None), the next state and,
        with ``full``, the whole [R, V] distribution (for the decoding controls). ``positions`` int64
        [R]: each row's own target position (tokens it has decoded), passed only to a model whose
        ``per_row_positions`` is true; None: all rows are at the same step."""

    def select_rows(self, tensors: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
        """Rows ``rows`` (int64 [R']) of every [R, ...] tensor, in that order: finished sentences
        leave the batch and beams follow the rows they extend. :func:`take_rows` for NumPy arrays."""

    def concat_rows(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """The rows of ``first`` followed by those of ``second`` (sentences joining a running decode); a
        non-row axis on which they differ (source length, cache capacity) is zero-padded first, and zero
        must mean padding there (a source mask's 0). :func:`concat_rows` for NumPy arrays. Needed only by
        a model whose ``per_row_positions`` is true (one that can decode rows at different steps)."""


def take_rows(tensors: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """:meth:`StepModel.select_rows` for models that keep their tensors as NumPy arrays."""
    return {name: value[rows] for name, value in tensors.items()}


def concat_rows(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:meth:`StepModel.concat_rows` for models that keep their tensors as NumPy arrays."""
    joined = {}
    for name, a in first.items():
        b = second[name]
        width = np.maximum(a.shape[1:], b.shape[1:])
        joined[name] = np.concatenate([_pad_to(a, width), _pad_to(b, width)])
    return joined


def _pad_to(array: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """``array`` zero-padded at the end of every non-row axis to ``shape`` (rows excluded)."""
    if tuple(array.shape[1:]) == tuple(shape):
        return array
    return np.pad(array, [(0, 0), *((0, int(want) - have) for have, want in zip(array.shape[1:], shape, strict=True))])


@dataclass
class BeamSentence:
    """Per-sentence search settings."""

    source_length: int  # source tokens including EOS
    num_hypotheses: int = 1
    max_length: int = 256
    length_penalty: float = 1.0
    is_cancelled: Callable[[], bool] | None = None
    controls: Controls = field(default_factory=Controls)
    patience: float = 1.0  # beam search keeps round(beam x patience) finished hypotheses before it stops

    def limit(self) -> int:
        """Longest output (EOS included): :func:`max_target_length`, and room for a forced prefix."""
        forced = self.controls.forced
        return max(max_target_length(self.source_length, self.max_length), len(forced) + 1)


@dataclass
class ScoredSequence:
    """A finished hypothesis of the search: token ids and scores (text comes later, in the engine)."""

    tokens: list[int]  # ends with EOS
    score: float
    token_scores: list[float]
    attention: np.ndarray | None = None  # [len(tokens), S]


@dataclass
class SearchResult:
    hypotheses: list[ScoredSequence] = field(default_factory=list)


def beam_search(
    model: StepModel,
    encoded: dict[str, Any],
    sentences: Sequence[BeamSentence],
    *,
    beam_size: int,
    start_id: int,
    eos_id: int,
    need_attention: bool = False,
) -> list[SearchResult | None]:
    """Decode ``len(sentences)`` sentences together; ``encoded`` holds every static input and the
    initial value of every state entry, batch first. Returns one result per sentence, ``None`` for
    a sentence whose ``is_cancelled`` turned true."""
    if any(not 1 <= s.num_hypotheses <= beam_size for s in sentences):
        raise ValueError("need 1 <= num_hypotheses <= beam_size")
    if beam_size > 1 and any(s.controls.samples for s in sentences):
        raise ValueError("sampling needs beam_size 1")
    search = _greedy if beam_size == 1 else _beam
    return search(model, encoded, sentences, beam_size=beam_size, start_id=start_id, eos_id=eos_id,
                  need_attention=need_attention)


def _cancelled(sentence: BeamSentence) -> bool:
    return sentence.is_cancelled is not None and sentence.is_cancelled()


def _step(model: StepModel, tokens: np.ndarray, static: dict[str, Any], state: dict[str, Any],
          need_attention: bool, k: int, controls: list[Controls], history: np.ndarray, t: int,
          eos_id: int) -> tuple[StepOutput, np.ndarray | None]:
    """One model step of rows under ``controls`` (``history`` [R, >= t]: their tokens so far). When a
    control is active the top k and the EOS log-probability are those of the processed distribution,
    which is returned too (else None)."""
    if not needs_full(controls, t):
        return model.step(tokens, static, state, need_attention, k), None
    out = model.step(tokens, static, state, need_attention, k, full=True)
    processed = process(out.log_probs, history, controls, t, eos_id)
    out.top_ids, out.top_log_probs = top_k(processed, k)
    out.eos_log_prob = processed[:, eos_id]
    return out, processed


def _greedy(
    model: StepModel,
    encoded: dict[str, Any],
    sentences: Sequence[BeamSentence],
    *,
    beam_size: int,
    start_id: int,
    eos_id: int,
    need_attention: bool,
) -> list[SearchResult | None]:
    """:func:`beam_search` for ``beam_size == 1``: arg-max decoding, same results as :func:`_beam`."""
    n = len(sentences)
    limits = np.array([s.limit() for s in sentences])
    penalties = np.array([s.length_penalty for s in sentences])
    controls = [s.controls for s in sentences]
    rngs = [c.rng() if c.samples else None for c in controls]
    results: list[SearchResult | None] = [None] * n
    history = np.zeros((n, int(limits.max())), dtype=np.int64)
    history_scores = np.zeros((n, int(limits.max())))
    history_attention: np.ndarray | None = None
    totals = np.zeros(n)

    active = np.arange(n)  # sentence of each row
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    tokens = np.full(n, start_id, dtype=np.int64)
    t = 0
    while active.size:
        out, processed = _step(model, tokens, static, state, need_attention, 1, [controls[s] for s in active],
                               history[active], t, eos_id)
        attention, state = out.attention, out.state
        tokens = out.top_ids[:, 0].astype(np.int64)
        scores = out.top_log_probs[:, 0].astype(np.float64)
        for j, s in enumerate(active):
            if rngs[s] is not None and scores[j] > NEG_INF:
                tokens[j] = sample(processed[j], controls[s], rngs[s])
                scores[j] = processed[j, tokens[j]]
        forced = limits[active] - 1 == t
        if forced.any():  # out of room: only EOS may follow
            tokens[forced] = eos_id
            scores[forced] = out.eos_log_prob[forced]
        history[active, t] = tokens
        history_scores[active, t] = scores
        totals[active] += scores
        if attention is not None:
            if history_attention is None:
                history_attention = np.zeros((n, history.shape[1], attention.shape[1]), dtype=np.float32)
            history_attention[active, t] = attention
        stop = (tokens == eos_id) | (scores == NEG_INF)  # EOS, or nothing left to choose
        leaving = stop.copy()
        for j, s in enumerate(active):
            cancelled = _cancelled(sentences[s])
            leaving[j] |= cancelled
            if stop[j] and not cancelled and scores[j] > NEG_INF:
                attention_rows = history_attention[s, : t + 1].copy() if history_attention is not None else None
                hypothesis = ScoredSequence(tokens=history[s, : t + 1].tolist(),
                                            score=float(normalized_score(totals[s], t + 1, penalties[s])),
                                            token_scores=history_scores[s, : t + 1].tolist(),
                                            attention=attention_rows)
                results[s] = SearchResult([hypothesis])
            elif stop[j] and not cancelled:
                results[s] = SearchResult([])
        if leaving.any():
            stay = np.flatnonzero(~leaving)
            active, tokens = active[stay], tokens[stay]
            if stay.size:  # the last rows left: nothing to select
                static, state = model.select_rows(static, stay), model.select_rows(state, stay)
        t += 1
    return results


def _beam(
    model: StepModel,
    encoded: dict[str, Any],
    sentences: Sequence[BeamSentence],
    *,
    beam_size: int,
    start_id: int,
    eos_id: int,
    need_attention: bool,
) -> list[SearchResult | None]:
    """:func:`beam_search`'s general case (any beam size)."""
    n = len(sentences)
    limits = np.array([s.limit() for s in sentences])
    penalties = np.array([s.length_penalty for s in sentences])
    quotas = [max(beam_size, round(beam_size * s.patience)) for s in sentences]  # finished kept
    results: list[SearchResult | None] = [None] * n
    finished: list[list[ScoredSequence]] = [[] for _ in range(n)]

    active = np.arange(n)  # sentences still decoding, in row-block order
    width = 1  # rows per active sentence (1 before the first expansion)
    static_all = {name: encoded[name] for name in model.static_names}
    static = static_all
    state = {name: encoded[name] for name in model.state_names}
    tokens = np.full(n, start_id, dtype=np.int64)
    totals = np.zeros(n)
    history = np.zeros((n, 0), dtype=np.int64)
    history_scores = np.zeros((n, 0))
    history_attention: np.ndarray | None = None

    t = 0
    while active.size:
        # a sentence's 2*beam best continuations are among its rows' 2*beam best tokens
        row_controls = [sentences[s].controls for s in np.repeat(active, width)]
        out, _ = _step(model, tokens, static, state, need_attention, 2 * beam_size, row_controls, history, t, eos_id)
        attention, state = out.attention, out.state
        row_tokens, row_scores = out.top_ids.astype(np.int64), out.top_log_probs.astype(np.float64)
        rows, per_row = row_tokens.shape
        forced = np.repeat(limits[active] - 1 == t, width)
        if forced.any():  # out of room: only EOS may follow
            row_tokens[forced] = eos_id
            row_scores[forced] = NEG_INF
            row_scores[forced, 0] = out.eos_log_prob[forced]
        candidates = (totals[:, None] + row_scores).reshape(active.size, width * per_row)
        order = np.argsort(-candidates, axis=1, kind="stable")[:, : 2 * beam_size]
        top_scores = np.take_along_axis(candidates, order, 1)
        token = np.take_along_axis(row_tokens.reshape(active.size, -1), order, 1)
        token_score = np.take_along_axis(row_scores.reshape(active.size, -1), order, 1)
        origin = order // per_row + (np.arange(active.size) * width)[:, None]  # row each candidate extends
        valid = top_scores > NEG_INF
        is_eos = (token == eos_id) & valid
        live = ~is_eos & valid
        live_before = np.cumsum(live, axis=1) - live
        keep = live & (live_before < beam_size)
        finish = is_eos & (live_before < beam_size)

        for j, c in zip(*np.nonzero(finish), strict=True):
            s, row = active[j], origin[j, c]
            attention_rows = None
            if attention is not None:
                past = history_attention[row] if history_attention is not None else np.zeros((0, attention.shape[1]))
                attention_rows = np.concatenate([past, attention[row][None]])
            finished[s].append(
                ScoredSequence(
                    tokens=history[row].tolist() + [eos_id],
                    score=float(normalized_score(top_scores[j, c], t + 1, penalties[s])),
                    token_scores=history_scores[row].tolist() + [float(token_score[j, c])],
                    attention=attention_rows,
                )
            )

        # the first beam_size live candidates of each sentence become its next rows (-1: none)
        chosen = np.full((active.size, beam_size), -1)
        kj, kc = np.nonzero(keep)
        chosen[kj, (np.cumsum(keep, axis=1) - 1)[kj, kc]] = kc
        has_live = chosen[:, 0] >= 0
        best_live = np.where(has_live, np.take_along_axis(top_scores, np.maximum(chosen[:, :1], 0), 1)[:, 0], NEG_INF)

        survivors = []
        for j, s in enumerate(active):
            if finished[s]:
                finished[s].sort(key=lambda hyp: hyp.score, reverse=True)
                del finished[s][quotas[s]:]
            done = not has_live[j] or (
                len(finished[s]) == quotas[s]
                and normalized_score(best_live[j], t + 1, penalties[s]) <= finished[s][-1].score
            )
            cancelled = _cancelled(sentences[s])
            if done and not cancelled:
                results[s] = SearchResult(finished[s][: sentences[s].num_hypotheses])
            elif not done and not cancelled:
                survivors.append(j)
        if not survivors:
            break

        keep_rows = np.array(survivors)
        picked = chosen[keep_rows]  # [n', beam]
        alive = picked >= 0
        safe = np.maximum(picked, 0)
        new_origin = np.where(alive, np.take_along_axis(origin[keep_rows], safe, 1), origin[keep_rows, :1])
        new_token = np.where(alive, np.take_along_axis(token[keep_rows], safe, 1), start_id)
        new_totals = np.where(alive, np.take_along_axis(top_scores[keep_rows], safe, 1), NEG_INF)
        step_scores = np.take_along_axis(token_score[keep_rows], safe, 1).reshape(-1)
        index = new_origin.reshape(-1)
        flat_token = new_token.reshape(-1)

        history = np.concatenate([history[index], flat_token[:, None]], axis=1)
        history_scores = np.concatenate([history_scores[index], step_scores[:, None]], axis=1)
        if attention is not None:
            if history_attention is None:
                history_attention = np.zeros((rows, 0, attention.shape[1]), dtype=np.float32)
            history_attention = np.concatenate([history_attention[index], attention[index][:, None]], axis=1)
        if width != beam_size or len(survivors) != active.size:
            active = active[keep_rows]
            static = model.select_rows(static_all, np.repeat(active, beam_size))
        width = beam_size
        if not np.array_equal(index, np.arange(rows)):
            state = model.select_rows(state, index)
        tokens = flat_token.astype(np.int64)
        totals = new_totals.reshape(-1)
        t += 1
    return results
