"""A loaded version's weights held once: one read-only memory map of ``weights.bin`` (see
:mod:`nmt.model_format.weights`) and one ``OrtValue`` per stored range, given to every session of the
version through ``SessionOptions.add_initializer``.

ONNX Runtime uses such an initializer's buffer as it is (no copy). Its CPU kernels still pre-pack each
``MatMul``/``Gemm`` weight into a layout of their own, a copy per session (three of the decoder, for the
three decoder graphs): :meth:`server.engine.engine.Engine.load`'s ``prepack=False`` turns that off, so
the version holds each weight once, at the cost of slower steps (benchmarks/README.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from nmt.model_format.weights import WEIGHTS_FILE, StoredTensor, stored_tensors


class SharedWeights:
    """``weights.bin`` of one version, mapped once; :meth:`add_to` gives a session its ranges."""

    def __init__(self, version_dir: Path) -> None:
        self.map = np.memmap(version_dir / WEIGHTS_FILE, dtype=np.uint8, mode="r")
        self.values: dict[tuple[int, str, tuple[int, ...]], ort.OrtValue] = {}

    @staticmethod
    def present(version_dir: Path) -> bool:
        """Whether the version stores its weights once (versions exported before keep them in each graph)."""
        return (version_dir / WEIGHTS_FILE).is_file()

    def add_to(self, options: ort.SessionOptions, graph_path: Path) -> None:
        """Give the session of ``graph_path`` (opened with ``options``) every one of its stored initializers."""
        for tensor in stored_tensors(graph_path):
            options.add_initializer(tensor.name, self._value(tensor))

    def _value(self, tensor: StoredTensor) -> ort.OrtValue:
        key = (tensor.offset, tensor.dtype.str, tensor.shape)
        if key not in self.values:
            data = self.map[tensor.offset : tensor.offset + tensor.length].view(tensor.dtype).reshape(tensor.shape)
            self.values[key] = ort.OrtValue.ortvalue_from_numpy(data)
        return self.values[key]
