"""SMG (the real gateway, ``pip install smg``) driving two ``tandem engine`` processes over
vllm.grpc.engine.VllmEngine, checked with the official ``openai`` SDK against Tandem's
own frontend over the same engines.

One module-scoped stack: two engines (with /metrics), a Tandem frontend with its HTTP
API, and ``smg launch --backend vllm --policy cache_aware`` over both engines.

SMG tokenizes ``/v1/completions`` prompts without the tokenizer's special tokens (no
BOS; measured with smg 1.13), so the frontend gets the same token ids as its prompt.
Texts are compared with trailing U+FFFD removed: a random checkpoint's last token may
end inside a UTF-8 sequence, which SMG's stream decoder holds back and the frontend
shows as a replacement character; non-streamed chat compares every token's bytes (its
logprobs) exactly, and every case compares the completion's token count.
"""

from __future__ import annotations

import contextlib
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.smg_peer import SmgGateway, smg_executable
from tests.e2e_helpers import Stack, free_port, launch, start_engine, start_frontend

pytestmark = pytest.mark.skipif(smg_executable() is None, reason="the smg wheel is not installed (pip install smg)")

openai = pytest.importorskip("openai")

MAX_TOKENS = 12


@dataclass
class SmgStack:
    stack: Stack  # the engines and the Tandem frontend
    smg: SmgGateway
    metrics_ports: list[int]
    frontend_http: str
    tokenizer: Any

    def client(self, base_url: str) -> Any:
        return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0)

    @property
    def via_smg(self) -> Any:
        return self.client(self.smg.base_url)

    @property
    def via_frontend(self) -> Any:
        return self.client(self.frontend_http)

    def prefix_hits(self) -> list[float]:
        """Each engine's tandem:prefix_cache_hits counter (prompt tokens served from cache)."""
        hits = []
        for port in self.metrics_ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            total = 0.0
            for family in text_string_to_metric_families(text):
                if family.name == "tandem:prefix_cache_hits":
                    total += sum(s.value for s in family.samples if s.name.endswith("_total"))
            hits.append(total)
        return hits


@pytest.fixture(scope="module")
def smg_stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmgStack]:
    from transformers import AutoTokenizer

    log_dir: Path = tmp_path_factory.mktemp("smg_e2e_logs")
    started: list[Any] = []
    try:
        metrics_ports = [free_port(), free_port()]
        engines = [start_engine(tiny_llama_dir, i, log_dir, metrics_port=p) for i, p in enumerate(metrics_ports)]
        started += engines
        http_port = free_port()
        frontend = start_frontend(tiny_llama_dir, [e.address for e in engines], log_dir, http_port=http_port)
        started.append(frontend)
        for engine in engines:
            engine.wait_serving()
        smg = SmgGateway.launch(tiny_llama_dir, [e.address for e in engines], log_dir, spawn=launch)
        started.append(smg)
        frontend.wait_serving()
        smg.wait_ready()
        stack = SmgStack(
            Stack(tiny_llama_dir, engines, frontend), smg, metrics_ports, f"http://127.0.0.1:{http_port}",
            AutoTokenizer.from_pretrained(tiny_llama_dir),
        )
        yield stack
    finally:
        for proc in reversed(started):
            with contextlib.suppress(Exception):
                proc.stop()


def _model(client: Any) -> str:
    return client.models.list().data[0].id


def _text(text: str | None) -> str:
    return (text or "").rstrip("\ufffd")


PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land far away,"]
MESSAGES = [[{"role": "user", "content": "Hi there, how are you?"}], [{"role": "user", "content": "Count to five."}]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_streaming_or_not_match_the_tandem_frontend(smg_stack: SmgStack, prompt: str) -> None:
    smg, frontend = smg_stack.via_smg, smg_stack.via_frontend
    ids = smg_stack.tokenizer.encode(prompt, add_special_tokens=False)
    ref = frontend.completions.create(model=_model(frontend), prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    got = smg.completions.create(model=_model(smg), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == ref.usage.completion_tokens
    assert got.choices[0].finish_reason == ref.choices[0].finish_reason
    assert _text(got.choices[0].text) == _text(ref.choices[0].text)

    stream = smg.completions.create(
        model=_model(smg), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert _text(streamed) == _text(ref.choices[0].text)
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    smg_stack.stack.wait_engines_idle()


def _token_bytes(logprobs: Any) -> list[tuple[str, list[int] | None]]:
    return [(t.token, t.bytes) for t in logprobs.content]


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_streaming_or_not_matches_the_tandem_frontend_token_for_token(smg_stack: SmgStack, messages: list) -> None:
    smg, frontend = smg_stack.via_smg, smg_stack.via_frontend
    kwargs = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    ref = frontend.chat.completions.create(model=_model(frontend), **kwargs)
    got = smg.chat.completions.create(model=_model(smg), **kwargs)
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens
    assert _token_bytes(got.choices[0].logprobs) == _token_bytes(ref.choices[0].logprobs)
    assert len(got.choices[0].logprobs.content) == ref.usage.completion_tokens
    assert got.choices[0].finish_reason == ref.choices[0].finish_reason
    assert _text(got.choices[0].message.content) == _text(ref.choices[0].message.content)

    # Streamed, SMG holds back tokens that end inside a UTF-8 sequence (their logprobs
    # too), so the stream is compared by its text and its token count.
    chunks = list(
        smg.chat.completions.create(
            model=_model(smg), stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _text(streamed) == _text(ref.choices[0].message.content)
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    smg_stack.stack.wait_engines_idle()


def test_a_cancelled_stream_frees_everything_on_the_engines(smg_stack: SmgStack) -> None:
    smg = smg_stack.via_smg
    stream = smg.chat.completions.create(
        model=_model(smg), messages=MESSAGES[0], max_tokens=900, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 2:
            break
    stream.close()  # the client goes away mid-generation
    infos = smg_stack.stack.wait_engines_idle(timeout=60)
    assert all(i.num_running_reqs == 0 and i.num_free_blocks == i.num_kv_blocks for i in infos)
    logs = "".join(e.log() for e in smg_stack.stack.engines)
    # SMG drops the call and sends Abort: whichever lands first aborts the request.
    assert ": aborting" in logs or "left; aborting" in logs, "the engine never saw the cancel"
    # The engines still serve through the gateway afterwards.
    again = smg.completions.create(model=_model(smg), prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2


def test_cache_aware_routes_a_shared_long_prefix_to_the_engine_that_has_it(smg_stack: SmgStack) -> None:
    smg = smg_stack.via_smg
    stack = smg_stack.stack
    stack.wait_engines_idle()
    applied = smg_stack.smg.kv_batches_applied()
    stack.reset_prefix_caches()
    applied = _wait_for_smg_batches(smg_stack, applied, at_least=2)  # both caches' "cleared"
    rng = random.Random(5)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    prefix = "System:"
    while (prefix_tokens := len(smg_stack.tokenizer.encode(prefix, add_special_tokens=False))) < 256:
        prefix += " " + rng.choice(words)

    before = smg_stack.prefix_hits()
    smg.completions.create(model=_model(smg), prompt=prefix + " Question 0?", max_tokens=1, temperature=0)
    stack.wait_engines_idle()
    first = [b - a for a, b in zip(before, smg_stack.prefix_hits(), strict=True)]
    assert first == [0.0, 0.0]  # the caches were empty
    _wait_for_smg_batches(smg_stack, applied, at_least=1)  # the prefix's blocks, stored

    followers = 4
    for i in range(1, followers + 1):
        smg.completions.create(model=_model(smg), prompt=prefix + f" Question {i}?", max_tokens=1, temperature=0)
        stack.wait_engines_idle()
    gained = [b - a for a, b in zip(before, smg_stack.prefix_hits(), strict=True)]
    holder = max(range(2), key=lambda i: gained[i])
    # Every follower found at least the prefix's full blocks cached, all on one engine.
    assert gained[1 - holder] == 0, gained
    assert gained[holder] >= followers * (prefix_tokens // 16 - 1) * 16, gained


def _wait_for_smg_batches(
    smg_stack: SmgStack, since: dict[str, float], at_least: int, timeout: float = 30.0
) -> dict[str, float]:
    """Until at least ``at_least`` workers have had a KV-event batch applied to SMG's
    prefix index since ``since`` (SMG's own prometheus counter); returns the counts."""
    deadline = time.monotonic() + timeout
    urls = [f"grpc://{e.address}" for e in smg_stack.stack.engines]
    while True:
        now = smg_stack.smg.kv_batches_applied()
        grown = [url for url in urls if now.get(url, 0) > since.get(url, 0)]
        if len(grown) >= at_least:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"smg applied no new KV events from {at_least} workers: {now}\n{smg_stack.smg.log_tail()}")
        time.sleep(0.05)
