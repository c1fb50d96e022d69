"""Streaming-input sessions: an idle session's blocks given up when running requests
need them (``SessionEviction``, a scheduler feature). The turns themselves are moves of
the ``RequestLifecycle`` (``end_turn``, ``resume``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_service.scheduler_hooks import SchedulerFeature

if TYPE_CHECKING:
    from engine_service.kv_cache.manager import KVCacheManager
    from engine_service.request_lifecycle import RequestLifecycle


class SessionEviction(SchedulerFeature):
    """Idle sessions keep their blocks between turns until running requests need the
    room: then the least recently used one gives them up (its next turn recomputes its
    history, or finds it in the prefix cache)."""

    def __init__(self, lifecycle: RequestLifecycle, kv: KVCacheManager) -> None:
        self.lifecycle = lifecycle
        self.kv = kv

    def make_room(self) -> bool:
        """Free the blocks of the least recently used idle session that holds any."""
        holding = [r for r in self.lifecycle.sessions.values() if r.num_computed_tokens]
        if not holding:
            return False
        request = min(holding, key=lambda r: r.times.finished or 0.0)
        self.kv.free(request)
        request.num_computed_tokens = 0
        return True
