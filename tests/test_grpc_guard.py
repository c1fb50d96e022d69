"""MalformedRequestGuard: unparseable bodies end with INVALID_ARGUMENT, for all four
method shapes, and well-formed calls are untouched (in-process server, no model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.grpc_guard import MalformedRequestGuard
from tandem.v1 import engine_pb2, engine_pb2_grpc

BAD = b"\x08\xff"  # a varint cut short: no message parses from it
SERVING = health_pb2.HealthCheckResponse.SERVING


class EchoEngine(engine_pb2_grpc.EngineCoreServicer):
    """Stream: one output per input, read on a separate task as the engine does;
    counts the inputs it saw and whether it saw the input side end."""

    def __init__(self) -> None:
        self.seen = 0
        self.ended = asyncio.Event()

    async def Stream(
        self, request_iterator: AsyncIterator[engine_pb2.EngineCoreInput], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineCoreOutputs]:
        queue: asyncio.Queue[int | None] = asyncio.Queue()

        async def read() -> None:
            async for _ in request_iterator:
                self.seen += 1
                await queue.put(self.seen)
            self.ended.set()
            await queue.put(None)

        reader = asyncio.ensure_future(read())
        while (index := await queue.get()) is not None:
            yield engine_pb2.EngineCoreOutputs(engine_index=index)
        await reader

    async def GetEngineInfo(
        self, request: engine_pb2.GetEngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetEngineInfoResponse:
        return engine_pb2.GetEngineInfoResponse(engine_index=7)


async def _codes(bodies: list[bytes]) -> tuple[list[grpc.StatusCode], EchoEngine]:
    server = grpc.aio.server(interceptors=[MalformedRequestGuard()])
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    engine = EchoEngine()
    engine_pb2_grpc.add_EngineCoreServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for body in bodies:
                calls = [
                    channel.unary_unary("/grpc.health.v1.Health/Check")(body, timeout=10),
                    channel.unary_unary("/tandem.v1.EngineCore/GetEngineInfo")(body, timeout=10),
                    channel.unary_stream("/grpc.health.v1.Health/Watch")(body, timeout=10),
                    # A good input first: the stream is already running when the bad one comes.
                    channel.stream_stream("/tandem.v1.EngineCore/Stream")(iter([b"", body]), timeout=10),
                ]
                for call in calls:
                    try:
                        if isinstance(call, grpc.aio.UnaryUnaryCall):
                            await call
                        else:
                            async for _ in call:
                                if isinstance(call, grpc.aio.UnaryStreamCall):
                                    call.cancel()  # Watch never ends by itself
                                    break
                        codes.append(await call.code())
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            assert "does not parse" in (exc.details() or "")
                        codes.append(exc.code())
    finally:
        await server.stop(0)
    return codes, engine


def test_unparseable_bodies_are_invalid_argument_for_every_method_shape() -> None:
    codes, engine = asyncio.run(_codes([BAD]))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    # The stream's servicer saw the good input, then its input side ended cleanly.
    assert engine.seen == 1 and engine.ended.is_set()


@pytest.mark.parametrize("body", [b"", engine_pb2.GetEngineInfoRequest().SerializeToString()])
def test_well_formed_calls_are_untouched(body: bytes) -> None:
    codes, engine = asyncio.run(_codes([body]))
    # Watch is cancelled by the client after its first answer.
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.OK]
    assert engine.seen == 2
