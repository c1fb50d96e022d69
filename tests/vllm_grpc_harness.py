"""An engine service in this process (its own event-loop thread) serving tandem.v1 and
vllm.grpc.engine.VllmEngine on one port, for RPC-level tests with plain grpc clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.core_loop import EngineCoreLoop
from engine_service.metrics import EngineMetrics
from engine_service.servicer import MESSAGE_LIMITS, EngineServicer
from engine_service.vllm_grpc.kv_events import KvEventLog
from engine_service.vllm_grpc.servicer import VllmEngineServicer
from tandem.grpc_server import ServiceServer
from tandem.security import ServerSecurity
from tandem.v1 import engine_pb2_grpc

ADMIN_TOKEN = "vllm-grpc-admin"
ADMIN_METADATA = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


class InProcessEngine:
    """Start with ``start()``; ``address`` is host:port; ``servicer`` the EngineServicer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-engine-aio", daemon=True)
        self.servicer: EngineServicer | None = None
        self.kv_events = KvEventLog(config.block_size)
        self.address = ""
        self._server: ServiceServer | None = None
        self._engine_loop: EngineCoreLoop | None = None

    def start(self) -> InProcessEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=300)
        return self

    async def _start(self) -> None:
        metrics = EngineMetrics(CollectorRegistry(), 0)
        self.servicer = EngineServicer(self.config.model, metrics=metrics)
        server = ServiceServer("127.0.0.1", 0, ServerSecurity(admin_token=ADMIN_TOKEN), MESSAGE_LIMITS)
        engine_pb2_grpc.add_EngineCoreServicer_to_server(self.servicer, server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(self.servicer, self.kv_events), server)
        await server.start()
        self._server = server
        self.address = f"127.0.0.1:{server.port}"

        def build() -> EngineCore:
            core = EngineCore(self.config, 0)
            core.kv_manager.pool.events = self.kv_events
            return core

        self._engine_loop = EngineCoreLoop(build)
        self._engine_loop.start()
        core = await asyncio.wrap_future(self._engine_loop.started)
        self.servicer.attach(core, self._engine_loop)
        self.servicer.start_pump(asyncio.get_running_loop())

    def run(self, coro):  # type: ignore[no-untyped-def]
        """Run ``coro`` on the server's loop (to touch the servicer safely)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self.loop).result(timeout=30)
        if self._engine_loop is not None:
            self._engine_loop.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def engine_stub(address: str) -> Iterator[tuple[grpc.Channel, vllm_engine_pb2_grpc.VllmEngineStub]]:
    channel = grpc.insecure_channel(address)
    try:
        yield channel, vllm_engine_pb2_grpc.VllmEngineStub(channel)
    finally:
        channel.close()
