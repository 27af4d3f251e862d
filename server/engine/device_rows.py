"""Rows of a device-resident step model's tensors moved on the device: selected (a beam reorder, sentences
leaving), padded (a cache that grows), joined (sentences joining) and copied into fixed buffers (the runs kept for
CUDA graphs), each by one run of a small graph over every tensor concerned (``Gather``, ``Pad``, ``Concat``), made
once per kind and element types with the decoder's options and providers."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from common.model_format.manifest import StateTensor
from server.engine.cuda_graphs import graph_options
from server.engine.device_search import ELEMENT_TYPES
from server.engine.search import concat_rows


class DeviceRows:
    """The row moves of :class:`server.engine.device_step_model.DeviceStepModel` (a mixin over
    :class:`server.engine.step_models.OnnxStepModel`, whose host-array versions of :meth:`select_rows`,
    :meth:`concat_rows`, ``_reserve`` and ``_grow`` these replace); it reads the model's ``device``, ``sessions``,
    ``buffers`` and ``_sessions`` (the small graphs' sessions, by kind and element types)."""

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

