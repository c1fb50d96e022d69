"""The scheduler's side of KV transfer: requests parked while their KV is loaded, and
the connector's news applied at each schedule() (and while the engine is idle).

Mixed into ``Scheduler``; the connector's hooks are named in ``base.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from engine_service.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine_service.kv_cache.block_pool import KVCacheBlock
    from engine_service.kv_cache.manager import KVCacheManager
    from engine_service.kv_transfer.base import KvConnector
    from engine_service.waiting_queue import WaitingQueue


class KvTransferScheduling:
    """Needs the scheduler's ``kv``, ``connector``, ``waiting``, ``_loading``,
    ``_orphans``, ``_step_start`` and ``_take_from_queue``."""

    kv: KVCacheManager
    connector: KvConnector
    waiting: WaitingQueue
    _loading: dict[str, Request]
    _orphans: dict[str, list[KVCacheBlock]]
    _step_start: float
    _take_from_queue: Any

    def update_kv_transfers(self) -> None:
        """The connector's news, at each schedule() and while idle: blocks of held
        transfers done with go free; requests whose load ended go back to the queue's
        front, with the loaded tokens computed (none when the load failed)."""
        for blocks in self.connector.take_released(time.time()):
            self.kv.free_blocks(blocks)
        for done in self.connector.poll_finished_loads():
            orphan = self._orphans.pop(done.request_id, None)
            if orphan is not None:
                self.kv.free_blocks(orphan)
                continue
            request = self._loading.pop(done.request_id, None)
            if request is None:
                continue
            if done.num_tokens > request.num_computed_tokens:
                request.num_computed_tokens = done.num_tokens
                self.kv.cache_blocks(request)  # pulled full blocks join the prefix cache
            else:  # failed: start over as a preempted request does (prefix lookup included)
                self.kv.free(request)
                request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.add(request, front=True)

    def drop_kv_transfers(self) -> None:
        """Free every held transfer's blocks now (before the KV cache is released)."""
        for blocks in self.connector.drop_held():
            self.kv.free_blocks(blocks)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their KV from another engine."""
        return len(self._loading)

    def _start_load(
        self, request: Request, hits: list[KVCacheBlock], num_hit_tokens: int, n: int
    ) -> bool:
        """Park the queue head as WAITING_FOR_REMOTE_KV with blocks for ``n`` tokens to
        load after its ``num_hit_tokens`` local ones; False (nothing changed) when the
        blocks are not there."""
        if not self.kv.allocate_slots(request, n, hits):
            return False
        self._take_from_queue(request, num_hit_tokens, RequestStatus.WAITING_FOR_REMOTE_KV)
        self._loading[request.request_id] = request
        self.connector.start_load(
            request, self.kv.block_ids(request.request_id), request.num_computed_tokens
        )
        return True
