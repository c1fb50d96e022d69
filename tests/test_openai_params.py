"""The HTTP edge in-process, on a real socket, over a fake AsyncLLM: what reaches
``AsyncLLM.generate`` (SamplingParams, structured outputs, trace context) and how failures
become HTTP statuses and stream events. No engine, no model."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from frontend_service.admission import RequestFailedError
from frontend_service.engine_client import EngineUnavailableError
from frontend_service.openai.app import FrontendView
from frontend_service.openai.server import HttpServer
from frontend_service.outputs import CompletionOutput, RequestOutput, RequestUsage
from tandem.protocol.outputs import ErrorCode, RequestError
from tandem.protocol.sampling_params import RequestOutputKind, SamplingDefaults, SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _output(text: str, finished: bool, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", "prompt", [1, 2, 3], [CompletionOutput(0, text, [7], finish_reason=reason)],
                         finished, usage=RequestUsage(3, 1))


@dataclass
class FakeLLM:
    """Records each generate() call; ``script`` gives what it yields (or raises)."""

    script: Callable[[], list[RequestOutput | BaseException]] = lambda: [_output("hi", True, "stop")]
    calls: list[tuple[SamplingParams, dict[str, Any]]] = field(default_factory=list)
    tokenizer: Any = None
    # No LoRA adapters: every model name but the served one is unknown.
    loras: Any = field(default_factory=lambda: SimpleNamespace(get=lambda name: None, by_name={}))
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # the model's own settings

    async def generate(self, params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        self.calls.append((params, kwargs))
        for item in self.script():
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass
class FakeServicer:
    llm: Any
    model_name: str = "m"
    info: Any = None
    draining: bool = False


def run(servicer: FakeServicer, *requests: tuple[str, dict[str, Any], dict[str, str]]) -> list[tuple[int, bytes, dict[str, str]]]:
    """Serve on a free port in this loop; send ``requests`` (path, body, headers) from a thread."""

    def post(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **headers})
            reply = conn.getresponse()
            return reply.status, reply.read(), {k.lower(): v for k, v in reply.getheaders()}
        finally:
            conn.close()

    async def main() -> list[tuple[int, bytes, dict[str, str]]]:
        view = FrontendView(servicer, "/models/m", lambda: servicer.llm is not None and not servicer.draining)
        server = HttpServer(view, "127.0.0.1", 0)
        server.start()
        try:
            return [await asyncio.to_thread(post, server.port, *r) for r in requests]
        finally:
            await server.stop(1)

    return asyncio.run(main())


def completion(**body: Any) -> tuple[str, dict[str, Any], dict[str, str]]:
    return "/v1/completions", {"model": "m", "prompt": "p", **body}, {}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("body", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, StructuredOutputsParams(grammar="root ::= \"a\"")),
    ({"structured_outputs": {"structural_tag": {"k": 1}}}, StructuredOutputsParams(structural_tag='{"k": 1}')),
])
def test_structured_outputs_reach_generate(body: dict[str, Any], expected: StructuredOutputsParams | None) -> None:
    llm = FakeLLM()
    (status, reply, _), = run(FakeServicer(llm), completion(**body))
    assert status == 200, reply
    assert llm.calls[0][0].structured_outputs == expected


def test_the_model_s_sampling_defaults_fill_what_a_request_leaves_unset() -> None:
    llm = FakeLLM(sampling_defaults=SamplingDefaults(temperature=0.0, top_k=20))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    run(FakeServicer(llm), ("/v1/chat/completions", body, {}))
    run(FakeServicer(llm), ("/v1/chat/completions", {**body, "temperature": 0.7, "top_k": 3}, {}))
    (unset, _), (given, _) = llm.calls
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.0, 20, 1.0)
    assert (given.temperature, given.top_k) == (0.7, 3)


def test_sampling_params_and_context_reach_generate() -> None:
    llm = FakeLLM()
    chat = ("/v1/chat/completions", {
        "model": "/models/m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "stop": "x", "logit_bias": {"5": -2},
        "logprobs": True, "top_logprobs": 3, "priority": 2, "cache_salt": "s", "seed": 1,
        "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "stream": True,
    }, {"traceparent": TRACEPARENT})
    (status, reply, headers), = run(FakeServicer(llm), chat)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), reply
    params, kwargs = llm.calls[0]
    assert (params.max_tokens, params.stop, params.logit_bias, params.logprobs) == (7, ["x"], {5: -2.0}, 3)
    assert (params.seed, params.top_k, params.min_p, params.repetition_penalty) == (1, 4, 0.1, 1.2)
    assert params.output_kind == RequestOutputKind.DELTA
    assert kwargs["messages"] == [{"role": "user", "content": "hi"}]
    assert (kwargs["priority"], kwargs["cache_salt"]) == (2, "s")
    assert kwargs["trace_headers"] == {"traceparent": TRACEPARENT}
    events = reply.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    (status, _, _), = run(FakeServicer(llm), completion())
    assert llm.calls[-1][0].output_kind == RequestOutputKind.FINAL_ONLY and llm.calls[-1][0].max_tokens == 16


@pytest.mark.parametrize(("exc", "status"), [
    (RequestFailedError(RequestError(ErrorCode.RESOURCE_EXHAUSTED, "full", retry_after_ms=2500)), 429),
    (RequestFailedError(RequestError(ErrorCode.DEADLINE_EXCEEDED, "late")), 504),
    (RequestFailedError(RequestError(ErrorCode.INTERNAL, "boom")), 500),
    (EngineUnavailableError("no engine"), 503),
])
@pytest.mark.parametrize("stream", [False, True])
def test_failures_before_output_keep_their_status(exc: BaseException, status: int, stream: bool) -> None:
    (got, reply, headers), = run(FakeServicer(FakeLLM(lambda: [exc])), completion(stream=stream))
    assert got == status, reply
    error = json.loads(reply)["error"]
    assert error["code"] == status and str(exc) in error["message"]
    if status == 429:
        assert headers["retry-after"] == "3"


def test_failure_mid_stream_is_an_error_event() -> None:
    failure = RequestFailedError(RequestError(ErrorCode.INTERNAL, "engine died"))
    llm = FakeLLM(lambda: [_output("a", False), failure])
    (status, reply, _), = run(FakeServicer(llm), completion(stream=True))
    events = [e for e in reply.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == "engine died"
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "a"


def test_not_ready_and_draining_are_503() -> None:
    (status, reply, _), = run(FakeServicer(None), completion())
    assert status == 503, reply
    (status, reply, _), = run(FakeServicer(FakeLLM(), draining=True), completion())
    assert status == 503 and b"draining" in reply
