"""Plain beam steps: beam search on the in-place cache with the host's work per step cut to a few list operations.

The general step (:mod:`server.engine.decode`, :func:`server.engine.beam_select.select_beam`) makes some
hundred NumPy calls a step, and after a step graph's run each one is slow: the graph's weights have pushed the
interpreter's and NumPy's code out of the CPU's caches (see :class:`server.engine.bound_steps.GreedySteps`).
:class:`BeamSteps` runs the steps of a decode that searches beams (some sentence wider than 1) without decoding
controls, target prefix, attention or streaming, and :func:`quiet_selection` picks each step's hypotheses in
plain Python over each row's best tokens:

* its own I/O binding of the step graph: token ids and positions in arrays of its own, each row's best
  tokens and their log-probabilities into arrays read through memoryviews;
* the selection is that of :func:`server.engine.beam_select.select_beam` (the same candidates, summed in the
  same order, ranked by a stable sort), for the steps it can decide alone: a step is *quiet* when no
  sentence's ``beam`` best candidates include EOS (or nothing left to choose) and no sentence is done. A
  step that is not quiet goes through the general selection, which finishes hypotheses;
* a beam reorder copies cache rows only for an origin's second and later continuations (a hypothesis that
  is its origin's only continuation stays in its origin's row: :attr:`BeamSteps.places`), up to the
  positions in use, each straight into its destination (:meth:`CacheBlock.copy`): the steps keep the cache
  buffers as the leading rows of one block [buffers, rows, ...] (:class:`CacheBlock`), whose views the
  decode's state holds between the steps.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from common.model_format.manifest import TOP_K_OUTPUTS, StateTensor
from server.engine.bound_steps import BoundSteps
from server.engine.search import NEG_INF

_SCORE = itemgetter(0)


class QuietChoice(NamedTuple):
    """The selection of a quiet step: per new row its origin row, token, token log-probability and summed
    log-probability (a sentence's rows best first), and the hypotheses that end in EOS."""

    origin: list[int]
    token: list[int]
    token_score: list[float]
    total: list[float]
    finished: list[tuple[int, int, float, float]]  # (sentence, row, EOS log-probability, summed log-probability)


def quiet_selection(ids: list[int], scores: list[float], totals: list[float], sentences: list[tuple[int, int]],
                    width: int, eos_id: int, places: list[int]) -> QuietChoice | None:
    """The selection of a step (:func:`server.engine.beam_select.select_beam`'s rules), or None when it is
    not quiet here: a beam-1 sentence chose EOS, or a sentence has fewer than its beam of live continuations.

    Rows are the decode's (a sentence's rows best first), held in the model's rows ``places``: ``ids``/
    ``scores`` give each model row's ``width`` best tokens and their log-probabilities, row after row;
    ``totals``: each row's summed log-probability; ``sentences``: (first row, beam) of each sentence, every
    one expanded to its beam (a beam-1 sentence: one row). The candidates are walked in order: those ending
    in EOS finish, the others live until the beam is full."""
    rows = len(totals)
    origin, token, token_score, total = [0] * rows, [0] * rows, [0.0] * rows, [0.0] * rows
    finished: list[tuple[int, int, float, float]] = []
    for sentence, (first, beam) in enumerate(sentences):
        # a row holds EOS once at most, so its first beam + 1 tokens hold its beam of live ones: the walk never
        # reaches a row's later tokens
        per_row = min(beam + 1, width)
        candidates = []
        for row in range(first, first + beam):
            base, summed = places[row] * width, totals[row]
            candidates += [(summed + scores[at], at, row) for at in range(base, base + per_row)]
        candidates.sort(key=_SCORE, reverse=True)  # stable: ties keep their order, as np.argsort(kind="stable")
        slot, last = first, first + beam
        for summed, at, row in candidates:
            if summed == NEG_INF:
                return None
            if ids[at] == eos_id:
                if beam == 1:  # arg-max decoding ends there: the lean step's
                    return None
                finished.append((sentence, row, scores[at], summed))
                continue
            origin[slot], token[slot], token_score[slot], total[slot] = row, ids[at], scores[at], summed
            slot += 1
            if slot == last:
                break
        if slot < last:
            return None
    return QuietChoice(origin, token, token_score, total, finished)


class BeamSteps(BoundSteps):
    """Beam steps of an in-place-cache decoder for a fixed set of rows (the plain beam steps of
    :class:`server.engine.decode.RunningDecode`): :meth:`run` a step, :meth:`read` its best tokens, then
    :meth:`advance` with the hypotheses chosen (their tokens become the next step's input).

    Between :meth:`start` and :meth:`state` the decode's row ``i`` lives in the model's row
    :attr:`places` ``[i]``: a hypothesis that is its origin's only continuation stays in its origin's model
    row, so a reorder copies cache rows only for an origin's second and later continuations (into the model
    rows whose hypotheses died), not for every row whose origin differs. :meth:`state` puts the rows back in
    the decode's order."""

    def __init__(self, model: Any, rows: int, k: int) -> None:
        super().__init__(model, rows, k)
        width = int(model._top_k(k)[0])
        self.width = width
        self.top_ids = np.zeros((rows, width), dtype=np.int64)
        self.top_scores = np.zeros((rows, width), dtype=np.float32)
        self.eos_log_prob = np.zeros(rows, dtype=np.float32)
        self._views = memoryview(self.top_ids.ravel()), memoryview(self.top_scores.ravel()), memoryview(self.ids)
        ids, scores, eos = TOP_K_OUTPUTS
        for name, array in ((ids, self.top_ids), (scores, self.top_scores), (eos, self.eos_log_prob)):
            self._binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
        self._block = CacheBlock(model.buffers)
        self.places = list(range(rows))

    def start(self, tokens: np.ndarray, positions: np.ndarray, static: dict[str, Any], state: dict[str, Any],
              steps: int) -> None:
        self.places = list(range(self.rows))
        super().start(tokens, positions, static, state, steps)

    def read(self) -> tuple[list[int], list[float]]:
        """The last step's best tokens of every row and their log-probabilities, row after row."""
        return self._views[0].tolist(), self._views[1].tolist()

    def advance(self, tokens: list[int], origin: list[int]) -> None:
        """Take the chosen hypotheses: the decode's row ``i`` extends its row ``origin[i]`` with ``tokens[i]``
        (within one sentence's rows)."""
        places, taken = self.places, [False] * self.rows
        new, again = [0] * self.rows, []
        for row, source in enumerate(origin):
            place = places[source]
            if taken[place]:
                again.append(row)
            else:
                taken[place], new[row] = True, place
        if again:  # in row order, as the free model rows are: each sentence's pair within its own rows
            free = [place for place, used in enumerate(taken) if not used]
            self._block.copy(free, [places[origin[row]] for row in again], self._last)
            for row, place in zip(again, free, strict=True):
                new[row] = place
        ids = self._views[2]
        for row, value in enumerate(tokens):
            ids[new[row]] = value
        self.places = new

    def outputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The last step's top ids, their log-probabilities and the EOS log-probability, in the decode's rows."""
        places = self.places
        return self.top_ids[places], self.top_scores[places], self.eos_log_prob[places]

    def state(self) -> dict[str, Any]:
        """The decoder state after the steps run (each row's position moved on), with the rows back in the
        decode's order."""
        places = self.places
        moved = [row for row, place in enumerate(places) if place != row]
        if moved:
            self._block.move(moved, [places[row] for row in moved], self._last)
            self.ids[:] = self.ids[places]  # the right side is copied first
            self.places = list(range(self.rows))
        return super().state()

    def _grown(self, state: dict[str, Any], needed: int) -> dict[str, Any]:
        return self._block.grow(state, needed)

    def _held(self, state: dict[str, Any]) -> dict[str, Any]:
        return self._block.adopt(state, self.rows)


class CacheBlock:
    """The in-place cache buffers of :class:`BeamSteps` as the leading rows of one array
    [buffers, rows, *shape]: the rows go back to the decode's order (:meth:`move`) and the cache grows
    (:meth:`grow`) in one NumPy call for every layer's keys and values, not one per buffer."""

    def __init__(self, buffers: dict[str, StateTensor]) -> None:
        self.names = list(buffers)
        self.axis = next(iter(buffers.values())).capacity_axis + 1  # the capacity axis in the block
        self.array = np.zeros((0, 0), dtype=np.float32)
        self.views: list[np.ndarray] = []  # the buffers' views of the block, as handed out

    def adopt(self, state: dict[str, Any], rows: int) -> dict[str, Any]:
        """``state`` whose buffers are views of the block: as they are when they already are (the general
        step moves rows within them), else copied into a new block."""
        buffers = [state[name] for name in self.names]
        if len(self.views) == len(buffers) and all(b is v for b, v in zip(buffers, self.views, strict=True)):
            return state  # the views handed out, as the general step leaves them when no row count changed
        block = self.array
        if block.ndim == buffers[0].ndim + 1 and block.shape[1] >= rows and all(
                b.shape == (rows, *block.shape[2:]) and b.dtype == block.dtype
                and b.ctypes.data == block[i].ctypes.data for i, b in enumerate(buffers)):
            return state
        self.array = np.empty((len(buffers), rows, *buffers[0].shape[1:]), dtype=buffers[0].dtype)
        for i, buffer in enumerate(buffers):
            self.array[i] = buffer
        self.views = list(self.array)
        return {**state, **dict(zip(self.names, self.views, strict=True))}

    def grow(self, state: dict[str, Any], needed: int) -> dict[str, Any]:
        """``state`` whose buffers hold at least ``needed`` positions: a new block of twice the capacity or
        more, the positions held copied in one call."""
        rows, capacity = state[self.names[0]].shape[0], self.array.shape[self.axis]
        shape = list(self.array.shape)
        shape[1], shape[self.axis] = rows, max(2 * capacity, needed)
        grown = np.zeros(shape, dtype=self.array.dtype)
        held = (slice(None), slice(0, rows)) + (slice(None),) * (self.axis - 2) + (slice(0, capacity),)
        grown[held] = self.array[held]
        self.array, self.views = grown, list(grown)
        return {**state, **dict(zip(self.names, self.views, strict=True))}

    def copy(self, rows: list[int], sources: list[int], used: int) -> None:
        """Row ``rows[i]`` of every buffer receives row ``sources[i]``, up to position ``used``, where no row is both
        (a beam reorder's second continuations into free rows): one NumPy call a row and buffer, each copying
        straight into its destination. A call over all of them (:meth:`move`) gathers the sources into a
        temporary first, and after a step graph's run has pushed the cache out of the CPU's caches that second
        pass costs more than the calls (SMALL, one row: 43 against 31 us; BASE: 110 against 80)."""
        span = (slice(None),) * (self.axis - 2) + (slice(0, used),)
        for row, source in zip(rows, sources, strict=True):
            for buffer in self.array:
                buffer[(row, *span)] = buffer[(source, *span)]

    def move(self, rows: list[int], sources: list[int], used: int) -> None:
        """Row ``rows[i]`` of every buffer receives row ``sources[i]``, up to position ``used`` (a permutation: the
        sources are read before any row is written)."""
        span = (slice(None),) * (self.axis - 2) + (slice(0, used),)
        self.array[(slice(None), rows, *span)] = self.array[(slice(None), sources, *span)]  # the right side is
        # copied first
