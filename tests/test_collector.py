"""The cyclic garbage collector in a serving process (:mod:`server.collector`): start-up's objects frozen out of
its reach, the cycles of what left collected at the next freeze, and every collection's pause measured."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

from prometheus_client import CollectorRegistry

from server import collector
from server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parent.parent


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def pause_counts(metrics: ServerMetrics) -> dict[str, float]:
    return {s.labels["generation"]: s.value for family in metrics.registry.collect()
            if family.name == "nmt_gc_pause_seconds" for s in family.samples if s.name.endswith("_count")}


def test_freezing_moves_every_object_out_of_reach_and_frees_the_cycles_that_left_first() -> None:
    try:
        kept, gone = Node(), Node()
        gone_ref = weakref.ref(gone)
        frozen = collector.freeze()
        # an object leaves the permanent generation when its last reference goes (other tests' threads drop some)
        assert frozen > 2 and 0 < gc.get_freeze_count() <= frozen
        del gone
        gc.collect()
        assert gone_ref() is not None, "a frozen cycle is out of the collector's reach"
        collector.freeze()  # after a model repository change: unfrozen and collected first
        assert gone_ref() is None and kept.me is kept
    finally:
        gc.unfreeze()


def test_every_collection_is_timed_into_the_histogram_by_its_generation() -> None:
    metrics = ServerMetrics(CollectorRegistry())
    assert pause_counts(metrics) == {"0": 0, "1": 0, "2": 0}, "the series exist at zero from the start"
    pauses = collector.Pauses(metrics.gc_pause)
    pauses.start()
    try:
        gc.collect(0)
        gc.collect(2)
        assert pause_counts(metrics) == {"0": 0, "1": 0, "2": 0}, "written when flushed, not in the callback"
        pauses.flush()
        assert pause_counts(metrics) == {"0": 1, "1": 0, "2": 1}
    finally:
        pauses.stop()
    gc.collect(1)
    pauses.flush()
    assert pause_counts(metrics) == {"0": 1, "1": 0, "2": 1}, "stopped: no longer measured"


class Repository:
    """What :func:`server.collector.watch` needs of a model repository: its listeners."""

    def __init__(self) -> None:
        self.listeners: list = []

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)


def test_watch_freezes_now_and_after_each_repository_change_and_flushes_on_its_own(monkeypatch) -> None:
    frozen = []
    monkeypatch.setattr(collector, "freeze", lambda: frozen.append(1) or 0)
    monkeypatch.setattr(collector, "FLUSH_SECONDS", 0.01)
    metrics, repository = ServerMetrics(CollectorRegistry()), Repository()

    async def scenario() -> None:
        task = collector.watch(repository, metrics.gc_pause)
        assert frozen == [1] and len(repository.listeners) == 1
        await repository.listeners[0]()  # the repository changed
        assert frozen == [1, 1]
        await asyncio.sleep(0.02)  # the task is measuring
        gc.collect(0)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert pause_counts(metrics)["0"] >= 1
    assert not any(getattr(callback, "__self__", None).__class__ is collector.Pauses for callback in gc.callbacks)
    assert frozen == [1, 1]
