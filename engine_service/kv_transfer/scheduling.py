"""KV transfer as a scheduler feature: requests wait while their KV is loaded, and an
ending request's blocks are freed, held for another engine, or (mid-load) kept until
the load is over. The connector's hooks are named in ``base.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine_service.kv_transfer.base import KvConnector, NoConnector
from engine_service.request import Request, RequestStatus
from engine_service.scheduler_hooks import SchedulerFeature, Verdict
from tandem.protocol.outputs import FinishReason

if TYPE_CHECKING:
    from engine_service.kv_cache.manager import KVBlocks, KVCacheManager
    from engine_service.request_lifecycle import RequestLifecycle


class KvTransfer(SchedulerFeature):
    """``bind`` the lifecycle before the first schedule (the lifecycle is built with
    this object's ``release``)."""

    def __init__(self, kv: KVCacheManager, connector: KvConnector | None = None) -> None:
        self.kv = kv
        self.connector = connector or NoConnector()
        self._lifecycle: RequestLifecycle | None = None
        # Blocks of requests that ended while their KV was loading: freed once the load ends.
        self._orphans: dict[str, KVBlocks] = {}

    def bind(self, lifecycle: RequestLifecycle) -> None:
        self._lifecycle = lifecycle

    @property
    def lifecycle(self) -> RequestLifecycle:
        if self._lifecycle is None:
            raise RuntimeError("KvTransfer used before bind()")
        return self._lifecycle

    def before_schedule(self, now: float) -> None:
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
            request = self.lifecycle.loading.get(done.request_id)
            if request is None:
                continue
            if done.num_tokens > request.num_computed_tokens:
                request.num_computed_tokens = done.num_tokens
                self.kv.cache_blocks(request)  # pulled full blocks join the prefix cache
            else:  # failed: start over as a preempted request does (prefix lookup included)
                self.kv.free(request)
                request.num_computed_tokens = 0
            self.lifecycle.loaded(done.request_id)

    def place(self, request: Request, hit: KVBlocks, num_new_tokens: int, now: float) -> Verdict:
        """Start loading the queue head's KV when the connector has tokens beyond the
        local ``hit``: blocks for them allocated, the request WAITING_FOR_REMOTE_KV."""
        if request.num_computed_tokens or request.pooling_params is not None:
            return Verdict.ADMIT
        num_external = self.connector.get_num_external_tokens(request, hit.num_tokens)
        if not num_external:
            return Verdict.ADMIT
        if not self.kv.allocate_slots(request, num_external, hit):
            return Verdict.NO_ROOM
        self.lifecycle.start_loading(request, hit.num_tokens, now)
        self.connector.start_load(request, self.kv.block_ids(request.request_id), request.num_computed_tokens)
        return Verdict.TAKEN

    def release(self, request: Request, reason: FinishReason) -> None:
        """An ending request's blocks (called by the lifecycle before its status changes):
        mid-load they wait for the load to end; else the connector may hold them for
        another engine; else they are freed."""
        rid = request.request_id
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.connector.cancel_load(rid)
            self._orphans[rid] = self.kv.take_blocks(request)
        elif request.status == RequestStatus.IDLE:
            self.kv.free(request)
        else:
            hold, params = self.connector.request_finished(request, reason, self.kv.blocks_of(request))
            if hold:  # the connector keeps the blocks (one reference each) for another engine
                self.kv.take_blocks(request)
                request.kv_transfer_out = params
            else:
                self.kv.free(request)

    def drop_held(self) -> None:
        """Free every held transfer's blocks now (before the KV cache is released)."""
        for blocks in self.connector.drop_held():
            self.kv.free_blocks(blocks)

    @property
    def num_orphans(self) -> int:
        """Block sets of requests that ended mid-load, waiting for the load to end."""
        return len(self._orphans)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their KV from another engine."""
        return len(self.lifecycle.loading)
