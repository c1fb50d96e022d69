"""The frontend's ``tandem.v1.FrontendAdmin`` servicer: engine membership at run time.

Thin: protobuf in, ``EngineGroup.add`` / ``remove`` / ``describe``, protobuf out; every
failure goes through ``errors.abort_with``. Who may call it is the auth interceptor's
business (every method here is an admin method).
"""

from __future__ import annotations

import grpc

from frontend_service.engine_group import EngineGroup, EngineState, EngineStatus
from frontend_service.errors import abort_with
from tandem.v1 import frontend_pb2, frontend_pb2_grpc

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
