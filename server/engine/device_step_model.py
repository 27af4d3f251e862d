"""The step model that keeps a version's tensors on the execution provider's device (CUDA) between steps.

Its rows move on the device: selected (a beam reorder, sentences
leaving), padded (a cache that grows), joined (sentences joining) and copied into fixed buffers (the runs kept for
CUDA graphs), each by one run of a small graph over every tensor concerned (``Gather``, ``Pad``, ``Concat``), made
once per kind and element types with the decoder's options and providers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from common.model_format.layout import FORCED_GRAPH
from common.model_format.manifest import LOGITS_OUTPUT, TOP_K_INPUT, TOP_K_OUTPUTS, Manifest, StateTensor
from server.engine.cuda_graphs import (
    SKIP,
    GraphCapture,
    RunPool,
    Slot,
    bind,
    bucket,
    bucketed_shape,
    can_release,
    graph_options,
    run_options,
)
from server.engine.device_runs import (
    BLOCK_STEPS,
    ELEMENT_TYPES,
    DeviceBeamRun,
    DeviceBooks,
    DeviceGreedyRun,
    GreedyShapes,
    RunShapes,
    selection_graph,
)
from server.engine.forced import stepwise_force
from server.engine.host_runs import moved_on
from server.engine.onnx_step_model import OnnxStepModel, extra_outputs, initial_shape
from server.engine.shared_weights import SharedWeights
from server.engine.step_model import ForcedOutput, StepOutput, concat_rows


class DeviceStepModel(OnnxStepModel):
    """:class:`OnnxStepModel` with I/O binding: the encoder outputs and the recurrent state (the
    Transformer's KV cache) stay on ``device`` as ``OrtValue`` buffers from step to step, and rows are
    selected there by a ``Gather`` graph. Each step sends the [R] token ids in and brings only the
    top-k, the EOS log-prob and (when asked) the attention back to the host; with ``device_search`` a beam
    search's quiet steps keep even those there (:meth:`device_step`, :mod:`server.engine.device_runs`).

    For CUDA, where copying the cache to the host and back at every step would dominate. On the CPU
    it gains nothing (NumPy arrays already share ONNX Runtime's memory) and serves to test the
    binding logic on machines without a GPU.

    Rows move on the device (:class:`server.engine.device_step_model.DeviceRows`); the ``Gather`` sessions (one for the
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
        # beam search's selection on the device with device_search; no plain beam runs: their reorder moves host rows,
        # a device's is the general step's Gather
        self.capabilities = replace(self.capabilities, beam_steps=False, on_device=device != "cpu",
                                    kept_runs=cuda_graphs, device_beam=device_search)
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
            if entry.init == "buffer":
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
    def beam_run(self, beam: int, eos_id: int, start_id: int, books: DeviceBooks, penalties: list[float],
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

    def _run_shapes(self, beam: int, eos_id: int, start_id: int, books: DeviceBooks, quotas: list[int],
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
        (:class:`server.engine.device_runs.DeviceGreedyRun`, kept one or new, its step graph's runs naming a graph
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

    device: str
    device_id: int
    sessions: dict[str, ort.InferenceSession]
    buffers: dict[str, StateTensor]
    _sessions: dict[tuple[str, Any], ort.InferenceSession]

    def select_rows(self, tensors: dict[str, Any], rows: np.ndarray, in_place: bool = False) -> dict[str, Any]:
        """Rows by one ``Gather`` session run on the device for every tensor there (the whole tensor, ``in_place``
        or not; positions are gathered on the host)."""
        rows_value = ort.OrtValue.ortvalue_from_numpy(rows.astype(np.int64, copy=False), self.device, self.device_id)
        selected = self._gather(tensors, rows_value)
        for name, value in tensors.items():
            if isinstance(value, np.ndarray):
                selected[name] = value[rows]
        return selected

    def _gather(self, tensors: dict[str, Any], rows: ort.OrtValue) -> dict[str, Any]:
        """Rows ``rows`` (on the device) of every device tensor of ``tensors``, in one session run; host arrays are
        returned as they are."""
        names = [name for name, value in tensors.items() if not isinstance(value, np.ndarray)]
        selected = dict(tensors)
        if not names:
            return selected
        values = [tensors[name] for name in names]
        selected.update(zip(names, self._run_rows("gather", values, {"rows": rows}), strict=True))
        return selected

    def gather_session(self, types: tuple[str, ...], graphs: bool = False) -> ort.InferenceSession:
        """The session that gathers the rows of tensors of element ``types`` ("tensor(float)", ...), one
        ``Gather`` each (made once per tuple: the static inputs' and the state's at load; ``graphs``: with CUDA
        graphs enabled)."""
        return self._rows_session("gather", types, graphs)

    def padded_copies(self, values: list[ort.OrtValue], rows: np.ndarray, into: list[ort.OrtValue] | None = None,
                      ) -> list[ort.OrtValue]:
        """Rows ``rows`` of ``values`` copied in one session run: into the buffers ``into``, each zero-padded at
        the ends of its other axes to its buffer's shape, or (None) into new device memory, as they are."""
        if not values:
            return []
        pads = {f"p{i}": _pads([len(rows), *value.shape()[1:]],
                               value.shape()[1:] if into is None else into[i].shape()[1:])
                for i, value in enumerate(values)}
        rows_value = ort.OrtValue.ortvalue_from_numpy(rows.astype(np.int64), self.device, self.device_id)
        return self._run_rows("fill", values, {"rows": rows_value}, host=pads, into=into)

    def concat_rows(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """:meth:`OnnxStepModel.concat_rows` on the device: every tensor's ``Pad`` and ``Concat`` in one session
        run (host arrays, the positions, joined on the host)."""
        names = [name for name, value in first.items() if not isinstance(value, np.ndarray)]
        joined = concat_rows({name: first[name] for name in first if name not in names},
                             {name: second[name] for name in first if name not in names})
        if not names:
            return joined
        values, pads = [], {}
        for i, name in enumerate(names):
            a, b = first[name], second[name]
            width = [int(w) for w in np.maximum(a.shape()[1:], b.shape()[1:])]
            values += [a, b]
            pads[f"pa{i}"], pads[f"pb{i}"] = _pads(a.shape(), width), _pads(b.shape(), width)
        joined.update(zip(names, self._run_rows("join", values, host=pads), strict=True))
        return {name: joined[name] for name in first}

    def _reserve(self, state: dict[str, Any], needed: int) -> dict[str, Any]:
        """:meth:`OnnxStepModel._reserve` with every buffer that grows padded in one session run."""
        growing = []
        for name, entry in self.buffers.items():
            capacity = state[name].shape()[entry.capacity_axis]
            if needed > capacity:
                growing.append((name, entry, max(2 * capacity, needed)))
        if not growing:
            return state
        pads = {}
        for i, (name, entry, capacity) in enumerate(growing):
            target = state[name].shape()[1:]
            target[entry.capacity_axis - 1] = capacity
            pads[f"p{i}"] = _pads(state[name].shape(), target)
        grown = self._run_rows("pad", [state[name] for name, _, _ in growing], host=pads)
        return {**state, **{name: value for (name, _, _), value in zip(growing, grown, strict=True)}}

    def _grow(self, buffer: ort.OrtValue, entry: StateTensor, capacity: int) -> ort.OrtValue:
        shape = buffer.shape()
        target = shape[1:]
        target[entry.capacity_axis - 1] = capacity
        return self._run_rows("pad", [buffer], host={"p0": _pads(shape, target)})[0]

    def _run_rows(self, kind: str, values: list[ort.OrtValue], device: dict[str, ort.OrtValue] | None = None,
                  host: dict[str, np.ndarray] | None = None, into: list[ort.OrtValue] | None = None,
                  ) -> list[ort.OrtValue]:
        """One run of the ``kind`` session (:meth:`_rows_session`) over ``values`` (its tensors, in its input
        order) with ``device`` inputs (``rows``) and ``host`` ones (pads); returns its outputs, on the device (in
        the buffers ``into`` when given)."""
        per = 2 if kind == "join" else 1
        session = self._rows_session(kind, tuple(value.data_type() for value in values[::per]))
        binding = session.io_binding()
        for name, value in zip(_tensor_inputs(kind, len(values) // per), values, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in (device or {}).items():
            binding.bind_ortvalue_input(name, value)
        for name, array in (host or {}).items():
            binding.bind_cpu_input(name, array)
        for i in range(len(values) // per):
            if into is None:
                binding.bind_output(f"y{i}", self.device, self.device_id)
            else:
                binding.bind_ortvalue_output(f"y{i}", into[i])
        session.run_with_iobinding(binding)
        return binding.get_outputs() if into is None else into

    def _rows_session(self, kind: str, types: tuple[str, ...], graphs: bool = False) -> ort.InferenceSession:
        """The session of a small graph over tensors of element ``types``, one chain of nodes each, all in one
        run: ``gather`` (rows ``rows`` of each ``x{i}``), ``pad`` (each ``x{i}`` zero-padded by ``p{i}``),
        ``fill`` (rows ``rows`` of each ``x{i}``, zero-padded by ``p{i}``) or ``join`` (each ``a{i}`` and
        ``b{i}`` padded by ``pa{i}``/``pb{i}``, then concatenated on the rows); ``graphs``: with CUDA graphs
        enabled."""
        key = (kind, types, graphs)
        if key not in self._sessions:
            nodes, inputs = [], []
            for i, element_type in enumerate(types):
                dtype = ELEMENT_TYPES[element_type]
                inputs += [helper.make_tensor_value_info(name, dtype, None) for name in _tensor_inputs(kind, 1, i)]
                if kind == "gather":
                    nodes.append(helper.make_node("Gather", [f"x{i}", "rows"], [f"y{i}"], axis=0))
                elif kind == "pad":
                    nodes.append(helper.make_node("Pad", [f"x{i}", f"p{i}"], [f"y{i}"]))
                elif kind == "fill":
                    nodes += [helper.make_node("Gather", [f"x{i}", "rows"], [f"g{i}"], axis=0),
                              helper.make_node("Pad", [f"g{i}", f"p{i}"], [f"y{i}"])]
                else:
                    nodes += [helper.make_node("Pad", [f"a{i}", f"pa{i}"], [f"ja{i}"]),
                              helper.make_node("Pad", [f"b{i}", f"pb{i}"], [f"jb{i}"]),
                              helper.make_node("Concat", [f"ja{i}", f"jb{i}"], [f"y{i}"], axis=0)]
            extra = (["rows"] if kind in ("gather", "fill") else []) + [
                f"{p}{i}" for i in range(len(types)) if kind != "gather"
                for p in (("pa", "pb") if kind == "join" else ("p",))]
            inputs += [helper.make_tensor_value_info(name, TensorProto.INT64, None) for name in extra]
            outputs = [helper.make_tensor_value_info(f"y{i}", ELEMENT_TYPES[t], None) for i, t in enumerate(types)]
            graph = helper.make_graph(nodes, f"rows_{kind}", inputs, outputs)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
            self._sessions[key] = self._session(model.SerializeToString(), graphs)
        return self._sessions[key]

    def _session(self, model: bytes, graphs: bool = False) -> ort.InferenceSession:
        """A session of a small graph with the decoder's options and providers (device id and memory limit
        included; ``graphs``: CUDA graphs enabled)."""
        decoder = self.sessions["decoder"]
        options = decoder.get_provider_options()  # provider -> its options (device id, memory limit, ...)
        providers = [(name, options.get(name, {})) for name in decoder.get_providers()]
        return ort.InferenceSession(model, decoder.get_session_options(),
                                    providers=graph_options(providers) if graphs else providers)

    @property
    def gather_sessions(self) -> dict[str, ort.InferenceSession]:
        """The ``Gather`` sessions that select rows, by the element types of the tensors they take ("tensor(float),
        tensor(float)", ...)."""
        return {", ".join(key): session for (kind, key, graphs), session in self._sessions.items()
                if kind == "gather" and not graphs}


def _tensor_inputs(kind: str, count: int, first: int = 0) -> list[str]:
    """The tensor inputs of a :meth:`DeviceRows._rows_session` graph of ``kind`` for tensors ``first`` ..."""
    names = ("a", "b") if kind == "join" else ("x",)
    return [f"{name}{i}" for i in range(first, first + count) for name in names]


def _pads(shape: list[int], target: list[int]) -> np.ndarray:
    """``Pad``'s pads that take a tensor of ``shape`` to ``target`` on its non-row axes (zeros at their ends)."""
    return np.array([0] * len(shape) + [0] + [want - got for got, want in zip(shape[1:], target, strict=True)],
                    dtype=np.int64)
