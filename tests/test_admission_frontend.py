"""Frontend admission, engine errors and deadlines in AsyncLLM, without engine services."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from frontend_service.admission import PendingLimit, RequestFailedError
from frontend_service.async_llm import AsyncLLM
from frontend_service.engine_client import EngineUnavailableError
from frontend_service.errors import RETRY_PUSHBACK_KEY, status_for, trailing_metadata_for
from frontend_service.input_processor import InputProcessor
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
)
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams


class FakeEngine:
    """Stands in for an EngineConnection: records what AsyncLLM sends."""

    def __init__(self, name: str) -> None:
        self.name = self.address = name
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


class FakeGroup:
    """Picks engines in list order, as EngineGroup.pick does with equal loads."""

    def __init__(self, *engines: FakeEngine) -> None:
        self.engines = list(engines)

    def pick(self, request: object = None, exclude: Collection[FakeEngine] = ()) -> FakeEngine:
        for engine in self.engines:
            if engine not in exclude:
                return engine
        raise EngineUnavailableError("no engine is available")


def _llm(tokenizer: Any, group: FakeGroup, admission: PendingLimit | None = None) -> AsyncLLM:
    processor = InputProcessor(tokenizer, 512, len(tokenizer), 5, tokenizer.eos_token_id)
    return AsyncLLM(tokenizer, group, processor, admission=admission)  # type: ignore[arg-type]


def _error(request_id: str, code: ErrorCode, retry_after_ms: int = 0) -> EngineCoreOutputs:
    error = RequestError(code, f"{code.name} from the engine", retry_after_ms)
    out = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=error)
    return EngineCoreOutputs(outputs=[out])


def _token(request_id: str, token: int, finish: FinishReason | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [token], finish_reason=finish)])


async def _started(stream: Any) -> asyncio.Future[Any]:
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the request reaches the (fake) engine
    return first


def test_resource_exhausted_before_any_token_moves_to_the_next_engine(tokenizer: Any) -> None:
    async def scenario() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        llm = _llm(tokenizer, FakeGroup(a, b))
        params = SamplingParams(max_tokens=2, n=2, output_kind=RequestOutputKind.FINAL_ONLY)
        stream = llm.generate(params, prompt_token_ids=[5, 6], timeout_s=30.0)
        first = await _started(stream)
        assert len(a.added) == 2 and b.added == []
        refused, admitted = a.added
        llm.on_engine_outputs(a, _error(refused.request_id, ErrorCode.RESOURCE_EXHAUSTED, 80))  # type: ignore[arg-type]
        # Both samples go to b, the admitted one is aborted on a, with the time left.
        assert [r.request_id for r in b.added] == [refused.request_id, admitted.request_id]
        assert admitted.request_id in a.aborted
        assert all(r.timeout_s is not None and 0 < r.timeout_s <= 30.0 for r in b.added)
        # A late output from a (the abort raced a step) is dropped.
        llm.on_engine_outputs(a, _token(admitted.request_id, 40, FinishReason.ABORT))  # type: ignore[arg-type]
        for r in b.added:
            llm.on_engine_outputs(b, _token(r.request_id, 41))  # type: ignore[arg-type]
            llm.on_engine_outputs(b, _token(r.request_id, 42, FinishReason.LENGTH))  # type: ignore[arg-type]
        outs = [await first] + [o async for o in stream]
        assert len(outs) == 1 and outs[0].finished
        assert [(c.token_ids, c.finish_reason) for c in outs[0].outputs] == [([41, 42], "length")] * 2

    asyncio.run(scenario())


def test_resource_exhausted_everywhere_reaches_the_caller_with_the_hint(tokenizer: Any) -> None:
    async def scenario() -> RequestFailedError:
        a, b = FakeEngine("a"), FakeEngine("b")
        llm = _llm(tokenizer, FakeGroup(a, b))
        stream = llm.generate(SamplingParams(max_tokens=2), prompt_token_ids=[5, 6])
        first = await _started(stream)
        llm.on_engine_outputs(a, _error(a.added[0].request_id, ErrorCode.RESOURCE_EXHAUSTED, 80))  # type: ignore[arg-type]
        llm.on_engine_outputs(b, _error(b.added[0].request_id, ErrorCode.RESOURCE_EXHAUSTED, 120))  # type: ignore[arg-type]
        with pytest.raises(RequestFailedError) as info:
            await first
        assert llm.streams.by_id == {} and llm.num_unfinished == 0
        return info.value

    exc = asyncio.run(scenario())
    assert exc.code == ErrorCode.RESOURCE_EXHAUSTED and exc.error.retry_after_ms == 120
    assert status_for(exc)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_no_second_engine_after_tokens_arrived(tokenizer: Any) -> None:
    async def scenario() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        llm = _llm(tokenizer, FakeGroup(a, b))
        stream = llm.generate(SamplingParams(max_tokens=4), prompt_token_ids=[5, 6])
        first = await _started(stream)
        rid = a.added[0].request_id
        llm.on_engine_outputs(a, _token(rid, 40))  # type: ignore[arg-type]
        await first
        llm.on_engine_outputs(a, _error(rid, ErrorCode.DEADLINE_EXCEEDED))  # type: ignore[arg-type]
        with pytest.raises(RequestFailedError) as info:
            await stream.__anext__()
        assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert b.added == []

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
        (ErrorCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
        (ErrorCode.INTERNAL, grpc.StatusCode.INTERNAL),
        (ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_engine_error_codes_map_to_the_client_status(code: ErrorCode, status: grpc.StatusCode) -> None:
    exc = RequestFailedError(RequestError(code, "why"))
    assert status_for(exc) == (status, "why")


def test_retry_hint_travels_as_retry_info_and_pushback_trailer() -> None:
    metadata = dict(trailing_metadata_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", 1250))
    assert metadata[RETRY_PUSHBACK_KEY] == "1250"
    status = status_pb2.Status.FromString(metadata["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and status.message == "full"
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() == 1250


def test_frontend_bound_refuses_without_contacting_an_engine(tokenizer: Any) -> None:
    async def scenario() -> None:
        a = FakeEngine("a")
        llm = _llm(tokenizer, FakeGroup(a), PendingLimit(1))
        held = llm.generate(SamplingParams(max_tokens=1), prompt_token_ids=[5])
        first = await _started(held)
        refused = llm.generate(SamplingParams(max_tokens=1), prompt_token_ids=[6])
        with pytest.raises(RequestFailedError) as info:
            await refused.__anext__()
        assert info.value.code == ErrorCode.RESOURCE_EXHAUSTED
        assert info.value.error.retry_after_ms > 0 and "max_pending_requests=1" in str(info.value)
        assert len(a.added) == 1
        llm.on_engine_outputs(a, _token(a.added[0].request_id, 7, FinishReason.LENGTH))  # type: ignore[arg-type]
        await first
        assert [o async for o in held] == []
        # The slot is free again.
        again = llm.generate(SamplingParams(max_tokens=1), prompt_token_ids=[6])
        pending = await _started(again)
        assert len(a.added) == 2
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert llm.admission is not None and llm.admission.pending == 0

    asyncio.run(scenario())


def test_a_deadline_already_passed_never_reaches_an_engine(tokenizer: Any) -> None:
    async def scenario() -> None:
        a = FakeEngine("a")
        llm = _llm(tokenizer, FakeGroup(a))
        stream = llm.generate(SamplingParams(max_tokens=1), prompt_token_ids=[5], timeout_s=0.0)
        with pytest.raises(RequestFailedError) as info:
            await stream.__anext__()
        assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert a.added == []

    asyncio.run(scenario())
