"""Tensor parallelism (engine_service/distributed): TP=2 against TP=1 and Hugging Face.

One TP=2 engine (its worker process and gloo group) and one TP=1 engine are built per
checkpoint and reused by the four parity set-ups: a set-up only changes what the
engine process owns (token budget, number of KV blocks in use, prefix caching), so
``_reconfigure`` gives both cores a fresh scheduler and block manager instead of
starting new workers. Each step's logits (every row the sampler sees) are recorded on
both and must agree within 1e-4; greedy tokens must equal HF generate().
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from engine_service.config import ConfigError, EngineConfig
from engine_service.core import EngineCore
from engine_service.distributed.sharding import ShardPlan
from engine_service.engine_step import SyncStep
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.make_model import make_model
from engine_service.scheduler import Scheduler
from engine_service.step_observer import StepObserver
from engine_service.step_outputs import StepOutputs
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import SamplingParams
from tests.factories import hf_greedy

MAX_MODEL_LEN = 128
KV_BLOCKS = 48  # allocated once per engine; set-ups use at most this many
LENGTHS = [1, 7, 14, 45, 60]  # with the prefix and max_tokens: decodes cross block edges
MAX_TOKENS = [12, 6, 10, 3, 8]
PREFIX = 24  # prompts 1 and 4 start with the same 24 tokens

SETUPS = {
    "fits": dict(max_num_batched_tokens=1024, num_blocks=KV_BLOCKS, prefix=False),
    "chunked": dict(max_num_batched_tokens=16, num_blocks=KV_BLOCKS, prefix=False),
    "preempt": dict(max_num_batched_tokens=64, num_blocks=7, prefix=False),
    "prefix": dict(max_num_batched_tokens=256, num_blocks=KV_BLOCKS, prefix=True),
}


@pytest.fixture(scope="session")
def tiny_llama_1kv_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama with one kv head: with TP=2 both ranks hold (a replica of) it."""
    return make_model(tmp_path_factory.mktemp("tiny_llama_1kv"), preset="tiny", seed=1, num_kv_heads=1)


class LogitRecorder:
    """Wraps a core's sampler; keeps a copy of every logits batch it is given."""

    def __init__(self, sampler: object) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, metadata: object) -> object:
        self.logits.append(logits.detach().clone())
        return self.sampler(logits, metadata)  # type: ignore[operator]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The runner's path for batches of plain greedy rows."""
        self.logits.append(logits.detach().clone())
        return self.sampler.argmax(logits)  # type: ignore[attr-defined]


@dataclass
class Case:
    model_dir: str
    prompts: list[list[int]]
    expected: list[list[int]]  # HF greedy
    tp1: EngineCore
    tp2: EngineCore


def _config(model_dir: str, tp: int) -> EngineConfig:
    return EngineConfig(
        model=model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_gpu_blocks_override=KV_BLOCKS,
        tensor_parallel_size=tp, num_threads=1,
    )


@pytest.fixture(
    scope="module",
    params=[
        "tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_llama_1kv_dir",
        "tiny_mistral_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
        "tiny_phi3_dir", "tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir",
    ],
)
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    model_dir = request.getfixturevalue(request.param)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(14)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]
    prompts[1] = prompts[4][:PREFIX] + prompts[1]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    tp2 = EngineCore(_config(model_dir, 2))
    try:
        yield Case(model_dir, prompts, expected, EngineCore(_config(model_dir, 1)), tp2)
    finally:
        tp2.shutdown()


def _reconfigure(core: EngineCore, max_num_batched_tokens: int, num_blocks: int, prefix: bool) -> LogitRecorder:
    """A fresh scheduler and block manager over the first ``num_blocks`` blocks of the
    allocated cache (the workers hold only tensors, so they need nothing new)."""
    core.kv_manager = KVCacheManager(num_blocks, core.config.block_size, prefix)
    core.runner.kv = core.kv_manager
    core.scheduler = Scheduler(
        core.kv_manager, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=core.max_model_len, policy="fcfs", enable_chunked_prefill=True,
    )
    # The step's parts read the scheduler they were built with: rebuilt over the new one.
    execution = core.engine_step.execution
    execution.observer = core.observer = StepObserver(core.scheduler, core.admission.drain_rate)
    core.outputs = StepOutputs(core.scheduler, core.engine_index)
    core.engine_step = SyncStep(core.scheduler, execution, core.outputs)
    recorder = LogitRecorder(core.runner.sampler)
    core.runner.sampler = recorder  # type: ignore[assignment]
    # Logits on every step for the comparison: no LM-head argmax without them on TP=1.
    core.runner.model.greedy_tokens = lambda hidden: None  # type: ignore[method-assign]
    return recorder


def _run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams], waves: list[list[int]]) -> dict:
    """Prompts by wave; request id -> (tokens, logprobs, prompt logprobs, cached tokens),
    and the preemptions seen."""
    got: dict[str, list] = {}
    preemptions = 0
    for wave in waves:
        for i in wave:
            got[f"r{i}"] = [[], [], None, 0]
            core.add_request(EngineCoreRequest(f"r{i}", prompts[i], params[i], eos_token_id=None))
        while core.has_unfinished_requests():
            outs = core.step()
            preemptions += outs.scheduler_stats.num_preemptions
            for o in outs.all_outputs():
                entry = got[o.request_id]
                entry[0] += o.new_token_ids
                if o.new_logprobs is not None:
                    entry[1] += o.new_logprobs.logprobs
                if o.new_prompt_logprobs is not None:
                    entry[2] = o.new_prompt_logprobs.logprobs
                entry[3] = o.num_cached_tokens
    core.kv_manager.pool.check_all_free()
    return {"requests": got, "preemptions": preemptions}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_tp2_matches_tp1_logits_and_hf_tokens(case: Case, setup: str) -> None:
    n = len(case.prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    params[2] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[2], ignore_eos=True, logprobs=3, prompt_logprobs=2)
    # A sampled request too: seeded, so both engines draw the same tokens from the same logits.
    prompts = [*case.prompts, case.prompts[3][:9]]
    params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True))
    waves = [[0, 1, 2, 5], [3, 4]] if SETUPS[setup]["prefix"] else [list(range(n + 1))]
    results, recorders = [], []
    for core in (case.tp1, case.tp2):
        recorders.append(_reconfigure(core, **SETUPS[setup]))  # type: ignore[arg-type]
        results.append(_run(core, prompts, params, waves))
    one, two = (r["requests"] for r in results)
    for i, want in enumerate(case.expected):
        assert two[f"r{i}"][0] == want, f"{setup}: prompt {i} (len {len(case.prompts[i])}) diverged from HF"
    assert two[f"r{n}"][0] == one[f"r{n}"][0]  # the sampled one
    assert max(len(set(e)) for e in case.expected) > 3  # diverse enough for the comparison to bite
    # Same scheduling on both, so the same logits batches in the same order.
    assert [t.shape for t in recorders[0].logits] == [t.shape for t in recorders[1].logits]
    for a, b in zip(recorders[0].logits, recorders[1].logits, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    for key in (1, 2):  # logprobs, prompt logprobs of request 2
        torch.testing.assert_close(torch.tensor(two["r2"][key]), torch.tensor(one["r2"][key]), atol=1e-4, rtol=0)
    preemptions = [r["preemptions"] for r in results]
    assert preemptions[0] == preemptions[1]
    assert (preemptions[1] > 0) == (setup == "preempt")
    cached = {rid: entry[3] for rid, entry in two.items()}
    if SETUPS[setup]["prefix"]:
        assert cached["r4"] >= 16  # the second wave reused the first's shared-prefix block
    else:
        assert sum(cached.values()) == 0


def _greedy_and_embedding(core: EngineCore, prompt: list[int], tag: str) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request(EngineCoreRequest(f"g{tag}", prompt, params, eos_token_id=None))
    core.add_request(
        EngineCoreRequest(f"e{tag}", prompt, SamplingParams(), pooling_params=PoolingParams(pooling_type="MEAN"))
    )
    tokens: list[int] = []
    embedding: list[float] = []
    while core.has_unfinished_requests():
        for o in core.step().all_outputs():
            tokens += o.new_token_ids
            embedding = o.pooling_output or embedding
    return tokens, embedding


def test_tp2_pools_sleeps_and_wakes_like_tp1(case: Case) -> None:
    for core in (case.tp1, case.tp2):
        _reconfigure(core, **SETUPS["fits"])  # type: ignore[arg-type]
    prompt = case.prompts[3]
    want_tokens, want_embedding = _greedy_and_embedding(case.tp1, prompt, "ref")
    assert _greedy_and_embedding(case.tp2, prompt, "ref")[0] == want_tokens
    for level in (1, 2):
        case.tp2.sleep(level)
        assert case.tp2.is_sleeping() and case.tp2.kv_cache_bytes == 0
        case.tp2.wake_up()  # the worker reloads its shard (level 2) and its KV cache
        tokens, embedding = _greedy_and_embedding(case.tp2, prompt, f"woken{level}")
        assert tokens == want_tokens, f"after sleep level {level}"
        torch.testing.assert_close(torch.tensor(embedding), torch.tensor(want_embedding), atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="one tensor-parallel engine per process"):
        EngineCore(_config(case.model_dir, 2))


# ---- sharding rules ----------------------------------------------------------------


def _model_config(tiny_llama_dir: str, **changes: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(ModelConfig.from_pretrained(tiny_llama_dir), **changes)


def test_shard_plan_splits_heads_and_replicates_too_few_kv_heads(tiny_llama_dir: str) -> None:
    config = _model_config(tiny_llama_dir, num_heads=8, num_kv_heads=2, vocab_size=1001)
    plans = [ShardPlan.build(config, r, 4) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # q heads 2r, 2r+1 read kv head (2r) // 4 = r // 2, replicated on two ranks.
    assert all(p.kv_replicated and p.num_kv_heads == 1 for p in plans)
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [(p.vocab_start, p.vocab_stop) for p in plans] == [(0, 251), (251, 502), (502, 753), (753, 1001)]
    split = ShardPlan.build(config, 1, 2)
    assert (split.kv_replicated, split.kv_heads, split.q_heads) == (False, (1, 2), (4, 8))


def test_shard_plan_splits_uneven_kv_heads_by_whole_groups(tiny_llama_dir: str) -> None:
    # bench-135m's shape: 9 q heads in 3 groups over 2 ranks -> 1 and 2 groups.
    config = _model_config(tiny_llama_dir, num_heads=9, num_kv_heads=3)
    plans = [ShardPlan.build(config, r, 2) for r in range(2)]
    assert [(p.kv_heads, p.q_heads) for p in plans] == [((0, 1), (0, 3)), ((1, 3), (3, 9))]
    assert plans[0].max_num_kv_heads == 2
    local = plans[1].local_config
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (6, 2, config.head_dim)


def test_shard_plan_refuses_families_it_does_not_split(tiny_olmoe_dir: str) -> None:
    for model_dir, why in ((tiny_olmoe_dir, "all of q and k"),):
        with pytest.raises(ConfigError, match=why):
            ShardPlan.build(ModelConfig.from_pretrained(model_dir), 0, 2)


def test_shard_plan_rejects_models_that_do_not_split(tiny_llama_dir: str) -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads=2 below it"):
        ShardPlan.build(_model_config(tiny_llama_dir), 0, 3)
    with pytest.raises(ConfigError, match="intermediate_size=130"):
        ShardPlan.build(_model_config(tiny_llama_dir, intermediate_size=130), 0, 4)


def test_config_refuses_lora_and_bad_settings_with_tensor_parallelism() -> None:
    with pytest.raises(ConfigError, match="enable_lora is not supported with tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive"):
        EngineConfig(model="m", tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="distributed_backend"):
        EngineConfig(model="m", distributed_backend="mpi")  # type: ignore[arg-type]

