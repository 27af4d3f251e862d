"""CUDA graphs for the decode's runs on the device: shape buckets, a pool of runs kept for reuse, graph ids.

A device beam run (:class:`server.engine.device_runs.DeviceBeamRun`) makes three session runs a step (the step
graph, the selection, the state's ``Gather``) and an arg-max run (:class:`server.engine.device_runs.
DeviceGreedyRun`) one, each some tens to a hundred kernels launched one by one. ONNX Runtime's CUDA provider can
capture a session run as a CUDA graph and replay it with one launch (``enable_cuda_graph``; run option
``gpu_graph_id`` names the graph: its first two runs are ordinary, the third captures, the later ones replay). A
replay reads and writes exactly the buffers the capture saw, at the shapes it saw, so:

* a run's shapes come in **buckets** (:func:`bucket`): the number of sentences, the source length, the cache's
  capacity and the history's length are rounded up to a power of two or one and a half times one (padding: a
  padded sentence copies the first one's rows and is never done, a source's mask marks its padded positions, a
  cache and a history have room they do not use); the beam, the top-k width and the quota stay exact;
* every buffer a run binds is its own, allocated once (the decode's state is copied in at its start and out at
  its end), and the run is kept in a :class:`RunPool` for the next run of its bucket, which replays its graphs;
* each kept run has graph ids of its own (a beam run's: one per parity of its two buffer sets), never reused;
  its graphs are released when the pool lets it go (or, where the runtime cannot release a graph, no more are
  captured once :data:`MAX_CAPTURED_RUNS` runs have been).

A run that cannot capture runs its steps as ordinary runs (``gpu_graph_id`` -1) and says why once
(:meth:`GraphCapture.unavailable`, :meth:`GraphCapture.failed`): on the CPU, on a runtime without CUDA graphs, or
when a capture fails.

ONNX Runtime captures in CUDA's global mode: while a capture is under way, another thread's device allocation or
synchronous copy fails and spoils the capture. So a session run that may capture holds :data:`CAPTURE_GATE`
(:meth:`KeptRun._run`: a graph id's first :data:`CAPTURE_CALLS` runs), and so does the encoder's thread beside the
decode (a device rule, :func:`beside_captures`): a capture then waits for an encoder call to end, and an
encoder call for a capture. Replays and ordinary runs need no gate."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

log = logging.getLogger("nmt.server")

BUCKET_FLOOR = 16  # the smallest bucket of a length
BUCKETED_DIMS = ("src_len", "capacity")  # the axes (named in the step graph's inputs) a bucket rounds up
MAX_CAPTURED_RUNS = 256  # runs that capture graphs, at most, where the runtime cannot release a captured graph
SKIP = -1  # gpu_graph_id: an ordinary run, no capture and no replay
CAPTURE_CALLS = 3  # a graph id's session runs that may capture (ONNX Runtime runs an id ordinarily twice, then
# captures; a version that captures on a run's own second pass does so within these); later ones replay
CAPTURE_GATE = threading.Lock()  # held by a session run that may capture and by encoder calls beside the decode


def bucket(size: int, floor: int = BUCKET_FLOOR) -> int:
    """The size a run of ``size`` is made for: the smallest power of two, or one and a half times one, at least
    ``size`` and ``floor`` (lengths: 16, 24, 32, 48, 64, 96, ...; sentences, from 1: 1, 2, 3, 4, 6, 8, 12, ...):
    at most half again the size, and a handful of buckets up to the largest."""
    if size <= floor:
        return floor
    power = 1 << (size - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= size else power


def bucketed_shape(shape: Sequence[int], dims: Sequence[Any] | None) -> tuple[int, ...]:
    """``shape`` with each axis that ``dims`` (the graph input's declared dimensions) names in
    :data:`BUCKETED_DIMS` rounded up to its :func:`bucket`; the other axes as they are."""
    if dims is None or len(dims) != len(shape):
        return tuple(shape)
    return tuple(bucket(size) if dim in BUCKETED_DIMS else size for size, dim in zip(shape, dims, strict=True))


def graph_options(providers: list[Any]) -> list[Any]:
    """``providers`` (an ``InferenceSession``'s list) with CUDA graphs enabled in the CUDA provider's options."""
    return [(name, {**options, "enable_cuda_graph": "1"}) if name == "CUDAExecutionProvider" else (name, options)
            for name, options in (p if isinstance(p, tuple) else (p, {}) for p in providers)]


class GraphCapture:
    """Whether a model's runs on the device capture CUDA graphs, the graph ids they use, and what is said once when
    they cannot. ``reason``: why runs cannot capture (empty: they can)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self._said: set[Hashable] = set()
        self._next_id = 1  # 0 is ONNX Runtime's default graph, -1 its "no graph"
        self._lock = threading.Lock()
        self.captured_runs = 0  # runs given graph ids
        self.failures = 0  # captures that failed (their runs went on as ordinary runs)

    @property
    def enabled(self) -> bool:
        """Runs capture graphs (on CUDA, with the graph-enabled sessions)."""
        return not self.reason

    def ids(self, can_release: bool, count: int = 2) -> tuple[int, ...] | None:
        """``count`` new graph ids for a run (a beam run's: one per buffer set), or None when it must not capture:
        capture is off, or :data:`MAX_CAPTURED_RUNS` runs have captured on a runtime that cannot release graphs
        (said once)."""
        with self._lock:
            if not self.enabled:
                return None
            if not can_release and self.captured_runs >= MAX_CAPTURED_RUNS:
                self._say_once("full", "CUDA graphs: %d runs have captured and this ONNX Runtime cannot release a "
                               "graph; later runs of new buckets are ordinary runs", MAX_CAPTURED_RUNS)
                return None
            first = self._next_id
            self._next_id += count
            self.captured_runs += 1
            return tuple(range(first, first + count))

    def unavailable(self) -> None:
        """Say once that runs do not capture, and why."""
        self._say_once("unavailable", "CUDA graphs: not captured (%s); the device's runs use ordinary session runs",
                       self.reason)

    def failed(self, bucket_key: Hashable, error: BaseException) -> None:
        """A capture failed: its run goes on with ordinary runs; said once per bucket."""
        self.failures += 1
        self._say_once(("failed", bucket_key), "CUDA graphs: a capture failed (%s); this bucket's runs use "
                       "ordinary session runs", error)

    def _say_once(self, key: Hashable, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args)


def beside_captures(model: Any) -> AbstractContextManager[Any]:
    """What a thread other than the decode's holds around its device work for ``model`` (the encoder's, with
    on a device): :data:`CAPTURE_GATE` where the model's runs capture CUDA graphs, else nothing."""
    kept = model is not None and model.capabilities.kept_runs
    return CAPTURE_GATE if kept and model.capture.enabled else nullcontext()


def run_options(graph_id: int) -> ort.RunOptions:
    """Run options that name ``graph_id`` (:data:`SKIP`: an ordinary run)."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


def can_release(session: ort.InferenceSession) -> bool:
    """This ONNX Runtime can release a captured graph (``InferenceSession.release_captured_graph``)."""
    return hasattr(session, "release_captured_graph")


@dataclass(frozen=True)
class Slot:
    """Slot ``index`` of a run's buffer ``buffer`` [slots, ...], bound as a tensor of ``shape``: the bindings of
    several steps point into one allocation, which one copy then writes or reads whole."""

    buffer: ort.OrtValue
    index: int
    shape: tuple[int, ...]
    device_id: int = 0  # the buffer's device (an OrtValue does not tell)

    def bind(self, binding: ort.IOBinding, name: str, output: bool) -> None:
        slots, *rest = self.buffer.shape()
        size = int(np.prod(rest, dtype=np.int64))  # elements a slot
        if int(np.prod(self.shape, dtype=np.int64)) != size or not 0 <= self.index < slots:
            raise ValueError(f"slot {self.index} of {slots}, {size} elements each, bound as {self.shape}")
        itemsize = self.buffer.tensor_size_in_bytes() // (slots * size)
        pointer = self.buffer.data_ptr() + self.index * size * itemsize
        method = binding.bind_output if output else binding.bind_input
        method(name, self.buffer.device_name(), self.device_id, self.buffer.element_type(), list(self.shape), pointer)


def bind(binding: ort.IOBinding, name: str, value: ort.OrtValue | Slot, output: bool = False) -> None:
    """Bind input (or ``output``) ``name`` to a whole buffer or to a :class:`Slot` of one."""
    if isinstance(value, Slot):
        value.bind(binding, name, output)
    elif output:
        binding.bind_ortvalue_output(name, value)
    else:
        binding.bind_ortvalue_input(name, value)


class KeptRun:
    """What the runs a :class:`RunPool` keeps share: ``model`` (its :class:`GraphCapture` is ``model.capture``),
    the ``shapes`` they are made for (their bucket), their ``sessions`` and each parity's run ``options`` (None: no
    graph-enabled sessions), the ``graph_ids`` those name, and buffers allocated on the model's device, counted
    (:attr:`nbytes`)."""

    def __init__(self, model: Any, shapes: Hashable, sessions: tuple[ort.InferenceSession, ...],
                 options: list[ort.RunOptions | None], graph_ids: tuple[int, ...]) -> None:
        self.model, self.device, self.device_id = model, model.device, model.device_id
        self.shapes, self.sessions = shapes, sessions
        self.options = options
        self.graph_ids = graph_ids  # the graphs this run's session runs may capture (released by drop())
        self.capturing = bool(graph_ids)  # its session runs name graphs (captured on their third run, then replayed)
        self.nbytes = 0  # device memory of the run's buffers
        self._calls: Counter[tuple[int, int]] = Counter()  # runs so far of each (session, parity): of each graph id

    def drop(self) -> None:
        """Release the graphs this run's session runs captured (its buffers go with the run)."""
        if self.graph_ids and can_release(self.sessions[0]):
            for session in self.sessions:
                for graph_id in self.graph_ids:
                    session.release_captured_graph(graph_id)

    def _run(self, session: int, binding: ort.IOBinding, parity: int = 0) -> None:
        """Run session ``session`` with ``binding`` and the run options of ``parity``, holding
        :data:`CAPTURE_GATE` while the run may capture (its graph id's first :data:`CAPTURE_CALLS`). A run that names
        a graph and fails (a capture that failed) sends this run's bucket to ordinary runs, said once, and runs
        again: during a capture nothing ran."""
        if self.capturing and self._calls[session, parity] < CAPTURE_CALLS:
            self._calls[session, parity] += 1
            with CAPTURE_GATE:
                self._run_once(session, binding, parity)
        else:
            self._run_once(session, binding, parity)

    def _run_once(self, session: int, binding: ort.IOBinding, parity: int) -> None:
        try:
            self.sessions[session].run_with_iobinding(binding, self.options[parity])
        except Exception as error:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors
            if not self.capturing:
                raise
            self.model.capture.failed(self.shapes, error)
            self.options, self.capturing = [run_options(SKIP)] * len(self.options), False
            self.sessions[session].run_with_iobinding(binding, self.options[parity])

    def _alloc(self, shape: tuple[int, ...], dtype: Any) -> ort.OrtValue:
        self.nbytes += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id)


class RunPool:
    """Runs kept for reuse, by bucket, within ``budget`` bytes of device memory (the least recently used go first;
    their graphs are released by ``drop``). :meth:`take` hands a kept run out (it is not kept while in use),
    :meth:`keep` takes it back."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._runs: OrderedDict[Hashable, list[Any]] = OrderedDict()  # bucket -> runs (nbytes, drop())
        self._lock = threading.Lock()
        self.held = 0  # bytes of the runs kept
        self.reused = 0  # runs handed out again

    def take(self, key: Hashable) -> Any | None:
        """A kept run of bucket ``key``, or None."""
        with self._lock:
            runs = self._runs.get(key)
            if not runs:
                return None
            run = runs.pop()
            if not runs:
                del self._runs[key]
            self.held -= run.nbytes
            self.reused += 1
            return run

    def keep(self, key: Hashable, run: Any) -> None:
        """Keep ``run`` for the next run of bucket ``key``, letting the least recently used go (``run.drop()``)
        while the pool holds more than its budget (``run`` itself, when it alone is larger)."""
        dropped = []
        with self._lock:
            self._runs.setdefault(key, []).append(run)
            self._runs.move_to_end(key)
            self.held += run.nbytes
            while self.held > self.budget and self._runs:
                oldest, runs = next(iter(self._runs.items()))
                gone = runs.pop(0)
                if not runs:
                    del self._runs[oldest]
                self.held -= gone.nbytes
                dropped.append(gone)
        for gone in dropped:
            gone.drop()

    def __len__(self) -> int:
        return sum(len(runs) for runs in self._runs.values())
