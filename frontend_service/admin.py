"""The frontend's ``tandem.v1.FrontendAdmin`` servicer: engine membership and LoRA
adapters at run time, and the engine utilities (sleep mode, profiling, prefix cache,
health, collective_rpc).

Thin: protobuf in, ``EngineGroup.add`` / ``remove`` / ``describe``, the AsyncLLM's LoRA
calls, or an AsyncLLM utility (frontend_service/utilities.py) — each fanned out to every
serving engine — protobuf out; every failure goes through ``errors.abort_with``. Who may
call it is the auth interceptor's business (every method here is an admin method).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from frontend_service.engine_client import EngineUnavailableError
from frontend_service.engine_group import EngineGroup, EngineState, EngineStatus
from frontend_service.errors import abort_with
from tandem.protocol import convert
from tandem.protocol.sampling_params import InvalidRequestError
from tandem.v1 import frontend_pb2, frontend_pb2_grpc

if TYPE_CHECKING:
    from frontend_service.async_llm import AsyncLLM

SERVICE_NAME = frontend_pb2.DESCRIPTOR.services_by_name["FrontendAdmin"].full_name

_STATES = {
    EngineState.CONNECTING: frontend_pb2.ENGINE_STATE_CONNECTING,
    EngineState.SERVING: frontend_pb2.ENGINE_STATE_SERVING,
    EngineState.DRAINING: frontend_pb2.ENGINE_STATE_DRAINING,
    EngineState.DEAD: frontend_pb2.ENGINE_STATE_DEAD,
}


def status_to_proto(status: EngineStatus) -> frontend_pb2.EngineStatus:
    return frontend_pb2.EngineStatus(
        address=status.address,
        index=max(status.index, 0),
        state=_STATES[status.state],
        num_running_reqs=status.num_running_reqs,
        num_waiting_reqs=status.num_waiting_reqs,
        load_score=status.load_score,
        num_in_flight=status.num_in_flight,
        detail=status.detail,
    )


class FrontendAdminServicer(frontend_pb2_grpc.FrontendAdminServicer):
    def __init__(self, group: EngineGroup) -> None:
        self.group = group
        self.llm: AsyncLLM | None = None  # set once the engines are connected

    async def _utility(
        self, context: grpc.aio.ServicerContext, call: Callable[[AsyncLLM], Awaitable[Any]]
    ) -> Any:
        try:
            if self.llm is None:
                raise EngineUnavailableError("the frontend is not connected to its engines yet")
            return await call(self.llm)
        except Exception as exc:
            await abort_with(context, exc)

    async def Sleep(
        self, request: frontend_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.SleepResponse:
        level = request.level or 1
        if level not in (1, 2):
            await abort_with(context, InvalidRequestError("level", level, "must be 1 or 2"))
        await self._utility(context, lambda llm: llm.sleep(level))
        return frontend_pb2.SleepResponse()

    async def WakeUp(
        self, request: frontend_pb2.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.WakeUpResponse:
        await self._utility(context, lambda llm: llm.wake_up())
        return frontend_pb2.WakeUpResponse()

    async def IsSleeping(
        self, request: frontend_pb2.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.IsSleepingResponse:
        sleeping = await self._utility(context, lambda llm: llm.is_sleeping())
        return frontend_pb2.IsSleepingResponse(is_sleeping=sleeping)

    async def ResetPrefixCache(
        self, request: frontend_pb2.FrontendAdminResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.FrontendAdminResetPrefixCacheResponse:
        dropped = await self._utility(context, lambda llm: llm.reset_prefix_cache())
        return frontend_pb2.FrontendAdminResetPrefixCacheResponse(num_blocks_dropped=dropped)

    async def StartProfile(
        self, request: frontend_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.StartProfileResponse:
        await self._utility(context, lambda llm: llm.start_profile())
        return frontend_pb2.StartProfileResponse()

    async def StopProfile(
        self, request: frontend_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.StopProfileResponse:
        paths = await self._utility(context, lambda llm: llm.stop_profile())
        return frontend_pb2.StopProfileResponse(trace_paths=paths)

    async def CheckHealth(
        self, request: frontend_pb2.CheckHealthRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.CheckHealthResponse:
        await self._utility(context, lambda llm: llm.check_health())
        return frontend_pb2.CheckHealthResponse()

    async def CollectiveRpc(
        self, request: frontend_pb2.CollectiveRpcRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.CollectiveRpcResponse:
        results = await self._utility(context, lambda llm: llm.collective_rpc(request.method))
        return frontend_pb2.CollectiveRpcResponse(results=[json.dumps(r) for r in results])

    async def AddEngine(
        self, request: frontend_pb2.AddEngineRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.AddEngineResponse:
        try:
            status = self.group.add(request.address)
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.AddEngineResponse(engine=status_to_proto(status))

    async def RemoveEngine(
        self, request: frontend_pb2.RemoveEngineRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.RemoveEngineResponse:
        try:
            status = self.group.remove(request.address)
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.RemoveEngineResponse(engine=status_to_proto(status))

    async def ListEngines(
        self, request: frontend_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.ListEnginesResponse:
        return frontend_pb2.ListEnginesResponse(
            engines=[status_to_proto(s) for s in self.group.describe()]
        )

    # ---- LoRA adapters -----------------------------------------------------------------

    async def _llm(self, context: grpc.aio.ServicerContext) -> AsyncLLM:
        if self.llm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is still connecting to its engines")
        return self.llm  # type: ignore[return-value]

    async def AddLora(
        self, request: frontend_pb2.AddLoraRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.AddLoraResponse:
        llm = await self._llm(context)
        try:
            lora = convert.lora_request_from_proto(request.lora_request)
            added = await llm.add_lora(lora)
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.AddLoraResponse(added=added)

    async def RemoveLora(
        self, request: frontend_pb2.RemoveLoraRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.RemoveLoraResponse:
        llm = await self._llm(context)
        try:
            removed = await llm.remove_lora(request.lora_id)
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.RemoveLoraResponse(removed=removed)

    async def ListLoras(
        self, request: frontend_pb2.ListLorasRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.ListLorasResponse:
        llm = await self._llm(context)
        try:
            ids = await llm.list_loras()
        except Exception as exc:
            await abort_with(context, exc)
        known = sorted(llm.loras.by_name.values(), key=lambda r: r.lora_int_id)
        return frontend_pb2.ListLorasResponse(
            loras=[convert.lora_request_to_proto(r) for r in known], engine_lora_ids=sorted(ids)
        )

    async def PinLora(
        self, request: frontend_pb2.PinLoraRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.PinLoraResponse:
        llm = await self._llm(context)
        try:
            pinned = await llm.pin_lora(request.lora_id)
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.PinLoraResponse(pinned=pinned)
