"""The host's plain runs: decoding steps with an I/O binding of their own over a fixed set of rows, the plain
steps of :class:`server.engine.decode.RunningDecode` on host arrays (:meth:`server.engine.decode.RunningDecode._plain`):
arg-max runs (:class:`GreedySteps`) and beam runs (:class:`BeamSteps`, selected by :func:`quiet_selection`).

:class:`BoundSteps` holds what every such run shares: the token ids and positions in arrays bound once, the
in-place KV cache bound as each ``past_*`` input and its ``present_*`` output, the cache grown when a row
reaches its capacity, and the rows' next positions copied from a table made at :meth:`BoundSteps.start`. After
a step graph's run the CPU's caches hold the graph's weights and every NumPy call is slow (10-20 us on a
6-layer model), so a step touches its arrays through memoryviews. :class:`GreedySteps` (arg-max) and
:class:`server.engine.host_runs.BeamSteps` bind the step graph's outputs their own way.


**Plain beam steps**: beam search on the in-place cache with the host's work per step cut to a few list operations.

The general step (:mod:`server.engine.decode`, :func:`server.engine.beam_select.select_beam`) makes some
hundred NumPy calls a step, and after a step graph's run each one is slow: the graph's weights have pushed the
interpreter's and NumPy's code out of the CPU's caches (see :class:`server.engine.host_runs.GreedySteps`).
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

from collections.abc import Iterator
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from common.model_format.manifest import TOP_K_INPUT, TOP_K_OUTPUTS, StateTensor
from server.engine.step_model import NEG_INF


class BoundSteps:
    """Steps of ``model``'s in-place-cache decoder (an :class:`server.engine.onnx_step_model.OnnxStepModel`) for
    ``rows`` rows, each row's ``k`` best tokens asked for: :meth:`start`, then :meth:`run` a step at a time,
    then :meth:`state`. Subclasses bind the step graph's outputs."""

    def __init__(self, model: Any, rows: int, k: int) -> None:
        self.model, self.rows, self.k = model, rows, k
        self.ids = np.zeros(rows, dtype=np.int64)  # the next step's input
        self.positions = np.zeros(rows, dtype=np.int64)
        self._position_view = memoryview(self.positions)
        self._session = model.sessions["decoder"]
        self._binding = self._session.io_binding()
        self._bound: dict[str, Any] = {}
        self._state: dict[str, Any] = {}
        self._capacity = self._last = self._done = 0
        self._furthest: list[int] = []  # the furthest position a row writes at each step of the run
        self._next = memoryview(np.zeros(0, dtype=np.int64))  # each step's next positions, row after row
        self._step_inputs = {"input_ids": ort.OrtValue.ortvalue_from_numpy(self.ids),  # the arrays' memory
                             model.positions: ort.OrtValue.ortvalue_from_numpy(self.positions)}
        self._bind_each_step = binds_each_step(model)
        self._bind_step_inputs()
        self._binding.bind_ortvalue_input(TOP_K_INPUT, model._top_k_value(k))

    def start(self, tokens: np.ndarray, positions: np.ndarray, static: dict[str, Any], state: dict[str, Any],
              steps: int, ceilings: np.ndarray | None = None) -> None:
        """Continue from ``tokens`` at ``positions`` with ``state`` for up to ``steps`` steps (binding again
        only the arrays that changed); a row's position stops at its ``ceilings`` entry (a row held after its
        sentence's last step rewrites that slot)."""
        np.copyto(self.ids, tokens)
        np.copyto(self.positions, positions)
        moved = moved_on(positions, steps, ceilings)
        self._next = memoryview(moved[1:].ravel())
        self._furthest = moved.max(axis=1).tolist()
        self._last, self._done = self._furthest[0], 0  # the furthest position a row writes next; steps run
        for name, value in static.items():
            if self._bound.get(name) is not value:
                bind_input(self._binding, self._bound, name, value)
        self._state = dict(state)
        self._bind_buffers()

    def run(self) -> None:
        """One step (the KV cache grows first when a row reaches its capacity)."""
        if self._last >= self._capacity:
            self._state = self._grown(self._state, self._last + 1)
            self._bind_buffers()
        if self._bind_each_step:
            self._bind_step_inputs()
        self._session.run_with_iobinding(self._binding)
        first = self._done * self.rows
        self._position_view[:] = self._next[first:first + self.rows]
        self._done += 1
        self._last = self._furthest[self._done]

    def state(self) -> dict[str, Any]:
        """The decoder state after the steps run (each row's position moved on)."""
        return {**self._state, self.model.positions: self.positions.copy()}

    def held_arrays(self) -> Iterator[np.ndarray]:
        """The host arrays this run keeps between runs (the last decode's state and what is bound to it)."""
        yield from (v for v in (*self._state.values(), *self._bound.values()) if isinstance(v, np.ndarray))

    def _bind_step_inputs(self) -> None:
        for name, value in self._step_inputs.items():
            self._binding.bind_ortvalue_input(name, value)

    def _grown(self, state: dict[str, Any], needed: int) -> dict[str, Any]:
        """``state`` whose cache holds ``needed`` positions."""
        return self.model._reserve(state, needed)

    def _held(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as the steps hold its cache buffers (as it is, unless a subclass keeps them its way)."""
        return state

    def _bind_buffers(self) -> None:
        """Bind each cache buffer (a host array, or a device's ``OrtValue``) as its input and its output."""
        self._state = self._held(self._state)
        for name, entry in self.model.buffers.items():
            value = self._state[name]
            if self._bound.get(name) is not value:
                buffer = value if isinstance(value, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(value)
                self._binding.bind_ortvalue_input(name, buffer)
                self._binding.bind_ortvalue_output(entry.output, buffer)
                self._bound[name] = value
        name, entry = next(iter(self.model.buffers.items()))
        self._capacity = shape_of(self._state[name])[entry.capacity_axis]


class GreedySteps(BoundSteps):
    """Arg-max decoding steps, the host's work per step cut to moving the positions on and reading the tokens.

    The step graph (top 1) writes each step's best token of every row (``top_ids``) into the very array the
    next step reads as ``input_ids`` (:attr:`ids`): the graph reads its input before its last node writes
    the output, on the CPU and on a device's stream alike. :meth:`read` gives the tokens and their
    log-probabilities as lists (``R`` ids and scores, nothing of the [R, V] distribution)."""

    def __init__(self, model: Any, rows: int) -> None:
        super().__init__(model, rows, 1)
        self.scores = np.zeros(rows, dtype=np.float32)
        self.eos_log_prob = np.zeros(rows, dtype=np.float32)
        self._views = memoryview(self.ids), memoryview(self.scores)
        ids, scores, eos = TOP_K_OUTPUTS
        for name, array in ((ids, self.ids[:, None]), (scores, self.scores[:, None]), (eos, self.eos_log_prob)):
            self._binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))

    def run_block(self, steps: int) -> int:
        """One step (a block of one, as :meth:`server.engine.device_runs.DeviceGreedyRun.run_block` runs up to
        eight on a device): how many ran."""
        self.run()
        return 1

    def read(self, step: int = 0) -> tuple[list[int], list[float]]:
        """The last step's token of each row and its log-probability (``step``: its index in the block, 0)."""
        return self._views[0].tolist(), self._views[1].tolist()


def moved_on(positions: np.ndarray, steps: int, ceilings: np.ndarray | None) -> np.ndarray:
    """Each row's position before each of ``steps`` steps and after the last ([steps + 1, R]), none past its
    ``ceilings`` entry."""
    moved = positions + np.arange(steps + 1)[:, None]
    return moved if ceilings is None else np.minimum(moved, np.maximum(ceilings, positions))


def binds_each_step(model: Any) -> bool:
    """Whether steps of ``model`` bind their ids and positions again before each run: a binding copies a host
    value to the device whose nodes read it when it is bound, not at each run (ONNX Runtime's
    ``IOBinding::BindInput``), so on a device; on the CPU a step reads the arrays themselves."""
    return model.capabilities.on_device


def bind_input(binding: ort.IOBinding, bound: dict[str, Any], name: str, value: np.ndarray | ort.OrtValue) -> None:
    """Bind input ``name`` to ``value`` (an OrtValue, or a host array whose memory is bound) and hold it in
    ``bound``, so the memory bound stays valid (and an id is never reused)."""
    if isinstance(value, ort.OrtValue):
        binding.bind_ortvalue_input(name, value)
    else:
        binding.bind_cpu_input(name, value)
    bound[name] = value


def shape_of(value: np.ndarray | ort.OrtValue) -> tuple[int, ...]:
    """The shape of a host array or an ``OrtValue``."""
    return tuple(value.shape) if isinstance(value, np.ndarray) else tuple(value.shape())


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
