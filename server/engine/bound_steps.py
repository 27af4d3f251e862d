"""Decoding steps that run with an I/O binding of their own over a fixed set of rows: the plain steps of
:class:`server.engine.decode.RunningDecode` (:meth:`server.engine.decode.RunningDecode._plain`).

:class:`BoundSteps` holds what every such run shares: the token ids and positions in arrays bound once, the
in-place KV cache bound as each ``past_*`` input and its ``present_*`` output, the cache grown when a row
reaches its capacity, and the rows' next positions copied from a table made at :meth:`BoundSteps.start`. After
a step graph's run the CPU's caches hold the graph's weights and every NumPy call is slow (10-20 us on a
6-layer model), so a step touches its arrays through memoryviews. :class:`GreedySteps` (arg-max) and
:class:`server.engine.beam_steps.BeamSteps` bind the step graph's outputs their own way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort

from common.model_format.manifest import TOP_K_INPUT, TOP_K_OUTPUTS


class BoundSteps:
    """Steps of ``model``'s in-place-cache decoder (an :class:`server.engine.step_models.OnnxStepModel`) for
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
        """One step (a block of one, as :meth:`server.engine.device_greedy.DeviceGreedyRun.run_block` runs up to
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
