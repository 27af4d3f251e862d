"""The process's malloc settings (server.core.allocator): freed arrays' pages reused by the next allocations."""

from __future__ import annotations

import resource

import numpy as np
import pytest

from common.errors import NmtError
from server.config import ServerConfig
from server.core.allocator import retain_freed_memory


def _faults_per_round(rounds: int, megabytes: int) -> float:
    """Minor page faults per round of allocating, filling and freeing a ``megabytes`` array."""
    def one() -> None:
        array = np.empty(megabytes << 18, dtype=np.float32)  # megabytes << 20 bytes
        array.fill(1.0)
        del array

    one()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        one()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds


def test_freed_arrays_are_reused_without_page_faults():
    """A 24 MiB array allocated, filled and freed again and again: with the settings it lands on pages the
    heap kept (no faults); by default glibc maps it anew each time (~100 faults a round on this machine,
    huge pages included)."""
    assert retain_freed_memory(256 << 20)
    assert _faults_per_round(5, 24) < 10


def test_zero_leaves_malloc_alone_and_the_bound_is_checked():
    assert retain_freed_memory(0) is False
    with pytest.raises(ValueError):
        retain_freed_memory(4 << 30)
    assert ServerConfig().malloc_retain_mb == 1024
    with pytest.raises(NmtError, match="malloc_retain_mb"):
        ServerConfig(malloc_retain_mb=2048).validate()
    assert ServerConfig.from_env({"NMT_MALLOC_RETAIN_MB": "0"}).malloc_retain_mb == 0
