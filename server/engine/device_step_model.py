"""The step model that keeps a version's tensors on the execution provider's device (CUDA) between steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import onnxruntime as ort

from common.model_format.layout import FORCED_GRAPH
from common.model_format.manifest import LOGITS_OUTPUT, TOP_K_INPUT, TOP_K_OUTPUTS, Manifest
from server.engine.bound_steps import moved_on
from server.engine.cuda_graphs import (
    SKIP,
    GraphCapture,
    RunPool,
    Slot,
    bind,
    bucket,
    bucketed_shape,
    can_release,
    run_options,
)
from server.engine.device_greedy import BLOCK_STEPS, DeviceGreedyRun, GreedyShapes
from server.engine.device_rows import DeviceRows
from server.engine.device_search import ELEMENT_TYPES, Books, DeviceBeamRun, RunShapes, selection_graph
from server.engine.forced import stepwise_force
from server.engine.search import ForcedOutput, StepOutput
from server.engine.shared_weights import SharedWeights
from server.engine.step_models import OnnxStepModel, extra_outputs, initial_shape


class DeviceStepModel(DeviceRows, OnnxStepModel):
    """:class:`OnnxStepModel` with I/O binding: the encoder outputs and the recurrent state (the
    Transformer's KV cache) stay on ``device`` as ``OrtValue`` buffers from step to step, and rows are
    selected there by a ``Gather`` graph. Each step sends the [R] token ids in and brings only the
    top-k, the EOS log-prob and (when asked) the attention back to the host; with ``device_search`` a beam
    search's quiet steps keep even those there (:meth:`device_step`, :mod:`server.engine.device_search`).

    For CUDA, where copying the cache to the host and back at every step would dominate. On the CPU
    it gains nothing (NumPy arrays already share ONNX Runtime's memory) and serves to test the
    binding logic on machines without a GPU.

    Rows move on the device (:class:`server.engine.device_rows.DeviceRows`); the ``Gather`` sessions (one for the
    static inputs, one for the state: a run moves every tensor) are created here, at load, with the decoder's
    options and providers (device id and memory limit included).

    ``cuda_graphs``: keep beam runs for reuse, by shape bucket, within ``graph_pool_bytes`` of device memory, and
    let their session runs capture CUDA graphs where the sessions can (a ``decoder_graphs`` session, the
    decoder's graph with CUDA graphs enabled: :mod:`server.engine.cuda_graphs`)."""

    def __init__(self, manifest: Manifest, sessions: dict[str, ort.InferenceSession], device: str,
                 weights: SharedWeights | None = None, device_search: bool = False, cuda_graphs: bool = False,
                 graph_pool_bytes: int = 0, device_id: int = 0) -> None:
        super().__init__(manifest, sessions, weights)
        self.device, self.device_id = device, device_id  # where every OrtValue of the decode is made and bound
        # beam search's selection on the device (not for the concatenating cache of nmt-model/1, whose state grows
        # every step); no plain beam runs: their reorder moves host rows, a device's is the general step's Gather
        self.capabilities = replace(
            self.capabilities, beam_steps=False, on_device=device != "cpu", kept_runs=cuda_graphs,
            device_beam=device_search and not any(e.init == "empty" and 0 in (e.shape or []) for e in self.state))
        self.cuda_graphs = cuda_graphs  # keep runs for CUDA graphs (their captures are global to the process)
        self.capture = GraphCapture(
            "" if "decoder_graphs" in sessions else
            "the sessions run on the CPU provider" if device == "cpu" else "no graph-enabled decoder session")
        self.pool = RunPool(graph_pool_bytes if cuda_graphs else 0)
        self._dims = {i.name: i.shape for i in sessions["decoder"].get_inputs()}  # declared dimensions
        outputs = {o.name: o.type for o in sessions["decoder"].get_outputs()}
        static = tuple(o.type for o in sessions["encoder"].get_outputs() if o.name in self.static_names)
        state = tuple(outputs[e.output] for e in self.state)
        self._sessions: dict[tuple[str, Any], ort.InferenceSession] = {}  # (kind, key) -> a small graph's session
        for types in (static, state):
            self.gather_session(types)

    def encode(self, src: np.ndarray) -> dict[str, ort.OrtValue | np.ndarray]:
        session = self.sessions["encoder"]
        binding = session.io_binding()
        binding.bind_cpu_input("src_ids", src)
        names = [o.name for o in session.get_outputs()]
        for name in names:
            binding.bind_output(name, self.device, self.device_id)
        session.run_with_iobinding(binding)
        encoded: dict[str, ort.OrtValue | np.ndarray] = dict(zip(names, binding.get_outputs(), strict=True))
        for entry in self.state:
            if entry.init in ("empty", "buffer"):
                zeros = np.zeros(initial_shape(entry, src.shape[0]), dtype=entry.dtype or "float32")
                encoded[entry.input] = ort.OrtValue.ortvalue_from_numpy(zeros, self.device, self.device_id)
        if self.positions:  # positions stay on the host: the engine reads them to size the buffers
            encoded[self.positions] = np.zeros(src.shape[0], dtype=np.int64)
        return encoded

    def step(
        self, tokens: np.ndarray, static: dict[str, ort.OrtValue], state: dict[str, Any],
        need_attention: bool, k: int, full: bool = False, positions: np.ndarray | None = None,
        logits: bool = False,
    ) -> StepOutput:
        if self.positions:
            positions = state[self.positions] if positions is None else positions.astype(np.int64, copy=False)
            state = self._reserve(state, int(positions.max()) + 1)
        else:
            self._check_shared_position(state, positions)
        extra = extra_outputs(full, logits)
        host = TOP_K_OUTPUTS + (["attention"] if need_attention else []) + extra
        outputs, new_state = self._run_step(tokens, static, state, need_attention, k, positions,
                                            {name: "cpu" for name in host})
        values = [value.numpy() for value in outputs]
        heads = len(TOP_K_OUTPUTS)
        full_outputs = dict(zip(extra, values[len(host) - len(extra):], strict=True))
        return StepOutput(*values[:heads], values[heads] if need_attention else None, new_state,
                          full_outputs.get("log_probs"), full_outputs.get(LOGITS_OUTPUT))

    def _run_step(self, tokens: np.ndarray, static: dict[str, ort.OrtValue], state: dict[str, Any],
                  need_attention: bool, k: int, positions: np.ndarray | None, outputs: dict[str, str],
                  ) -> tuple[list[ort.OrtValue], dict[str, Any]]:
        """Run the step graph on ``tokens`` with ``outputs`` (name -> where) bound; returns those outputs, in
        order, and the next state (its buffers in place, the rest in new device memory)."""
        session = self.sessions["decoder_attention" if need_attention else "decoder"]
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", tokens)
        if self.positions:
            binding.bind_cpu_input(self.positions, positions)
        self._bind_step_inputs(binding, static, state, k)
        for name, where in outputs.items():
            binding.bind_output(name, where, self.device_id if where == self.device else 0)
        for entry in self.state:  # an in-place buffer is its own output; the rest get new device memory
            if entry.init == "buffer":
                binding.bind_ortvalue_output(entry.output, state[entry.input])
            else:
                binding.bind_output(entry.output, self.device, self.device_id)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()  # in binding order
        # a buffer stays the OrtValue it was (which keeps a host array it wraps alive), not get_outputs()'s twin
        new_state = {entry.input: state[entry.input] if entry.init == "buffer" else values[len(outputs) + i]
                     for i, entry in enumerate(self.state)}
        if self.positions:
            new_state[self.positions] = positions + 1
        return values[: len(outputs)], new_state

    def _bind_step_inputs(self, binding: ort.IOBinding, static: dict[str, ort.OrtValue], state: dict[str, Any],
                          k: int) -> None:
        for name, value in static.items():
            binding.bind_ortvalue_input(name, value)
        for entry in self.state:
            binding.bind_ortvalue_input(entry.input, state[entry.input])
        binding.bind_ortvalue_input(TOP_K_INPUT, self._top_k_value(k))

    @contextmanager
    def beam_run(self, beam: int, eos_id: int, start_id: int, books: Books, penalties: list[float],
                 quotas: list[int], static: dict[str, ort.OrtValue], state: dict[str, Any], positions: np.ndarray,
                 k: int, steps: int) -> Iterator[DeviceBeamRun]:
        """Up to ``steps`` beam steps whose selection stays on the device (:class:`DeviceBeamRun`), from the books
        and ``state`` at ``positions`` (int64 [R]), the in-place buffers with room for all of them. With
        ``cuda_graphs``, in a run of their shapes' bucket, kept one or new, that copies them in and out and is kept
        again at the end; without, in a run that reads and writes the decode's own buffers."""
        if not self.cuda_graphs and self.positions:  # the run reads the decode's buffers: room in them first
            state = self._reserve(state, int(positions.max()) + steps + 1)
        shapes = self._run_shapes(beam, eos_id, start_id, books, quotas, static, state, positions, k, steps)
        with self._kept(shapes, lambda: self._new_run(shapes, None if self.cuda_graphs else (static, state))) as run:
            run.start(books, penalties, quotas, static, state, positions if self.positions else None)
            yield run

    @contextmanager
    def _kept(self, shapes: Any, new: Callable[[], Any]) -> Iterator[Any]:
        """A run of bucket ``shapes`` from the pool, or ``new()``; kept again at the end (dropped at once where
        nothing is kept)."""
        run = self.pool.take(shapes) or new()
        try:
            yield run
        finally:
            self.pool.keep(shapes, run)

    def _run_shapes(self, beam: int, eos_id: int, start_id: int, books: Books, quotas: list[int],
                    static: dict[str, ort.OrtValue], state: dict[str, Any], positions: np.ndarray, k: int,
                    steps: int) -> RunShapes:
        """The shapes of a run (:class:`RunShapes`), the cache with room for ``steps`` more; with ``cuda_graphs``
        the number of sentences, the source length, the cache's capacity and the history's length rounded up to
        their bucket (:func:`server.engine.cuda_graphs.bucket`), so that runs of nearby shapes share one kept run
        and its graphs (without, padding would only cost: 0.85-0.92x on the CPU's device path)."""
        rounded = self.cuda_graphs
        length, sentences = books.history.shape[1], len(books.steps)
        if rounded:
            length, sentences = bucket(length), bucket(sentences, floor=1)
        needed = int(positions.max()) + steps + 1 if self.positions else 0
        static_shapes, state_shapes = self._buffer_shapes(sentences * beam, static, state, needed)
        return RunShapes(beam, eos_id, start_id, k, self.top_k_width(k), sentences * beam, sentences, length,
                         max(quotas), static_shapes, state_shapes, bool(self.positions))

    def _buffer_shapes(self, rows: int, static: dict[str, ort.OrtValue], state: dict[str, Any], needed: int,
                       ) -> tuple[tuple[tuple[str, tuple[int, ...], str], ...], ...]:
        """The shapes of a run's static inputs and device state for ``rows`` rows, the in-place buffers with room
        for ``needed`` positions; with ``cuda_graphs`` the source length and the capacity in their buckets."""

        def shape_of(name: str, value: ort.OrtValue, needed: int = 0) -> tuple[int, ...]:
            shape = [rows, *value.shape()[1:]]
            if name in self.buffers:  # room for the run's steps
                axis = self.buffers[name].capacity_axis
                shape[axis] = max(shape[axis], needed)
            return bucketed_shape(shape, self._dims.get(name)) if self.cuda_graphs else tuple(shape)

        return (tuple((name, shape_of(name, value), value.data_type()) for name, value in static.items()),
                tuple((name, shape_of(name, value, needed), value.data_type()) for name, value in state.items()
                      if not isinstance(value, np.ndarray)))

    @contextmanager
    def greedy_steps(self, tokens: np.ndarray, static: dict[str, Any], state: dict[str, Any], positions: np.ndarray,
                     steps: int, ceilings: np.ndarray | None = None) -> Iterator[Any]:
        """:meth:`OnnxStepModel.greedy_steps`; with ``cuda_graphs``, in a run of the rows' and shapes' bucket
        (:class:`server.engine.device_greedy.DeviceGreedyRun`, kept one or new, its step graph's runs naming a graph
        of its own where they can capture), kept again at the end."""
        if not self.cuda_graphs:
            with super().greedy_steps(tokens, static, state, positions, steps, ceilings) as run:
                yield run
            return
        rows = bucket(len(tokens), floor=1)
        furthest = int(moved_on(positions, steps, ceilings)[-1].max())  # a held row's position stops at its ceiling
        shapes = GreedyShapes(rows, *self._buffer_shapes(rows, static, state, furthest + 1))
        with self._kept(shapes, lambda: self._new_greedy_run(shapes)) as run:
            run.start(tokens, positions, static, state, steps, ceilings)
            yield run

    def _new_greedy_run(self, shapes: GreedyShapes) -> DeviceGreedyRun:
        """A greedy run made for ``shapes``: on the graph-enabled decoder session with a graph id of its own where
        runs capture, else on the ordinary one (said once)."""
        if not self.capture.enabled:
            self.capture.unavailable()
            return DeviceGreedyRun(self, shapes, self.sessions["decoder"], None)
        session = self.sessions["decoder_graphs"]
        options, ids = self._graph_options(session, BLOCK_STEPS)
        return DeviceGreedyRun(self, shapes, session, options, ids)

    def _new_run(self, shapes: RunShapes, borrowed: tuple[dict[str, Any], dict[str, Any]] | None,
                 ) -> DeviceBeamRun:
        """A run made for ``shapes``: on the graph-enabled sessions with graph ids of its own where runs capture,
        else on the ordinary sessions (``cuda_graphs`` says once why it does not capture); ``borrowed``: the
        decode's static inputs and state, which a run that is not kept reads where they are."""
        graphs = self.capture.enabled and self.cuda_graphs
        if graphs:
            try:
                sessions = self._run_sessions(shapes, graphs=True)
            except Exception as error:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors
                self.capture.failed(shapes, error)  # a graph-enabled session that did not open: ordinary runs
                graphs = False
        if not graphs:
            if self.cuda_graphs:
                self.capture.unavailable()
            return DeviceBeamRun(self, shapes, self._run_sessions(shapes, graphs=False), [None, None],
                                 borrowed=borrowed)
        return DeviceBeamRun(self, shapes, sessions, *self._graph_options(sessions[0], 2))

    def _graph_options(self, session: ort.InferenceSession, count: int,
                       ) -> tuple[list[ort.RunOptions], tuple[int, ...]]:
        """Run options naming ``count`` new graph ids for a run on ``session`` (ordinary runs where no more may
        capture), and the ids."""
        ids = self.capture.ids(can_release(session), count) or ()
        return [run_options(graph_id) for graph_id in ids] or [run_options(SKIP) for _ in range(count)], ids

    def _run_sessions(self, shapes: RunShapes, graphs: bool) -> tuple[ort.InferenceSession, ...]:
        """A run's step graph, selection and state ``Gather`` sessions (``graphs``: those with CUDA graphs)."""
        return (self.sessions["decoder_graphs" if graphs else "decoder"],
                self.selection_session(shapes.beam, shapes.eos_id, shapes.start_id, shapes.k, graphs=graphs),
                self.gather_session(tuple(kind for _, _, kind in shapes.state), graphs=graphs))

    def step_binding(self, session: ort.InferenceSession, tokens: ort.OrtValue | Slot,
                     positions: ort.OrtValue | Slot | None, static: dict[str, ort.OrtValue],
                     state: dict[str, ort.OrtValue], k: int, outputs: dict[str, ort.OrtValue | Slot],
                     written: dict[str, ort.OrtValue]) -> ort.IOBinding:
        """The step graph's ``session`` bound to buffers that stay: token ids and positions in, ``outputs``
        (top-k) out, ``state`` in and ``written`` out (the same buffer for an in-place one); ids, positions and
        outputs whole buffers or :class:`~server.engine.cuda_graphs.Slot` s of one."""
        binding = session.io_binding()
        bind(binding, "input_ids", tokens)
        if positions is not None:
            bind(binding, self.positions, positions)
        self._bind_step_inputs(binding, static, state, k)
        for name, value in outputs.items():
            bind(binding, name, value, output=True)
        for entry in self.state:
            binding.bind_ortvalue_output(entry.output, written[entry.input])
        return binding

    def gather_binding(self, session: ort.InferenceSession, inputs: list[ort.OrtValue], rows: ort.OrtValue,
                       outputs: list[ort.OrtValue]) -> ort.IOBinding:
        """The ``Gather`` ``session`` of ``inputs``' element types bound to buffers that stay: row ``i`` of each
        output receives row ``rows[i]`` of its input."""
        binding = session.io_binding()
        for i, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
            binding.bind_ortvalue_input(f"x{i}", x)
            binding.bind_ortvalue_output(f"y{i}", y)
        binding.bind_ortvalue_input("rows", rows)
        return binding

    def top_k_width(self, k: int) -> int:
        """The best tokens a step returns for ``k`` (``k``, or the vocabulary when smaller)."""
        return int(self._top_k(k)[0])

    @property
    def score_dtype(self) -> Any:
        """The NumPy type of the step's log-probabilities."""
        return self._output_dtypes[TOP_K_OUTPUTS[1]]

    def selection_session(self, beam: int, eos_id: int, start_id: int, k: int, graphs: bool = False,
                          ) -> ort.InferenceSession:
        """The selection graph's session for sentences of beam ``beam`` after steps of top-``k``, made once, with
        the decoder's options and providers (``graphs``: with CUDA graphs enabled)."""
        width = min(2 * beam, self.top_k_width(k))
        key = ("select", f"{beam}/{eos_id}/{start_id}/{width}", graphs)
        if key not in self._sessions:
            score_type = ELEMENT_TYPES[next(o.type for o in self.sessions["decoder"].get_outputs()
                                            if o.name == TOP_K_OUTPUTS[1])]
            self._sessions[key] = self._session(selection_graph(beam, eos_id, start_id, score_type, width), graphs)
        return self._sessions[key]

    def force(self, inputs: np.ndarray, targets: np.ndarray, static: dict[str, ort.OrtValue],
              state: dict[str, Any], need_attention: bool) -> ForcedOutput:
        """:meth:`OnnxStepModel.force` with the static inputs and the resulting cache on the device."""
        session = self.sessions.get(FORCED_GRAPH)
        if session is None:
            return stepwise_force(self, inputs, targets, static, state, need_attention)
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", inputs)
        binding.bind_cpu_input("target_ids", targets)
        for name, value in static.items():
            binding.bind_ortvalue_input(name, value)
        heads = ["target_log_probs", "last_log_probs", "attention"]
        for name in heads:
            binding.bind_output(name, "cpu")
        for entry in self.state:
            binding.bind_output(entry.output, self.device, self.device_id)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()
        outputs = dict(zip([*heads, *(entry.output for entry in self.state)], values, strict=True))
        return ForcedOutput(outputs["target_log_probs"].numpy(), outputs["last_log_probs"].numpy(),
                            outputs["attention"].numpy() if need_attention else None,
                            self.state_from_forced(outputs, inputs.shape[1]))
