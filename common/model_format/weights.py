"""A model version's weights, stored once: every graph's large initializers live in one ``weights.bin``.

The exporter traces each graph with its own copy of the weights (the decoder's in three step graphs, the
embedding in all four). :class:`WeightStore` (or :func:`store_once`, for graphs already saved) moves every
initializer of at least :data:`MIN_BYTES` out of the graphs into ``weights.bin`` as ONNX external data,
each distinct content once (equal bytes and element type share one range, whatever the initializer's name
or shape in each graph), at offsets aligned to :data:`ALIGNMENT` (a page: the ranges can be
memory-mapped). The graphs stay valid ONNX files that any ONNX tool opens from the version's directory.

:class:`server.engine.shared_weights.SharedWeights` is the loading side: one read-only memory map of
``weights.bin`` and one ``OrtValue`` per stored range, given to every session of the version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from common.model_format.layout import WEIGHTS_FILE

ALIGNMENT = 4096
MIN_BYTES = 1024  # smaller initializers (shapes, scalars, biases of small layers) stay inside their graph


class WeightStore:
    """``weights.bin`` being written: :meth:`externalize` moves a graph's initializers of at least
    :data:`MIN_BYTES` into it, each distinct content once (equal bytes and element type share one range)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close() / the context manager
        self.ranges: dict[tuple[int, bytes], tuple[int, int]] = {}  # (element type, sha256) -> (offset, length)

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def externalize(self, model: onnx.ModelProto, base_dir: str | Path | None = None) -> onnx.ModelProto:
        """``model`` with its large initializers pointing at their ranges of the store (new contents written),
        as a new message: protobuf frees a message's memory only with the message, so the old one (with
        every weight) goes when the caller drops it. With ``base_dir``, initializers that are external data
        there (another store's: the export's traced graphs) are read from it, one at a time, and stored
        here; without, external data is taken to be this store's already (a graph copied from a stored one)."""
        for tensor in model.graph.initializer:
            if tensor.data_type == onnx.TensorProto.STRING:
                continue
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                if base_dir is None:
                    continue
                # read, not loaded into the message (which would then hold every weight until it goes)
                raw = numpy_helper.to_array(tensor, str(base_dir)).tobytes()
            else:
                raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
                if len(raw) < MIN_BYTES:
                    continue
            _point_to(tensor, *self.put(tensor.data_type, raw))
        return onnx.ModelProto.FromString(model.SerializeToString())

    def put(self, data_type: int, raw: bytes) -> tuple[int, int]:
        """The (offset, length) of ``raw`` (a tensor's little-endian bytes, ONNX element type ``data_type``) in
        the store: written at the next aligned offset unless an equal tensor is there already."""
        key = (data_type, hashlib.sha256(raw).digest())
        if key not in self.ranges:
            offset = -self.file.tell() % ALIGNMENT + self.file.tell()
            self.file.seek(offset)
            self.file.write(raw)
            self.ranges[key] = (offset, len(raw))
        return self.ranges[key]


def store_once(directory: Path, graph_files: Sequence[str]) -> None:
    """Rewrite the graphs ``graph_files`` in ``directory`` (each holding its initializers inline) so their
    large initializers are ranges of ``directory/weights.bin`` (:class:`WeightStore`); one graph is in
    memory at a time."""
    with WeightStore(directory / WEIGHTS_FILE) as store:
        for filename in graph_files:
            onnx.save(store.externalize(onnx.load(str(directory / filename))), str(directory / filename))


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
