"""The prefix cache's changes as ``smg.grpc.common.KvEventBatch`` messages.

``KvEventLog`` is the BlockPool's event sink (engine_service/kv_cache/block_pool.py):
the step thread records block-stored / block-removed / cleared events under a lock;
readers (each ``SubscribeKvEvents`` call, on the event loop) seal what is pending into
a numbered batch and read the batches after their cursor. The log keeps the last
``max_batches`` batches (memory stays bounded with no reader), so a new subscriber gets
the cache's history as far as it reaches: replaying stores and removals rebuilds the
current state when it reaches back to the start.

Block hashes are the engine's SHA-256 chain hashes cut to their first 8 bytes as a
signed int64 (the proto's type); stored events carry each block's token ids too, which
is what a gateway that hashes tokens itself indexes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2


def hash_to_int64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "big", signed=True)


@dataclass(frozen=True)
class _Stored:
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Removed:
    block_hash: int


class _Cleared:
    pass


_Event = _Stored | _Removed | _Cleared


@dataclass(frozen=True)
class SealedBatch:
    sequence_number: int
    timestamp: float  # wall clock (time.time()) when sealed
    events: tuple[tuple[int, _Event], ...]  # (event id, event)


class KvEventLog:
    """Thread-safe: ``stored`` / ``removed`` / ``cleared`` from the step thread,
    ``batches_after`` from any reader."""

    def __init__(self, block_size: int, max_batches: int = 1024, max_batch_events: int = 256) -> None:
        """At most ``max_batches`` x ``max_batch_events`` events are kept: with no reader,
        pending events are sealed every ``max_batch_events`` and the oldest batches drop."""
        self.block_size = block_size
        self.max_batch_events = max_batch_events
        self._lock = threading.Lock()
        self._pending: list[tuple[int, _Event]] = []
        self._batches: deque[SealedBatch] = deque(maxlen=max_batches)
        self._event_ids = itertools.count(1)
        self._last_sequence = 0

    # ---- BlockEventSink (the step thread) ------------------------------------------

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        parent = None if parent_hash is None else hash_to_int64(parent_hash)
        self._record(_Stored(hash_to_int64(block_hash), parent, tuple(token_ids)))

    def removed(self, block_hash: bytes) -> None:
        self._record(_Removed(hash_to_int64(block_hash)))

    def cleared(self) -> None:
        self._record(_Cleared())

    def _record(self, event: _Event) -> None:
        with self._lock:
            self._pending.append((next(self._event_ids), event))
            if len(self._pending) >= self.max_batch_events:
                self._seal_locked()

    # ---- readers ---------------------------------------------------------------------

    def seal(self) -> int:
        """Close what is pending into a batch; returns the last batch's number (0: none yet)."""
        with self._lock:
            self._seal_locked()
            return self._last_sequence

    def batches_after(self, cursor: int) -> list[SealedBatch]:
        """Seal what is pending, then every kept batch numbered above ``cursor``."""
        with self._lock:
            self._seal_locked()
            return [b for b in self._batches if b.sequence_number > cursor]

    def _seal_locked(self) -> None:
        if self._pending:
            self._last_sequence += 1
            self._batches.append(SealedBatch(self._last_sequence, time.time(), tuple(self._pending)))
            self._pending = []

    def to_proto(self, batch: SealedBatch) -> common_pb2.KvEventBatch:
        msg = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, dp_rank=0)
        for event_id, event in batch.events:
            item = msg.events.add(event_id=event_id)
            if isinstance(event, _Stored):
                stored = item.stored
                stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
                stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
                if event.parent_hash is not None:
                    stored.parent_block_hash = event.parent_hash
                stored.blocks.add(
                    block_hash=event.block_hash, token_ids=event.token_ids, block_size=self.block_size
                )
            elif isinstance(event, _Removed):
                removed = item.removed
                removed.block_hashes.append(event.block_hash)
                removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
                removed.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
            else:
                item.cleared.SetInParent()
        return msg
