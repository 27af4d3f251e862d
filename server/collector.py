"""The interpreter's cyclic garbage collector in a serving process: what start-up made kept out of its reach, and
its pauses measured.

A full collection walks every object the collector tracks and stops every thread meanwhile (the event loop and the
decode thread alike, the interpreter lock held). Once the demo models, gRPC, NumPy and ONNX Runtime are loaded a
process tracks ~50,000 objects, and a full collection took 8-12 ms there idle and 25-30 ms under load on the
development host, every ~1,000-1,500 requests (docs/decisions.md): a pause in the middle of some requests. Those
objects (modules, the versions' sessions, manifests and tokenizers, gRPC's descriptors) live as long as the process
or their version, so :func:`freeze` moves them into the collector's permanent generation once start-up is done, and
again after each change of the model repository (unfrozen and collected first, so the cycles of a version that left
are freed); collections then walk only what requests made since. Objects in the permanent generation are still freed
when their last reference goes.

:class:`Pauses` times every collection into ``nmt_gc_pause_seconds{generation}``. The collector calls back in
whatever thread allocated, possibly while that thread holds prometheus_client's lock, so the callback only
appends to a list and :meth:`Pauses.flush`, on the event loop, writes the histogram.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from typing import Any

log = logging.getLogger("nmt.server")

FLUSH_SECONDS = 1.0  # how often the pauses measured are written into the histogram


def watch(repository: Any, histogram: Any) -> asyncio.Task:
    """For the process's lifetime (call it once start-up is done): :func:`freeze` now and after each change of
    ``repository`` (its listeners); every collection's pause into ``histogram`` (the task's)."""

    async def changed() -> None:
        freeze()

    log.info("start-up's objects frozen out of the garbage collector's reach",
             extra={"fields": {"objects": freeze(), "pid": os.getpid()}})
    repository.add_listener(changed)
    return asyncio.get_running_loop().create_task(Pauses(histogram).run(), name="gc-pauses")


def freeze() -> int:
    """Collect everything, then move every object left into the permanent generation (after start-up, after a
    model repository change). Returns how many objects that holds."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Pauses:
    """Every collection's pause, by generation, into ``histogram`` (labelled by ``generation``):
    :meth:`start`, then :meth:`flush` (or :meth:`run` to flush every :data:`FLUSH_SECONDS`)."""

    def __init__(self, histogram: Any) -> None:
        self._series = [histogram.labels(str(generation)) for generation in range(3)]
        self._pending: list[tuple[int, float]] = []  # (generation, seconds), appended by the collector's callback
        self._started = 0.0

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)
        self.flush()

    def flush(self) -> None:
        """Write the pauses measured since the last flush into the histogram."""
        pending, self._pending = self._pending, []
        for generation, seconds in pending:
            self._series[generation].observe(seconds)

    async def run(self) -> None:
        """Measure and flush every :data:`FLUSH_SECONDS` until cancelled."""
        self.start()
        try:
            while True:
                await asyncio.sleep(FLUSH_SECONDS)
                self.flush()
        finally:
            self.stop()

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pending.append((info["generation"], time.perf_counter() - self._started))
