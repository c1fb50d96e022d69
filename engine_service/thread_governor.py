"""Fewer intra-op threads while the engine's threads wait for a CPU, all of them again once
they stop waiting.

Every parallel region (a linear layer, an attention call) ends when its slowest thread
does. When another process takes one of the engine's cores (a busy neighbour, the
frontend next to it, a noisy VM), the thread the scheduler put there runs half the time
and every region waits for it: a 2-thread engine beside one busy process served a small
fraction of its quiet throughput (benchmarks/contention.py). One thread fewer keeps the
team on the cores it actually gets.

The signal is the kernel's own: the time this process's threads spent runnable but not
running (``/proc/self/task/*/schedstat``, second field). Each ``window_s`` of steps, that
wait divided by (window x threads) is the share of the team's time lost to waiting; above
``high`` the team shrinks by one. Every ``probe_s`` a shrunk team grows by one to see
whether the neighbour left; if the wait comes back it shrinks again at the next window.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def process_run_delay_s() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed
    over its live threads (0.0 where /proc has no schedstat)."""
    total = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that exited meanwhile
    return total / 1e9


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        *,
        window_s: float = 0.5,
        probe_s: float = 10.0,
        high: float = 0.15,
        run_delay: Callable[[], float] = process_run_delay_s,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.window_s = window_s
        self.probe_s = probe_s
        self.high = high
        self._run_delay = run_delay
        self._set_threads = set_threads
        self._clock = clock
        self._window_start = clock()
        self._delay_start = run_delay()
        self._last_change = self._window_start
        self.changes = 0  # team size changes so far (logged; read by tests)

    def observe(self) -> None:
        """Called after each step; acts at most once a window."""
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.window_s:
            return
        delay = self._run_delay()
        waiting = (delay - self._delay_start) / (elapsed * self.threads)  # share of team time lost
        self._window_start, self._delay_start = now, delay
        if waiting > self.high and self.threads > 1:
            self._resize(self.threads - 1, now, f"threads waited {waiting:.0%} of the time for a CPU")
        elif self.threads < self.max_threads and now - self._last_change >= self.probe_s:
            self._resize(self.threads + 1, now, "probing whether the CPUs are free again")

    def _resize(self, threads: int, now: float, why: str) -> None:
        logger.info("intra-op threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self._set_threads(threads)
        self._last_change = now
        self.changes += 1
        # The window after a change measures the new team alone.
        self._window_start, self._delay_start = now, self._run_delay()
