"""A model version's weights, stored once: every graph's large initializers live in one ``weights.bin``.

The exporter traces each graph with its own copy of the weights (the decoder's in three step graphs, the
embedding in all four). :func:`store_once` moves every initializer of at least :data:`MIN_BYTES` out of
the graphs into ``weights.bin`` as ONNX external data, each distinct content once (equal bytes and
element type share one range, whatever the initializer's name or shape in each graph), at offsets aligned
to :data:`ALIGNMENT` (a page: the ranges can be memory-mapped). The graphs stay valid ONNX files that any
ONNX tool opens from the version's directory.

:func:`shared_initializers` is the loading side: one read-only memory map of ``weights.bin`` and one
``OrtValue`` per stored range, which every session of the version is given
(``SessionOptions.add_initializer``), so a loaded version holds each weight once (see
:func:`server.engine.engine.Engine.load`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 4096
MIN_BYTES = 1024  # smaller initializers (shapes, scalars, biases of small layers) stay inside their graph


def store_once(directory: Path, graph_files: Sequence[str]) -> int:
    """Rewrite the graphs ``graph_files`` in ``directory`` (each holding its initializers inline) so their
    initializers of at least :data:`MIN_BYTES` are ranges of ``directory/weights.bin``, each distinct
    content stored once. One graph is in memory at a time. Returns the bytes of ``weights.bin``."""
    ranges: dict[tuple[int, bytes], tuple[int, int]] = {}  # (element type, sha256) -> (offset, length)
    with open(directory / WEIGHTS_FILE, "wb") as store:
        for filename in graph_files:
            path = directory / filename
            model = onnx.load(str(path))
            for tensor in model.graph.initializer:
                data = numpy_helper.to_array(tensor)
                if data.nbytes < MIN_BYTES or data.dtype == object:
                    continue
                raw = np.ascontiguousarray(data).tobytes()
                key = (tensor.data_type, hashlib.sha256(raw).digest())
                if key not in ranges:
                    offset = -store.tell() % ALIGNMENT + store.tell()
                    store.seek(offset)
                    store.write(raw)
                    ranges[key] = (offset, len(raw))
                offset, length = ranges[key]
                _point_to(tensor, offset, length)
            onnx.save(model, str(path))
        return store.tell()


def _point_to(tensor: onnx.TensorProto, offset: int, length: int) -> None:
    """Make ``tensor`` external data at ``offset``/``length`` of :data:`WEIGHTS_FILE` (its values dropped)."""
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                  "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


@dataclass(frozen=True)
class StoredTensor:
    """One initializer of a graph that lives in ``weights.bin``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    length: int


def stored_tensors(graph_path: Path) -> list[StoredTensor]:
    """The initializers of the graph at ``graph_path`` stored in its directory's ``weights.bin`` (reads the
    graph without its external data)."""
    model = onnx.load(str(graph_path), load_external_data=False)
    stored = []
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        if info.get("location") != WEIGHTS_FILE:
            continue
        stored.append(StoredTensor(tensor.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)),
                                   tuple(tensor.dims), int(info.get("offset", 0)), int(info["length"])))
    return stored
