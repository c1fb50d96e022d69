"""The frontend's side of the engine hop: one bidi stream per engine, and a balancer.

Each ``EngineConnection`` keeps one long-lived ``EngineCore.Stream`` to an engine
service: requests and aborts go up as ``EngineCoreInput`` messages, and one
``EngineCoreOutputs`` per engine step comes down. ``engine_group.EngineGroup`` holds
the connections, adds and removes engines, and places each new request on one of them
(never on one that is draining). AsyncLLM moves a request an engine refused before
producing anything (RESOURCE_EXHAUSTED, or UNAVAILABLE while it drains) to another engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.argtypes import non_negative_float, non_negative_int, positive_int
from tandem.health import LIVENESS
from tandem.protocol import convert
from tandem.protocol.outputs import EngineCoreOutputs, EngineCoreRequest, UtilityOutput
from tandem.security import EngineChannelSecurity
from tandem.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class EngineUnavailableError(RuntimeError):
    """No engine can take or finish the request. Maps to gRPC UNAVAILABLE."""


class TokenizerMismatchError(RuntimeError):
    """The engine serves a model whose tokenizer differs from the frontend's."""


class UtilityCallError(RuntimeError):
    """An engine's utility method failed; the engine's message is "<ExceptionType>: <detail>".

    ``invalid``: it refused its arguments (InvalidRequestError, ValueError):
    INVALID_ARGUMENT. ``precondition``: the engine's state does not allow it now (busy,
    profiling not configured): FAILED_PRECONDITION. Anything else: INTERNAL.
    """

    _INVALID = ("InvalidRequestError", "ValueError")
    _PRECONDITION = ("EngineBusyError", "ProfilerNotConfiguredError")

    def __init__(self, message: str) -> None:
        kind, _, detail = message.partition(": ")
        self.invalid = kind in self._INVALID
        self.precondition = kind in self._PRECONDITION
        super().__init__(detail if self.invalid or self.precondition else message)


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    in_flight_adds: int = 0  # sent since the last stats arrived

    @property
    def score(self) -> int:
        return (self.waiting + self.in_flight_adds) * 4 + self.running


OutputsHandler = Callable[["EngineConnection", EngineCoreOutputs], None]
DeadHandler = Callable[["EngineConnection", str], None]
AliveHandler = Callable[["EngineConnection"], None]
RECONNECT_MAX_DELAY = 5.0  # seconds between attempts to reach a dead engine, at most
# Start-up (fetch_info): how often an engine is asked again, how often a long model load
# is logged, and how long one liveness check may take.
LOADING_POLL_S = 0.25
LOADING_LOG_INTERVAL_S = 10.0
LIVENESS_PROBE_TIMEOUT_S = 2.0
# Output messages an engine may have in flight to this frontend before it merges its
# later steps into one (Hello.output_window). Two: one being handed out here while the
# next travels, so a frontend that keeps up sees every step as it is made; one that
# falls behind gets fewer, larger messages instead of a backlog.
OUTPUT_WINDOW = 2


@dataclass(frozen=True)
class OutputFlow:
    """How outputs flow from the engines through this frontend to its clients (each is a
    flag and an env var)."""

    # Hello.output_window: unacknowledged output messages in flight before the engine
    # merges its later steps; 0: one message per step, no flow control.
    window: int = OUTPUT_WINDOW
    # With a window: at least this many seconds between two acknowledgements, so at most
    # about one output message per interval and engine, each stream's tokens of the
    # interval in one client message. Trades up to this much latency per token for
    # fewer messages (less CPU per token) at GPU speed; 0: as fast as they are handed out.
    interval_s: float = 0.0
    # Tokens per streamed client message (vLLM's --stream-interval): a DELTA or
    # CUMULATIVE stream gets its first token at once, then a message once this many
    # tokens are new, and the last one at the finish. Fewer, larger messages: less CPU
    # per token in the frontend and the clients; 1: a message per step.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"the output window must be >= 0, got {self.window}")
        if not self.interval_s >= 0:
            raise ValueError(f"the output interval must be >= 0 s, got {self.interval_s}")
        if self.stream_interval < 1:
            raise ValueError(f"the stream interval must be >= 1 token, got {self.stream_interval}")


def add_output_flow_cli(parser: Any) -> None:
    env = os.environ.get
    parser.add_argument(
        "--engine-output-window", type=non_negative_int,
        default=non_negative_int(env("TANDEM_ENGINE_OUTPUT_WINDOW", str(OUTPUT_WINDOW))),
        help="Output messages each engine may have in flight to this frontend before it merges "
        "its later steps into one (flow control: a frontend that falls behind gets fewer, larger "
        f"messages); 0: one message per step, no flow control (env TANDEM_ENGINE_OUTPUT_WINDOW; "
        f"default {OUTPUT_WINDOW}).",
    )
    parser.add_argument(
        "--engine-output-interval-ms", type=non_negative_float,
        default=non_negative_float(env("TANDEM_ENGINE_OUTPUT_INTERVAL_MS", "0")),
        help="At least this many ms between two output messages of an engine (with a window): "
        "the steps in between reach each stream as one message. Up to this much more latency "
        "per token for fewer messages, i.e. less CPU per token at GPU speed; 0: none (env "
        "TANDEM_ENGINE_OUTPUT_INTERVAL_MS; default 0).",
    )
    parser.add_argument(
        "--stream-interval", type=positive_int, default=positive_int(env("TANDEM_STREAM_INTERVAL", "1")),
        help="Tokens per streamed message (vLLM's flag): a streaming request gets its first token "
        "at once, then a message whenever this many tokens are new, and the last at its finish. "
        "Larger: less CPU per token in the frontend and its clients, burstier streams (env "
        "TANDEM_STREAM_INTERVAL; default 1: every step's tokens as they come).",
    )


def add_load_timeout_cli(parser: Any) -> None:
    """--load-timeout, beside each command's --connect-timeout."""
    parser.add_argument(
        "--load-timeout", type=non_negative_float,
        default=non_negative_float(os.environ.get("TANDEM_LOAD_TIMEOUT", "0")),
        help="Seconds an engine that is up and loading its model (it answers, its health says "
        "alive, not ready) may take before start-up gives up; each such answer restarts "
        "--connect-timeout, which bounds only the wait for an engine that does not answer at "
        "all. 0: no bound, the load's progress is logged every 10 s (env TANDEM_LOAD_TIMEOUT; "
        "default 0).",
    )


def output_flow_from_args(args: Any) -> OutputFlow:
    return OutputFlow(args.engine_output_window, args.engine_output_interval_ms / 1000.0, args.stream_interval)


# A stream that has not written its share of an output message within this many
# seconds (a client that stopped reading) no longer holds up the acknowledgement.
ROUND_TIMEOUT_S = 0.05


class OutputsRound:
    """The streams that one engine message gave output to. The message is acknowledged
    (the engine may send the next) once each of them has handed its output to its
    client, or ROUND_TIMEOUT_S after it arrived: until then the engine's later steps
    gather on its side, and reach each stream as one message."""

    __slots__ = ("_on_done", "_timer", "pending")

    def __init__(self) -> None:
        self.pending = 0
        self._on_done: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def join(self) -> None:
        self.pending += 1

    def leave(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self._done()

    def start(self, on_done: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        """After the message's outputs were handed out: ``on_done`` runs once, when the
        last stream leaves or at the timeout."""
        self._on_done = on_done
        if self.pending <= 0:
            self._done()
        else:
            self._timer = loop.call_later(ROUND_TIMEOUT_S, self._done)

    def _done(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            if self._timer is not None:
                self._timer.cancel()
            on_done()


class EngineConnection:
    def __init__(
        self,
        address: str,
        index: int,
        client_index: int,
        on_outputs: OutputsHandler,
        on_dead: DeadHandler,
        on_alive: AliveHandler | None = None,
        channel: EngineChannelSecurity | None = None,
        output_flow: OutputFlow | None = None,
    ) -> None:
        self.output_flow = output_flow or OutputFlow()
        self.address = address
        self.index = index
        self.client_index = client_index
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.on_alive = on_alive
        self.channel = (channel or EngineChannelSecurity()).open_channel(address, CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineCoreStub(self.channel)
        self.info: engine_pb2.GetEngineInfoResponse | None = None
        self.load = EngineLoad()
        self.in_flight: set[str] = set()  # engine request ids sent here and not finished
        self.alive = False
        # The engine said it is shutting down gracefully: it finishes what it has and
        # takes nothing new (EngineGroup.pick skips it). Cleared when it comes back.
        self.draining = False
        self.dead_reason = ""
        # Start-up: the loop time fetch_info first heard "still loading" (None: it has
        # not, or the engine has answered since).
        self.loading_since: float | None = None
        self._send: asyncio.Queue[engine_pb2.EngineCoreInput | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._reconnector: asyncio.Task[None] | None = None
        self._fingerprint = ""
        self._closing = False
        # Utility calls on the stream waiting for their answer: call id -> future.
        self._utility_calls: dict[int, asyncio.Future[UtilityOutput]] = {}
        self._call_ids = itertools.count(1)
        # The OutputsRound of the message being handed to on_outputs (None otherwise):
        # the streams it wakes join it.
        self.outputs_round: OutputsRound | None = None

    async def fetch_info(self, timeout: float, load_timeout: float = 0.0) -> engine_pb2.GetEngineInfoResponse:
        """Wait for the engine to answer and return its info.

        ``timeout`` bounds the wait for an engine that does not answer at all (nothing
        listening yet, or a process that never gets that far). An engine that is up but
        still loading its model answers UNAVAILABLE while its grpc.health.v1 liveness is
        SERVING: that is progress, so each such answer moves the ``timeout`` on, and the
        wait goes on up to ``load_timeout`` seconds after its first such answer (0: no
        bound), logging the progress every LOADING_LOG_INTERVAL_S. EngineUnavailableError when either runs out,
        or at once when the engine refuses the call (a wrong token, say).
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        silent_deadline = started + timeout  # moved on by every "still loading" answer
        next_log = started + LOADING_LOG_INTERVAL_S
        while True:
            left = silent_deadline - loop.time()
            # An engine that answered "loading" is up: a slow answer (a busy host, its
            # load holding the GIL) gets LIVENESS_PROBE_TIMEOUT_S even past the timeout.
            call_timeout = max(left, LIVENESS_PROBE_TIMEOUT_S if self.loading_since is not None else 0.001)
            try:
                self.info = await self.stub.GetEngineInfo(
                    engine_pb2.GetEngineInfoRequest(), timeout=call_timeout, wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and await self._alive(
                    min(max(left, 0.5), LIVENESS_PROBE_TIMEOUT_S)
                ):
                    now = loop.time()
                    if self.loading_since is None:
                        self.loading_since = now
                        logger.info("engine %d at %s is up and loading its model; waiting for it",
                                    self.index, self.address)
                    if load_timeout and now - self.loading_since > load_timeout:
                        raise EngineUnavailableError(
                            f"engine at {self.address} is still loading its model after "
                            f"{now - self.loading_since:.0f} s (the load timeout)"
                        ) from exc
                    if now >= next_log:
                        logger.info("engine %d at %s: still loading its model (%.0f s)",
                                    self.index, self.address, now - started)
                        next_log = now + LOADING_LOG_INTERVAL_S
                    silent_deadline = now + timeout
                elif code == grpc.StatusCode.UNAVAILABLE and left > 0.5:
                    pass  # not up yet, or restarting: ask again within the timeout
                elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise EngineUnavailableError(
                        f"engine at {self.address} did not answer within {timeout:g} s "
                        f"(the connect timeout): {code.name}: {exc.details()}"
                    ) from exc
                else:
                    raise EngineUnavailableError(
                        f"engine at {self.address} is unreachable: {code.name}: {exc.details()}"
                    ) from exc
                await asyncio.sleep(LOADING_POLL_S)
                continue
            self.draining = self.info.draining
            if self.loading_since is not None:
                logger.info("engine %d at %s loaded its model (%.0f s)", self.index, self.address,
                            loop.time() - started)
                self.loading_since = None
            return self.info

    async def _alive(self, timeout: float) -> bool:
        """Whether the engine's process is up (grpc.health.v1 liveness SERVING: loading
        its model, say), whatever its readiness."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def open(self, tokenizer_fingerprint: str) -> None:
        """Start the stream; the first message says who we are."""
        self._fingerprint = tokenizer_fingerprint
        await self._send.put(convert.hello_input(self.client_index, tokenizer_fingerprint, self.output_flow.window))
        call = self.stub.Stream(self._inputs())
        self.alive = True
        self._reader = asyncio.ensure_future(self._read(call))

    async def _inputs(self):  # type: ignore[no-untyped-def]
        """The stream's requests: what queued up while the previous message was being
        written goes as one InputBatch (acknowledgements summed), to engines that read
        batches; 1,024 requests arriving at once are a handful of writes, not 1,024."""
        batches = self.info is not None and self.info.accepts_input_batches
        while True:
            item = await self._send.get()
            if item is None:
                return
            if not batches or self._send.empty():
                yield item
                continue
            inputs, acks, end = [item], 0, False
            while not self._send.empty():
                more = self._send.get_nowait()
                if more is None:
                    end = True
                    break
                inputs.append(more)
            kept = []
            for one in inputs:
                if one.WhichOneof("kind") == "ack":
                    acks += one.ack.count
                else:
                    kept.append(one)
            if acks:
                kept.append(convert.ack_input(acks))
            yield kept[0] if len(kept) == 1 else convert.batch_input(kept)
            if end:
                return

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        reason = "the engine closed the stream"
        ack = convert.ack_input(1)
        loop = asyncio.get_running_loop()

        interval = self.output_flow.interval_s
        last_ack = [0.0]

        def send_ack() -> None:
            if self.alive:
                last_ack[0] = loop.time()
                self._send.put_nowait(ack)

        def acknowledge() -> None:
            if not self.output_flow.window:
                return
            due = last_ack[0] + interval
            if interval and due > loop.time():
                loop.call_at(due, send_ack)
            else:
                send_ack()
        try:
            async for msg in call:
                try:
                    outs = convert.engine_core_outputs_from_proto(msg)
                except convert.EngineDeadError as exc:
                    reason = str(exc)
                    break
                if outs.scheduler_stats is not None:
                    self.load.running = outs.scheduler_stats.num_running_reqs
                    self.load.waiting = outs.scheduler_stats.num_waiting_reqs
                    self.load.in_flight_adds = 0
                if outs.draining and not self.draining:
                    logger.info("engine %d at %s is draining: placing no new requests there", self.index, self.address)
                    self.draining = True
                for out in outs.outputs:
                    if out.finished:
                        self.in_flight.discard(out.request_id)
                if outs.utility_output is not None:
                    waiter = self._utility_calls.pop(outs.utility_output.call_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(outs.utility_output)
                self.outputs_round = OutputsRound()
                try:
                    self.on_outputs(self, outs)
                finally:
                    handed_out, self.outputs_round = self.outputs_round, None
                handed_out.start(acknowledge, loop)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the frontend is shutting down"
        finally:
            self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.in_flight.clear()  # on_dead fails them all
        self.dead_reason = f"engine {self.index} at {self.address} is unavailable: {reason}"
        # Our own shutdown and a drained engine leaving are not errors; anything else is.
        logger.log(logging.INFO if self._closing or self.draining else logging.ERROR, self.dead_reason)
        self._send.put_nowait(None)  # ends the old stream's request iterator
        for waiter in self._utility_calls.values():
            if not waiter.done():
                waiter.set_exception(EngineUnavailableError(self.dead_reason))
        self._utility_calls.clear()
        self.on_dead(self, self.dead_reason)
        if not self._closing:
            self._reconnector = asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        """Retry a dead engine (e.g. restarted by its orchestrator) until it answers.

        Requests that were on it already failed; new ones go to it again once it is back.
        """
        delay = 0.5
        while not self._closing:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)
            try:
                info = await self.stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                continue
            if self._fingerprint and info.tokenizer_fingerprint != self._fingerprint:
                logger.error("engine at %s came back with a different tokenizer; not using it", self.address)
                continue
            self.info = info
            self.draining = info.draining
            self.load = EngineLoad()
            self._send = asyncio.Queue()
            await self.open(self._fingerprint)
            logger.info("engine %d at %s is back", self.index, self.address)
            if self.on_alive is not None:
                self.on_alive(self)
            return

    def add_request(self, request: EngineCoreRequest) -> None:
        if not self.alive:
            raise EngineUnavailableError(
                self.dead_reason or f"engine at {self.address} is not connected"
            )
        self.load.in_flight_adds += 1
        self.in_flight.add(request.request_id)
        self._send.put_nowait(convert.add_input(request))

    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Call one of the engine's UTILITY_METHODS over the stream; its result, or
        UtilityCallError with the engine's failure message."""
        if not self.alive:
            raise EngineUnavailableError(self.dead_reason or f"engine at {self.address} is not connected")
        call_id = next(self._call_ids)
        waiter: asyncio.Future[UtilityOutput] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = waiter
        self._send.put_nowait(convert.utility_input(call_id, method, args))
        try:
            out = await asyncio.wait_for(waiter, timeout)
        finally:
            self._utility_calls.pop(call_id, None)
        if out.failure_message is not None:
            raise UtilityCallError(out.failure_message)
        return out.result

    def abort(self, request_ids: list[str]) -> None:
        self.in_flight.difference_update(request_ids)
        if self.alive and request_ids:
            self._send.put_nowait(convert.abort_input(request_ids))

    async def close(self) -> None:
        self._closing = True
        self._send.put_nowait(None)
        for task in (self._reader, self._reconnector):
            if task is not None:
                task.cancel()
        await self.channel.close()
