"""EngineCore behaviour beyond greedy parity: seeds, logprobs, bad input, aborts, sizing."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_service.config import ConfigError, EngineConfig
from engine_service.core import EngineCore
from engine_service.core_loop import EngineCoreLoop, EngineDead, UtilityCall
from engine_service.startup import ScratchForward, warm_up_shapes
from tandem.protocol.outputs import EngineCoreOutputs, EngineCoreRequest, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def core(tiny_llama_dir: str) -> EngineCore:
    return EngineCore(
        EngineConfig(model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=128, max_logprobs=5)
    )


def _prompt(core: EngineCore, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, core.model_config.vocab_size) for _ in range(n)]


def _drain(core: EngineCore) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_seeded_sampling_is_independent_of_the_batch(core: EngineCore) -> None:
    rng = random.Random(1)
    prompt = _prompt(core, 20, rng)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    core.add_request(EngineCoreRequest("alone", prompt, params))
    alone = [t for o in _drain(core)["alone"] for t in o.new_token_ids]

    core.add_request(EngineCoreRequest("seeded", prompt, params))
    for i in range(15):
        other = SamplingParams(temperature=1.0, max_tokens=rng.randint(5, 30), ignore_eos=True)
        core.add_request(EngineCoreRequest(f"o{i}", _prompt(core, rng.randint(1, 60), rng), other))
    in_batch = [t for o in _drain(core)["seeded"] for t in o.new_token_ids]
    assert in_batch == alone
    assert len(set(alone)) > 3  # really sampled, not a constant
    core.kv_manager.pool.check_all_free()


def test_plain_outputs_go_in_the_columns(core: EngineCore) -> None:
    # Requests that only got a token travel as columns; anything with details (logprobs,
    # a finish) as an EngineCoreOutput; each request in exactly one of the two.
    rng = random.Random(7)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    core.add_request(EngineCoreRequest("p0", _prompt(core, 9, rng), plain))
    core.add_request(EngineCoreRequest("p1", _prompt(core, 5, rng), plain))
    core.add_request(EngineCoreRequest("lp", _prompt(core, 7, rng), SamplingParams(max_tokens=3, logprobs=1)))
    steps = []
    while core.has_unfinished_requests():
        steps.append(core.step())
    for step in steps:
        ids = [o.request_id for o in step.all_outputs()]
        assert len(ids) == len(set(ids)) == step.num_outputs
        assert all(o.new_logprobs is not None or o.finished for o in step.outputs)
    first, last = steps[0], steps[-1]
    assert first.token_columns is not None and first.token_columns.request_ids == ["p0", "p1"]
    assert first.token_columns.num_new_tokens is None  # one token each
    assert [o.request_id for o in first.outputs] == ["lp"]
    assert last.token_columns is None and {o.request_id for o in last.outputs} == {"p0", "p1", "lp"}
    tokens = {rid: [t for s in steps for o in s.all_outputs() if o.request_id == rid for t in o.new_token_ids]
              for rid in ("p0", "p1", "lp")}
    assert all(len(t) == 3 for t in tokens.values())
    core.kv_manager.pool.check_all_free()


def test_logprobs_match_hf(core: EngineCore, tiny_llama_dir: str) -> None:
    rng = random.Random(2)
    prompt = _prompt(core, 12, rng)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    core.add_request(EngineCoreRequest("lp", prompt, params))
    outs = _drain(core)["lp"]
    tokens = [t for o in outs for t in o.new_token_ids]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)  # [len, vocab]

    prompt_lp = outs[0].new_prompt_logprobs
    assert prompt_lp is not None and len(prompt_lp) == len(prompt) - 1
    for j in range(len(prompt) - 1):
        target = prompt[j + 1]
        assert prompt_lp.token_ids[j][0] == target
        assert abs(prompt_lp.logprobs[j][0] - ref[j, target].item()) < 1e-4
        top2 = torch.topk(ref[j], 2)
        assert prompt_lp.token_ids[j][1:] == top2.indices.tolist()
        assert prompt_lp.ranks[j] == int((ref[j] > ref[j, target]).sum()) + 1

    for step, out in enumerate(outs):
        row = len(prompt) - 1 + step
        lp = out.new_logprobs
        assert lp is not None and len(lp) == 1
        token = out.new_token_ids[0]
        assert lp.token_ids[0][0] == token and lp.ranks[0] == 1  # greedy picks rank 1
        assert abs(lp.logprobs[0][0] - ref[row, token].item()) < 1e-4
        assert lp.token_ids[0][1:] == torch.topk(ref[row], 3).indices.tolist()


BAD_INPUTS = [
    ("prompt_token_ids", dict(prompt=[]), {}),
    ("prompt_token_ids", dict(prompt=list(range(3, 300))), {}),
    ("prompt_token_ids[1]", dict(prompt=[5, 10**7]), {}),
    ("max_tokens", {}, dict(max_tokens=0)),
    ("temperature", {}, dict(temperature=-0.5)),
    ("top_p", {}, dict(top_p=0.0)),
    ("top_p", {}, dict(top_p=1.5)),
    ("top_k", {}, dict(top_k=0)),
    ("top_k", {}, dict(top_k=-2)),
    ("min_p", {}, dict(min_p=1.5)),
    ("n", {}, dict(n=0)),
    ("logprobs", {}, dict(logprobs=6)),
]


@pytest.mark.parametrize(("field", "req", "params"), BAD_INPUTS)
def test_bad_input_names_the_field_and_engine_keeps_serving(
    core: EngineCore, field: str, req: dict, params: dict
) -> None:
    good = EngineCoreRequest("good", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    core.add_request(good)
    bad = EngineCoreRequest("bad", req.get("prompt", [5, 6, 7]), SamplingParams(**params))
    with pytest.raises(InvalidRequestError) as info:
        core.add_request(bad)
    assert info.value.field == field
    assert field.split("[")[0] in str(info.value)
    outs = _drain(core)
    assert len([t for o in outs["good"] for t in o.new_token_ids]) == 3
    assert "bad" not in outs
    core.kv_manager.pool.check_all_free()


def test_abort_reports_and_frees(core: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", [5] * 40, params))
    core.add_request(EngineCoreRequest("b", [6] * 40, params))
    core.step()
    core.abort_requests(["a"])
    outs = core.step()
    aborted = [o for o in outs.all_outputs() if o.request_id == "a"]
    assert aborted and aborted[0].finish_reason == FinishReason.ABORT
    assert "a" in (outs.finished_requests or set())
    core.abort_requests(["b"])
    assert not core.has_unfinished_requests()
    core.kv_manager.pool.check_all_free()


def test_warm_up_shapes_cover_each_integer_class() -> None:
    shapes = warm_up_shapes(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096, block_size=16)
    for axis in range(3):  # sequences, tokens per sequence, block-table width
        assert {shape[axis] for shape in shapes} == {1, 2, 16}
    assert (1, 1, 1) in shapes and (16, 16, 16) in shapes and len(set(shapes)) == 27
    # Within the engine's limits: sequences, tokens a step, context length.
    small = warm_up_shapes(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=40, block_size=16)
    assert small and all(s <= 8 and s * t <= 24 and w <= 3 for s, t, w in small)
    assert {s for s, _, _ in small} == {1, 2} and {w for _, _, w in small} == {1, 2}


def test_warm_up_forwards_leave_the_engine_as_it_was(core: EngineCore) -> None:
    """Every warm-up shape runs (consistent metadata on a scratch cache); the engine's
    own KV cache is not written and it serves as before."""
    before = [(k.clone(), v.clone()) for k, v in core.runner.kv_caches]
    cfg = core.config
    shapes = warm_up_shapes(cfg.max_num_seqs, cfg.max_num_batched_tokens, core.max_model_len, cfg.block_size)
    assert len(shapes) == 27
    scratch = ScratchForward(cfg, core.model, core.model.config, core.executor)
    for shape in shapes:
        scratch(*shape)
    for (k0, v0), (k1, v1) in zip(before, core.runner.kv_caches, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    rng = random.Random(5)
    core.add_request(EngineCoreRequest("after-warm-up", _prompt(core, 20, rng), SamplingParams(max_tokens=4)))
    assert len([t for o in _drain(core)["after-warm-up"] for t in o.new_token_ids]) == 4


def test_kv_budget_too_small_is_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ConfigError, match="max_model_len=1024 needs 64 blocks"):
        EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=1024, num_gpu_blocks_override=10))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=10**6))


def test_kv_blocks_follow_the_memory_budget(tiny_llama_dir: str) -> None:
    budget = 4 * 1024 * 1024
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=256, kv_cache_memory_bytes=budget))
    mc = core.model_config
    block_bytes = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    assert core.num_blocks == budget // block_bytes


def test_core_loop_thread_and_utilities(tiny_llama_dir: str) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=32))
    loop = EngineCoreLoop(lambda: core)
    loop.start()
    loop.add_request(EngineCoreRequest("x", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)))
    loop.call_utility(UtilityCall(call_id=7, method="reset_prefix_cache"))
    loop.call_utility(UtilityCall(call_id=8, method="no_such_method"))
    tokens, utility = [], {}
    while len(tokens) < 5 or len(utility) < 2:
        item = loop.outputs.get(timeout=30)
        assert isinstance(item, EngineCoreOutputs)
        tokens += [t for o in item.all_outputs() for t in o.new_token_ids]
        if item.utility_output is not None:
            utility[item.utility_output.call_id] = item.utility_output
    assert len(tokens) == 5
    assert utility[7].failure_message is None and isinstance(utility[7].result, int)
    assert "no_such_method" in (utility[8].failure_message or "")
    loop.shutdown()
    assert not loop.is_alive


def test_core_loop_reports_engine_death(tiny_llama_dir: str) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=32))

    def broken(*args: object) -> None:
        raise RuntimeError("simulated device failure")

    core.runner.execute = broken  # type: ignore[method-assign]
    loop = EngineCoreLoop(lambda: core)
    loop.start()
    loop.add_request(EngineCoreRequest("x", [5, 6, 7], SamplingParams(max_tokens=5)))
    item = loop.outputs.get(timeout=30)
    assert isinstance(item, EngineDead) and "simulated device failure" in item.message
    assert not loop.is_alive


def test_core_loop_builds_the_core_on_its_own_thread(tiny_llama_dir: str) -> None:
    # Every torch op of an engine process runs on the loop thread: one OpenMP team.
    built_on: list[threading.Thread] = []

    def make_core() -> EngineCore:
        built_on.append(threading.current_thread())
        return EngineCore(EngineConfig(model=tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=32))

    loop = EngineCoreLoop(make_core)
    loop.start()
    core = loop.started.result(timeout=60)
    assert isinstance(core, EngineCore)
    assert built_on == [loop._thread] and built_on[0] is not threading.current_thread()
    loop.shutdown()


def test_core_loop_start_up_failure_reaches_the_starter() -> None:
    def make_core() -> EngineCore:
        raise ConfigError("no such checkpoint")

    loop = EngineCoreLoop(make_core)
    loop.start()
    with pytest.raises(ConfigError, match="no such checkpoint"):
        loop.started.result(timeout=10)
    loop._thread.join(5)
    assert not loop.is_alive
