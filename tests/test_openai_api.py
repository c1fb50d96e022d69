"""The OpenAI-compatible HTTP API, end to end: the official ``openai`` SDK against
``tandem serve --http-port P`` over a real socket (one server for the module).

Structured output: response_format / structured_outputs reach the engine request
(``test_openai_params.py`` checks the SamplingParams AsyncLLM gets) and the text that
finishes with ``stop`` obeys them (the engine's side is tested in
``test_structured_output.py``).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import ENGINE_ARGS, START_TIMEOUT, ServiceProcess, free_port, start_frontend

pytest_plugins = ["tests.e2e_helpers"]
pytestmark = pytest.mark.timeout(180)

PROMPT = "The quick brown fox jumps over"
LONG = {"max_tokens": 1000, "temperature": 0.0, "stream": True, "extra_body": {"ignore_eos": True}}


class Server:
    def __init__(self, proc: ServiceProcess, grpc_port: int, http_port: int, engine: str, model: str) -> None:
        self.proc = proc
        self.grpc_address = f"127.0.0.1:{grpc_port}"
        self.http_port = http_port
        self.engine = engine
        self.model_dir = model
        self.base_url = f"http://127.0.0.1:{http_port}/v1"

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", timeout=60, **kwargs)  # type: ignore[arg-type]

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, reply.read().decode()
        finally:
            conn.close()

    def post(self, path: str, body: dict[str, object]) -> tuple[int, dict[str, object], dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read()), dict(reply.getheaders())
        finally:
            conn.close()

    def engine_busy(self) -> int:
        with grpc.insecure_channel(self.engine) as channel:
            info = engine_pb2_grpc.EngineCoreStub(channel).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=10
            )
        return info.num_running_reqs + info.num_waiting_reqs

    def metric(self, name: str, labels: str = "") -> float:
        _, text = self.get("/metrics")
        pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+]+)"
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port, engine_port, http_port = free_port(), free_port(), free_port()
    args = [
        "serve", "--model", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(port),
        "--engine-base-port", str(engine_port), "--metrics-port", "0", "--engine-metrics-base-port", "0",
        "--http-port", str(http_port), "--admin-port", "0", "--", *ENGINE_ARGS,
    ]
    proc = ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", tmp_path_factory.mktemp("openai_api"))
    try:
        proc.wait_serving(START_TIMEOUT)
        yield Server(proc, port, http_port, f"127.0.0.1:{engine_port}", tiny_llama_dir)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def wait_idle(server: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.engine_busy():
        assert time.monotonic() < deadline, "the engine still runs requests"
        time.sleep(0.05)


# ---- the service endpoints --------------------------------------------------------------------


def test_models_health_metrics(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [Path(server.model_dir).name]
    assert server.get("/health")[0] == 200
    status, text = server.get("/metrics")
    assert status == 200 and "tandem:request_success_total" in text


def test_tokenize_detokenize(server: Server, model: str) -> None:
    status, body, _ = server.post("/tokenize", {"model": model, "prompt": PROMPT})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0  # type: ignore[arg-type]
    assert body["max_model_len"] == 1024
    status, back, _ = server.post("/detokenize", {"model": model, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT
    status, chat, _ = server.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chat["count"] > 1  # type: ignore[operator]
    status, err, _ = server.post("/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens[0]"  # type: ignore[index]


# ---- completions ---------------------------------------------------------------------------


def test_completion_matches_grpc_generate(server: Server, client: openai.OpenAI, model: str) -> None:
    """Greedy: the HTTP edge adds nothing to what gRPC Generate gives for the same prompt."""
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with grpc.insecure_channel(server.grpc_address) as channel:
        responses = list(frontend_pb2_grpc.GenerationStub(channel).Generate(
            frontend_pb2.GenerateRequest(prompt=PROMPT, sampling_params=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=16, ignore_eos=True, output_kind=common_pb2.OUTPUT_KIND_DELTA,
            )), timeout=60,
        ))
    text = "".join(o.text for r in responses for o in r.outputs)
    ids = [t for r in responses for o in r.outputs for t in o.token_ids]
    choice = reply.choices[0]
    assert (choice.text, choice.token_ids) == (text, ids)  # type: ignore[attr-defined]
    assert reply.prompt_token_ids == list(responses[0].prompt_token_ids)  # type: ignore[attr-defined]
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion" and reply.model == model
    assert choice.finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.completion_tokens, reply.usage.prompt_tokens) == (16, len(responses[0].prompt_token_ids))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16


def test_completion_stream_n2_usage_logprobs(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=0.8, seed=7, logprobs=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion"
        for c in chunk.choices:
            texts[c.index] += c.text
            assert c.logprobs is not None and len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
            assert all(len(top) >= 1 for top in c.logprobs.top_logprobs)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"} and all(texts.values())
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 16


def test_completion_prompt_forms_and_echo(client: openai.OpenAI, model: str) -> None:
    ids = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"return_token_ids": True}).prompt_token_ids  # type: ignore[attr-defined]
    reply = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0,
                                      n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]  # prompt p, sample i: p * n + i
    by_index = {c.index: c.text for c in reply.choices}
    as_ids = client.completions.create(model=model, prompt=[ids, ids], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in as_ids.choices] == [by_index[0]] * 2  # the same prompt as ids, greedy
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(PROMPT)
    assert lp is not None and lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 2
    assert lp.text_offset == sorted(lp.text_offset)


def test_stop_and_seed(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    start = next(i for i in range(2, len(free) - 2) if "\ufffd" not in free[i:i + 2])
    stop = free[start:start + 2]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert free.startswith(stopped.choices[0].text)
    runs = [client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=1234,
                                      extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_extra_body_fields(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0.7, seed=3,
        extra_body={"top_k": 5, "min_p": 0.01, "min_tokens": 6, "repetition_penalty": 1.1,
                    "return_token_ids": True, "skip_special_tokens": True, "priority": 0,
                    "cache_salt": "salt", "stop_token_ids": [2], "some_unknown_field": 1},
        logit_bias={"5": 1.0}, presence_penalty=0.5, frequency_penalty=0.5, user="me",
    )
    assert len(reply.choices[0].token_ids) == 6  # type: ignore[attr-defined]  # min_tokens == max_tokens


@pytest.mark.parametrize("response_format", [
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
])
def test_response_format_accepted(client: openai.OpenAI, model: str, response_format: dict) -> None:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}],
                                           max_tokens=4, response_format=response_format)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason in ("stop", "length")


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 1, "maximum": 50}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_is_obeyed(client: openai.OpenAI, model: str, stream: bool) -> None:
    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": SCHEMA}}
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": "A person, as JSON"}], max_tokens=96, n=2,
        temperature=0.8, seed=5, response_format=response_format,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},  # compact JSON
    )
    texts, reasons = ["", ""], ["", ""]
    if stream:
        for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    else:
        reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        for choice in reply.choices:
            texts[choice.index], reasons[choice.index] = choice.message.content or "", choice.finish_reason
    assert reasons == ["stop", "stop"], (reasons, texts)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_structured_outputs_extra_field(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="Pick one:", max_tokens=16, temperature=1.0, n=4,
                                      extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c.text for c in reply.choices} <= {"red", "green", "blue"}
    assert all(c.finish_reason == "stop" for c in reply.choices)
    reply = client.completions.create(model=model, prompt="Code:", max_tokens=16, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", reply.choices[0].text)
    with pytest.raises(openai.BadRequestError, match=re.escape("structured_outputs.regex")):
        client.completions.create(model=model, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    with pytest.raises(openai.BadRequestError, match=re.escape("structured_outputs.json")):
        client.completions.create(model=model, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"json": "{not json"}})
    # The engine's compile error arrives before a stream's first output: still a 400.
    with pytest.raises(openai.BadRequestError, match=re.escape("structured_outputs.grammar")):
        client.completions.create(model=model, prompt="x", max_tokens=4, stream=True,
                                  extra_body={"structured_outputs": {"grammar": "root ::= ("}}).close()


# ---- chat ----------------------------------------------------------------------------------


def test_chat(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8,  # type: ignore[arg-type]
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    message = reply.choices[0].message
    assert message.role == "assistant" and message.content
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    stream = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True, n=2,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert all(c.object == "chat.completion.chunk" for c in stream)
    roles = [c.choices[0] for c in stream[:2]]
    assert [(r.index, r.delta.role) for r in roles] == [(0, "assistant"), (1, "assistant")]
    texts = {0: "", 1: ""}
    for chunk in stream[2:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] == message.content  # greedy: both samples and the non-streamed one agree
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 16  # type: ignore[union-attr]


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format.type"),
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format.json_schema"),
    ({"extra_body": {"structured_outputs": {"regex": "a+", "choice": ["a"]}}}, "structured_outputs"),
    ({"n": "two"}, "n"),
    ({"stream": True, "temperature": -1}, "temperature"),
])
def test_bad_request_names_the_field(client: openai.OpenAI, model: str, kwargs: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        result = client.completions.create(model=model, prompt=PROMPT, **kwargs)
        list(result)  # type: ignore[call-overload]  # a stream raises on its first read
    assert info.value.status_code == 400
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == field, error
    assert field.split(".")[0] in error["message"]


def test_unknown_model_is_404(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
    # The checkpoint path is a name of the model too.
    assert client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=1).choices


def _open_stream(port: int, body: dict[str, object]) -> socket.socket:
    """POST a streaming request and read until its first event."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    seen = b""
    while b"data: " not in seen:
        part = sock.recv(65536)
        assert part, seen
        seen += part
    assert seen.startswith(b"HTTP/1.1 200"), seen
    return sock


def test_disconnect_aborts_the_request(server: Server, model: str) -> None:
    wait_idle(server)
    aborted = server.metric("tandem:request_success_total", 'finished_reason="abort"')
    body = {"model": model, "prompt": "Tell me a long story", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sock = _open_stream(server.http_port, body)
    assert server.engine_busy() == 1
    sock.close()
    wait_idle(server, timeout=5)
    assert server.metric("tandem:request_success_total", 'finished_reason="abort"') == aborted + 1
    # A non-streaming request whose client leaves is aborted too.
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    data = json.dumps({**body, "stream": False}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    deadline = time.monotonic() + 10
    while not server.engine_busy():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    wait_idle(server, timeout=5)
    assert server.metric("tandem:request_success_total", 'finished_reason="abort"') == aborted + 2


def test_admission_refusal_is_429(server: Server, tmp_path: Path) -> None:
    """A frontend over its --max-pending-requests answers 429 with Retry-After."""
    http_port = free_port()
    frontend = start_frontend(server.model_dir, [server.engine], tmp_path, http_port=http_port,
                              env={"TANDEM_MAX_PENDING_REQUESTS": "1"})
    try:
        frontend.wait_serving()
        busy = Server(frontend, 0, http_port, server.engine, server.model_dir)
        sock = _open_stream(http_port, {"prompt": "Tell me a long story", "max_tokens": 1000,
                                        "temperature": 0, "ignore_eos": True, "stream": True})
        try:
            status, body, headers = busy.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
            assert status == 429 and int(headers["retry-after"]) >= 1, (status, body)
            with pytest.raises(openai.RateLimitError):
                busy.client(max_retries=0).completions.create(
                    model=Path(server.model_dir).name, prompt=PROMPT, max_tokens=1
                )
        finally:
            sock.close()
    finally:
        frontend.stop()
    wait_idle(server)


def test_embeddings(client: openai.OpenAI, model: str) -> None:
    import math

    reply = client.embeddings.create(model=model, input=["the quick brown fox", "a lazy dog"])
    assert [d.index for d in reply.data] == [0, 1]
    for d in reply.data:
        assert len(d.embedding) == 64 and abs(math.sqrt(sum(v * v for v in d.embedding)) - 1) < 1e-4
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    # float and base64 (little-endian float32) carry the same vector.
    import base64
    import struct

    ids = client.embeddings.create(model=model, input=[5, 6, 7, 8], dimensions=16, encoding_format="float")
    b64 = client.embeddings.create(model=model, input=[5, 6, 7, 8], dimensions=16, encoding_format="base64")
    assert len(ids.data[0].embedding) == 16
    decoded = struct.unpack("<16f", base64.b64decode(b64.data[0].embedding))  # type: ignore[arg-type]
    assert ids.data[0].embedding == pytest.approx(list(decoded), abs=1e-6)
    mean = client.embeddings.create(model=model, input="x y z", extra_body={"pooling_type": "MEAN", "normalize": False})
    assert abs(math.sqrt(sum(v * v for v in mean.data[0].embedding)) - 1) > 1e-3
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=1000)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
