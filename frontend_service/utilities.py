"""The engine API beyond generation, with vLLM's names (AsyncLLM delegates to it): sleep /
wake_up / is_sleeping, start_profile / stop_profile, reset_prefix_cache, collective_rpc,
get_supported_tasks, check_health, wait_for_requests_to_drain.

``EngineUtilities`` is given the engine group and the pause of the frontend's requests
(``PausableRequests``: sleep pauses generation first). Each call goes to every engine of
the group that is connected, as a utility call on its stream (``EngineGroup.call_utility``),
concurrently; an engine that fails the call fails it here (UtilityCallError, or
EngineUnavailableError when none is connected).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from frontend_service.control import PauseMode
from frontend_service.engine_client import EngineUnavailableError
from frontend_service.engine_group import EngineGroup


class PausableRequests(Protocol):
    """What the utilities need of the frontend's requests (``RequestControl``)."""

    async def pause(self, mode: PauseMode, poll_interval: float = ...) -> None: ...

    def resume(self) -> None: ...

    @property
    def num_unfinished(self) -> int: ...


class EngineUtilities:
    def __init__(self, engines: EngineGroup, requests: PausableRequests) -> None:
        self.engines = engines
        self._requests = requests

    async def sleep(self, level: int = 1) -> None:
        """New requests wait (generation is paused), the ones in flight finish, then every
        engine sleeps: level 1 gives back the KV cache, level 2 the weights too."""
        await self._requests.pause(PauseMode.WAIT)
        try:
            await self.engines.call_utility("sleep", level)
        except BaseException:
            self._requests.resume()
            raise

    async def wake_up(self) -> None:
        """Every engine wakes (weights and KV cache back), then waiting requests run."""
        await self.engines.call_utility("wake_up")
        self._requests.resume()

    async def is_sleeping(self) -> bool:
        """Whether any engine is asleep."""
        return any(await self.engines.call_utility("is_sleeping"))

    async def reset_prefix_cache(self) -> int:
        """Drop every engine's cached prefixes (blocks a running request uses stay);
        returns how many blocks were dropped in all."""
        return sum(int(n) for n in await self.engines.call_utility("reset_prefix_cache"))

    async def start_profile(self) -> None:
        await self.engines.call_utility("start_profile")

    async def stop_profile(self) -> list[str]:
        """The trace file each engine wrote (on the engine's host)."""
        return [str(p) for p in await self.engines.call_utility("stop_profile")]

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """``method`` (an allow-listed engine method) on every worker of every engine:
        one result per worker, engines in index order."""
        results = []
        for per_engine in await self.engines.call_utility("collective_rpc", method, *args):
            results.extend(per_engine)
        return results

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks every engine supports (e.g. "generate")."""
        per_engine = [set(tasks) for tasks in await self.engines.call_utility("get_supported_tasks")]
        return tuple(sorted(set.intersection(*per_engine)))

    async def check_health(self) -> None:
        """Raise EngineUnavailableError unless every engine of the group answers."""
        dead = [e for e in self.engines.engines if not e.alive]
        if dead:
            raise EngineUnavailableError("; ".join(e.dead_reason or f"engine {e.index} is down" for e in dead))
        await self.engines.call_utility("check_health")

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300.0) -> None:
        """Wait until no request is unfinished, here and on every engine; TimeoutError
        after ``drain_timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while True:
            if not self._requests.num_unfinished and all(await self.engines.call_utility("is_idle")):
                return
            if loop.time() >= deadline:
                raise TimeoutError(f"requests still unfinished after {drain_timeout:g}s")
            await asyncio.sleep(0.05)
