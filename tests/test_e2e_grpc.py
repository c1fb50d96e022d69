"""End to end over gRPC: real engine and frontend processes, a Python gRPC client.

Most tests share one stack (2 engines + frontend on the tiny Llama, ``e2e_stack``);
the tests that kill an engine or start a frontend with no engine start their own.
Engine-side state is checked through each engine's own ``GetEngineInfo``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from transformers import AutoTokenizer

from frontend_service import LLM, SamplingParams
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ENGINE_ARGS,
    START_TIMEOUT,
    ServiceProcess,
    Stack,
    engine_cached_tokens,
    free_port,
    spawn_python,
    start_frontend,
    start_stack,
)
from tests.factories import hf_greedy

pytest_plugins = ["tests.e2e_helpers"]
pytestmark = pytest.mark.timeout(180)

DELTA = common_pb2.OUTPUT_KIND_DELTA
CUMULATIVE = common_pb2.OUTPUT_KIND_CUMULATIVE
FINAL_ONLY = common_pb2.OUTPUT_KIND_FINAL_ONLY
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

PROMPT_IDS = [1, 17, 250, 999, 42, 7, 512, 300, 64]
PROMPT_TEXT = "The quick brown fox jumps over"
MAX_TOKENS = 32
LONG_TOKENS = 1000  # ~max_model_len: runs for >1 s, far longer than a cancel takes
CALL_TIMEOUT = 60.0

IDLE_SECONDS = 45  # > 3 keepalive pings of the frontend's engine channels
# When the shared stack last carried a request (see test_engine_streams_survive_idle_pings).
_last_shared_use = [time.monotonic()]


# ---- helpers -----------------------------------------------------------------------


def params(kind: int = DELTA, **kwargs: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(output_kind=kind, **kwargs)  # type: ignore[arg-type]


def greedy(max_tokens: int, kind: int = DELTA, **kwargs: object) -> common_pb2.SamplingParams:
    return params(kind, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(
    stub: frontend_pb2_grpc.GenerationStub, request: frontend_pb2.GenerateRequest
) -> list[frontend_pb2.GenerateResponse]:
    """All responses of one Generate call; checks the stream's framing."""
    responses = list(stub.Generate(request, timeout=CALL_TIMEOUT))
    _last_shared_use[0] = time.monotonic()
    assert responses, "the stream ended without a response"
    assert responses[-1].finished
    assert not any(r.finished for r in responses[:-1])
    assert responses[0].prompt_token_ids
    assert not any(r.prompt_token_ids for r in responses[1:])
    return responses


def joined(responses: list[frontend_pb2.GenerateResponse], index: int = 0) -> tuple[str, list[int]]:
    """Concatenated text and token ids of completion ``index`` of a DELTA stream."""
    text, ids = "", []
    for response in responses:
        for out in response.outputs:
            if out.index == index:
                text += out.text
                ids += out.token_ids
    return text, ids


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    return info.value


def long_request(prompt: str = "Tell me a long story") -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=greedy(LONG_TOKENS))


# ---- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def stub(e2e_stack: Stack) -> frontend_pb2_grpc.GenerationStub:
    return e2e_stack.generation_stub()


@pytest.fixture(scope="module")
def offline_llm(tiny_llama_dir: str) -> Iterator[LLM]:
    llm = LLM(tiny_llama_dir, max_model_len=1024, kv_cache_memory_bytes=20_000_000)
    yield llm
    del llm


# ---- 1. parity with the offline LLM and with Hugging Face ------------------------------


def test_greedy_stream_matches_offline_llm_and_hf(
    stub: frontend_pb2_grpc.GenerationStub, offline_llm: LLM, tokenizer, tiny_llama_dir: str
) -> None:
    requests = [
        frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=PROMPT_IDS), sampling_params=greedy(MAX_TOKENS)
        ),
        frontend_pb2.GenerateRequest(prompt=PROMPT_TEXT, sampling_params=greedy(MAX_TOKENS)),
    ]
    streamed = [run(stub, r) for r in requests]
    text_prompt_ids = tokenizer.encode(PROMPT_TEXT)  # with BOS, like the server's default
    assert list(streamed[0][0].prompt_token_ids) == PROMPT_IDS
    assert list(streamed[1][0].prompt_token_ids) == text_prompt_ids

    offline = offline_llm.generate(
        [{"prompt_token_ids": PROMPT_IDS}, PROMPT_TEXT],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    expected = hf_greedy(tiny_llama_dir, [PROMPT_IDS, text_prompt_ids], MAX_TOKENS)
    for responses, off, want in zip(streamed, offline, expected):
        assert len(responses) > 1  # really streamed
        text, ids = joined(responses)
        assert ids == want  # Hugging Face greedy generate()
        assert ids == list(off.outputs[0].token_ids)
        assert text == off.outputs[0].text
        assert responses[-1].outputs[0].finish_reason == "length"
        assert responses[-1].usage.completion_tokens == MAX_TOKENS
    assert len(set(expected[0])) > 4  # diverse enough for the comparison to bite


# ---- 2. output kinds, n > 1, chat ------------------------------------------------------


def test_output_kinds(stub: frontend_pb2_grpc.GenerationStub) -> None:
    def request(kind: int) -> frontend_pb2.GenerateRequest:
        return frontend_pb2.GenerateRequest(prompt="Once upon a time", sampling_params=greedy(24, kind))

    final_only = run(stub, request(FINAL_ONLY))
    assert len(final_only) == 1
    (final,) = final_only[0].outputs
    assert final.finish_reason == "length" and len(final.token_ids) == 24
    assert final_only[0].usage.completion_tokens == 24

    delta = run(stub, request(DELTA))
    assert len(delta) > 1
    assert joined(delta) == (final.text, list(final.token_ids))
    # A client that does not choose gets deltas too (OUTPUT_KIND_UNSPECIFIED).
    unset = run(stub, frontend_pb2.GenerateRequest(
        prompt="Once upon a time",
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ))
    assert len(unset) > 1
    assert joined(unset) == (final.text, list(final.token_ids))
    assert all(o.finish_reason == "" for r in delta[:-1] for o in r.outputs)
    assert delta[-1].outputs[0].finish_reason == "length"

    cumulative = run(stub, request(CUMULATIVE))
    assert len(cumulative) > 1
    prev_text, prev_ids = "", []
    for response in cumulative:
        (out,) = response.outputs
        assert out.text.startswith(prev_text)
        assert list(out.token_ids[: len(prev_ids)]) == prev_ids
        assert len(out.token_ids) > len(prev_ids)
        prev_text, prev_ids = out.text, list(out.token_ids)
    assert (prev_text, prev_ids) == (final.text, list(final.token_ids))


def test_stream_interval_sends_the_same_tokens_in_fewer_messages(
    e2e_stack: Stack, stub: frontend_pb2_grpc.GenerationStub, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # A second frontend on the same engines with --stream-interval 5 (set by env, as a
    # container would): DELTA and CUMULATIVE streams carry the first token at once,
    # then at least 5 new tokens a message, and end with the same text and tokens.
    spaced = start_frontend(e2e_stack.model_dir, [e.address for e in e2e_stack.engines], tmp_path,
                            name="frontend-interval", env={"TANDEM_STREAM_INTERVAL": "5"})
    try:
        spaced.wait_serving()
        with grpc.insecure_channel(spaced.address) as channel:
            spaced_stub = frontend_pb2_grpc.GenerationStub(channel)
            for kind in (DELTA, CUMULATIVE):
                request = frontend_pb2.GenerateRequest(prompt="Once upon a time", sampling_params=greedy(23, kind))
                every, fewer = run(stub, request), run(spaced_stub, request)
                counts = [len(r.outputs[0].token_ids) for r in fewer]
                if kind == CUMULATIVE:
                    assert fewer[-1].outputs[0] == every[-1].outputs[0]
                    counts = [b - a for a, b in zip([0, *counts], counts)]
                else:
                    assert joined(fewer) == joined(every)
                assert counts[0] == 1 and all(c >= 5 for c in counts[1:-1]) and sum(counts) == 23
                assert len(fewer) <= 1 + -(-22 // 5)  # the first token, then >= 5 a message
    finally:
        spaced.stop()
    e2e_stack.wait_engines_idle()


def test_detokenize_false_streams_token_ids_without_text(stub: frontend_pb2_grpc.GenerationStub) -> None:
    text = run(stub, frontend_pb2.GenerateRequest(prompt="Once upon a time", sampling_params=greedy(16, DELTA)))
    params = greedy(16, DELTA)
    params.detokenize = False
    ids_only = run(stub, frontend_pb2.GenerateRequest(prompt="Once upon a time", sampling_params=params))
    assert joined(ids_only) == ("", joined(text)[1])
    assert joined(text)[0]  # the same request with text has some
    assert ids_only[-1].outputs[0].finish_reason == "length"


def test_n3_seeded(stub: frontend_pb2_grpc.GenerationStub, offline_llm: LLM) -> None:
    def request(kind: int) -> frontend_pb2.GenerateRequest:
        sp = params(kind, n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
        return frontend_pb2.GenerateRequest(prompt=PROMPT_TEXT, sampling_params=sp)

    (final,) = run(stub, request(FINAL_ONLY))
    assert sorted(o.index for o in final.outputs) == [0, 1, 2]
    by_index = {o.index: (o.text, list(o.token_ids)) for o in final.outputs}
    assert all(len(ids) == 12 for _, ids in by_index.values())
    assert len({tuple(ids) for _, ids in by_index.values()}) > 1  # the children differ
    assert final.usage.completion_tokens == 36

    delta = run(stub, request(DELTA))  # seeded: the same three completions, streamed
    assert {i: joined(delta, i) for i in range(3)} == by_index

    (offline,) = offline_llm.generate(
        PROMPT_TEXT, SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    )
    assert {o.index: (o.text, list(o.token_ids)) for o in offline.outputs} == by_index


def test_unset_n_means_one_completion(stub: frontend_pb2_grpc.GenerationStub) -> None:
    (final,) = run(stub, frontend_pb2.GenerateRequest(prompt="Hi", sampling_params=greedy(3, FINAL_ONLY)))
    assert [o.index for o in final.outputs] == [0]


def test_chat_uses_chat_template(stub: frontend_pb2_grpc.GenerationStub, tokenizer, offline_llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello in two words."},
    ]
    request = frontend_pb2.GenerateRequest(
        chat=frontend_pb2.ChatMessages(messages=[frontend_pb2.ChatMessage(**m) for m in messages]),
        sampling_params=greedy(8),
    )
    responses = run(stub, request)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    assert list(responses[0].prompt_token_ids) == expected
    assert expected.count(tokenizer.bos_token_id) == 1  # the template's BOS, not a second one
    assert rendered.endswith("<|im_start|>assistant\n")
    (offline,) = offline_llm.generate(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert joined(responses)[1] == list(offline.outputs[0].token_ids)



def test_tokenization_flags_reach_the_prompt(stub: frontend_pb2_grpc.GenerationStub, tokenizer) -> None:
    """add_special_tokens / add_generation_prompt on Generate and Tokenize."""
    text = "Say hello."
    (first, *_) = run(stub, frontend_pb2.GenerateRequest(
        prompt=text, add_special_tokens=False, sampling_params=greedy(2)))
    assert list(first.prompt_token_ids) == tokenizer.encode(text, add_special_tokens=False)
    assert list(first.prompt_token_ids) != tokenizer.encode(text, add_special_tokens=True)

    messages = [{"role": "user", "content": text}]
    chat = frontend_pb2.ChatMessages(messages=[frontend_pb2.ChatMessage(**m) for m in messages])
    (first, *_) = run(stub, frontend_pb2.GenerateRequest(
        chat=chat, add_generation_prompt=False, sampling_params=greedy(2)))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert list(first.prompt_token_ids) == tokenizer.encode(rendered, add_special_tokens=False)
    tokenized = stub.Tokenize(frontend_pb2.TokenizeRequest(chat=chat, add_generation_prompt=False))
    assert list(tokenized.token_ids) == list(first.prompt_token_ids)



def test_generation_config_eos_ids_stop_a_request(stub: frontend_pb2_grpc.GenerationStub) -> None:
    """The test checkpoints list <|im_end|> as a second eos id in generation_config.json."""
    from engine_service.make_model import IM_END_ID

    forced = params(DELTA, temperature=0.0, max_tokens=5, allowed_token_ids=[IM_END_ID])
    responses = run(stub, frontend_pb2.GenerateRequest(prompt="Hi", sampling_params=forced))
    final = responses[-1].outputs[0]
    assert joined(responses)[1] == [IM_END_ID]
    assert (final.finish_reason, final.stop_token_id) == ("stop", IM_END_ID)
    forced.ignore_eos = True
    responses = run(stub, frontend_pb2.GenerateRequest(prompt="Hi", sampling_params=forced))
    assert joined(responses)[1] == [IM_END_ID] * 5
    assert responses[-1].outputs[0].finish_reason == "length"


# ---- 3. detokenization and stop strings ------------------------------------------------


def test_multibyte_detokenization(stub: frontend_pb2_grpc.GenerationStub, tokenizer) -> None:
    """Sample only the byte-level tokens of CJK characters and an emoji; the streamed
    deltas must add up to the tokenizer's decode of the ids, with no premature U+FFFD."""
    target = "你好🎉"
    allowed = sorted(set(tokenizer.encode(target, add_special_tokens=False)))
    assert any("\ufffd" in tokenizer.decode([t]) for t in allowed)  # some tokens are partial characters

    def request(kind: int) -> frontend_pb2.GenerateRequest:
        sp = params(kind, n=4, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
        return frontend_pb2.GenerateRequest(prompt="Greetings:", sampling_params=sp)

    delta = run(stub, request(DELTA))
    finals = {}
    for index in range(4):
        text, ids = joined(delta, index)
        assert len(ids) == 24 and set(ids) <= set(allowed)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert text == decoded
        for response in delta:
            for out in response.outputs:
                if out.index == index and "\ufffd" in out.text:
                    assert "\ufffd" in decoded
        finals[index] = (decoded, ids)
    # The run exercised what it is meant to: whole CJK / emoji characters assembled
    # from several tokens each (the seed makes this deterministic).
    all_text = "".join(text for text, _ in finals.values())
    assert "你" in all_text or "🎉" in all_text

    # Cumulative texts never take anything back.
    cumulative = run(stub, request(CUMULATIVE))
    for response in cumulative:
        for out in response.outputs:
            assert finals[out.index][0].startswith(out.text)
            assert finals[out.index][1][: len(out.token_ids)] == list(out.token_ids)


def test_stop_string_across_token_boundary(stub: frontend_pb2_grpc.GenerationStub, tokenizer) -> None:
    prompt = "Hello world"
    (first,) = run(stub, frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=greedy(48, FINAL_ONLY)))
    text, ids = first.outputs[0].text, list(first.outputs[0].token_ids)

    stop = ""
    start = -1
    for k in range(3, len(ids) - 2):  # boundary between token k-1 and token k
        before = tokenizer.decode(ids[:k], skip_special_tokens=True)
        after = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        b = len(before)
        if b < 2 or not text.startswith(after) or len(after) < b + 2:
            continue
        candidate = text[b - 2 : b + 2]
        if "\ufffd" in candidate or not candidate.strip() or text.find(candidate) != b - 2:
            continue
        stop, start = candidate, b - 2
        break
    assert stop, f"no stop string found in {text!r}"

    for include in (False, True):
        end = start + len(stop) if include else start
        sp = greedy(48, FINAL_ONLY, stop=[stop], include_stop_str_in_output=include)
        (final,) = run(stub, frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=sp))
        (out,) = final.outputs
        assert out.text == text[:end]
        assert out.finish_reason == "stop"
        assert out.WhichOneof("stop_reason") == "stop_str" and out.stop_str == stop
        assert list(out.token_ids) == ids[: len(out.token_ids)]
        assert len(out.token_ids) < len(ids)

        # Streamed, the held-back text never leaks the (partial) stop string.
        sp = greedy(48, DELTA, stop=[stop], include_stop_str_in_output=include)
        delta = run(stub, frontend_pb2.GenerateRequest(prompt=prompt, sampling_params=sp))
        assert joined(delta) == (out.text, list(out.token_ids))


# ---- 4. cancellation and disconnects free the engines ----------------------------------
#
# After the client goes away, every engine must be idle with all KV blocks free. That
# alone would also hold if the request had simply run to its end, so each test then
# probes the prefix cache of the engine that ran it: a request that ran to the end
# left ~LONG_TOKENS tokens of cached KV blocks, an aborted one only what it computed
# before the abort arrived.

LONG_PROMPT = "Tell me a long story"


@pytest.fixture(scope="module")
def long_run(e2e_stack: Stack, stub: frontend_pb2_grpc.GenerationStub) -> list[int]:
    """Prompt + greedy output of the long request run to its end; checks the probe."""
    responses = run(stub, long_request(LONG_PROMPT))
    ids = list(responses[0].prompt_token_ids) + joined(responses)[1]
    assert len(ids) > LONG_TOKENS
    e2e_stack.wait_engines_idle()
    # Probe check: one engine cached (nearly) the whole sequence.
    cached = [engine_cached_tokens(e.address, ids) for e in e2e_stack.engines]
    assert max(cached) >= len(ids) - 2 * 16, cached
    return ids


def _cancelled_early(stack: Stack, engine_index: int, ids: list[int]) -> None:
    stack.wait_engines_idle(timeout=30)
    cached = engine_cached_tokens(stack.engines[engine_index].address, ids)
    assert cached < len(ids) // 2, f"engine {engine_index} computed {cached} of {len(ids)} tokens"


def _running_engine(stack: Stack) -> int:
    running = [i.num_running_reqs for i in stack.engine_infos()]
    assert sorted(running) == [0, 1], running
    return running.index(1)


async def _stream_then(stack: Stack, how: str) -> int:
    channel = grpc.aio.insecure_channel(stack.address)
    try:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(long_request(LONG_PROMPT), timeout=CALL_TIMEOUT)
        first = await call.read()
        assert not first.finished
        engine_index = await asyncio.to_thread(_running_engine, stack)
        if how == "cancel":
            assert call.cancel()
            assert await call.code() == grpc.StatusCode.CANCELLED
        else:
            await channel.close()  # mid-stream: the server sees the connection go
        return engine_index
    finally:
        await channel.close()


@pytest.mark.parametrize("how", ["cancel", "close_channel"])
def test_client_cancel_frees_engine(e2e_stack: Stack, long_run: list[int], how: str) -> None:
    e2e_stack.wait_engines_idle()
    e2e_stack.reset_prefix_caches()
    engine_index = asyncio.run(_stream_then(e2e_stack, how))
    _last_shared_use[0] = time.monotonic()
    _cancelled_early(e2e_stack, engine_index, long_run)


CLIENT_SCRIPT = """
import sys, time, grpc
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
stub = frontend_pb2_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True,
                               output_kind=common_pb2.OUTPUT_KIND_DELTA)
for response in stub.Generate(frontend_pb2.GenerateRequest(prompt=sys.argv[2], sampling_params=sp)):
    print("streaming", flush=True)
    time.sleep(600)
"""


def test_killed_client_frees_engine(e2e_stack: Stack, long_run: list[int]) -> None:
    e2e_stack.wait_engines_idle()
    e2e_stack.reset_prefix_caches()
    proc = spawn_python(CLIENT_SCRIPT, e2e_stack.address, LONG_PROMPT, str(LONG_TOKENS))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.strip() == b"streaming", proc.stderr.read() if proc.poll() is not None else line
        engine_index = _running_engine(e2e_stack)
    finally:
        proc.kill()  # SIGKILL: the connection drops without a goodbye
        proc.wait(timeout=10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    _last_shared_use[0] = time.monotonic()
    _cancelled_early(e2e_stack, engine_index, long_run)


# ---- 5. bad input ----------------------------------------------------------------------


def _bad(mutate: Callable[[frontend_pb2.GenerateRequest], None]) -> frontend_pb2.GenerateRequest:
    request = frontend_pb2.GenerateRequest(prompt="Hello", sampling_params=greedy(4))
    mutate(request)
    return request


def _chat(*roles: str) -> Callable[[frontend_pb2.GenerateRequest], None]:
    def mutate(r: frontend_pb2.GenerateRequest) -> None:
        r.chat.SetInParent()
        for role in roles:
            r.chat.messages.add(role=role, content="hi")

    return mutate


def _set(field: str, value: object) -> Callable[[frontend_pb2.GenerateRequest], None]:
    return lambda r: setattr(r.sampling_params, field, value)


def _ids(ids: list[int]) -> Callable[[frontend_pb2.GenerateRequest], None]:
    return lambda r: r.prompt_token_ids.CopyFrom(frontend_pb2.TokenIds(token_ids=ids))


BAD_REQUESTS: dict[str, tuple[Callable[[frontend_pb2.GenerateRequest], None], str]] = {
    "empty prompt": (lambda r: setattr(r, "prompt", ""), "prompt"),
    "empty prompt_token_ids": (_ids([]), "prompt_token_ids"),
    "no input": (lambda r: r.ClearField("prompt"), "input"),
    "prompt too long": (lambda r: setattr(r, "prompt", " hello" * 1100), "prompt"),
    "prompt_token_ids too long": (_ids([5] * 1024), "prompt_token_ids"),
    "prompt of 3 MiB": (lambda r: setattr(r, "prompt", "x" * 3 * 2**20), "prompt"),
    "max_tokens=0": (_set("max_tokens", 0), "max_tokens"),
    "max_tokens past max_model_len": (_set("max_tokens", 1024), "max_tokens"),
    "n=0": (_set("n", 0), "n"),
    "n=2**32-1": (_set("n", 2**32 - 1), "n"),
    "too many stop strings": (lambda r: r.sampling_params.stop.extend(["s"] * 129), "stop"),
    "temperature<0": (_set("temperature", -0.5), "temperature"),
    "top_p=0": (_set("top_p", 0.0), "top_p"),
    "unknown output kind": (_set("output_kind", 99), "output_kind"),
    "token id too large": (_ids([1, 1024]), "prompt_token_ids[1]"),
    "negative token id": (_ids([-3, 5]), "prompt_token_ids[0]"),
    "allowed id out of range": (lambda r: r.sampling_params.allowed_token_ids.append(5000), "allowed_token_ids"),
    "empty stop string": (lambda r: r.sampling_params.stop.append(""), "stop"),
    "stop string without text": (
        lambda r: (r.sampling_params.stop.append("x"), setattr(r.sampling_params, "detokenize", False)), "stop"
    ),
    "too many logprobs": (_set("logprobs", 21), "logprobs"),
    "empty chat": (_chat(), "messages"),
    "unknown chat role": (_chat("user", "wizard"), "messages[1].role"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument(stub: frontend_pb2_grpc.GenerationStub, case: str) -> None:
    mutate, field = BAD_REQUESTS[case]
    error = rpc_error(lambda: stub.Generate(_bad(mutate), timeout=CALL_TIMEOUT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(f"invalid {field}="), error.details()


def test_serves_after_bad_input(stub: frontend_pb2_grpc.GenerationStub, e2e_stack: Stack) -> None:
    responses = run(stub, frontend_pb2.GenerateRequest(prompt="Hello", sampling_params=greedy(5)))
    assert len(joined(responses)[1]) == 5
    error = rpc_error(lambda: stub.Detokenize(frontend_pb2.DetokenizeRequest(token_ids=[1, 4096])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in error.details()
    e2e_stack.wait_engines_idle()


# ---- 6. an engine address with nothing behind it ---------------------------------------


def test_frontend_without_engine_fails_cleanly(tiny_llama_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    address = f"127.0.0.1:{free_port()}"
    frontend = start_frontend(tiny_llama_dir, [address], tmp_path, connect_timeout=8)
    try:
        # While it waits for the engine: up, NOT_SERVING, and Generate fails fast.
        frontend.wait_health(NOT_SERVING, timeout=START_TIMEOUT)
        with grpc.insecure_channel(frontend.address) as channel:
            stub = frontend_pb2_grpc.GenerationStub(channel)
            error = rpc_error(lambda: stub.Generate(long_request(), timeout=CALL_TIMEOUT))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        # Then it gives up: non-zero exit, one clear line naming the address.
        returncode = frontend.proc.wait(timeout=START_TIMEOUT)
        log = frontend.log()
        assert returncode != 0
        assert address in log
        assert "Traceback" not in log, log
    finally:
        frontend.stop()


# ---- 7. an engine dies mid-stream ------------------------------------------------------


def test_engine_killed_mid_stream(tiny_llama_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with start_stack(tiny_llama_dir, 2, tmp_path) as stack:
        stub = stack.generation_stub()
        # Two long requests: the balancer puts one on each engine.
        calls = [stub.Generate(long_request(f"Story number {i}"), timeout=CALL_TIMEOUT) for i in range(2)]
        assert not any(next(c).finished for c in calls)
        assert [i.num_running_reqs for i in stack.engine_infos()] == [1, 1]

        stack.engines[0].kill()
        # Engine 0's stream migrates to engine 1 (migration.py): both complete.
        for call in calls:
            last = list(call)[-1]
            assert last.finished and last.outputs[0].finish_reason == "length"

        # One engine left: still SERVING, and new requests run there.
        assert stack.frontend.health() == SERVING
        responses = list(stub.Generate(long_request(), timeout=CALL_TIMEOUT))
        assert responses[-1].outputs[0].finish_reason == "length"

        # Kill the last engine while a request streams on it: nowhere to migrate.
        call = stub.Generate(long_request(), timeout=CALL_TIMEOUT)
        assert not next(call).finished
        stack.engines[1].kill()
        error = rpc_error(lambda: list(call))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()

        assert stack.frontend.alive
        stack.frontend.wait_health(NOT_SERVING, timeout=30)
        info = stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT)
        assert info.num_engines == 2 and info.vocab_size == 1024
        error = rpc_error(lambda: stub.Generate(long_request(), timeout=CALL_TIMEOUT))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert stack.frontend.alive

        # The engine comes back on its address (as an orchestrator restarts it): the
        # frontend reconnects by itself and serves again.
        old = stack.engines[1]
        port = old.address.rsplit(":", 1)[1]
        args = ["engine", "--model", tiny_llama_dir, "--host", "127.0.0.1", "--port", port,
                "--engine-index", "1", "--metrics-port", "0", *ENGINE_ARGS]
        stack.engines[1] = ServiceProcess.spawn("engine1-restarted", args, old.address, tmp_path)
        stack.engines[1].wait_serving()
        stack.frontend.wait_health(SERVING, timeout=60)
        responses = list(stub.Generate(long_request(), timeout=CALL_TIMEOUT))
        assert responses[-1].outputs[0].finish_reason == "length"


# ---- keepalive -------------------------------------------------------------------------


def test_engine_streams_survive_idle_pings(e2e_stack: Stack, stub: frontend_pb2_grpc.GenerationStub) -> None:
    """Frontends ping their engines every 10 s; an engine that rejected those pings
    would close the streams with GOAWAY "too_many_pings" after ~30 s without traffic.
    The tests above leave the shared stack idle for a while; wait for the rest."""
    idle = time.monotonic() - max(_last_shared_use[0], e2e_stack.started_at)
    if idle < IDLE_SECONDS:
        time.sleep(IDLE_SECONDS - idle)
    log = e2e_stack.frontend.log()
    assert "too_many_pings" not in log and "is unavailable" not in log, log[-2000:]
    assert e2e_stack.frontend.health() == SERVING
    # Two requests at once land on both engines, through streams opened at start-up.
    calls = [stub.Generate(long_request(f"Still there {i}?"), timeout=CALL_TIMEOUT) for i in range(2)]
    assert not any(next(c).finished for c in calls)
    assert [i.num_running_reqs for i in e2e_stack.engine_infos()] == [1, 1]
    for call in calls:
        assert list(call)[-1].outputs[0].finish_reason == "length"


def test_no_leaked_processes(e2e_stack: Stack) -> None:
    """Every process the tests above started is gone; only the shared stack runs."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True, check=False
    ).stdout
    running = {int(line.split()[0]) for line in out.splitlines() if line.split()[1:2] != ["ps"]}
    shared = {p.proc.pid for p in (e2e_stack.frontend, *e2e_stack.engines)}
    assert running == shared, out


# ---- structured output over gRPC ------------------------------------------------------


def test_structured_output_json_schema(stub: frontend_pb2_grpc.GenerationStub) -> None:
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    so = common_pb2.StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True)
    request = frontend_pb2.GenerateRequest(
        prompt=PROMPT_TEXT,
        sampling_params=params(temperature=0.0, max_tokens=64, n=2, seed=3, structured_outputs=so),
    )
    responses = run(stub, request)
    for index in (0, 1):
        text, _ = joined(responses, index)
        jsonschema.validate(json.loads(text), schema)
    finals = [o for r in responses for o in r.outputs if o.finish_reason]
    assert sorted(o.finish_reason for o in finals) == ["stop", "stop"]


def test_structured_output_errors_are_invalid_argument(stub: frontend_pb2_grpc.GenerationStub) -> None:
    bad_regex = frontend_pb2.GenerateRequest(
        prompt=PROMPT_TEXT,
        sampling_params=params(max_tokens=8, structured_outputs=common_pb2.StructuredOutputs(regex="(open")),
    )
    err = rpc_error(lambda: stub.Generate(bad_regex, timeout=CALL_TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in (err.details() or "")
    bad_json = frontend_pb2.GenerateRequest(
        prompt=PROMPT_TEXT,
        sampling_params=params(max_tokens=8, structured_outputs=common_pb2.StructuredOutputs(json="{nope")),
    )
    err = rpc_error(lambda: stub.Generate(bad_json, timeout=CALL_TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.json" in (err.details() or "")
    # The stack still serves.
    _, ids = joined(run(stub, frontend_pb2.GenerateRequest(prompt=PROMPT_TEXT, sampling_params=greedy(4))))
    assert len(ids) == 4


def test_extreme_sampling_values_answer_ok_or_invalid_argument(
    stub: frontend_pb2_grpc.GenerationStub,
) -> None:
    """Issue 36: accepted extreme values ended INTERNAL with structured output (float32
    turned the penalty into 0 and the temperature into inf, the masked logits into NaN).
    Each runs now, or is refused naming its field (logit_bias is a float on the wire:
    1e300 arrives as inf); the largest int64 seed with n=2 (child seeds past int64) runs."""
    json_object = common_pb2.StructuredOutputs(json_object=True)
    regex = common_pb2.StructuredOutputs(regex="[a-z]{2,6}")
    cases = {
        "ok": [
            params(repetition_penalty=1e-300, max_tokens=8, structured_outputs=json_object),
            params(temperature=1e300, max_tokens=8, structured_outputs=json_object),
            params(temperature=1e300, max_tokens=8, seed=2**63 - 1, n=2, structured_outputs=regex),
            params(repetition_penalty=1e300, logit_bias={5: 3e38}, structured_outputs=regex),
        ],
        "logit_bias[5]": [params(logit_bias={5: 1e300}, max_tokens=8, structured_outputs=regex)],
    }
    for expected, sampling_params_list in cases.items():
        for sampling_params in sampling_params_list:
            request = frontend_pb2.GenerateRequest(prompt="a", sampling_params=sampling_params)
            if expected != "ok":
                error = rpc_error(lambda r=request: stub.Generate(r, timeout=CALL_TIMEOUT))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
                assert error.details().startswith(f"invalid {expected}="), error.details()
                continue
            responses = run(stub, request)
            finals = [o.finish_reason for r in responses for o in r.outputs if o.finish_reason]
            assert len(finals) == max(sampling_params.n, 1), (sampling_params, finals)
            assert set(finals) <= {"stop", "length"}, (sampling_params, finals)
