"""Pooling (embeddings) on decoder models: vectors equal Hugging Face AutoModel hidden
states pooled the same way, through the same scheduler as generation (chunked prefill,
prefix caching, mixed batches)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from frontend_service import LLM, PoolingParams
from tandem.protocol.outputs import EngineCoreRequest, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams

pytest_plugins = ["tests.e2e_helpers"]
ARCHS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]


def _hf_hidden(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def _pooled(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[params.pooling_type]
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    return torch.nn.functional.normalize(vec, dim=0) if params.normalize else vec


@pytest.mark.parametrize("arch", ARCHS)
def test_embeddings_match_hf(arch: str, request: pytest.FixtureRequest, rng: random.Random) -> None:
    model_dir = request.getfixturevalue(arch)
    # A 16-token step budget: longer prompts are pooled over several prefill chunks.
    llm = LLM(model_dir, max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts = [[rng.randrange(5, 1024) for _ in range(n)] for n in (1, 7, 16, 33, 70)]
    reference = _hf_hidden(model_dir, prompts)
    for pooling_type in ("LAST", "MEAN", "CLS"):
        for normalize in (True, False):
            params = PoolingParams(pooling_type=pooling_type, normalize=normalize)  # type: ignore[arg-type]
            outs = llm.encode([{"prompt_token_ids": p} for p in prompts], params)
            for out, hidden in zip(outs, reference):
                got = torch.tensor(out.outputs.embedding)
                want = _pooled(hidden, params)
                assert got.shape == want.shape
                assert torch.allclose(got, want, atol=1e-4, rtol=0), (pooling_type, normalize, (got - want).abs().max())
    truncated = llm.embed({"prompt_token_ids": prompts[3]}, PoolingParams(dimensions=8))[0].outputs.embedding
    assert torch.allclose(torch.tensor(truncated), _pooled(reference[3], PoolingParams(dimensions=8)), atol=1e-4)


def test_mixed_batch_and_prefix_cache(tiny_llama_dir: str) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32))
    prompt = list(range(10, 80))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(requests: list[EngineCoreRequest]) -> dict:
        for r in requests:
            core.add_request(r)
        final: dict = {}
        tokens: dict = {}
        while core.has_unfinished_requests():
            for o in core.step().all_outputs():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    final[o.request_id] = (o, tokens[o.request_id])
        core.kv_manager.pool.check_all_free()
        return final

    alone = run([EngineCoreRequest("g", prompt, greedy)])["g"][1]
    mixed = run([
        EngineCoreRequest("g2", prompt, greedy),
        EngineCoreRequest("last", prompt, SamplingParams(), pooling_params=PoolingParams()),
        EngineCoreRequest("mean", prompt, SamplingParams(), pooling_params=PoolingParams(pooling_type="MEAN")),
    ])
    assert mixed["g2"][1] == alone
    for rid in ("last", "mean"):
        out, tokens = mixed[rid]
        assert out.finish_reason == FinishReason.STOP and tokens == [] and len(out.pooling_output) == 64
    # The prompt is cached now: LAST pooling may use the hits, MEAN recomputes it all;
    # both give the same vectors as before.
    again = run([
        EngineCoreRequest("last2", prompt, SamplingParams(), pooling_params=PoolingParams()),
        EngineCoreRequest("mean2", prompt, SamplingParams(), pooling_params=PoolingParams(pooling_type="MEAN")),
    ])
    assert again["last2"][0].num_cached_tokens > 0 and again["mean2"][0].num_cached_tokens == 0
    for a, b in (("last", "last2"), ("mean", "mean2")):
        assert torch.allclose(torch.tensor(mixed[a][0].pooling_output), torch.tensor(again[b][0].pooling_output), atol=1e-5)


def test_bad_pooling_params(tiny_llama_dir: str) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=16))
    for params, field in [
        (PoolingParams(dimensions=65), "pooling_params.dimensions"),  # hidden size 64
        (PoolingParams(task="classify"), "pooling_params.task"),
        (PoolingParams(pooling_type="MAX"), "pooling_params.pooling_type"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(InvalidRequestError) as err:
            core.add_request(EngineCoreRequest("bad", [5, 6], SamplingParams(), pooling_params=params))
        assert err.value.field == field
    assert not core.has_unfinished_requests()


# ---- over gRPC ------------------------------------------------------------------------


def test_embed_rpc_matches_in_process(e2e_stack, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2

    stub = e2e_stack.generation_stub()
    texts = ["the quick brown fox", "jumps over the lazy dog, twice"]
    reply = stub.Embed(frontend_pb2.EmbedRequest(
        inputs=[frontend_pb2.EmbedInput(text=t) for t in texts]
        + [frontend_pb2.EmbedInput(token_ids=frontend_pb2.TokenIds(token_ids=[5, 6, 7]))],
        pooling_params=common_pb2.PoolingParams(pooling_type=common_pb2.POOLING_TYPE_MEAN, dimensions=32),
    ), timeout=60)
    assert [d.index for d in reply.data] == [0, 1, 2]
    llm = LLM(tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64)
    local = llm.embed([*texts, {"prompt_token_ids": [5, 6, 7]}], PoolingParams(pooling_type="MEAN", dimensions=32))
    for got, want in zip(reply.data, local):
        assert len(got.embedding) == 32 and got.num_prompt_tokens == len(want.prompt_token_ids)
        assert torch.allclose(torch.tensor(list(got.embedding)), torch.tensor(want.outputs.embedding), atol=1e-5)
    assert reply.num_prompt_tokens == sum(len(w.prompt_token_ids) for w in local)
    for bad, field in [
        (frontend_pb2.EmbedRequest(), "inputs"),
        (frontend_pb2.EmbedRequest(inputs=[frontend_pb2.EmbedInput(text="x")],
                                   pooling_params=common_pb2.PoolingParams(dimensions=1000)), "pooling_params.dimensions"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
