"""The frontend's ``tandem.v1.FrontendAdmin`` servicer: engine membership and LoRA
adapters at run time.

Thin: protobuf in, ``EngineGroup.add`` / ``remove`` / ``describe`` or the AsyncLLM's
LoRA calls (fanned out to every serving engine), protobuf out; every
failure goes through ``errors.abort_with``. Who may call it is the auth interceptor's
business (every method here is an admin method).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from frontend_service.engine_group import EngineGroup, EngineState, EngineStatus
from frontend_service.errors import abort_with
from tandem.protocol import convert
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
        self.llm: AsyncLLM | None = None  # set once the engines are connected (LoRA calls)

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
