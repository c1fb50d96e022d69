"""All engines of one frontend: who they are (membership) and where requests go (placement).

Members come from the ``--engine`` targets (fixed addresses, ``dns:///`` names and
``file:///`` lists resolved again every discovery interval, see ``discovery.py``) and
from the admin calls ``add`` / ``remove``. The members wanted at any time are

    (fixed and admin-added addresses | addresses discovered last) - removed by admin

A member moves through CONNECTING (asked GetEngineInfo until it answers, is not loading
or draining, and serves the frontend's tokenizer with the first engine's max_model_len
and vocab_size) -> SERVING (takes new requests) -> DRAINING (gone from discovery or
removed: takes no new request, its in-flight requests finish, then its stream is
closed). DEAD: its stream broke; its requests failed UNAVAILABLE and it is retried until
it answers again (``EngineConnection``). Invariant: ``placeable()`` holds only SERVING
members, and a request stays on the engine it was placed on for its whole life.

Fixed addresses keep their start-up contract: every one must answer within the connect
timeout or the frontend does not start. With discovery targets, the frontend starts as
soon as one engine is usable.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from frontend_service.discovery import (
    FixedTarget,
    ResolveError,
    Target,
    normalize_address,
    parse_target,
)
from frontend_service.engine_client import (
    AliveHandler,
    DeadHandler,
    EngineConnection,
    EngineUnavailableError,
    OutputFlow,
    OutputsHandler,
    TokenizerMismatchError,
)
from frontend_service.placement import Placement, PlacementConfig
from tandem.protocol.outputs import EngineCoreRequest
from tandem.security import EngineChannelSecurity
from tandem.v1 import engine_pb2

logger = logging.getLogger(__name__)

DEFAULT_DISCOVERY_INTERVAL = 10.0  # seconds between resolutions of dns:/// and file:/// targets
JOIN_PROBE_TIMEOUT = 30.0  # seconds one GetEngineInfo of a joining engine may wait
JOIN_RETRY_MAX_DELAY = 5.0  # seconds between probes of an engine that cannot join yet, at most
RETIRE_POLL_INTERVAL = 0.1  # seconds between checks whether a draining member is idle
LOADING_RECHECK_S = 1.0  # start-up with discovery: how often a loading member extends the wait

MemberHandler = Callable[[EngineConnection], None]


class EngineExistsError(ValueError):
    """AddEngine of an address that is already a member. Maps to ALREADY_EXISTS."""


class EngineNotFoundError(LookupError):
    """RemoveEngine of an address that is no member. Maps to NOT_FOUND."""


class EngineState(enum.Enum):
    CONNECTING = "connecting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(frozen=True)
class EngineStatus:
    """One member as the admin API shows it."""

    address: str
    index: int
    state: EngineState
    num_running_reqs: int
    num_waiting_reqs: int
    load_score: int
    num_in_flight: int  # this frontend's requests on it
    detail: str  # why it is not SERVING, if known


class EngineGroup:
    """The members, their life cycle, and the placement of new requests on them."""

    def __init__(
        self,
        targets: Sequence[str],
        client_index: int,
        on_outputs: OutputsHandler,
        on_dead: DeadHandler,
        on_alive: AliveHandler | None = None,
        *,
        discovery_interval: float = DEFAULT_DISCOVERY_INTERVAL,
        placement: PlacementConfig | None = None,
        on_join: MemberHandler | None = None,
        on_leave: MemberHandler | None = None,
        on_change: Callable[[], None] | None = None,
        channel: EngineChannelSecurity | None = None,
        output_flow: OutputFlow | None = None,
    ) -> None:
        """``on_join``/``on_leave``: a member starts/stops taking requests for good;
        ``on_change``: the set of placeable engines may have changed (health, metrics);
        ``channel``: TLS and token for every engine channel (None: plain text, no token)."""
        if not targets:
            raise ValueError("at least one engine target is required")
        if discovery_interval <= 0:
            raise ValueError(f"discovery_interval must be > 0, got {discovery_interval}")
        self.targets: list[Target] = [parse_target(t) for t in targets]
        self.client_index = client_index
        self.discovery_interval = discovery_interval
        self.placement = Placement(placement)
        self.channel = channel or EngineChannelSecurity()
        self.output_flow = output_flow or OutputFlow()  # of every member
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._on_alive = on_alive
        self._on_join = on_join
        self._on_leave = on_leave
        self._on_change = on_change
        self._members: dict[str, EngineConnection] = {}  # address -> connection
        self._admitted: set[str] = set()  # members that passed the join checks
        self._joining: dict[str, asyncio.Task[None]] = {}
        self._retiring: dict[str, asyncio.Task[None]] = {}
        self._static = [t.address for t in self.targets if isinstance(t, FixedTarget)]
        self._discovered: dict[Target, list[str]] = {}
        self._excluded: set[str] = set()  # removed by admin; discovery does not re-add them
        self._resolve_errors: dict[Target, str] = {}
        self._next_index = 0
        self._fingerprint: str | None = None  # set when connect() starts
        self._load_timeout = 0.0  # connect()'s: how long a joining engine may load its model (0: no bound)
        self._usable = asyncio.Event()
        self._discovery: asyncio.Task[None] | None = None
        self.reference: engine_pb2.GetEngineInfoResponse | None = None  # the first engine's info

    # ---- start-up ----------------------------------------------------------------------

    async def connect(
        self, tokenizer_fingerprint: str, timeout: float, load_timeout: float = 0.0
    ) -> engine_pb2.GetEngineInfoResponse:
        """Reach the fixed engines (all of them) and, with discovery, wait for one usable
        engine. ``timeout`` bounds the wait for an engine that does not answer at all; one
        that answers that it is loading its model is waited for up to ``load_timeout``
        seconds (0: as long as it keeps answering so). Returns the first engine's info."""
        self._fingerprint = tokenizer_fingerprint
        self._load_timeout = load_timeout
        fixed = [self._new_member(address) for address in dict.fromkeys(self._static)]
        if fixed:
            infos = await asyncio.gather(*(e.fetch_info(timeout, load_timeout) for e in fixed))
            for engine, info in zip(fixed, infos):
                problem = self._incompatibility(engine, info)
                if problem:
                    raise TokenizerMismatchError(problem)
                await self._admit(engine, info)
        if any(t.dynamic for t in self.targets):
            await self._refresh()
            self._discovery = asyncio.ensure_future(self._discover_forever())
            await self._wait_usable(timeout, load_timeout)
        if self.reference is None:  # unreachable: a fixed engine or _usable admitted one
            raise EngineUnavailableError("no engine joined")
        return self.reference

    async def _wait_usable(self, timeout: float, load_timeout: float) -> None:
        """Until one engine joined: ``timeout`` seconds, longer while a member is loading
        its model (up to ``load_timeout`` seconds since it began; 0: no bound)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                await asyncio.wait_for(self._usable.wait(), max(deadline - loop.time(), 0.0))
                return
            except TimeoutError:
                now = loop.time()
                loading = [e.loading_since for e in self.engines if e.loading_since is not None]
                if loading and not (load_timeout and now - min(loading) > load_timeout):
                    deadline = now + min(timeout, LOADING_RECHECK_S)
                    continue
                shown = "; ".join(f"{s.address}: {s.detail or s.state.value}" for s in self.describe())
                raise EngineUnavailableError(
                    f"no engine of {', '.join(map(str, self.targets))} became usable within "
                    f"{timeout:.0f}s ({shown or 'none found'})"
                ) from None

    # ---- membership --------------------------------------------------------------------

    @property
    def engines(self) -> list[EngineConnection]:
        """Every member, in index order (whatever its state)."""
        return sorted(self._members.values(), key=lambda e: e.index)

    def add(self, address: str) -> EngineStatus:
        """Admin: make ``address`` a member (it joins once it passes the checks)."""
        address = normalize_address(address)
        if address in self._members or (self._fingerprint is None and address in self._static):
            raise EngineExistsError(f"engine {address} is already a member")
        self._excluded.discard(address)
        self._static.append(address)
        if self._fingerprint is None:  # connect() has not started: it will reach it
            return EngineStatus(address, -1, EngineState.CONNECTING, 0, 0, 0, 0, "")
        return self._status(self._start_join(address))

    def remove(self, address: str) -> EngineStatus:
        """Admin: drain ``address`` out; discovery does not bring it back until ``add``."""
        address = normalize_address(address)
        engine = self._members.get(address)
        if engine is None or address in self._retiring:
            raise EngineNotFoundError(f"engine {address} is not a member")
        self._excluded.add(address)
        self._static = [a for a in self._static if a != address]
        self._start_retire(address, "removed by an admin call")
        return self._status(engine)

    def _new_member(self, address: str) -> EngineConnection:
        engine = EngineConnection(
            address, self._next_index, self.client_index, self._on_outputs, self._on_dead,
            self._engine_back, self.channel, self.output_flow,
        )
        self._next_index += 1
        self._members[address] = engine
        return engine

    def _start_join(self, address: str) -> EngineConnection:
        engine = self._new_member(address)
        self._joining[address] = asyncio.ensure_future(self._join(engine))
        logger.info("engine %d at %s found; joining once it serves", engine.index, address)
        return engine

    async def _join(self, engine: EngineConnection) -> None:
        delay = 0.5
        try:
            while True:
                try:
                    info = await engine.fetch_info(JOIN_PROBE_TIMEOUT, self._load_timeout)
                    problem = self._incompatibility(engine, info)
                except EngineUnavailableError as exc:
                    problem = str(exc)
                if not problem:
                    break
                if problem != engine.dead_reason:
                    logger.warning("engine at %s cannot join yet: %s", engine.address, problem)
                    engine.dead_reason = problem
                await asyncio.sleep(delay)
                delay = min(delay * 2, JOIN_RETRY_MAX_DELAY)
            engine.dead_reason = ""
            await self._admit(engine, info)
        finally:
            self._joining.pop(engine.address, None)

    def _incompatibility(self, engine: EngineConnection, info: engine_pb2.GetEngineInfoResponse) -> str:
        """Why ``engine`` cannot serve this frontend's requests ("" if it can)."""
        if self._fingerprint and info.tokenizer_fingerprint != self._fingerprint:
            return (
                f"engine at {engine.address} serves {info.model} whose tokenizer fingerprint "
                f"{info.tokenizer_fingerprint[:12]} differs from the frontend's "
                f"{self._fingerprint[:12]}: start both with the same model"
            )
        ref = self.reference
        if ref is not None and (info.max_model_len, info.vocab_size) != (ref.max_model_len, ref.vocab_size):
            return (
                f"engine at {engine.address} has max_model_len={info.max_model_len}, "
                f"vocab_size={info.vocab_size}; the first engine has {ref.max_model_len}, {ref.vocab_size}"
            )
        if info.draining:
            return f"engine at {engine.address} is draining"
        return ""

    async def _admit(self, engine: EngineConnection, info: engine_pb2.GetEngineInfoResponse) -> None:
        await engine.open(self._fingerprint or "")
        if self.reference is None:
            self.reference = info
        self._admitted.add(engine.address)
        self.placement.add_engine(engine.index, info.block_size, info.num_kv_blocks)
        logger.info("engine %d at %s joined (%d serving)", engine.index, engine.address, len(self.placeable()))
        self._usable.set()
        if self._on_join is not None:
            self._on_join(engine)
        if self._on_alive is not None:
            self._on_alive(engine)
        self._changed()

    def _engine_back(self, engine: EngineConnection) -> None:
        """A dead member answers again: a restarted engine, its prefix cache empty."""
        info = engine.info
        if info is not None:
            self.placement.add_engine(engine.index, info.block_size, info.num_kv_blocks)
        if self._on_alive is not None:
            self._on_alive(engine)
        self._changed()

    def _start_retire(self, address: str, why: str) -> None:
        engine = self._members[address]
        join = self._joining.pop(address, None)
        if join is not None:
            join.cancel()
        self.placement.remove_engine(engine.index)
        logger.info(
            "engine %d at %s leaves (%s); %d request(s) in flight finish there first",
            engine.index, address, why, len(engine.in_flight),
        )
        self._retiring[address] = asyncio.ensure_future(self._retire(engine))
        self._changed()

    async def _retire(self, engine: EngineConnection) -> None:
        try:
            while engine.alive and engine.in_flight:
                await asyncio.sleep(RETIRE_POLL_INTERVAL)
            await engine.close()
        finally:
            if self._members.get(engine.address) is engine:
                del self._members[engine.address]
            self._retiring.pop(engine.address, None)
            admitted = engine.address in self._admitted
            self._admitted.discard(engine.address)
            logger.info("engine %d at %s left", engine.index, engine.address)
            if admitted and self._on_leave is not None:
                self._on_leave(engine)
            self._changed()

    # ---- discovery ---------------------------------------------------------------------

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval)
            try:
                await self._refresh()
            except Exception:  # a bug here must not end discovery for good
                logger.exception("engine discovery failed")

    async def _refresh(self) -> None:
        """Resolve every dynamic target once (a failure keeps its last addresses), then
        bring the members in line."""
        for target in self.targets:
            if not target.dynamic:
                continue
            try:
                self._discovered[target] = await target.resolve()
            except ResolveError as exc:
                if self._resolve_errors.get(target) != str(exc):
                    logger.warning("%s; keeping the %d engine(s) it had", exc, len(self._discovered.get(target, [])))
                self._resolve_errors[target] = str(exc)
                continue
            self._resolve_errors.pop(target, None)
        self._reconcile()

    def _reconcile(self) -> None:
        wanted = dict.fromkeys(self._static)
        for addresses in self._discovered.values():
            wanted.update(dict.fromkeys(addresses))
        for address in wanted:
            if address not in self._members and address not in self._excluded:
                self._start_join(address)
        for address in list(self._members):
            if (address not in wanted or address in self._excluded) and address not in self._retiring:
                self._start_retire(address, "no longer discovered")

    # ---- placement ---------------------------------------------------------------------

    def placeable(self) -> list[EngineConnection]:
        """The SERVING members: admitted, stream up, not leaving, not draining."""
        return [
            e for e in self.engines
            if e.alive and not e.draining and e.address in self._admitted and e.address not in self._retiring
        ]

    async def call_utility(self, method: str, *args: object, serving_only: bool = False) -> list[object]:
        """Engine utility ``method`` on every connected member (only the placeable ones
        with ``serving_only``), concurrently; results in engine index order."""
        engines = self.placeable() if serving_only else [e for e in self.engines if e.alive]
        if not engines:
            raise EngineUnavailableError(
                "no engine is serving" if serving_only else f"no engine is connected to call {method!r} on"
            )
        return list(await asyncio.gather(*(e.call_utility(method, *args) for e in engines)))

    @property
    def any_alive(self) -> bool:
        """Whether some engine can take a new request."""
        return bool(self.placeable())

    def pick(
        self,
        request: EngineCoreRequest | None = None,
        exclude: Collection[EngineConnection] = (),
        kv_roles: Collection[str] | None = None,
    ) -> EngineConnection:
        """The engine for a new request (``request``: its prompt, for prefix-aware placement),
        leaving out ``exclude`` (engines that already refused it); ``kv_roles``: only
        engines with one of these KV roles (GetEngineInfoResponse.kv_role)."""
        live = [e for e in self.placeable() if e not in exclude]
        if kv_roles is not None:
            live = [e for e in live if e.info is not None and e.info.kv_role in kv_roles]
        if not live:
            reasons = "; ".join(
                e.dead_reason or f"{e.address}: {self.state_of(e).value}" for e in self.engines
            )
            raise EngineUnavailableError(f"no engine is available ({reasons or 'none found yet'})")
        if request is None:
            return self.placement.choose(live)  # type: ignore[return-value]
        return self.placement.choose(live, request.prompt_token_ids, request.cache_salt)  # type: ignore[return-value]

    # ---- status ------------------------------------------------------------------------

    def state_of(self, engine: EngineConnection) -> EngineState:
        if engine.address in self._retiring or (engine.alive and engine.draining):
            return EngineState.DRAINING
        if engine.address not in self._admitted:
            return EngineState.CONNECTING
        return EngineState.SERVING if engine.alive else EngineState.DEAD

    def _status(self, engine: EngineConnection) -> EngineStatus:
        state = self.state_of(engine)
        return EngineStatus(
            address=engine.address,
            index=engine.index,
            state=state,
            num_running_reqs=engine.load.running,
            num_waiting_reqs=engine.load.waiting,
            load_score=engine.load.score,
            num_in_flight=len(engine.in_flight),
            detail="" if state is EngineState.SERVING else engine.dead_reason,
        )

    def describe(self) -> list[EngineStatus]:
        return [self._status(e) for e in self.engines]

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    async def close(self) -> None:
        tasks = [t for t in (self._discovery, *self._joining.values(), *self._retiring.values()) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in list(self._members.values())), return_exceptions=True)
