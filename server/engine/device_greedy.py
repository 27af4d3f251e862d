"""Arg-max steps on the device in blocks, whose step graph runs can be captured as CUDA graphs (``--cuda-graphs``).

:class:`server.engine.bound_steps.GreedySteps` binds host arrays (the token ids and positions in, each row's best
token and its log-probability out), which ONNX Runtime copies at each run: a captured graph would not. Here every
input and output is a device buffer of the run's own (:mod:`server.engine.cuda_graphs`: a run made for a shape
bucket, the decode's static inputs and cache copied in, kept for the next run of its bucket), and the steps go in
**blocks** of up to :data:`BLOCK_STEPS`:

* the host writes the block's first token ids and every step's positions in one copy;
* it launches the block's steps back to back, each step's best tokens landing in the slot the next step reads as
  its input, so no step waits for the host (each step has bindings of its own, its slots, and so a graph id of its
  own);
* it reads the block's tokens and scores in one copy after the last step, and then step by step.

Where a step of a block is not quiet (some row chose EOS) or the decode must stop, the run stands after the last
step read (:meth:`DeviceGreedyRun.read`): the block's later steps are undone by that alone, since the cache entries
they wrote lie past every row's position, where attention never reads and the next steps write again. Rows past
the decode's (a bucket's padding) copy its first row and are never read. The interface is :class:`GreedySteps`'s,
so :meth:`server.engine.decode.RunningDecode._plain_greedy` runs either."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnxruntime as ort

from common.model_format.manifest import TOP_K_OUTPUTS
from server.engine.bound_steps import moved_on
from server.engine.cuda_graphs import KeptRun, Slot
from server.engine.device_search import numpy_type

BLOCK_STEPS = 8  # arg-max steps launched together before the host reads their tokens


@dataclass(frozen=True)
class GreedyShapes:
    """What a :class:`DeviceGreedyRun`'s buffers are made for, and the key it is kept under: its rows and the static
    inputs' and cache's shapes, in their buckets (:func:`server.engine.cuda_graphs.bucket`)."""

    rows: int
    static: tuple[tuple[str, tuple[int, ...], str], ...]  # (input, shape, OrtValue element type)
    state: tuple[tuple[str, tuple[int, ...], str], ...]  # the cache's in-place buffers, likewise


class DeviceGreedyRun(KeptRun):
    """Arg-max steps over buffers of the run's own, bound once (see the module docstring): :meth:`start`, then
    :meth:`run_block` and :meth:`read` each of its steps (or the first few, where the decode stops inside
    a block), then :meth:`state`; ``options`` name each block step's graph (None: no graph-enabled session)."""

    def __init__(self, model: Any, shapes: GreedyShapes, session: ort.InferenceSession,
                 options: list[ort.RunOptions] | None, graph_ids: tuple[int, ...] = ()) -> None:
        for option in options or []:  # the host waits for the block's last step only (synchronize_outputs)
            option.add_run_config_entry("disable_synchronize_execution_providers", "1")
        super().__init__(model, shapes, (session,), options or [None] * BLOCK_STEPS, graph_ids)
        self.rows = 0  # the decode's rows (the run's may be more)
        rows, block = shapes.rows, BLOCK_STEPS
        self.static = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.static}
        self.buffers = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.state}
        # the host's one copy in per block: slot 0 the first step's token ids, slots 1..block each step's best ids
        # (the next step's input), slots block+1.. each step's positions
        self._feeds = self._alloc((2 * block + 1, rows), np.int64)
        self._host_feeds = np.zeros((2 * block + 1, rows), dtype=np.int64)
        score_dtype = model.score_dtype
        self._scores = self._alloc((block, rows), score_dtype)  # each step's best log-probability, a slot a step
        self._eos = self._alloc((block, rows), score_dtype)  # and EOS's
        ids, scores, eos = TOP_K_OUTPUTS
        slot = partial(Slot, device_id=self.device_id)
        self._bindings = [
            model.step_binding(session, slot(self._feeds, t, (rows,)), slot(self._feeds, block + 1 + t, (rows,)),
                               self.static, self.buffers, 1,
                               {ids: slot(self._feeds, t + 1, (rows, 1)), scores: slot(self._scores, t, (rows, 1)),
                                eos: slot(self._eos, t, (rows,))}, self.buffers)
            for t in range(block)]
        self._row_of = np.zeros(rows, dtype=np.int64)  # each of the run's rows: the decode's row it copies
        self._next = np.zeros((0, rows), dtype=np.int64)  # each step's positions (of the run's rows)
        self._done = 0  # steps read (a block's steps left unread are not taken)
        self._block = np.zeros((0, rows), dtype=np.int64), np.zeros((0, rows))  # the last block's ids and scores
        self._at = 0  # the step read last, within its block
        self.ids = self.scores = np.zeros(0)

    def start(self, tokens: np.ndarray, positions: np.ndarray, static: dict[str, Any], state: dict[str, Any],
              steps: int, ceilings: np.ndarray | None = None) -> None:
        """Continue from ``tokens`` at ``positions`` (int64 [R]) with the decode's ``static`` inputs and ``state``
        (copied in, padded to the run's shapes) for up to ``steps`` steps, no row's position past its
        ``ceilings`` entry."""
        self.rows = len(tokens)
        self._row_of = np.concatenate([np.arange(self.rows), np.zeros(self.shapes.rows - self.rows, dtype=np.int64)])
        self.ids, self.scores = tokens.astype(np.int64, copy=True), np.zeros(self.rows, dtype=np.float32)
        self._next = moved_on(positions[self._row_of], steps, None if ceilings is None else ceilings[self._row_of])
        self._done = 0
        names = list(self.buffers)
        self.model.padded_copies([static[name] for name in self.static], self._row_of, list(self.static.values()))
        self.model.padded_copies([state[name] for name in names], self._row_of, list(self.buffers.values()))

    def run_block(self, steps: int) -> int:
        """Up to ``steps`` steps (at most :data:`BLOCK_STEPS`, none past the ``steps`` given to :meth:`start`),
        launched back to back and read in one copy after the last; how many ran. :meth:`read` then gives each."""
        count = min(steps, BLOCK_STEPS, len(self._next) - 1 - self._done)
        feeds, block = self._host_feeds, BLOCK_STEPS
        feeds[0] = self.ids[self._row_of]
        feeds[block + 1: block + 1 + count] = self._next[self._done: self._done + count]
        self._feeds.update_inplace(feeds)
        first = self._bindings[0]
        first.synchronize_inputs()  # the host's copy landed before the first step (or its replay) reads it
        for t in range(count):
            self._run(0, self._bindings[t], t)
        self._bindings[count - 1].synchronize_outputs()
        self._block = (self._feeds.numpy()[1: count + 1, : self.rows].copy(),  # (a CPU buffer's numpy() is a view)
                       self._scores.numpy()[:count, : self.rows].astype(np.float32))
        return count

    def read(self, step: int) -> tuple[list[int], list[float]]:
        """Step ``step`` of the last block, read in order: each row's token and its log-probability. The run then
        stands after that step: the next block starts there, whatever of this block is left unread."""
        ids, scores = self._block
        self._at = step
        self._done += 1
        self.ids, self.scores = ids[step], scores[step]
        return self.ids.tolist(), self.scores.tolist()

    @property
    def eos_log_prob(self) -> np.ndarray:
        """EOS's log-probability in each row at the step read last."""
        return self._eos.numpy()[self._at, : self.rows].astype(np.float32)

    def state(self) -> dict[str, Any]:
        """The decoder state after the steps taken (the cache copied out, each row's position moved on)."""
        copies = self.model.padded_copies(list(self.buffers.values()), np.arange(self.rows))
        positions = self._next[self._done, : self.rows].copy()
        return {**dict(zip(self.buffers, copies, strict=True)), self.model.positions: positions}
