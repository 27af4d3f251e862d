"""A loaded version's weights held once: one read-only memory map of ``weights.bin`` (see
:mod:`common.model_format.weights`) and one ``OrtValue`` per stored range, given to every session of the
version through ``SessionOptions.add_initializer``.

ONNX Runtime uses such an initializer's buffer as it is (no copy). Its CPU kernels still pre-pack each
``MatMul``/``Gemm`` weight into a layout of their own, a copy per session (three of the decoder, for the
three decoder graphs; by default only the encoder's and the main decoder's): :meth:`server.engine.engine.Engine.load`'s
``prepack="none"`` turns that off, so the version holds each weight once, at the cost of slower steps
(benchmarks/README.md). With pre-packing
on, :meth:`SharedWeights.release_pages` gives the mapped pages that only the packing read back to the
page cache once the sessions are built; the few the kernels read later come back on first touch.

On CUDA the values are made once on the device (``device="cuda"``; what ``add_initializer`` is given is a
non-owning view of each device buffer, which is all it takes) and every session takes the same device buffers,
so the version holds each weight once in device memory too; given host values, each CUDA session would copy
every weight to the device for itself. Where a device value cannot be made (no usable GPU), the values stay on
the host.

The map reads the file as it is on disk: a version is replaced by writing a new directory and renaming it
into place (as ``nmt export`` does), never by overwriting ``weights.bin`` while a server maps it.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common.model_format.weights import WEIGHTS_FILE, StoredTensor, stored_tensors

log = logging.getLogger("nmt.server")


class SharedWeights:
    """``weights.bin`` of one version, mapped once; :meth:`add_to` gives a session its ranges."""

    def __init__(self, version_dir: Path, device: str = "cpu", device_id: int = 0) -> None:
        self.device, self.device_id = device, device_id
        with open(version_dir / WEIGHTS_FILE, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            self.mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.map = np.frombuffer(self.mapping, dtype=np.uint8) if self.mapping else np.empty(0, np.uint8)
        self.values: dict[tuple[int, str, tuple[int, ...]], ort.OrtValue] = {}
        self.owned: list[ort.OrtValue] = []  # the device buffers the values view

    @staticmethod
    def present(version_dir: Path) -> bool:
        """Whether the version stores its weights once (versions exported before keep them in each graph)."""
        return (version_dir / WEIGHTS_FILE).is_file()

    def add_to(self, options: ort.SessionOptions, graph_path: Path) -> None:
        """Give the session of ``graph_path`` (opened with ``options``) every one of its stored initializers."""
        for tensor in stored_tensors(graph_path):
            options.add_initializer(tensor.name, self._value(tensor))

    def release_pages(self) -> None:
        """Drop the mapped pages from this process (the page cache keeps them; a later read maps them again)."""
        if self.mapping is not None:
            self.mapping.madvise(mmap.MADV_DONTNEED)

    def _value(self, tensor: StoredTensor) -> ort.OrtValue:
        key = (tensor.offset, tensor.dtype.str, tensor.shape)
        if key not in self.values:
            data = self.map[tensor.offset : tensor.offset + tensor.length].view(tensor.dtype).reshape(tensor.shape)
            self.values[key] = self._place(data)
        return self.values[key]

    def _place(self, data: np.ndarray) -> ort.OrtValue:
        if self.device != "cpu":
            try:
                owned = ort.OrtValue.ortvalue_from_numpy(data, self.device, self.device_id)
                view = _view(owned)
            except Exception as error:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors; any means no device
                log.warning("weights stay in host memory: no %s value could be made (%s)", self.device, error)
                self.device = "cpu"
            else:
                self.owned.append(owned)
                return view
        return ort.OrtValue.ortvalue_from_numpy(data)


def _view(owned: ort.OrtValue) -> ort.OrtValue:
    """An ``OrtValue`` over ``owned``'s memory that does not own it: ``add_initializer`` takes only buffers the
    caller owns (a NumPy array's, or this view's; ``owned`` must outlive the sessions). Through DLPack, whose
    Python entry point changed across onnxruntime releases."""
    if hasattr(ort.OrtValue, "from_dlpack"):
        try:
            return ort.OrtValue.from_dlpack(owned)
        except TypeError:
            pass
    from onnxruntime.capi import _pybind_state

    return ort.OrtValue(_pybind_state.OrtValue.from_dlpack(owned._ortvalue.to_dlpack(), False))
