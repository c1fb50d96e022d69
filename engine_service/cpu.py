"""CPU process settings for the engine."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os

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
    them on free, so every step's large activations and KV gathers page-fault anew;
    memory kept mapped is reused without that cost (benchmarks/NOTES.md).

    It also keeps every thread on glibc's main arena. A thread's own arena is made of
    mmap'ed heaps of at most 64 MiB that the thresholds above do not govern, so on the
    engine's loop thread a large step's buffers were mapped, zeroed and unmapped every
    step, which made large prefill steps there slower than on the main arena. That part
    reaches only threads that have not allocated yet, so a service
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


def cpu_quota(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup may use (its CFS quota / period, the
    tightest along its path to the root), or None without a quota. Reads cgroup v2
    (``cpu.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); a Kubernetes CPU
    limit or ``docker run --cpus`` is such a quota."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified tree
            dirs = [cgroup_root]
            files = ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            dirs = [os.path.join(cgroup_root, name) for name in (controllers, "cpu", "cpu,cpuacct")]
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for mount in dict.fromkeys(dirs):
            if os.path.isdir(mount):
                limits += _quotas_along(mount, path, files)
                break
    return min(limits) if limits else None


def _quotas_along(mount: str, path: str, files: tuple[str, ...]) -> list[float]:
    """The quota (CPUs) of every cgroup from ``path`` up to ``mount``'s root that has one."""
    found: list[float] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        where = os.path.join(mount, *parts[:depth])
        try:
            values = [_read_words(os.path.join(where, name)) for name in files]
        except OSError:
            continue
        if len(files) == 1:  # cpu.max: "QUOTA PERIOD" or "max PERIOD"
            quota, period = (values[0] + ["100000"])[:2]
        else:
            quota, period = values[0][0], values[1][0]
        if quota not in ("max", "-1") and float(period) > 0:
            found.append(float(quota) / float(period))
    return found


def _read_words(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def allowed_cpus() -> float:
    """CPUs this process may use: the cores of its affinity mask, capped by its cgroup's
    CPU quota (a fraction where the quota is one: 1.5 in a quota of 150 ms per 100 ms)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return float(cores) if quota is None else min(float(cores), quota)


def threads_per_engine(num_engines: int) -> int:
    """Intra-op threads for each of ``num_engines`` engines sharing this process's CPUs
    (``tandem serve``): whole CPUs split evenly, at least one each; where a fractional
    quota is the limit, each share rounded up, as ``default_num_threads`` does for one."""
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    cpus = allowed_cpus()
    share = cpus / num_engines
    whole = cpus == math.floor(cpus)
    return max(1, math.floor(share) if whole else math.ceil(share - 1e-9))


def default_num_threads() -> int:
    """Intra-op threads an engine runs by default: the CPUs it may use, a fractional quota
    rounded up (1.5 -> 2). A quota throttles the whole team at once, not one straggler,
    so a team that can spend all of it serves more: in a 1.5-CPU quota 2 threads served
    more than 1 (benchmarks/contention.py)."""
    return max(1, math.ceil(allowed_cpus() - 1e-9))
