"""Execution providers as they really run: what this ONNX Runtime build offers, what a session got, why not.

``get_available_providers()`` lists what the build was compiled with, not what can run: with
``onnxruntime-gpu`` installed and the CUDA or cuDNN libraries missing it still lists CUDA, and a session
asked for CUDA silently falls back to the CPU. So the provider reported anywhere is taken from the
sessions' own ``get_providers()`` (:func:`session_provider`), and :func:`check_provider` turns an
explicit ``cuda`` that did not get CUDA into an error naming the library that failed to load.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort
from onnx import TensorProto, helper

from common.errors import NmtError

log = logging.getLogger("nmt.server")

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
PROVIDER_NAMES = {"cpu": CPU, "cuda": CUDA}
# ONNX Runtime's messages when an arena cannot grow (BFCArena, the CUDA allocator, cudaMalloc)
OUT_OF_MEMORY_MARKERS = ("Failed to allocate memory", "out of memory", "CUDNN_STATUS_ALLOC_FAILED",
                         "CUBLAS_STATUS_ALLOC_FAILED")


@dataclass(frozen=True)
class DeviceSettings:
    """Where a model version's sessions run (from :class:`server.config.ServerConfig`)."""

    provider: str = "auto"  # auto, cpu or cuda
    device_id: int = 0  # CUDA device ordinal
    gpu_mem_limit: int = 0  # bytes each session's CUDA arena may hold; 0: no limit
    cuda_tf32: bool = False  # let CUDA use TF32 for fp32 MatMul/Conv (faster, ~1e-3 relative error)


def provider_list(settings: DeviceSettings) -> list[Any]:
    """The ``providers`` argument of ``InferenceSession``: CUDA with its options (then CPU for the nodes
    CUDA has no kernel for), or the CPU alone. Raises :class:`NmtError` for an unknown provider."""
    requested = settings.provider
    if requested not in ("auto", *PROVIDER_NAMES):
        raise NmtError(f"unknown execution provider {requested!r}; choose auto, cpu or cuda")
    if requested == "cpu" or (requested == "auto" and CUDA not in ort.get_available_providers()):
        return [CPU]
    options = {"device_id": str(settings.device_id), "arena_extend_strategy": "kSameAsRequested",
               "use_tf32": "1" if settings.cuda_tf32 else "0"}
    if settings.gpu_mem_limit:
        options["gpu_mem_limit"] = str(settings.gpu_mem_limit)
    return [(CUDA, options), CPU]


def session_provider(sessions: dict[str, ort.InferenceSession]) -> str:
    """The provider every session really runs on first; :class:`NmtError` if they disagree."""
    got = {role: session.get_providers()[0] for role, session in sessions.items()}
    if len(set(got.values())) != 1:
        raise NmtError(f"the sessions of one model version run on different providers: {got}")
    return next(iter(got.values()))


def check_provider(requested: str, providers: list[Any], got: str) -> None:
    """Raise when an explicit ``cuda`` did not get CUDA; log when ``auto`` fell back to the CPU."""
    wanted = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
    if got == wanted:
        return
    reason = cuda_unavailable_reason()
    if requested == "auto":
        log.warning("CUDA listed by onnxruntime but sessions run on the CPU; serving on the CPU",
                    extra={"fields": {"provider": got, "reason": reason}})
        return
    raise NmtError(f"execution provider {requested} requested but the sessions run on {got}: {reason}")


def probe_provider(settings: DeviceSettings) -> str:
    """Open a one-node session with ``settings`` before any model loads: an explicit ``cuda`` that does not
    really run fails here, at start-up (:class:`NmtError`), instead of refusing every version; ``auto``
    logs its fallback. Returns the provider the session got."""
    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the fallback is reported by check_provider, in the JSON log
    providers = provider_list(settings)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    got = session.get_providers()[0]
    check_provider(settings.provider, providers, got)
    return got


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot run in this process: the build lacks it, or the library that fails to load."""
    library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if CUDA not in ort.get_available_providers() or not library.exists():
        return (f"this onnxruntime build ({runtime_build()}) has no CUDA provider; install onnxruntime-gpu "
                "alone (see the README)")
    try:
        ctypes.CDLL(str(library))
    except OSError as error:  # names the missing dependency, e.g. libcudnn.so.9 or libcublasLt.so.12
        return f"cannot load {library.name}: {error}"
    return "the CUDA provider loads but no session got it (no GPU visible, or the driver is too old?)"


def runtime_build() -> str:
    """``onnxruntime-gpu 1.20.1 (GPU)``: the installed distribution(s), version and build device."""
    installed = [name for name in ("onnxruntime", "onnxruntime-gpu") if _installed(name)]
    return f"{'+'.join(installed) or 'onnxruntime'} {ort.__version__} ({ort.get_device()})"


def log_runtime() -> None:
    """Log the ONNX Runtime build and its providers at start-up; warn when the CPU and GPU distributions
    are both installed (they share one ``onnxruntime`` package and the last installed wins)."""
    fields = {"onnxruntime": runtime_build(), "available_providers": ort.get_available_providers()}
    log.info("onnxruntime", extra={"fields": fields})
    if _installed("onnxruntime") and _installed("onnxruntime-gpu"):
        log.warning("onnxruntime and onnxruntime-gpu are both installed and overwrite each other's files; "
                    "keep onnxruntime-gpu only", extra={"fields": fields})


def is_out_of_memory(error: BaseException) -> bool:
    """Is ``error`` ONNX Runtime failing to allocate device (or arena) memory?"""
    text = str(error)
    return any(marker in text for marker in OUT_OF_MEMORY_MARKERS)


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
