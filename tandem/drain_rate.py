"""How fast a queue drains, and the retry hint that follows from it.

Both services use it for RESOURCE_EXHAUSTED answers: the engine measures requests
leaving its waiting queue for the running batch, the frontend requests finishing.
"""

from __future__ import annotations

MIN_RETRY_AFTER_MS = 50
MAX_RETRY_AFTER_MS = 30_000
DEFAULT_RETRY_AFTER_MS = 1_000  # before any drain was measured


class DrainRate:
    """Requests leaving a queue per second (EWMA).

    Departures are counted over windows of at least ``window_s`` seconds during which
    the queue was non-empty; each window gives one sample ``departed / elapsed`` that
    moves the average by ``alpha``. Time with an empty queue starts a new window.
    """

    def __init__(self, window_s: float = 0.5, alpha: float = 0.3) -> None:
        self.window_s = window_s
        self.alpha = alpha
        self.rate: float | None = None  # requests/s; None: nothing measured yet
        self._window_start: float | None = None
        self._admitted = 0

    def observe(self, now: float, admitted: int, num_waiting: int) -> None:
        """``admitted`` requests left the queue since the last call; ``num_waiting``
        remain. Call it at least when the queue changes."""
        if self._window_start is None:
            if num_waiting == 0:
                return  # idle: no drain to measure
            self._window_start, self._admitted = now, 0
        self._admitted += admitted
        elapsed = now - self._window_start
        if elapsed >= self.window_s:
            sample = self._admitted / elapsed
            self.rate = sample if self.rate is None else (
                self.alpha * sample + (1 - self.alpha) * self.rate
            )
            self._window_start = now if num_waiting else None
            self._admitted = 0
        elif num_waiting == 0 and admitted == 0:
            self._window_start = None  # the queue emptied before the window closed

    def retry_after_ms(self) -> int:
        """Expected wait for the queue to shrink by one, in [MIN, MAX]_RETRY_AFTER_MS."""
        if self.rate is None:
            return DEFAULT_RETRY_AFTER_MS
        if self.rate <= 0:
            return MAX_RETRY_AFTER_MS
        return int(min(max(1000.0 / self.rate, MIN_RETRY_AFTER_MS), MAX_RETRY_AFTER_MS))
