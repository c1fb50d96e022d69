"""``tandem.v1.KvTransfer``: the producer's side of a pull, on the engine's gRPC server.

The engine server registers it next to ``EngineCore`` when the engine produces KV
(``--kv-role producer|both``); ``security.METHOD_ACCESS`` puts it behind the engine
token and mutual TLS, as ``EngineCore.Stream``. ``KvTransferServer`` serves it alone on
a thread (tests, and an engine core driven without the engine service).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from engine_service.kv_transfer.grpc_connector import GrpcKvConnector
from engine_service.kv_transfer.held import TransferRefused
from engine_service.kv_transfer.observe import TRACE_KEYS, emit_span
from tandem.grpc_server import MessageLimits, ServiceServer
from tandem.security import ServerSecurity
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

T = TypeVar("T")

SERVICE_NAME = "tandem.v1.KvTransfer"
_KINDS = (kv_transfer_pb2.KV_CACHE_KIND_KEY, kv_transfer_pb2.KV_CACHE_KIND_VALUE)


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    def __init__(self, connector: Callable[[], GrpcKvConnector | None]) -> None:
        """``connector()``: the engine's connector, None while the engine starts."""
        self._connector = connector

    async def PullBlocks(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_pb2.PullBlocksResponse]:
        connector = self._connector()
        if connector is None or not connector.produces or connector.io is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "this engine holds no KV for others (--kv-role)"
            )
            return
        block_ids = list(request.block_ids)
        try:
            held = connector.held.claim(
                request.remote_request_id, request.transfer_secret, block_ids, time.time()
            )
        except TransferRefused as exc:
            await context.abort(exc.code, exc.message)
            return
        io = connector.io
        layout = io.layout
        sent = 0
        complete = False
        started = time.time()
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if k in TRACE_KEYS}
        try:
            first = kv_transfer_pb2.PullBlocksResponse(
                layout=kv_transfer_pb2.KvCacheLayout(
                    dtype=layout.dtype,
                    num_layers=layout.num_layers,
                    block_size=layout.block_size,
                    num_kv_heads=layout.num_kv_heads,
                    head_dim=layout.head_dim,
                    layout=layout.layout,
                )
            )
            if not block_ids:
                yield first
            for layer, kind, start, ids in connector.serve_pull(
                held, block_ids, request.max_chunk_bytes
            ):
                if time.time() > held.expires_at + connector.expiry_s:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "the pull outlived its transfer"
                    )
                    return
                data = await asyncio.to_thread(io.read, layer, kind, ids)
                msg = kv_transfer_pb2.PullBlocksResponse(
                    layer=layer,
                    kind=_KINDS[kind],
                    first_block=start,
                    num_blocks=len(ids),
                    data=data,
                )
                if first is not None:
                    msg.layout.CopyFrom(first.layout)
                    first = None
                sent += len(data)
                yield msg
            complete = True
        finally:
            connector.pull_ended(held, sent, complete)
            emit_span(
                connector.tracing,
                "kv_transfer_send",
                metadata,
                started,
                time.time(),
                {
                    "tandem.kv_transfer.request_id": held.request_id,
                    "tandem.kv_transfer.consumer_engine_id": request.consumer_engine_id,
                    "tandem.kv_transfer.blocks": len(block_ids),
                    "tandem.kv_transfer.bytes": sent,
                },
                complete,
            )


class KvTransferServer:
    """The KvTransfer service alone, on its own thread and event loop."""

    def __init__(
        self,
        connector: GrpcKvConnector,
        host: str = "127.0.0.1",
        port: int = 0,
        security: ServerSecurity | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kv-transfer-server", daemon=True
        )
        self._thread.start()
        limits = MessageLimits(max_receive_bytes=64 * 1024 * 1024, max_send_bytes=64 * 1024 * 1024)

        async def start() -> ServiceServer:
            server = ServiceServer(host, port, security or ServerSecurity(), limits)
            kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(
                KvTransferServicer(lambda: connector), server
            )
            await server.start()
            return server

        self.server = self._run(start())
        self.port = self.server.port
        self.address = f"{host}:{self.port}"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        """Stop serving; idempotent (a second call finds the loop stopped: nothing to wait for)."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self._run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
