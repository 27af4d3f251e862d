"""An emulated device for the batching benchmarks (``nmt bench batching --emulate-device STEP_MS ENCODER_MS``).

A GPU decodes a step of a few rows or of a few hundred in about the same time (its kernels are launch- and
memory-bound, not compute-bound: ~1 ms per step of the SMALL model on an H200, at 1 row and at 32 alike),
while a CPU's step costs about its rows. Batching policies behave differently in the two regimes, and a
GPU is lent to only some sessions. Under :func:`emulate`, every run with an I/O binding (the decoder's
steps) takes at least ``step_ms`` and every plain run (encoder calls) at least ``encoder_ms``: the work still
runs on the CPU and the rest of the floor is slept, with the interpreter lock released as during a device's
kernels, so a step costs the same at any row count up to where the CPU's own work exceeds the floor.

Python imports this module at start-up wherever this folder is on ``PYTHONPATH``: every process of a server
started with ``NMT_EMULATED_STEP_MS`` (and ``NMT_EMULATED_ENCODER_MS``) set runs on the emulated device, the
engine core of ``--frontends`` too. A benchmark's own process calls :func:`emulate`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def floored(run: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """``run`` taking at least ``seconds``: what is left of them after it returns is slept."""
    def at_least(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = run(*args, **kwargs)
        left = seconds - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return result
    return at_least


def emulate(step_ms: float, encoder_ms: float) -> None:
    """From now on every ONNX Runtime run with an I/O binding takes at least ``step_ms`` and every plain run
    at least ``encoder_ms`` (see the module docstring)."""
    from onnxruntime.capi import onnxruntime_inference_collection as collection

    collection.Session.run_with_iobinding = floored(collection.Session.run_with_iobinding, step_ms / 1000)
    collection.Session.run = floored(collection.Session.run, encoder_ms / 1000)


if os.environ.get("NMT_EMULATED_STEP_MS"):
    emulate(float(os.environ["NMT_EMULATED_STEP_MS"]), float(os.environ.get("NMT_EMULATED_ENCODER_MS", "0")))
