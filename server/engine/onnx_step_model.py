"""The :class:`server.engine.step_model.StepModel` of an exported model version: ONNX Runtime sessions, step by step.

:class:`OnnxStepModel` keeps the static inputs and the recurrent state as NumPy arrays that share ONNX
Runtime's memory (the CPU); :class:`server.engine.device_step_model.DeviceStepModel` keeps them on the execution
provider's device as ``OrtValue`` buffers (CUDA), selecting and joining rows there with small graphs.

A Transformer exported as ``nmt-model/2`` keeps its self-attention KV cache in place: the state holds
preallocated [rows, heads, capacity, head_dim] buffers and each row's position; the decoder writes each
row's new key/value at its position into the very buffer it reads (the output is bound to the input's
memory), capacity doubles when a row reaches it, and a beam reorder moves only the rows whose source
differs. Arrays this module allocates keep as many spare rows again behind their rows: a beam's first
expansion and the sentences joining a running decode are written there, not into a copy of the decode.
A running decode's static inputs move their rows in place too once they are its own
(``select_rows(..., in_place=True)``); the step's I/O binding shares the arrays' memory, so a move
within the same arrays reaches the next step without binding them again.

:class:`server.engine.host_runs.GreedySteps` runs plain arg-max steps on the in-place cache with a binding of
its own, the step graph's top-1 output bound to the next step's ``input_ids``.

``decoder_forced.onnx`` runs given target tokens in one call (:meth:`OnnxStepModel.force`); its K/V of
those positions go into the step decoder's buffers (:meth:`OnnxStepModel.state_from_forced`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnxruntime as ort

from common.model_format.layout import FORCED_GRAPH
from common.model_format.manifest import (
    FORMAT,
    LOGITS_OUTPUT,
    REEXPORT,
    TOP_K_INPUT,
    TOP_K_OUTPUTS,
    Manifest,
    ManifestError,
    StateTensor,
)
from server.engine.forced import stepwise_force
from server.engine.host_runs import BeamSteps, GreedySteps, bind_input, shape_of
from server.engine.shared_weights import SharedWeights
from server.engine.step_model import Capabilities, ForcedOutput, StepOutput

RELEASE_BYTES = 64 << 20  # what a thread's bindings may keep of an ended decode (OnnxStepModel.release)
INITIAL_CAPACITY = 16  # positions an in-place KV cache holds before it first grows (it doubles)


class OnnxStepModel:
    """The :class:`server.engine.step_model.StepModel` of an exported model version: encoder + one-step decoder.

    With an in-place KV cache (``manifest.decoder_positions``) the state also holds each row's position
    (int64 [R], under that input's name), so rows carry their own lengths through :meth:`select_rows`
    and :meth:`concat_rows`; :meth:`step` feeds them (or the ``positions`` it is given), binds each
    ``present_*`` output to its ``past_*`` buffer and grows the buffers when a row reaches their capacity."""

    def __init__(self, manifest: Manifest, sessions: dict[str, ort.InferenceSession],
                 weights: SharedWeights | None = None) -> None:
        self.manifest = manifest
        self.sessions = sessions
        self.weights = weights  # the buffers the sessions read (a version storing its weights once): they must
        # live as long as the sessions, which hold no reference to them
        self.static_names = list(manifest.decoder_static)
        self.static_src_axes = dict(manifest.static_src_axes)  # static input -> its source-length axis
        self.state = list(manifest.decoder_state)
        self.positions = manifest.decoder_positions  # "": no cache of positions (an RNN's state)
        self.buffers = {entry.input: entry for entry in self.state if entry.init == "buffer"}
        for role in ("decoder", "decoder_attention"):
            missing = set(TOP_K_OUTPUTS) - {o.name for o in sessions[role].get_outputs()}
            if missing:
                raise ManifestError(f"the {role} graph lacks the outputs {sorted(missing)} of the {FORMAT} "
                                    "format: export the model again with this version of nmt export")
        self._top_k_feeds: dict[int, np.ndarray] = {}  # k -> the int64 [1] feed (built once, not every step)
        self._top_k_values: dict[int, ort.OrtValue] = {}  # k -> top_k as an OrtValue (wraps the cached feed)
        self._bindings = threading.local()  # the in-place cache's persistent I/O bindings (see _binding)
        self._output_dtypes = {o.name: _NUMPY_TYPES[o.type] for o in sessions["decoder_attention"].get_outputs()
                               if o.type in _NUMPY_TYPES}
        missing = [role for role in ("decoder", "decoder_attention")
                   if LOGITS_OUTPUT not in {o.name for o in sessions[role].get_outputs()}]
        if missing:
            raise ManifestError(f"the {' and '.join(missing)} graph lacks the {LOGITS_OUTPUT!r} output of the decoding "
                                f"controls (an earlier export); {REEXPORT}")
        # per-row positions: the in-place cache, or a position-free state (an RNN's, all from the encoder); plain
        # arg-max runs: the in-place cache; plain beam runs: its buffers all of one shape and type (they share one
        # block: server.engine.host_runs.CacheBlock)
        self.capabilities = Capabilities(
            per_row_positions=bool(self.positions) or all(entry.init == "encoder" for entry in self.state),
            greedy_steps=bool(self.positions),
            beam_steps=bool(self.positions) and len({(tuple(e.shape or ()), e.dtype, e.capacity_axis)
                                                     for e in self.buffers.values()}) == 1)

    def encode(self, src: np.ndarray) -> dict[str, np.ndarray]:
        """``src`` [B, S] int64 -> the decoder's static inputs and initial state, per sentence (batch first)."""
        outputs = self.sessions["encoder"].run(None, {"src_ids": src})
        names = [o.name for o in self.sessions["encoder"].get_outputs()]
        encoded = dict(zip(names, outputs, strict=True))
        batch = src.shape[0]
        for entry in self.state:
            if entry.init == "buffer":
                encoded[entry.input] = np.zeros(initial_shape(entry, batch), dtype=entry.dtype or "float32")
        if self.positions:
            encoded[self.positions] = np.zeros(batch, dtype=np.int64)
        return encoded

    def step(
        self, tokens: np.ndarray, static: dict[str, np.ndarray], state: dict[str, np.ndarray], need_attention: bool,
        k: int, full: bool = False, positions: np.ndarray | None = None, logits: bool = False,
    ) -> StepOutput:
        """One decoding step (see :class:`server.engine.step_model.StepModel`): only the ``k`` best tokens of each
        row leave ONNX Runtime, not the [R, V] distribution, unless ``full`` (and ``logits``) ask for it.
        ``positions`` (int64 [R]) overrides the positions the state carries (a state without positions, an
        RNN's, has none to override)."""
        if self.positions:
            return self._step_in_place(tokens, static, state, need_attention, k, full, positions, logits)
        session = self.sessions["decoder_attention" if need_attention else "decoder"]
        feeds = {"input_ids": tokens, **static, **state, TOP_K_INPUT: self._top_k(k)}
        output_names = TOP_K_OUTPUTS + [entry.output for entry in self.state]
        if need_attention:
            output_names.append("attention")
        extra = extra_outputs(full, logits)
        outputs = session.run(output_names + extra, feeds)
        heads = len(TOP_K_OUTPUTS)
        new_state = {entry.input: outputs[heads + i] for i, entry in enumerate(self.state)}
        attention = outputs[heads + len(self.state)] if need_attention else None
        full_outputs = dict(zip(extra, outputs[len(output_names):], strict=True))
        return StepOutput(*outputs[:heads], attention, new_state, full_outputs.get("log_probs"),
                          full_outputs.get(LOGITS_OUTPUT))

    def force(self, inputs: np.ndarray, targets: np.ndarray, static: dict[str, np.ndarray],
              state: dict[str, np.ndarray], need_attention: bool) -> ForcedOutput:
        """Given tokens in one ``decoder_forced`` call (see :class:`server.engine.step_model.StepModel`), or step by
        step for a version without that graph (the RNN, Transformers exported before it)."""
        session = self.sessions.get(FORCED_GRAPH)
        if session is None:
            return stepwise_force(self, inputs, targets, static, state, need_attention)
        names = ["target_log_probs", "last_log_probs", "attention", *(entry.output for entry in self.state)]
        outputs = dict(zip(names, session.run(names, {"input_ids": inputs, "target_ids": targets, **static}),
                           strict=True))
        return ForcedOutput(outputs["target_log_probs"], outputs["last_log_probs"],
                            outputs["attention"] if need_attention else None,
                            self.state_from_forced(outputs, inputs.shape[1]))

    def state_from_forced(self, outputs: dict[str, Any], length: int) -> dict[str, Any]:
        """The step decoder's state after a ``decoder_forced`` call over ``length`` positions: each state
        entry's ``output`` there ([batch, heads, length, head_dim] K/V of every layer) under its input
        name; an in-place cache's buffers hold them in their first ``length`` positions (capacity
        :data:`INITIAL_CAPACITY` doubled until they fit, zeros beyond) and every row's
        position is ``length``. The one place that hands the forced pass's cache to the step search."""
        state = {}
        for entry in self.state:
            value = outputs[entry.output]
            if entry.init == "buffer":  # a host array takes the buffers' type (an fp16 graph's already has it)
                value = value.astype(entry.dtype or "float32", copy=False) if isinstance(value, np.ndarray) else value
                value = self._grow(value, entry, max(INITIAL_CAPACITY, 1 << (length - 1).bit_length()))
            state[entry.input] = value
        if self.positions:
            state[self.positions] = np.full(shape_of(outputs[self.state[0].output])[0], length, dtype=np.int64)
        return state

    def _step_in_place(
        self, tokens: np.ndarray, static: dict[str, np.ndarray], state: dict[str, np.ndarray], need_attention: bool,
        k: int, full: bool, positions: np.ndarray | None, logits: bool = False,
    ) -> StepOutput:
        """:meth:`step` of the in-place cache: I/O binding, each ``present_*`` bound to its ``past_*`` buffer.

        The binding persists between steps (one per graph, output set and thread): only inputs whose array
        changed are bound again, the token ids and positions (new every step) are copied into arrays bound
        once per row count, and the host outputs are written into arrays bound once per shape (copied
        out after the run). Binding everything anew and fetching the outputs cost ~0.1-0.2 ms a step, a
        third of the demo Transformer's step at one row; binding the ids and positions, ~40 us."""
        positions = state[self.positions] if positions is None else positions.astype(np.int64, copy=False)
        state = self._reserve(state, int(positions.max()) + 1)
        binding, bound, output_names, extra = self._binding(need_attention, full, logits)
        for name, value in (("input_ids", tokens), (self.positions, positions)):
            held = bound.get(name)
            if held is not None and held.shape == value.shape:
                np.copyto(held, value)
            else:
                held = bound[name] = value.astype(np.int64)  # a copy of its own
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(held))
        for name, value in static.items():
            if bound.get(name) is not value:
                bind_input(binding, bound, name, value)
        if bound.get(TOP_K_INPUT) is not (top_k := self._top_k_value(k)):
            bind_input(binding, bound, TOP_K_INPUT, top_k)
        for name, entry in self.buffers.items():
            value = state[name]
            if bound.get(name) is not value:
                buffer = ort.OrtValue.ortvalue_from_numpy(value)  # shares the array's memory
                binding.bind_ortvalue_input(name, buffer)
                binding.bind_ortvalue_output(entry.output, buffer)
                bound[name] = value
        shapes = (len(tokens), k, self._source_width(static) if need_attention else 0)
        if bound.get(_SHAPES) != shapes:  # the host outputs' arrays, bound again when a shape changes
            for name in output_names:
                shape = self._output_shape(name, len(tokens), k, static)
                if name not in bound or bound[name].shape != shape:
                    bound[name] = np.empty(shape, dtype=self._output_dtypes[name])
                    binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(bound[name]))
            bound[_SHAPES] = shapes
        new_state = {**state, self.positions: positions + 1}  # before the run, while the caches are warm
        self.sessions["decoder_attention" if need_attention else "decoder"].run_with_iobinding(binding)
        outputs = [bound[name].copy() for name in output_names]  # the bound arrays are written again next step
        heads = len(TOP_K_OUTPUTS)
        full_outputs = dict(zip(extra, outputs[len(output_names) - len(extra):], strict=True)) if extra else {}
        return StepOutput(*outputs[:heads], outputs[heads] if need_attention else None, new_state,
                          full_outputs.get("log_probs"), full_outputs.get(LOGITS_OUTPUT))

    def release(self) -> None:
        """Let go of this thread's bindings and runs (:class:`server.engine.step_model.StepModel`) when they hold
        more than :data:`RELEASE_BYTES` of the ended decode (its cache, static inputs, [R, V] outputs), which
        would otherwise stay allocated until the next decode binds its own (at NLLB-600M's size and 80 rows,
        ~1.6 GiB). A smaller decode's are kept: making the bindings again costs a small model's batch-1
        sentence 5-7% (the dates Transformer, 1.3 ms)."""
        held: dict[int, int] = {}
        for value in self._held_arrays():
            base = value.base if isinstance(value.base, np.ndarray) else value
            held[id(base)] = base.nbytes
        if sum(held.values()) > RELEASE_BYTES:
            self._bindings.__dict__.clear()

    def _held_arrays(self) -> Iterator[np.ndarray]:
        runs = self._bindings.__dict__
        for _, bound, _, _ in runs.get("by_outputs", {}).values():
            yield from (v for v in bound.values() if isinstance(v, np.ndarray))
        for key in ("greedy", "beam"):
            if (run := runs.get(key)) is not None:
                yield from run.held_arrays()

    @contextmanager
    def greedy_steps(self, tokens: np.ndarray, static: dict[str, np.ndarray], state: dict[str, Any],
                     positions: np.ndarray, steps: int, ceilings: np.ndarray | None = None) -> Iterator[GreedySteps]:
        """Up to ``steps`` arg-max steps from ``tokens`` (int64 [R]) at ``positions`` (int64 [R]), no row's
        position moving past its ``ceilings`` entry, with every array bound once (:class:`GreedySteps`, this
        thread's for ``R`` rows); needs ``capabilities.greedy_steps``."""
        run = self._bindings.__dict__.get("greedy")
        if run is None or run.rows != len(tokens):
            run = self._bindings.__dict__["greedy"] = GreedySteps(self, len(tokens))
        run.start(tokens, positions, static, state, steps, ceilings)
        yield run

    def beam_steps(self, tokens: np.ndarray, static: dict[str, np.ndarray], state: dict[str, Any],
                   positions: np.ndarray, k: int, steps: int) -> BeamSteps:
        """Up to ``steps`` beam steps from ``tokens`` (int64 [R]) at ``positions`` (int64 [R]), each row's ``k``
        best tokens read (:class:`server.engine.host_runs.BeamSteps`); needs :attr:`plain_beam`."""
        run = self._bindings.__dict__.get("beam")
        if run is None or (run.rows, run.k) != (len(tokens), k):
            run = self._bindings.__dict__["beam"] = BeamSteps(self, len(tokens), k)
        run.start(tokens, positions, static, state, steps)
        return run

    def _binding(self, need_attention: bool, full: bool, logits: bool
                 ) -> tuple[ort.IOBinding, dict[str, Any], list[str], list[str]]:
        """This thread's I/O binding of the step graph with the outputs these flags ask for, what is bound to
        it (input or host output name -> the array), its host output names and the [R, V] ones among them."""
        bindings = self._bindings.__dict__.setdefault("by_outputs", {})
        key = (need_attention, full, logits)
        if key not in bindings:
            extra = extra_outputs(full, logits)
            output_names = TOP_K_OUTPUTS + (["attention"] if need_attention else []) + extra
            role = "decoder_attention" if need_attention else "decoder"
            bindings[key] = (self.sessions[role].io_binding(), {}, output_names, extra)
        return bindings[key]

    def _source_width(self, static: dict[str, np.ndarray]) -> int:
        source, axis = next(iter(self.manifest.static_src_axes.items()))
        return static[source].shape[axis]

    def _output_shape(self, name: str, rows: int, k: int, static: dict[str, np.ndarray]) -> tuple[int, ...]:
        """The shape of host output ``name`` for ``rows`` rows and top ``k``."""
        if name in TOP_K_OUTPUTS[:2]:  # top_ids, top_log_probs
            return rows, int(self._top_k(k)[0])
        if name in ("log_probs", LOGITS_OUTPUT):
            return rows, self.manifest.vocab_size
        if name == "attention":  # [rows, source length]
            return rows, self._source_width(static)
        return (rows,)  # eos_log_prob

    def _reserve(self, state: dict[str, Any], needed: int) -> dict[str, Any]:
        """``state`` with buffers that hold at least ``needed`` positions (grown to twice their capacity or
        more; the buffers grow together, so the first one tells). Grown in ``state`` itself, one buffer at
        a time, once this thread's step bindings have let their references go: each old buffer is freed as
        its successor is made, so growing takes one buffer more rather than a second cache (the grown
        buffers hold the same entries, so whoever else holds ``state`` loses nothing)."""
        name, entry = next(iter(self.buffers.items()))
        if needed <= shape_of(state[name])[entry.capacity_axis]:
            return state
        self._unbind_all()
        for name, entry in self.buffers.items():
            capacity = shape_of(state[name])[entry.capacity_axis]
            if needed > capacity:
                state[name] = self._grow(state.pop(name), entry, max(2 * capacity, needed))
        return state

    def _unbind_all(self) -> None:
        """Clear this thread's step bindings (their next run binds everything again)."""
        for binding, bound, _, _ in self._bindings.__dict__.get("by_outputs", {}).values():
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            bound.clear()

    def _grow(self, buffer: np.ndarray, entry: StateTensor, capacity: int) -> np.ndarray:
        shape = list(buffer.shape)
        old, shape[entry.capacity_axis] = shape[entry.capacity_axis], capacity
        grown = np.zeros(shape, dtype=buffer.dtype)
        grown[(slice(None),) * entry.capacity_axis + (slice(0, old),)] = buffer
        return grown

    def _top_k(self, k: int) -> np.ndarray:
        if k not in self._top_k_feeds:
            self._top_k_feeds[k] = np.array([min(k, self.manifest.vocab_size)], dtype=np.int64)
        return self._top_k_feeds[k]

    def _top_k_value(self, k: int) -> ort.OrtValue:
        """``top_k`` as an OrtValue (an overridable initializer binds only as one), made once per k."""
        if k not in self._top_k_values:
            self._top_k_values[k] = ort.OrtValue.ortvalue_from_numpy(self._top_k(k))
        return self._top_k_values[k]

    def select_rows(self, tensors: dict[str, np.ndarray], rows: np.ndarray,
                    in_place: bool = False) -> dict[str, np.ndarray]:
        """Rows ``rows`` of ``tensors``, gathered into new arrays with as many spare rows again behind them
        (room for sentences that join later: :meth:`concat_rows`), except in-place cache buffers, and every
        tensor when ``in_place`` says they are the caller's alone (e.g. a running decode's static inputs
        once it has joined or selected them). Those reuse their memory where it has room for the rows:
        row ``i`` receives row ``rows[i]``'s entries only when ``rows[i] != i`` (rows in place are not
        touched), and cache buffers copy only the positions in use (up to the longest selected row's
        position). A beam reorder then copies a fraction of what a gather of whole rows did (measured on
        128 rows, 6 buffers of 32 positions: 1-3.5 ms against 10-13 ms), and a beam's first expansion
        writes the new rows behind the others when the buffer has spare rows there (see
        :func:`_spare_rows`). Otherwise, and for a fresh state (no position in use: selections from it
        never share memory), the rows go into a new buffer with room to spare. The caller keeps the
        result, not ``tensors``."""
        lengths = tensors.get(self.positions) if self.positions else None
        used = int(lengths[rows].max()) if lengths is not None and rows.size else None
        moved = np.flatnonzero(rows != np.arange(len(rows)))  # once for all buffers; rows past the old ones move
        moves = (moved, rows[moved])
        return {name: _move_rows(value, rows, moves, self.buffers[name], used) if name in self.buffers
                else _move_rows(value, rows, moves) if in_place else _gather_rows(value, rows)
                for name, value in tensors.items()}

    def concat_rows(self, first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The rows of ``first`` (a running decode's own arrays) then those of ``second`` (sentences joining
        it); source length and cache capacity zero-padded (a row's entries beyond its position are never
        read). The joined arrays keep as many spare rows again behind their rows, and a later admission
        writes its rows into that room when it is wide enough: it copies the joining rows, not the whole
        decode (see :func:`_append_rows`)."""
        return {name: _append_rows(a, second[name]) for name, a in first.items()}

    @property
    def state_names(self) -> list[str]:
        return [entry.input for entry in self.state] + ([self.positions] if self.positions else [])


def extra_outputs(full: bool, logits: bool) -> list[str]:
    """The [R, V] outputs a step fetches besides the top k: the distribution, and its logits."""
    return (["log_probs"] if full else []) + ([LOGITS_OUTPUT] if logits else [])


def initial_shape(entry: StateTensor, batch: int) -> tuple[int, ...]:
    """The first value of an ``empty`` state entry, or of a ``buffer`` at :data:`INITIAL_CAPACITY`."""
    shape = [batch, *entry.shape]
    if entry.capacity_axis is not None:
        shape[entry.capacity_axis] = INITIAL_CAPACITY
    return tuple(shape)


def _move_rows(buffer: np.ndarray, rows: np.ndarray, moves: tuple[np.ndarray, np.ndarray],
               entry: StateTensor | None = None, used: int | None = None) -> np.ndarray:
    """Rows ``rows`` of ``buffer``, moved within its memory where it has room (see
    :meth:`OnnxStepModel.select_rows`); ``moves``: the indices ``i`` whose ``rows[i] != i``, and their
    ``rows[i]``; ``used``: the positions worth copying on the in-place cache ``entry``'s capacity axis
    (None: all)."""
    span = () if entry is None else (slice(None),) * (entry.capacity_axis - 1) + (slice(0, used),)
    if used != 0 and len(rows) <= len(buffer):
        # the same array when the row count stays: the step's I/O binding holds it and need not bind it again
        target = buffer if len(rows) == len(buffer) else buffer[: len(rows)]
    elif used != 0 and len(owner := _spare_rows(buffer)) >= len(rows):  # more rows: into the spare rows behind
        target = owner[: len(rows)]
    else:  # a new buffer, with room for as many rows again
        selected = np.zeros((2 * len(rows), *buffer.shape[1:]), dtype=buffer.dtype)[: len(rows)]
        if used != 0:
            selected[(slice(None), *span)] = buffer[(rows, *span)]
        return selected
    moved, sources = moves
    if moved.size:
        target[(moved, *span)] = buffer[(sources, *span)]  # the right side is read (copied) first
    return target


def _gather_rows(value: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``value[rows]``, in a new array with as many spare rows again behind them: a running decode's static
    inputs and recurrent state are gathered whenever sentences leave it, and a later admission then
    writes its rows into that room (:func:`_append_rows`) instead of copying the whole decode again."""
    gathered = np.empty((2 * len(rows), *value.shape[1:]), dtype=value.dtype)[: len(rows)]
    return np.take(value, rows, axis=0, out=gathered, mode="clip")  # "raise" would gather into a temporary first


def _append_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a``'s rows then ``b``'s (:meth:`OnnxStepModel.concat_rows`). When ``a`` has spare rows behind it
    (:func:`_spare_rows`) for ``b``'s rows and ``b`` is no wider on any other axis, ``b``'s rows go there,
    zero-padded; otherwise both are copied into a new zeroed array with as many spare rows again, ``b``
    zero-padded as in :func:`server.engine.step_model.concat_rows`, and its leading view is returned."""
    rows = len(a) + len(b)
    owner = _spare_rows(a)
    if len(owner) >= rows and all(have <= room for have, room in zip(b.shape[1:], a.shape[1:], strict=True)):
        room = owner[len(a):rows]
        if b.shape[1:] != a.shape[1:]:
            room[...] = 0  # the padding (the rows that left held other values there)
        room[(slice(None), *(slice(0, n) for n in b.shape[1:]))] = b
        return owner[:rows]
    width = np.maximum(a.shape[1:], b.shape[1:])
    joined = np.zeros((2 * rows, *width), dtype=a.dtype)  # the spare half is not touched until it is used
    joined[(slice(0, len(a)), *(slice(0, n) for n in a.shape[1:]))] = a
    joined[(slice(len(a), rows), *(slice(0, n) for n in b.shape[1:]))] = b
    return joined[:rows]


def _spare_rows(a: np.ndarray) -> np.ndarray:
    """The array whose leading rows ``a`` is, or ``a`` itself. The rows behind ``a`` there are spare: this
    module makes such views only of buffers it allocated with room to spare, or of rows that left a decode,
    so nothing else reads those rows and a selection or an admission may write into them."""
    base = a.base
    if (isinstance(base, np.ndarray) and base.dtype == a.dtype and base.shape[1:] == a.shape[1:]
            and base.flags.c_contiguous and a.ctypes.data == base.ctypes.data):
        return base
    return a


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
_SHAPES = "(shapes)"  # a binding's key for the (rows, k, source width) its host outputs were bound for
