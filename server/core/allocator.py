"""The process's memory allocator, set for a decoding engine: large arrays reused instead of page-faulted anew.

A batch's decode allocates and frees arrays of megabytes every call: the encoder's outputs, the KV cache's
buffers when a beam expands and when they grow, the static inputs gathered for the beams. glibc's malloc
serves such arrays with ``mmap`` above a threshold that moves with what was freed, and gives freed memory
at the top of its heap back to the system above 128 KiB; either way the next call's arrays come as fresh
pages, zeroed by the kernel one fault at a time (measured: ~8,000 faults per call at batch 32, beam 4 of
the BASE model, int8). :func:`retain_freed_memory` serves arrays up to 32 MiB from the heap and keeps up to
a bound of freed memory for the next call, as allocators built for servers do. The process then holds its
peak memory (up to that bound) instead of returning it between calls.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest mmap threshold on 64-bit systems


def retain_freed_memory(retain_bytes: int) -> bool:
    """Have glibc's malloc serve allocations up to 32 MiB from its heap and keep up to ``retain_bytes`` of
    freed memory at the heap's top instead of returning it to the system (0: leave malloc as it is).
    Returns whether the settings took effect (False with ``retain_bytes`` 0, or off glibc)."""
    if retain_bytes <= 0:
        return False
    if not 0 < retain_bytes < 2**31:
        raise ValueError(f"retain_bytes must be below 2 GiB, got {retain_bytes}")
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        log.info("malloc settings left as they are: this C library has no mallopt")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, retain_bytes))
