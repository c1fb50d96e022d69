"""Disaggregated prefill and decode on the frontend (``--disaggregated``).

A new request goes first to a producer engine (GetEngineInfoResponse.kv_role
"producer" or "both") as a prefill: max_tokens 1 and ``do_remote_decode``. Its first
token streams to the caller as usual; its last output (FINISH_REASON_LENGTH, with
``kv_transfer_params``) does not end the stream: the request continues on a consumer
engine ("consumer" or "both") as a continuation (request migration's form: the first
token as ``generated_token_ids``) carrying those params, and the consumer pulls the KV
instead of computing the prompt. With no producer or no consumer serving, requests are
served aggregated; a prefill that fails or whose engine dies moves on as any request
does (the stream keeps the original request, not the prefill).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from frontend_service.admission import RequestFailedError
from frontend_service.errors import EngineUnavailableError
from frontend_service.migration import continuation
from frontend_service.streams import Stream, StreamTable, send
from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.outputs import EngineCoreOutput, EngineCoreRequest, FinishReason

if TYPE_CHECKING:
    from frontend_service.engine_client import EngineConnection
    from frontend_service.engine_group import EngineGroup
    from frontend_service.input_processor import ProcessedRequest
    from frontend_service.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

PRODUCERS = ("producer", "both")
CONSUMERS = ("consumer", "both")


def add_disaggregated_cli(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disaggregated",
        action="store_true",
        default=os.environ.get("TANDEM_DISAGGREGATED", "0").lower() in ("1", "true", "yes", "on"),
        help="Disaggregated prefill and decode: run each request's prefill on an engine started "
        "with --kv-role producer (or both) and its decode on one with --kv-role consumer (or "
        "both), which pulls the KV; with no producer or no consumer serving, requests are served "
        "aggregated (env TANDEM_DISAGGREGATED; default off).",
    )


def prefill_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """The producer's part of ``request``: its first token, the KV held afterwards."""
    params = request.sampling_params
    first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    return dataclasses.replace(
        request, sampling_params=first, kv_transfer_params=KvTransferParams(do_remote_decode=True)
    )


class DisaggregatedPrefill:
    """Runs a request's prefill on a producer and hands it to a consumer to decode.

    Given whether it is on, the engine group (producers and consumers), the live streams
    (a prefilled stream is found by engine request id and moved) and the output
    processor (the first token, which the decode continues after).
    """

    def __init__(
        self, enabled: bool, engines: EngineGroup, streams: StreamTable, output_processor: OutputProcessor
    ) -> None:
        self.enabled = enabled
        self._engines = engines
        self._streams = streams
        self._output_processor = output_processor
        # Engine request id -> the producer engine running its prefill now.
        self._prefilling: dict[str, EngineConnection] = {}

    @property
    def in_progress(self) -> bool:
        """Whether some prefill runs now (an engine step may finish one)."""
        return bool(self._prefilling)

    def engine_for(self, processed: ProcessedRequest) -> EngineConnection | None:
        """The producer for this request's prefill; None: serve it aggregated."""
        if not self.enabled or len(processed.engine_requests) != 1:
            return None
        request = processed.engine_requests[0]
        max_tokens = request.sampling_params.max_tokens
        if (
            request.pooling_params is not None
            or request.resumable
            or (max_tokens is not None and max_tokens <= 1)
        ):
            return None
        try:
            self._engines.pick(request, kv_roles=CONSUMERS)  # someone must take it over
            return self._engines.pick(request, kv_roles=PRODUCERS)
        except EngineUnavailableError:
            return None

    def send(self, stream: Stream, engine: EngineConnection) -> None:
        """Place the prefill of ``stream``'s one request on the producer ``engine``."""
        request = stream.requests[0]
        self._prefilling[request.request_id] = engine
        send(stream, engine, [prefill_request(request)])

    def forget(self, stream: Stream) -> None:
        """``stream`` is no longer tracked: drop its prefills."""
        for rid in stream.engine_request_ids:
            self._prefilling.pop(rid, None)

    def take_finished(
        self, engine: EngineConnection, outputs: list[EngineCoreOutput]
    ) -> list[tuple[str, KvTransferParams | None]]:
        """The prefills among ``outputs`` that ended at max_tokens on their producer: their
        finish is taken off (the stream goes on); returns (request id, params) each."""
        done = []
        for out in outputs:
            if out.finish_reason is None or self._prefilling.get(out.request_id) is not engine:
                continue
            del self._prefilling[out.request_id]
            if out.finish_reason == FinishReason.LENGTH:
                out.finish_reason = None
                done.append((out.request_id, out.kv_transfer_params))
                out.kv_transfer_params = None
        return done

    def hand_off(
        self, producer: EngineConnection, request_id: str, params: KvTransferParams | None
    ) -> None:
        """Continue a prefilled request on a consumer, with the producer's params."""
        found = self._streams.find(request_id)
        if found is None:
            return
        internal_id, stream = found
        if stream.finished or stream.engine is not producer:
            return
        request = stream.requests[0]
        generated = self._output_processor.generated_token_ids(request_id)
        if generated is None:  # finished meanwhile (a stop string in its first token)
            return
        decode = continuation(request, generated)
        decode.kv_transfer_params = params
        target = self._consumer_for(request, producer)
        if target is None:
            self._streams.fail(
                internal_id, stream, EngineUnavailableError("no engine left to decode the request")
            )
            return
        stream.engine = target
        try:
            send(stream, target, [decode])
        except (RequestFailedError, EngineUnavailableError) as exc:
            self._streams.fail(internal_id, stream, exc)

    def _consumer_for(
        self, request: EngineCoreRequest, producer: EngineConnection
    ) -> EngineConnection | None:
        """A consumer other than the producer, else any consumer, else any engine (which
        computes the prompt itself)."""
        for exclude in ([producer], []):
            try:
                return self._engines.pick(request, exclude=exclude, kv_roles=CONSUMERS)
            except EngineUnavailableError:
                continue
        try:
            return self._engines.pick(request)
        except EngineUnavailableError:
            return None
