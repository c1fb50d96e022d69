"""CPU process settings for the engine."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (``find_library`` runs ``ldconfig``); None if absent."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def keep_freed_memory_mapped() -> bool:
    """Stop glibc from returning large freed blocks to the OS after every step.

    By default glibc serves allocations above a few MiB with fresh mmap()s and unmaps
    them on free, so every step's large activations and KV gathers page-fault anew
    (measured here: a 35 MB tensor copy took 34 ms with the default, 12 ms with this).

    It also keeps every thread on glibc's main arena. A thread's own arena is made of
    mmap'ed heaps of at most 64 MiB that the thresholds above do not govern, so on the
    engine's loop thread a large step's buffers were mapped, zeroed and unmapped every
    step: a 2048-token prefill step took 1.9-3.0 s there against 1.5-1.6 s on the main
    arena. That part reaches only threads that have not allocated yet, so a service
    calls this first thing, before it starts threads.
    Returns False where glibc's mallopt is not available (e.g. musl).
    """
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31) == 1 and ok
        ok = libc.mallopt(_M_ARENA_MAX, 1) == 1 and ok
    except AttributeError:  # a C library without mallopt (e.g. musl)
        return False
    if not ok:
        logger.debug("mallopt refused the thresholds; keeping glibc's defaults")
    return ok


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``); False where
    there is no glibc. ``keep_freed_memory_mapped`` keeps them while the engine is busy
    (re-faulting them every step is slow); an idle engine calls this once, so its RSS
    is what it holds, not its busiest moment's high-water mark."""
    libc = _libc()
    if libc is None:
        return False
    try:
        libc.malloc_trim(0)
    except AttributeError:  # not glibc
        return False
    return True
