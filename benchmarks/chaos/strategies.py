"""Hypothesis strategies over the public request messages, and raw random bodies.

Every field of ``GenerateRequest`` / ``SamplingParams`` / ``TokenizeRequest`` /
``DetokenizeRequest`` is drawn from values that probe the edges: the wire type's
extremes (0, -1, 2**31 - 1, 2**32 - 1, int64 limits), NaN and infinities, any unicode
text, and repeated fields far larger than a sane client sends. Most draws are invalid
requests; the ones that are valid generate a bounded number of tokens where
``max_tokens`` is set (unset runs to the end of the context, as it should).

``collect(strategy, n, seed)`` draws ``n`` examples up front, so that the caller can
send them concurrently (hypothesis' ``@given`` runs one example at a time).
"""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tandem.v1 import common_pb2, frontend_pb2

INT32 = (-(2**31), 2**31 - 1)
UINT32_EDGES = [0, 1, 2, 3, 7, 16, 255, 256, 1023, 1024, 1025, 2**31 - 1, 2**31, 2**32 - 1]
INT32_EDGES = [-(2**31), -2, -1, 0, 1, 2, 5, 1023, 1024, 2**31 - 1]
INT64_EDGES = [-(2**63), -1, 0, 1, 2**32, 2**63 - 1]
# Prompts far past any max_model_len of the test models, below grpc's 4 MiB limit.
HUGE_TEXT_CHARS = [20_000, 300_000, 3 * 2**20]
HUGE_LIST_LEN = [5_000, 200_000]

# Text as protobuf accepts it: any code point but lone surrogates.
_any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=64)
_huge_text = st.builds(lambda n, c: c * n, st.sampled_from(HUGE_TEXT_CHARS), st.sampled_from("x é😀 \n"))


def _rarely(common: st.SearchStrategy, rare: st.SearchStrategy, one_in: int = 10) -> st.SearchStrategy:
    return st.integers(1, one_in).flatmap(lambda k: rare if k == 1 else common)


_text = _rarely(_any_text, _huge_text)


def _uint32() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(UINT32_EDGES), st.integers(0, 2**32 - 1))


def _int32() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(INT32_EDGES), st.integers(*INT32))


_double = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e-6, 0.5, 1.0, 2.0, 1e300, -1e300, math.nan, math.inf, -math.inf]),
)
_float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _ids(small: bool = False) -> st.SearchStrategy[list[int]]:
    """Token id lists: mostly short, sometimes with out-of-vocabulary ids, sometimes huge."""
    in_vocab = st.lists(st.integers(0, 1023), max_size=40)
    edgy = st.lists(_int32(), max_size=40)
    if small:
        return st.one_of(in_vocab, edgy)
    huge = st.builds(lambda n, t: [t] * n, st.sampled_from(HUGE_LIST_LEN), st.integers(0, 1023))
    return _rarely(st.one_of(in_vocab, edgy), huge)


def _optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams()
    for name, strategy in (
        ("n", st.one_of(st.sampled_from([1, 2]), _uint32())),
        ("temperature", _double),
        ("top_p", _double),
        ("top_k", _int32()),
        ("min_p", _double),
        ("seed", st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1))),
        ("presence_penalty", _double),
        ("frequency_penalty", _double),
        ("repetition_penalty", _double),
        # Mostly small: valid requests then finish fast; the edges still come up.
        ("max_tokens", st.one_of(st.integers(1, 8), st.integers(1, 8), _uint32())),
        ("min_tokens", st.one_of(st.integers(0, 4), _uint32())),
        ("logprobs", _uint32()),
        ("prompt_logprobs", _uint32()),
        ("skip_special_tokens", st.booleans()),
        ("ignore_eos", st.booleans()),
        ("include_stop_str_in_output", st.booleans()),
        ("output_kind", st.one_of(st.integers(0, 4), _int32())),
    ):
        value = draw(_optional(strategy))
        if value is not None:
            setattr(sp, name, value)
    for token, bias in draw(
        _rarely(
            st.dictionaries(_int32(), _float32, max_size=8),
            st.builds(lambda n: {i: 1.0 for i in range(n)}, st.sampled_from([2000, 100_000])),
        )
    ).items():
        sp.logit_bias[token] = bias
    sp.allowed_token_ids.extend(draw(_ids()))
    sp.stop_token_ids.extend(draw(_ids()))
    sp.stop.extend(
        draw(_rarely(st.lists(_any_text, max_size=4), st.lists(_any_text, min_size=100, max_size=300)))
    )
    return sp


def _chat(draw: st.DrawFn) -> frontend_pb2.ChatMessages:
    roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), _any_text)
    messages = draw(st.lists(st.tuples(roles, _text), max_size=4))
    return frontend_pb2.ChatMessages(
        messages=[frontend_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )


@st.composite
def generate_requests(draw: st.DrawFn) -> frontend_pb2.GenerateRequest:
    msg = frontend_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "prompt_token_ids", "chat", "none"]))
    if kind == "prompt":
        msg.prompt = draw(_text)
    elif kind == "prompt_token_ids":
        msg.prompt_token_ids.token_ids.extend(draw(_ids()))
        msg.prompt_token_ids.SetInParent()
    elif kind == "chat":
        msg.chat.CopyFrom(_chat(draw))
    if draw(st.booleans()):
        msg.sampling_params.CopyFrom(draw(sampling_params()))
    for name, strategy in (
        ("request_id", _any_text),
        ("cache_salt", _any_text),
        ("add_special_tokens", st.booleans()),
        ("add_generation_prompt", st.booleans()),
    ):
        value = draw(_optional(strategy))
        if value is not None:
            setattr(msg, name, value)
    msg.priority = draw(st.one_of(st.just(0), _int32()))
    return msg


@st.composite
def tokenize_requests(draw: st.DrawFn) -> frontend_pb2.TokenizeRequest:
    msg = frontend_pb2.TokenizeRequest(return_token_strings=draw(st.booleans()))
    kind = draw(st.sampled_from(["prompt", "chat", "none"]))
    if kind == "prompt":
        msg.prompt = draw(_text)
    elif kind == "chat":
        msg.chat.CopyFrom(_chat(draw))
    for name in ("add_special_tokens", "add_generation_prompt"):
        value = draw(_optional(st.booleans()))
        if value is not None:
            setattr(msg, name, value)
    return msg


@st.composite
def detokenize_requests(draw: st.DrawFn) -> frontend_pb2.DetokenizeRequest:
    msg = frontend_pb2.DetokenizeRequest(token_ids=draw(_ids()))
    value = draw(_optional(st.booleans()))
    if value is not None:
        msg.skip_special_tokens = value
    return msg


def collect(strategy: st.SearchStrategy, n: int, seed: int) -> list:
    """``n`` examples of ``strategy``, drawn by hypothesis from ``seed`` (no example
    database is written)."""
    out: list = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(example: object) -> None:
        out.append(example)

    draw()
    return out[:n]


def random_bodies(n: int, seed: int, max_len: int = 4096) -> list[bytes]:
    """Raw request bodies: empty, single bytes, random bytes of random length, and
    truncated / bit-flipped serialized requests (close to valid, so they parse further)."""
    rng = random.Random(seed)
    valid = frontend_pb2.GenerateRequest(
        prompt="Hello", sampling_params=common_pb2.SamplingParams(max_tokens=4)
    ).SerializeToString()
    bodies: list[bytes] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            body = rng.randbytes(rng.randint(0, max_len))
        elif kind == 1:
            body = rng.randbytes(rng.randint(0, 8))
        elif kind == 2:
            body = valid[: rng.randint(0, len(valid))]
        else:
            flipped = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            body = bytes(flipped)
        bodies.append(body)
    return bodies
