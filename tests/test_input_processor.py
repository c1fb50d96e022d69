"""InputProcessor: prompts, token ids and chat messages into validated engine requests."""

from __future__ import annotations

import random
from typing import Any

import pytest

from frontend_service.input_processor import InputProcessor
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams
from tests.text_factories import build_test_tokenizer, random_text

MAX_MODEL_LEN = 64
MAX_LOGPROBS = 5


@pytest.fixture
def processor(tokenizer: Any) -> InputProcessor:
    return InputProcessor(
        tokenizer, MAX_MODEL_LEN, len(tokenizer), MAX_LOGPROBS, tokenizer.eos_token_id
    )


def test_text_prompt_is_tokenized_and_max_tokens_resolved(
    processor: InputProcessor, tokenizer: Any, rng: random.Random
) -> None:
    prompt = random_text(rng, rng.randint(1, 10))
    params = SamplingParams(max_tokens=None, temperature=0.5)
    processed = processor.process("r1", params, prompt=prompt, priority=3, cache_salt="s")
    ids = tokenizer.encode(prompt)
    assert processed.prompt == prompt and processed.prompt_token_ids == ids
    (request,) = processed.engine_requests
    assert request.request_id == "r1" and request.external_req_id == "r1"
    assert request.prompt_token_ids == ids
    assert request.eos_token_id == tokenizer.eos_token_id
    assert (request.priority, request.cache_salt) == (3, "s")
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(ids)
    assert request.sampling_params.temperature == 0.5
    assert params.max_tokens is None  # the caller's params are not modified


def test_max_tokens_beyond_the_context_is_refused_and_the_room_itself_accepted(
    processor: InputProcessor, rng: random.Random
) -> None:
    ids = [rng.randrange(processor.vocab_size) for _ in range(rng.randint(1, MAX_MODEL_LEN - 1))]
    room = MAX_MODEL_LEN - len(ids)
    with pytest.raises(InvalidRequestError) as info:
        processor.process("r", SamplingParams(max_tokens=room + 1), prompt_token_ids=ids)
    assert info.value.field == "max_tokens" and str(room) in str(info.value)
    processed = processor.process("r", SamplingParams(max_tokens=room), prompt_token_ids=ids)
    assert processed.engine_requests[0].sampling_params.max_tokens == room


def test_n_is_limited_to_max_num_seqs(tokenizer: Any) -> None:
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, len(tokenizer), MAX_LOGPROBS, None, max_num_seqs=4)
    assert len(processor.process("r", SamplingParams(n=4), prompt="hi").engine_requests) == 4
    for n in (5, 2**32 - 1):
        with pytest.raises(InvalidRequestError) as info:
            processor.process("r", SamplingParams(n=n), prompt="hi")
        assert info.value.field == "n" and "max_num_seqs (4)" in str(info.value)


def test_text_longer_than_the_character_bound_is_refused_without_tokenizing(
    processor: InputProcessor, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = processor.max_prompt_chars
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert bound == (MAX_MODEL_LEN - 1) * longest  # byte-level BPE: a certain bound
    calls: list[str] = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(text) or [5])
    for field, kwargs in (
        ("prompt", {"prompt": "x" * (bound + 1)}),
        ("messages", {"messages": [{"role": "user", "content": "x" * (bound + 1)}]}),
    ):
        with pytest.raises(InvalidRequestError) as info:
            processor.process("r", **kwargs)
        assert info.value.field == field and "characters" in str(info.value)
    assert calls == []  # refused before tokenization
    processor.process("r", SamplingParams(max_tokens=1), prompt="x" * bound)
    assert calls == ["x" * bound]  # at the bound it is tokenized (and may still fit)


def test_character_bound_only_for_tokenizers_that_keep_every_character() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from frontend_service.prompt_bound import max_token_chars

    def fast(model: Any, pre: Any = None, norm: Any = None) -> PreTrainedTokenizerFast:
        tok = Tokenizer(model)
        if pre is not None:
            tok.pre_tokenizer = pre
        if norm is not None:
            tok.normalizer = norm
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    vocab = {"a": 0, "b": 1, "ab": 2, "abab": 3}
    merges = [("a", "b"), ("ab", "ab")]
    byte_level = fast(models.BPE(vocab, merges), pre_tokenizers.ByteLevel())
    assert max_token_chars(byte_level) == 4
    # Whitespace splitting drops the spaces; WordPiece maps long words to one [UNK];
    # NFKC can merge characters: none has a certain bound.
    assert max_token_chars(fast(models.BPE(vocab, merges), pre_tokenizers.Whitespace())) is None
    assert max_token_chars(fast(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None
    assert max_token_chars(
        fast(models.BPE(vocab, merges), pre_tokenizers.ByteLevel(), normalizers.NFKC())
    ) is None


def test_token_ids_prompt_passes_through(processor: InputProcessor, rng: random.Random) -> None:
    ids = [rng.randrange(processor.vocab_size) for _ in range(rng.randint(1, MAX_MODEL_LEN - 16))]
    processed = processor.process("r", prompt_token_ids=ids)
    assert processed.prompt is None
    assert processed.engine_requests[0].prompt_token_ids == ids


def test_chat_messages_render_with_template_and_no_doubled_bos(
    processor: InputProcessor, tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "你好 😀"},
    ]
    processed = processor.process("c", messages=messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert processed.prompt == text and text.endswith("assistant:")
    ids = processed.prompt_token_ids
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    # The template writes one <s> per turn plus one for the generation prompt.
    assert ids.count(tokenizer.bos_token_id) == len(messages) + 1
    assert ids[:2] != [tokenizer.bos_token_id] * 2



def test_add_special_tokens_and_add_generation_prompt_are_honoured(
    processor: InputProcessor, tokenizer: Any, rng: random.Random
) -> None:
    prompt = random_text(rng, rng.randint(1, 10))
    with_bos = processor.process("p1", prompt=prompt).prompt_token_ids
    without = processor.process("p2", prompt=prompt, add_special_tokens=False).prompt_token_ids
    assert with_bos == tokenizer.encode(prompt, add_special_tokens=True)
    assert without == tokenizer.encode(prompt, add_special_tokens=False)
    assert with_bos != without  # this tokenizer adds <s>

    messages = [{"role": "user", "content": random_text(rng, 3)}]
    plain = processor.process("c1", messages=messages, add_generation_prompt=False)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert plain.prompt == text and not text.endswith("assistant:")
    cued = processor.process("c2", messages=messages)
    assert cued.prompt != plain.prompt and cued.prompt.startswith(plain.prompt)
    doubled = processor.process("c3", messages=messages, add_special_tokens=True)
    assert doubled.prompt_token_ids == tokenizer.encode(cued.prompt, add_special_tokens=True)
    # For token ids neither applies.
    ids = [rng.randrange(processor.vocab_size) for _ in range(5)]
    kept = processor.process("t", prompt_token_ids=ids, add_special_tokens=True, add_generation_prompt=False)
    assert kept.prompt_token_ids == ids


def test_n_fans_out_into_seeded_children(processor: InputProcessor) -> None:
    processed = processor.process("p", SamplingParams(n=3, seed=7), prompt="hello")
    requests = processed.engine_requests
    assert [r.request_id for r in requests] == ["0_p", "1_p", "2_p"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert {r.sampling_params.n for r in requests} == {1}
    assert {r.external_req_id for r in requests} == {"p"}
    assert processed.parent.n == 3 and processed.sampling_params.n == 3
    # Each child owns its prompt list: the engine may not share mutable state.
    assert requests[0].prompt_token_ids is not requests[1].prompt_token_ids


def _error(processor: InputProcessor, **kwargs: Any) -> InvalidRequestError:
    request_id = kwargs.pop("request_id", "r")
    params = kwargs.pop("params", None)
    with pytest.raises(InvalidRequestError) as err:
        processor.process(request_id, params, **kwargs)
    return err.value


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": "word " * MAX_MODEL_LEN}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * MAX_MODEL_LEN}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2, 3, 10**6]}, "prompt_token_ids[3]"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1.5]}, "prompt_token_ids[0]"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
            "messages[1].role",
        ),
        ({"messages": [{"content": "b"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]}, "messages"),
        ({"prompt": "hi", "request_id": ""}, "request_id"),
        ({"prompt": "hi", "priority": "high"}, "priority"),
        ({"prompt": "hi", "params": SamplingParams(n=0)}, "n"),
        ({"prompt": "hi", "params": SamplingParams(temperature=-1.0)}, "temperature"),
        ({"prompt": "hi", "params": SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"prompt": "hi", "params": SamplingParams(top_p=0.0)}, "top_p"),
        ({"prompt": "hi", "params": SamplingParams(logprobs=MAX_LOGPROBS + 1)}, "logprobs"),
        ({"prompt": "hi", "params": SamplingParams(stop_token_ids=[10**6])}, "stop_token_ids"),
        ({"prompt": "hi", "params": SamplingParams(stop=[""])}, "stop"),
        (
            {"prompt": "hi", "params": SamplingParams(max_tokens=None, min_tokens=MAX_MODEL_LEN)},
            "min_tokens",
        ),
        ({"prompt": "hi", "params": {"temperature": 1.0}}, "sampling_params"),
    ],
)
def test_each_invalid_input_names_its_field(
    processor: InputProcessor, kwargs: dict[str, Any], field: str
) -> None:
    assert _error(processor, **kwargs).field == field


def test_random_out_of_vocab_position_is_named(
    processor: InputProcessor, rng: random.Random
) -> None:
    ids = [rng.randrange(processor.vocab_size) for _ in range(20)]
    bad = rng.randrange(len(ids))
    ids[bad] = processor.vocab_size + rng.randrange(1000)
    error = _error(processor, prompt_token_ids=ids)
    assert error.field == f"prompt_token_ids[{bad}]" and error.value == ids[bad]


def test_chat_without_template_is_rejected(tokenizer: Any) -> None:
    no_template = build_test_tokenizer()
    no_template.chat_template = None
    processor = InputProcessor(no_template, MAX_MODEL_LEN, len(tokenizer), MAX_LOGPROBS, 1)
    error = _error(processor, messages=[{"role": "user", "content": "hi"}])
    assert error.field == "messages"


def test_without_tokenizer_only_token_ids_are_accepted() -> None:
    processor = InputProcessor(None, MAX_MODEL_LEN, 100, MAX_LOGPROBS, None)
    assert processor.process("r", prompt_token_ids=[1, 2]).prompt_token_ids == [1, 2]
    assert _error(processor, prompt="hi").field == "prompt"
    assert _error(processor, prompt_token_ids=[1], params=SamplingParams(stop=["x"])).field == (
        "stop"
    )


def test_constructor_rejects_bad_limits(tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        InputProcessor(tokenizer, 0, 100, 5, None)
    with pytest.raises(ValueError):
        InputProcessor(tokenizer, 10, 100, -1, None)


def test_the_models_other_eos_ids_stop_unless_ignore_eos(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, len(tokenizer), MAX_LOGPROBS, eos, [eos, 7, 9, 7])
    stopping = processor.process("a", SamplingParams(stop_token_ids=[9, 3]), prompt="hi")
    assert stopping.engine_requests[0].sampling_params.stop_token_ids == [9, 3, 7]
    assert stopping.engine_requests[0].eos_token_id == eos
    ignoring = processor.process("b", SamplingParams(stop_token_ids=[3], ignore_eos=True), prompt="hi")
    assert ignoring.engine_requests[0].sampling_params.stop_token_ids == [3]


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("stop", SamplingParams(stop=["s"] * 129)),
        ("stop_token_ids", SamplingParams(stop_token_ids=[3] * 100_000)),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[3] * 100_000)),
        ("logit_bias", SamplingParams(logit_bias={i: 1.0 for i in range(100_000)})),
        ("seed", SamplingParams(seed=2**64)),
        ("seed", SamplingParams(seed=-(2**63) - 1)),
    ],
)
def test_size_and_range_limits(processor: InputProcessor, field: str, params: SamplingParams) -> None:
    with pytest.raises(InvalidRequestError) as info:
        processor.process("r", params, prompt="hi")
    assert info.value.field == field


def test_edge_values_inside_the_limits_pass(processor: InputProcessor) -> None:
    for params in (
        SamplingParams(stop=["s"] * 128, max_tokens=2),
        SamplingParams(seed=2**64 - 1, max_tokens=2),
        SamplingParams(seed=-(2**63), max_tokens=2),
        SamplingParams(stop_token_ids=list(range(processor.vocab_size)), max_tokens=2),
    ):
        processor.process("r", params, prompt="hi")


def test_request_id_and_cache_salt_lengths(processor: InputProcessor) -> None:
    processor.process("r" * 512, prompt="hi", cache_salt="s" * 1024)
    for kwargs, field in (({"request_id": "r" * 513}, "request_id"), ({"cache_salt": "s" * 1025}, "cache_salt")):
        with pytest.raises(InvalidRequestError) as info:
            processor.process(**{"request_id": "r", "prompt": "hi", **kwargs})
        assert info.value.field == field
