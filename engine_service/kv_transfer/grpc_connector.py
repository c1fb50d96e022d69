"""The KV connector over gRPC: producers serve ``tandem.v1.KvTransfer``, consumers pull.

Producer: a finished ``do_remote_decode`` request's blocks are held (``HeldTransfers``)
under a random per-transfer secret until a consumer's pull ends or the transfer
expires. Consumer: a ``do_remote_prefill`` request whose full blocks' hashes match its
own tokens pulls the blocks it lacks (a local prefix-cache hit is not pulled) on the
connector's client thread, into CPU buffers; the step thread copies them into its
cache when it polls. Whatever fails (producer gone, expired, refused, bad data), the
request computes its prompt itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch

from engine_service.kv_cache.block_pool import hash_block_tokens
from engine_service.kv_transfer.base import CacheLayout, FinishedLoad, KvConnector
from engine_service.kv_transfer.blocks import KvBlockIO
from engine_service.kv_transfer.held import HeldTransfer, HeldTransfers
from engine_service.kv_transfer.observe import TransferStats, emit_span, trace_metadata
from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.outputs import FinishReason
from tandem.security import EngineChannelSecurity
from tandem.telemetry import Tracing
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    from engine_service.kv_cache.manager import KVBlocks
    from engine_service.request import Request

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 16 << 20  # well under the engines' 64 MiB message limit
# A step with nothing to run waits this long for a load to end (see wait_if_idle).
_IDLE_WAIT_S = 0.005
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def block_hashes(request: Request, num_full_blocks: int, block_size: int) -> list[bytes]:
    """The prefix-cache hashes of the request's first ``num_full_blocks`` blocks."""
    out: list[bytes] = []
    tokens = request.all_token_ids
    for i in range(num_full_blocks):
        extra = request.cache_extra if i == 0 else None
        out.append(
            hash_block_tokens(
                out[-1] if out else None, tokens[i * block_size : (i + 1) * block_size], extra
            )
        )
    return out


@dataclass
class _Load:
    request_id: str
    params: KvTransferParams
    num_tokens: int  # tokens computed once the load is in
    local_ids: list[int]
    remote_ids: list[int]
    trace_headers: dict[str, str] | None = None
    started: float = field(default_factory=time.monotonic)
    wall_start: float = field(default_factory=time.time)
    num_bytes: int = 0
    cancelled: bool = False


class GrpcKvConnector(KvConnector):
    def __init__(
        self,
        role: str,
        engine_id: str,
        address: str,
        block_size: int,
        expiry_s: float = 30.0,
        channel_security: EngineChannelSecurity | None = None,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """``address``: host:port where consumers reach this engine's KvTransfer service
        (put in the params it returns); ``channel_security``: how this engine reaches
        producers (their engine token, TLS)."""
        self.role = role
        self.engine_id = engine_id
        self.address = address
        self.block_size = block_size
        self.expiry_s = expiry_s
        self.channel_security = channel_security or EngineChannelSecurity()
        self.max_chunk_bytes = max_chunk_bytes
        self.produces = role in ("producer", "both")
        self.consumes = role in ("consumer", "both")
        self.held = HeldTransfers()
        self.io: KvBlockIO | None = None
        self.stats = TransferStats()
        self._wake: Callable[[], None] = lambda: None
        # consumer
        self._loads: dict[str, _Load] = {}
        self._done: deque[tuple[_Load, list[tuple[int, int, list[int], torch.Tensor]] | None]] = (
            deque()
        )
        self._event = threading.Event()
        self._client: _PullClient | None = None
        self.tracing: Tracing | None = None  # set: a span per transfer, under the request's trace

    # ---- runner side ---------------------------------------------------------

    def register_kv_caches(
        self, caches: Callable[[], Sequence[tuple[torch.Tensor, torch.Tensor]]], layout: CacheLayout
    ) -> None:
        self.io = KvBlockIO(caches, layout)

    def set_wake(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    # ---- producer side ---------------------------------------------------------

    def request_finished(
        self, request: Request, reason: FinishReason, blocks: KVBlocks
    ) -> tuple[bool, KvTransferParams | None]:
        params = request.kv_transfer_params
        if not self.produces or params is None or not params.do_remote_decode:
            return False, None
        if reason != FinishReason.LENGTH or not blocks:  # a stop: no consumer will come
            return False, None
        bs = self.block_size
        num_tokens = request.num_computed_tokens
        num_blocks = -(-num_tokens // bs)
        if num_tokens < 1 or len(blocks) < num_blocks:
            return False, None
        ids = blocks.block_ids[:num_blocks]
        secret = secrets.token_bytes(16)
        expires_at = time.time() + self.expiry_s
        self.held.hold(HeldTransfer(request.request_id, blocks, ids, secret, expires_at))
        return True, KvTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_address=self.address,
            remote_request_id=request.request_id,
            remote_block_ids=ids,
            block_hashes=block_hashes(request, num_tokens // bs, bs),
            num_tokens=num_tokens,
            block_size=bs,
            expires_at=expires_at,
            transfer_secret=secret,
        )

    def take_released(self, now: float) -> list[KVBlocks]:
        before = self.held.num_expired
        released = self.held.take_released(now)
        self.stats.expired += self.held.num_expired - before
        return released

    def drop_held(self) -> list[KVBlocks]:
        return self.held.drop_all()

    @property
    def num_held_transfers(self) -> int:
        return len(self.held)

    def serve_pull(
        self, held: HeldTransfer, block_ids: Sequence[int], max_chunk_bytes: int
    ) -> Iterator[tuple[int, int, int, list[int]]]:
        """The chunks of a claimed pull: (layer, kind 0/1, first index, block ids)."""
        io = self.io
        assert io is not None
        limit = min(max_chunk_bytes or self.max_chunk_bytes, MAX_CHUNK_BYTES)
        per_chunk = max(1, limit // io.block_bytes)
        ids = list(block_ids)
        for layer in range(io.layout.num_layers):
            for kind in (0, 1):
                for first in range(0, len(ids), per_chunk):
                    yield layer, kind, first, ids[first : first + per_chunk]

    def pull_ended(self, held: HeldTransfer, num_bytes: int, complete: bool) -> None:
        self.held.release(held)
        self.stats.bytes_sent += num_bytes
        self.stats.pulls_served += int(complete)
        self._wake()

    # ---- consumer side ---------------------------------------------------------

    def _unusable(self, request: Request, params: KvTransferParams) -> str | None:
        if self.io is None:
            return "the engine's KV cache is not registered"
        if params.block_size != self.block_size:
            return f"producer block size {params.block_size} != {self.block_size}"
        if params.expires_at and params.expires_at <= time.time():
            return "the transfer expired"
        num_full = min(len(params.block_hashes), params.num_tokens // self.block_size)
        full_needed = min(params.num_tokens, request.num_tokens - 1) // self.block_size
        if num_full < full_needed:
            return f"{num_full} block hashes for {full_needed} full blocks"
        if block_hashes(request, full_needed, self.block_size) != list(
            params.block_hashes[:full_needed]
        ):
            return "the block hashes do not match the request's tokens"
        return None

    def get_num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        params = request.kv_transfer_params
        if not self.consumes or params is None or not params.do_remote_prefill:
            return 0
        reason = self._unusable(request, params)
        if reason is not None:
            logger.warning(
                "request %s: not pulling its KV (%s); computing it here", request.request_id, reason
            )
            params.do_remote_prefill = False  # decided: a later admission computes
            self.stats.loads_failed += 1
            self._release_remote(params)
            return 0
        num_tokens = min(params.num_tokens, request.num_tokens - 1)
        if num_tokens <= num_local_tokens:
            params.do_remote_prefill = False
            self._release_remote(params)  # everything is here already
            return 0
        return num_tokens - num_local_tokens

    def start_load(self, request: Request, block_ids: Sequence[int], num_local_tokens: int) -> None:
        params = request.kv_transfer_params
        assert params is not None
        params.do_remote_prefill = False  # one try: a preempted request computes its prompt
        num_tokens = min(params.num_tokens, request.num_tokens - 1)
        bs = self.block_size
        first, last = num_local_tokens // bs, -(-num_tokens // bs)
        load = _Load(
            request.request_id,
            params,
            num_tokens,
            list(block_ids[first:last]),
            list(params.remote_block_ids[first:last]),
            request.trace_headers,
        )
        self._loads[request.request_id] = load
        self._client_thread().submit(
            self._pull(load), lambda result: self._finish_pull(load, result)
        )

    def _finish_pull(
        self, load: _Load, result: list[tuple[int, int, list[int], torch.Tensor]] | None
    ) -> None:
        emit_span(
            self.tracing,
            "kv_transfer_pull",
            load.trace_headers,
            load.wall_start,
            time.time(),
            {
                "tandem.kv_transfer.remote_engine_id": load.params.remote_engine_id,
                "tandem.kv_transfer.remote_address": load.params.remote_address,
                "tandem.kv_transfer.blocks": len(load.remote_ids),
                "tandem.kv_transfer.tokens": load.num_tokens,
                "tandem.kv_transfer.bytes": load.num_bytes,
            },
            result is not None,
        )
        self._done.append((load, result))
        self._event.set()
        self._wake()

    def poll_finished_loads(self) -> list[FinishedLoad]:
        finished = []
        while self._done:
            load, result = self._done.popleft()
            self._loads.pop(load.request_id, None)
            ok = result is not None and not load.cancelled and self.io is not None
            if ok:
                assert self.io is not None and result is not None
                for layer, kind, ids, tensor in result:
                    self.io.write(layer, kind, ids, tensor)
                self.stats.loads_ok += 1
            else:
                self.stats.loads_failed += int(not load.cancelled)
            self.stats.load_seconds += time.monotonic() - load.started
            finished.append(FinishedLoad(load.request_id, load.num_tokens if ok else 0))
        return finished

    def cancel_load(self, request_id: str) -> None:
        load = self._loads.get(request_id)
        if load is not None:
            load.cancelled = True

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def wait_if_idle(self) -> None:
        if self._loads and not self._done:
            self._event.wait(_IDLE_WAIT_S)
        self._event.clear()

    def _release_remote(self, params: KvTransferParams) -> None:
        """Tell the producer to free a transfer this engine will not pull."""
        if params.remote_address and params.remote_request_id:
            load = _Load("", params, 0, [], [])
            self._client_thread().submit(self._pull(load), None)

    # ---- the pull (on the client thread) ---------------------------------------

    def _client_thread(self) -> _PullClient:
        if self._client is None:
            self._client = _PullClient(self.channel_security)
        return self._client

    async def _pull(self, load: _Load) -> list[tuple[int, int, list[int], torch.Tensor]] | None:
        """The blocks as (layer, kind, local block ids, CPU tensor); None: failed."""
        assert self._client is not None
        params = load.params
        try:
            stub = kv_transfer_pb2_grpc.KvTransferStub(self._client.channel(params.remote_address))
            call = stub.PullBlocks(
                kv_transfer_pb2.PullBlocksRequest(
                    remote_request_id=params.remote_request_id,
                    transfer_secret=params.transfer_secret,
                    block_ids=load.remote_ids,
                    consumer_engine_id=self.engine_id,
                    max_chunk_bytes=self.max_chunk_bytes,
                ),
                timeout=max(self.expiry_s, 1.0),
                metadata=trace_metadata(load.trace_headers),
            )
            return await self._receive(load, call)
        except Exception as exc:  # any failure: the request computes its prompt
            if load.request_id:
                logger.warning(
                    "request %s: pulling its KV from %s failed (%s); computing it here",
                    load.request_id,
                    params.remote_address,
                    _describe(exc),
                )
            return None

    async def _receive(
        self, load: _Load, call: Any
    ) -> list[tuple[int, int, list[int], torch.Tensor]] | None:
        io = self.io
        assert io is not None
        n = len(load.remote_ids)
        seen = np.zeros((io.layout.num_layers, 2, n), dtype=bool)
        out = []
        first_msg = True
        async for chunk in call:
            if load.cancelled:
                call.cancel()
                return None
            if first_msg:
                _check_layout(chunk.layout, io.layout)
                first_msg = False
            if not chunk.num_blocks:
                continue
            kind = chunk.kind - 1
            end = chunk.first_block + chunk.num_blocks
            if not (0 <= chunk.layer < io.layout.num_layers and kind in (0, 1) and end <= n):
                raise ValueError(
                    f"chunk out of range: layer {chunk.layer}, kind {chunk.kind}, blocks to {end}"
                )
            tensor = io.decode(chunk.data, chunk.num_blocks)
            seen[chunk.layer, kind, chunk.first_block : end] = True
            out.append((chunk.layer, kind, load.local_ids[chunk.first_block : end], tensor))
            self.stats.bytes_received += len(chunk.data)
            load.num_bytes += len(chunk.data)
        if first_msg:
            raise ValueError("the producer sent nothing")
        if not seen.all():
            raise ValueError("the producer's stream ended before every block came")
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _check_layout(got: kv_transfer_pb2.KvCacheLayout, want: CacheLayout) -> None:
    theirs = (got.dtype, got.num_layers, got.block_size, got.num_kv_heads, got.head_dim, got.layout)
    ours = (
        want.dtype,
        want.num_layers,
        want.block_size,
        want.num_kv_heads,
        want.head_dim,
        want.layout,
    )
    if theirs != ours:
        raise ValueError(f"the producer's KV cache layout {theirs} is not this engine's {ours}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class _PullClient:
    """A thread with an event loop and one channel per producer address."""

    def __init__(self, security: EngineChannelSecurity) -> None:
        self.security = security
        self.loop = asyncio.new_event_loop()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kv-transfer-client", daemon=True
        )
        self._thread.start()

    def channel(self, address: str) -> grpc.aio.Channel:
        """On the client thread only."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.security.open_channel(
                address, _CHANNEL_OPTIONS
            )
        return channel

    def submit(self, coro: Any, done: Callable[[Any], None] | None) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        if done is not None:
            future.add_done_callback(
                lambda f: done(None if f.cancelled() or f.exception() else f.result())
            )

    def close(self) -> None:
        async def close_channels() -> None:
            for channel in self._channels.values():
                await channel.close(None)

        with contextlib.suppress(Exception):  # closing: nothing to do about a failure
            asyncio.run_coroutine_threadsafe(close_channels(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
