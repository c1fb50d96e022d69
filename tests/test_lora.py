"""LoRA adapters: parity with Hugging Face + PEFT, mixed batches, slots, validation, gRPC.

Adapters are written by ``peft`` itself with random A and B (tests/lora_factories.py).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import grpc
import pytest

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from frontend_service import LLM, LoRARequest
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams
from tests.lora_factories import ALL_MODULES, ATTENTION, MLP, hf_peft_greedy, make_peft_adapter

MAX_TOKENS = 12


def _prompts(n: int, seed: int = 0, lengths: tuple[int, ...] = (5, 19, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _core(model_dir: str, **kwargs: object) -> EngineCore:
    args: dict[str, object] = {"model": model_dir, "enable_lora": True, "max_loras": 4, "max_model_len": 256}
    args.update(kwargs)
    return EngineCore(EngineConfig(**args))  # type: ignore[arg-type]


def _run(
    core: EngineCore, jobs: list[tuple[list[int], LoRARequest | None]], max_tokens: int = MAX_TOKENS,
    check_slots: bool = False,
) -> tuple[list[list[int]], list[int]]:
    """Run jobs together; (tokens, cached prompt tokens) per job."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, (prompt, lora) in enumerate(jobs):
        rid = f"j{i}-{random.random()}"
        tokens[rid] = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        core.add_request(EngineCoreRequest(rid, prompt, params, lora_request=lora))
    while core.has_unfinished_requests():
        for o in core.step().all_outputs():
            tokens[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
        if check_slots:
            running = {r.lora_int_id for r in core.scheduler.lifecycle.running} - {0}
            assert len(running) <= core.config.max_loras
    return list(tokens.values()), list(cached.values())


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Makes (and caches) adapters: adapter_dir(model_dir, r, modules, seed) -> path."""
    root = tmp_path_factory.mktemp("adapters")
    made: dict[tuple[str, int, tuple[str, ...], int, bool], str] = {}

    def make(model_dir: str, r: int = 8, modules: tuple[str, ...] = ALL_MODULES, seed: int = 1,
             rslora: bool = False) -> str:
        key = (model_dir, r, modules, seed, rslora)
        if key not in made:
            out = root / f"a{len(made)}"
            made[key] = make_peft_adapter(model_dir, str(out), r=r, lora_alpha=2 * r,
                                          target_modules=modules, seed=seed, use_rslora=rslora)
        return made[key]

    return make


# ---- parity with Hugging Face + PEFT --------------------------------------------------

CASES = [
    ("tiny_llama_dir", 8, ATTENTION, False),
    ("tiny_llama_dir", 16, ALL_MODULES, True),
    ("tiny_qwen2_dir", 8, MLP, False),
    ("tiny_qwen2_dir", 16, ALL_MODULES, False),
    ("tiny_qwen3_dir", 16, ATTENTION, False),
    ("tiny_qwen3_dir", 8, ALL_MODULES, False),
    ("tiny_qwen3_dir", 16, MLP, False),
]


@pytest.mark.parametrize(("arch", "r", "modules", "rslora"), CASES)
def test_greedy_matches_hf_peft(
    arch: str, r: int, modules: tuple[str, ...], rslora: bool, adapter_dir, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(arch)
    path = adapter_dir(model_dir, r, modules, rslora=rslora)
    prompts = _prompts(3)
    expected = hf_peft_greedy(model_dir, path, prompts, MAX_TOKENS)
    base = hf_peft_greedy(model_dir, None, prompts, MAX_TOKENS)
    assert expected != base, "the adapter should change the greedy tokens"
    core = _core(model_dir, max_loras=1)
    got, _ = _run(core, [(p, LoRARequest("a", 1, path)) for p in prompts] + [(p, None) for p in prompts])
    assert got[:3] == expected
    assert got[3:] == base


# ---- mixed batches --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama_dir: str, adapter_dir) -> list[LoRARequest]:  # type: ignore[no-untyped-def]
    sets = [ALL_MODULES, ATTENTION, MLP, ("q_proj", "v_proj", "down_proj")]
    return [
        LoRARequest(f"a{i + 1}", i + 1, adapter_dir(tiny_llama_dir, 8 if i % 2 else 16, m, seed=10 + i))
        for i, m in enumerate(sets)
    ]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: str, llama_adapters: list[LoRARequest]) -> dict[tuple[int, int], list[int]]:
    """(prompt index, adapter id or 0) -> tokens of that request run by itself."""
    core = _core(tiny_llama_dir, enable_prefix_caching=False)
    out = {}
    for i, prompt in enumerate(_prompts(4, seed=3)):
        for lora in [None, *llama_adapters]:
            out[(i, lora.lora_int_id if lora else 0)] = _run(core, [(prompt, lora)])[0][0]
    return out


def _mixed_jobs(adapters: list[LoRARequest | None]) -> list[tuple[int, list[int], LoRARequest | None]]:
    prompts = _prompts(4, seed=3)
    return [(i, prompts[i], adapters[(i + j) % len(adapters)]) for j in range(2) for i in range(4)]


@pytest.mark.parametrize("setup", ["plain", "chunked", "prefix_cache"])
def test_mixed_batch_equals_alone(
    setup: str, tiny_llama_dir: str, llama_adapters: list[LoRARequest], alone: dict
) -> None:
    kwargs: dict[str, object] = {"enable_prefix_caching": setup == "prefix_cache"}
    if setup == "chunked":
        kwargs["max_num_batched_tokens"] = 16
    core = _core(tiny_llama_dir, **kwargs)
    jobs = _mixed_jobs([None, *llama_adapters[:3]])  # 3 adapters and the base model
    got, _ = _run(core, [(p, lora) for _, p, lora in jobs])
    for (i, _, lora), tokens in zip(jobs, got, strict=True):
        assert tokens == alone[(i, lora.lora_int_id if lora else 0)]
    assert len({tuple(alone[(0, k)]) for k in range(4)}) == 4  # every adapter changes the output


def test_prefix_cache_never_shared_across_adapters(tiny_llama_dir: str, llama_adapters: list[LoRARequest]) -> None:
    core = _core(tiny_llama_dir, block_size=16)
    prompt = _prompts(1, seed=5, lengths=(50,))[0]
    a1, a2 = llama_adapters[:2]
    assert _run(core, [(prompt, a1)])[1] == [0]
    assert _run(core, [(prompt, a2)])[1] == [0]  # same tokens, other adapter: no hit
    assert _run(core, [(prompt, None)])[1] == [0]
    assert _run(core, [(prompt, a1)])[1] == [48]  # same adapter again: three full blocks
    assert _run(core, [(prompt, None)])[1] == [48]


def test_eviction_and_pinning(tiny_llama_dir: str, llama_adapters: list[LoRARequest], alone: dict) -> None:
    core = _core(tiny_llama_dir, max_loras=2, max_cpu_loras=2)
    core.add_lora(llama_adapters[0])
    assert core.pin_lora(1)
    jobs = _mixed_jobs(llama_adapters)  # 4 adapters through 2 slots (1 pinned)
    got, _ = _run(core, [(p, lora) for _, p, lora in jobs], check_slots=True)
    for (i, _, lora), tokens in zip(jobs, got, strict=True):
        assert tokens == alone[(i, lora.lora_int_id)]
    assert core.lora is not None and 1 in core.lora.slot_of  # the pinned adapter never left
    assert core.list_loras() == [1, 2, 3, 4]
    with pytest.raises(InvalidRequestError, match="lora_id"):
        core.pin_lora(2)  # would pin the last free slot
    assert core.remove_lora(4) and core.list_loras() == [1, 2, 3]
    core.kv_manager.pool.check_all_free()


def test_llm_api(tiny_llama_dir: str, llama_adapters: list[LoRARequest], alone: dict) -> None:
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=256)
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=3)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    loras = [None, llama_adapters[0], llama_adapters[1], None]
    outs = llm.generate(prompts, params, lora_request=loras)
    for i, (out, lora) in enumerate(zip(outs, loras, strict=True)):
        assert out.outputs[0].token_ids == alone[(i, lora.lora_int_id if lora else 0)]
    one = llm.generate(prompts[:1], params, lora_request=llama_adapters[2])
    assert one[0].outputs[0].token_ids == alone[(0, 3)]
    assert llm.list_loras() == {1, 2, 3}
    assert llm.add_lora(llama_adapters[3]) and llm.pin_lora(4) and llm.remove_lora(4)


# ---- validation -------------------------------------------------------------------------


def test_bad_adapters_are_invalid_argument(
    tiny_llama_dir: str, llama_adapters: list[LoRARequest], adapter_dir, tmp_path: Path
) -> None:
    core = _core(tiny_llama_dir, max_lora_rank=8)
    prompt = _prompts(1)[0]

    def refused(lora: LoRARequest, field: str, match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match) as info:
            _run(core, [(prompt, lora)])
        assert info.value.field == field

    refused(LoRARequest("x", 9, str(tmp_path / "missing")), "lora_request.lora_path", "no such adapter")
    refused(llama_adapters[0], "lora_request.lora_path", "exceeds max_lora_rank=8")  # r=16
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    refused(LoRARequest("b", 10, str(broken)), "lora_request.lora_path", "not valid JSON")
    alien = tmp_path / "alien"
    alien.mkdir()
    src = llama_adapters[1].lora_path
    config = json.loads(Path(src, "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "fc1"]
    (alien / "adapter_config.json").write_text(json.dumps(config))
    os.symlink(os.path.join(src, "adapter_model.safetensors"), alien / "adapter_model.safetensors")
    refused(LoRARequest("c", 11, str(alien)), "lora_request.lora_path", "fc1")
    refused(LoRARequest("nobody", 0), "lora_request.lora_name", "no adapter of this name")
    # The engine keeps serving, every block is back.
    core.kv_manager.pool.check_all_free()
    assert _run(core, [(prompt, llama_adapters[1])])[0][0]
    core.kv_manager.pool.check_all_free()

    plain = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=256))
    with pytest.raises(InvalidRequestError, match="not enabled") as info:
        _run(plain, [(prompt, llama_adapters[1])])
    assert info.value.field == "lora_request"


# ---- end to end over gRPC ---------------------------------------------------------------


def test_grpc_end_to_end(
    tiny_llama_dir: str, llama_adapters: list[LoRARequest], alone: dict, tmp_path: Path
) -> None:
    from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
    from tests.e2e_helpers import ADMIN_METADATA, ENGINE_ARGS, free_port, start_stack

    a1, a2 = llama_adapters[:2]
    args = (*ENGINE_ARGS, "--enable-lora", "--max-loras", "2", "--lora-modules", f"a1={a1.lora_path}")
    prompt = _prompts(4, seed=3)[0]

    def generate(stub: frontend_pb2_grpc.GenerationStub, lora: common_pb2.LoRARequest | None) -> list[int]:
        req = frontend_pb2.GenerateRequest(
            prompt_token_ids=frontend_pb2.TokenIds(token_ids=prompt),
            sampling_params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            lora_request=lora,
        )
        tokens: list[int] = []
        for resp in stub.Generate(req, timeout=60):
            tokens.extend(resp.outputs[0].token_ids)
        return tokens

    http_port = free_port()
    with (
        start_stack(tiny_llama_dir, 1, tmp_path / "logs", args, http_port=http_port) as stack,
        grpc.insecure_channel(stack.frontend.address) as channel,
    ):
        stub = frontend_pb2_grpc.GenerationStub(channel)
        admin = frontend_pb2_grpc.FrontendAdminStub(channel)
        assert generate(stub, common_pb2.LoRARequest(lora_name="a1")) == alone[(0, 1)]
        assert generate(stub, None) == alone[(0, 0)]
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, common_pb2.LoRARequest(lora_name="a2"))  # not added yet
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lora_request.lora_name" in info.value.details()
        proto = common_pb2.LoRARequest(lora_name="a2", lora_int_id=2, lora_path=a2.lora_path)
        assert admin.AddLora(frontend_pb2.AddLoraRequest(lora_request=proto), metadata=ADMIN_METADATA).added
        assert generate(stub, common_pb2.LoRARequest(lora_name="a2")) == alone[(0, 2)]
        listed = admin.ListLoras(frontend_pb2.ListLorasRequest(), metadata=ADMIN_METADATA)
        assert list(listed.engine_lora_ids) == [1, 2]
        assert {r.lora_name for r in listed.loras} == {"a1", "a2"}
        assert admin.PinLora(frontend_pb2.PinLoraRequest(lora_id=2), metadata=ADMIN_METADATA).pinned
        bad = common_pb2.LoRARequest(lora_name="z", lora_int_id=9, lora_path=str(tmp_path / "nope"))
        with pytest.raises(grpc.RpcError) as info:
            admin.AddLora(frontend_pb2.AddLoraRequest(lora_request=bad), metadata=ADMIN_METADATA)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lora_request.lora_path" in info.value.details()
        # The OpenAI API: "model" names an adapter, and /v1/models lists the adapters.
        import json
        import urllib.request

        base = f"http://127.0.0.1:{http_port}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as reply:
            assert {"a1", "a2"} <= {card["id"] for card in json.load(reply)["data"]}
        body = json.dumps({"model": "a1", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        post = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(post, timeout=60) as reply:
            assert json.load(reply)["choices"][0]["token_ids"] == alone[(0, 1)]
        assert admin.RemoveLora(frontend_pb2.RemoveLoraRequest(lora_id=2), metadata=ADMIN_METADATA).removed


def test_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import lora as bench

    assert bench.main(["--steps", "2", "--repeats", "1", "--batch", "4", "--prompt-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "4 mixed adapters" in out and "ratio" in out


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_adapters(tiny_llama_dir: str, llama_adapters: list[LoRARequest], level: int) -> None:
    """Sleep level 2 reloads the base weights; the adapters (and their slots) stay, so
    requests with and without adapters give the same tokens after wake_up."""
    core = _core(tiny_llama_dir)
    jobs = [(p, lora) for p, lora in zip(_prompts(3, seed=5), [None, *llama_adapters[:2]])]
    before, _ = _run(core, jobs)
    core.sleep(level)
    assert (core.model is None) == (level == 2)
    core.wake_up()
    after, _ = _run(core, jobs)
    assert after == before
    assert len(set(map(tuple, before))) == len(before)  # the adapters change the output
