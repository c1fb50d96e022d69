"""The producer's table of held transfers: finished requests' KV blocks kept for a
consumer until it has pulled them or the transfer expires.

Thread-safe: pulls claim and release transfers on the gRPC threads; the step thread
holds new ones and takes the released and expired ones back (``take_released``) to
free their blocks. A claimed transfer (a pull is streaming it) never expires under
the pull: its blocks are given back when the pull ends.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from engine_service.kv_cache.manager import KVBlocks


class TransferRefused(Exception):
    """A pull the producer refuses: ``code`` is the gRPC status it answers."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class HeldTransfer:
    request_id: str
    blocks: KVBlocks  # one reference each is the table's
    block_ids: list[int]  # the advertised ones (a prefix of ``blocks``)
    secret: bytes = field(repr=False)
    expires_at: float  # time.time()
    claimed: bool = False


class HeldTransfers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, HeldTransfer] = {}
        self._released: list[KVBlocks] = []
        self.num_expired = 0  # transfers dropped unpulled, since start

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, transfer: HeldTransfer) -> None:
        with self._lock:
            old = self._held.pop(transfer.request_id, None)
            if old is not None and not old.claimed:  # a reused request id: the old one goes
                self._released.append(old.blocks)
            elif old is not None:  # being pulled: its pull's release frees it
                self._held[f"{transfer.request_id}\x00superseded"] = old
            self._held[transfer.request_id] = transfer

    def claim(
        self, request_id: str, secret: bytes, block_ids: Sequence[int], now: float
    ) -> HeldTransfer:
        """Mark the transfer as being pulled; TransferRefused (changing nothing) when
        the pull may not go ahead."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held.expires_at <= now:
                raise TransferRefused(
                    grpc.StatusCode.NOT_FOUND,
                    f"no KV transfer {request_id!r} held here (never made, already pulled or expired)",
                )
            if not hmac.compare_digest(secret, held.secret):
                raise TransferRefused(grpc.StatusCode.PERMISSION_DENIED, "wrong transfer_secret")
            if held.claimed:
                raise TransferRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"KV transfer {request_id!r} is being pulled already",
                )
            known = set(held.block_ids)
            bad = [b for b in block_ids if b not in known]
            if bad:
                raise TransferRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block ids {bad[:8]} are not blocks of KV transfer {request_id!r}",
                )
            if len(set(block_ids)) != len(block_ids):
                raise TransferRefused(grpc.StatusCode.INVALID_ARGUMENT, "block_ids has duplicates")
            held.claimed = True
            return held

    def release(self, held: HeldTransfer) -> None:
        """The pull of ``held`` ended (done or not): its blocks go back."""
        with self._lock:
            for key, entry in list(self._held.items()):
                if entry is held:
                    del self._held[key]
                    self._released.append(held.blocks)
                    return

    def take_released(self, now: float) -> list[KVBlocks]:
        """Pulled transfers' blocks, and those of unclaimed transfers expired by ``now``."""
        with self._lock:
            for key, entry in list(self._held.items()):
                if not entry.claimed and entry.expires_at <= now:
                    del self._held[key]
                    self._released.append(entry.blocks)
                    self.num_expired += 1
            released, self._released = self._released, []
            return released

    def drop_all(self) -> list[KVBlocks]:
        """Every transfer, claimed or not (the engine resets or shuts down)."""
        with self._lock:
            released = self._released + [h.blocks for h in self._held.values()]
            self._held.clear()
            self._released = []
            return released
