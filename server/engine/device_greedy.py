"""Arg-max steps on the device whose step graph runs can be captured as CUDA graphs (``--cuda-graphs``).

:class:`server.engine.bound_steps.GreedySteps` binds host arrays (the token ids and positions in, each row's best
token and its log-probability out), which ONNX Runtime copies at each run: a captured graph would not. Here every
input and output is a device buffer of the run's own (:mod:`server.engine.cuda_graphs`: a run made for a shape
bucket, the decode's static inputs and cache copied in, kept for the next run of its bucket): before each step the
host writes the ids and positions into their buffers, after it reads the ``R`` best tokens and their scores (as
:class:`GreedySteps` reads them from its arrays), and the step graph's run names the run's graph id. Rows past the
decode's (a bucket's padding) copy its first row and are never read. The interface is :class:`GreedySteps`'s, so
:meth:`server.engine.plain_steps.PlainSteps._plain_greedy` runs either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from nmt.model_format.manifest import TOP_K_OUTPUTS
from server.engine.cuda_graphs import KeptRun
from server.engine.device_search import numpy_type


@dataclass(frozen=True)
class GreedyShapes:
    """What a :class:`DeviceGreedyRun`'s buffers are made for, and the key it is kept under: its rows and the static
    inputs' and cache's shapes, in their buckets (:func:`server.engine.cuda_graphs.bucket`)."""

    rows: int
    static: tuple[tuple[str, tuple[int, ...], str], ...]  # (input, shape, OrtValue element type)
    state: tuple[tuple[str, tuple[int, ...], str], ...]  # the cache's in-place buffers, likewise


class DeviceGreedyRun(KeptRun):
    """Arg-max steps over buffers of the run's own, bound once (see the module docstring): :meth:`start`, then
    :meth:`run` and :meth:`read` a step at a time, then :meth:`state`; ``options`` name the run's graph (None:
    no graph-enabled session)."""

    def __init__(self, model: Any, shapes: GreedyShapes, session: ort.InferenceSession,
                 options: ort.RunOptions | None, graph_ids: tuple[int, ...] = ()) -> None:
        super().__init__(model, shapes, (session,), [options], graph_ids)
        self.rows = 0  # the decode's rows (the run's may be more)
        rows = shapes.rows
        self.static = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.static}
        self.buffers = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.state}
        self._inputs = {"input_ids": self._alloc((rows,), np.int64), "positions": self._alloc((rows,), np.int64)}
        score_dtype = model.score_dtype
        ids, scores, eos = TOP_K_OUTPUTS
        self._outputs = {ids: self._alloc((rows, 1), np.int64), scores: self._alloc((rows, 1), score_dtype),
                         eos: self._alloc((rows,), score_dtype)}
        self._binding = model.step_binding(session, self._inputs["input_ids"], self._inputs["positions"], self.static,
                                           self.buffers, 1, self._outputs, self.buffers)
        self._row_of = np.zeros(rows, dtype=np.int64)  # each of the run's rows: the decode's row it copies
        self._next = np.zeros((0, rows), dtype=np.int64)  # each step's positions
        self._done = 0
        self.ids = self.scores = np.zeros(0)

    def start(self, tokens: np.ndarray, positions: np.ndarray, static: dict[str, Any], state: dict[str, Any],
              steps: int) -> None:
        """Continue from ``tokens`` at ``positions`` (int64 [R]) with the decode's ``static`` inputs and ``state``
        (copied in, padded to the run's shapes) for up to ``steps`` steps."""
        self.rows = len(tokens)
        self._row_of = np.concatenate([np.arange(self.rows), np.zeros(self.shapes.rows - self.rows, dtype=np.int64)])
        self.ids, self.scores = tokens.astype(np.int64, copy=True), np.zeros(self.rows, dtype=np.float32)
        self.positions = positions.astype(np.int64, copy=True)
        self._next = positions[self._row_of] + np.arange(steps + 1)[:, None]
        self._done = 0
        names = list(self.buffers)
        self.model.padded_copies([static[name] for name in self.static], self._row_of, list(self.static.values()))
        self.model.padded_copies([state[name] for name in names], self._row_of, list(self.buffers.values()))

    def run(self) -> None:
        """One step: the ids and positions written into their buffers, the step graph run (or its graph replayed),
        each row's best token and its score read."""
        self._inputs["input_ids"].update_inplace(self.ids[self._row_of])
        self._inputs["positions"].update_inplace(self._next[self._done])
        self._binding.synchronize_inputs()  # the host's copies landed before the run (or its replay) reads them
        self._run(0, self._binding)
        self._binding.synchronize_outputs()
        ids, scores, _ = TOP_K_OUTPUTS
        self.ids = self._outputs[ids].numpy()[: self.rows, 0].copy()
        self.scores = self._outputs[scores].numpy()[: self.rows, 0].astype(np.float32)
        self._done += 1
        self.positions = self._next[self._done, : self.rows].copy()

    def read(self) -> tuple[list[int], list[float]]:
        """The last step's token of each row and its log-probability."""
        return self.ids.tolist(), self.scores.tolist()

    @property
    def eos_log_prob(self) -> np.ndarray:
        """EOS's log-probability in each row at the last step."""
        return self._outputs[TOP_K_OUTPUTS[2]].numpy()[: self.rows].astype(np.float32)

    def state(self) -> dict[str, Any]:
        """The decoder state after the steps run (the cache copied out, each row's position moved on)."""
        copies = self.model.padded_copies(list(self.buffers.values()), np.arange(self.rows))
        return {**dict(zip(self.buffers, copies, strict=True)), self.model.positions: self.positions.copy()}
