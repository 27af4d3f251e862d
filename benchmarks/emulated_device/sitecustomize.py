"""An emulated device for the batching benchmarks (``nmt bench batching --emulate-device STEP_MS ENCODER_MS``).

A GPU decodes a step of a few rows or of a few hundred in about the same time (its kernels are launch- and
memory-bound, not compute-bound: ~1 ms per step of the SMALL model on an H200, at 1 row and at 32 alike),
while a CPU's step costs about its rows. Batching policies behave differently in the two regimes, and a
GPU is lent to only some sessions. Under :func:`emulate`, every run of a decoder graph (a session taking
``input_ids``: the steps, and the forced pass) takes at least ``step_ms`` and every run of the encoder (taking
``src_ids``) at least ``encoder_ms``; other sessions (the row gathers of a state kept on the device) run as
they are. The work still runs on the CPU and the rest of the floor is slept, with the interpreter lock
released as during a device's kernels, so a step costs the same at any row count up to where the CPU's own
work exceeds the floor.

Python imports this module at start-up wherever this folder is on ``PYTHONPATH``: every process of a server
started with ``NMT_EMULATED_STEP_MS`` (and ``NMT_EMULATED_ENCODER_MS``) set runs on the emulated device, the
engine core of ``--frontends`` too. A benchmark calls :func:`activate` before it starts them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

FLOOR_INPUTS = ("input_ids", "src_ids")  # a decoder graph's token input, the encoder's


def floored(run: Callable[..., Any], floors: dict[str, float]) -> Callable[..., Any]:
    """The session method ``run`` taking at least the floor (seconds) of the session's graph: ``floors`` by
    the first of :data:`FLOOR_INPUTS` the session takes (none: no floor); what is left of it after the run
    returns is slept."""
    def at_least(session: Any, *args: Any, **kwargs: Any) -> Any:
        floor = session.__dict__.get("_emulated_floor")
        if floor is None:
            names = {node.name for node in session.get_inputs()}
            floor = session.__dict__["_emulated_floor"] = next(
                (floors[name] for name in FLOOR_INPUTS if name in names), 0.0)
        start = time.perf_counter()
        result = run(session, *args, **kwargs)
        left = floor - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return result
    return at_least


def emulate(step_ms: float, encoder_ms: float) -> None:
    """From now on every ONNX Runtime run of a decoder graph takes at least ``step_ms`` and every run of the
    encoder at least ``encoder_ms``, with an I/O binding or without (see the module docstring)."""
    from onnxruntime.capi import onnxruntime_inference_collection as collection

    floors = {"input_ids": step_ms / 1000, "src_ids": encoder_ms / 1000}
    collection.Session.run_with_iobinding = floored(collection.Session.run_with_iobinding, floors)
    collection.Session.run = floored(collection.Session.run, floors)


def activate(step_ms: float, encoder_ms: float) -> None:
    """This process, and every process it starts from now on (the servers of a benchmark), on the emulated
    device: the floors in the environment with this folder on ``PYTHONPATH``, and :func:`emulate` here."""
    folder = os.path.dirname(os.path.abspath(__file__))
    os.environ.update(NMT_EMULATED_STEP_MS=str(step_ms), NMT_EMULATED_ENCODER_MS=str(encoder_ms),
                      PYTHONPATH=os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])))
    emulate(step_ms, encoder_ms)


if os.environ.get("NMT_EMULATED_STEP_MS"):
    emulate(float(os.environ["NMT_EMULATED_STEP_MS"]), float(os.environ.get("NMT_EMULATED_ENCODER_MS", "0")))
