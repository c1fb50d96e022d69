"""Liveness and readiness of one service, published through grpc.health.v1.

Service names (shared by engine and frontend, and what Kubernetes probes ask for):

- ``"liveness"``: the process works. NOT_SERVING only when it is broken (an engine's
  step loop died or hung); an orchestrator restarts it then.
- ``"readiness"``: it takes new work. NOT_SERVING while loading and while draining.
- ``""`` and the service's full name (e.g. ``tandem.v1.EngineCore``) follow readiness,
  so clients that ask for the default name route only to ready processes.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

LIVENESS = "liveness"
READINESS = "readiness"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServiceHealth:
    """The states a service moves through: loading -> ready <-> unready -> draining | broken.

    Every method runs on the server's event loop (the health servicer is asyncio's).
    """

    def __init__(self, servicer: health.aio.HealthServicer, service_name: str, *more_names: str) -> None:
        """``more_names``: other services on the same port that follow readiness too."""
        self.servicer = servicer
        self._readiness_names = (READINESS, "", service_name, *more_names)

    async def _set(self, live: int, ready: int) -> None:
        await self.servicer.set(LIVENESS, live)
        for name in self._readiness_names:
            await self.servicer.set(name, ready)

    async def loading(self) -> None:
        """Alive, not ready yet (model load, engine connections)."""
        await self._set(SERVING, NOT_SERVING)

    async def ready(self) -> None:
        await self._set(SERVING, SERVING)

    async def unready(self) -> None:
        """Alive but cannot serve right now (e.g. a frontend with no live engine)."""
        await self._set(SERVING, NOT_SERVING)

    async def draining(self) -> None:
        """Alive, finishing its work, taking no new work."""
        await self._set(SERVING, NOT_SERVING)

    async def broken(self) -> None:
        """Neither alive nor ready: the process is about to exit non-zero."""
        await self._set(NOT_SERVING, NOT_SERVING)
