"""The families beyond Llama/Qwen: greedy tokens equal transformers' on random-weight
checkpoints (Mistral, Gemma 2 and 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in the
parity set-ups, and the pieces they add checked on their own: config parsing, the
windowed / soft-capped attention, LongRoPE's long factors, the MoE routing.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.make_model import TINY_WINDOW
from engine_service.models.moe import MoEBlock
from engine_service.models.rotary import build_cos_sin_cache
from kernels import reference
from tandem.protocol.model_config import ModelConfig, ModelLoadError
from tandem.protocol.sampling_params import SamplingParams
from tests.conftest import FAMILY_FIXTURES
from tests.factories import hf_greedy
from tests.test_engine_parity import MAX_MODEL_LEN, SETUPS, _workload, run_engine

FAMILIES = list(FAMILY_FIXTURES)
# Chunked prefill, preemption with recompute, prefix caching (two waves), and prefix
# caching under async scheduling.
FAMILY_SETUPS = ["chunked", "preempt", "prefix", "async-prefix"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request: pytest.FixtureRequest) -> tuple[str, list[list[int]], list[int], list[list[int]]]:
    model_dir = request.getfixturevalue(request.param)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts, max_tokens = _workload(vocab, seed=FAMILIES.index(request.param))
    return model_dir, prompts, max_tokens, hf_greedy(model_dir, prompts, max_tokens)


@pytest.mark.parametrize("setup", FAMILY_SETUPS)
def test_family_greedy_matches_hf(family_case, setup: str) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, max_tokens, expected = family_case
    settings = dict(SETUPS[setup])
    if setup == "preempt":
        # Sliding-window layers hold only their window, so a decoding request stops growing:
        # chunked prefill into the smallest cache one max_model_len request allows makes
        # running requests compete for blocks in every family.
        settings.update(max_num_batched_tokens=128, num_gpu_blocks_override=MAX_MODEL_LEN // 16)
    core = EngineCore(EngineConfig(model=model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, **settings))
    moe_blocks = [m for m in core.runner.model.modules() if isinstance(m, MoEBlock)]
    # The CPU set-ups pack linear layers into panels: the experts too, for the native op.
    assert all(block.packed is not None and block.w13 is None for block in moe_blocks)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    prefix = bool(SETUPS[setup]["enable_prefix_caching"])
    tokens, cached, preemptions = run_engine(core, prompts, params, waves=2 if prefix else 1)
    for i, want in enumerate(expected):
        assert tokens[f"r{i}"] == want, f"{setup}: prompt {i} (len {len(prompts[i])}) diverged"
    assert len(set(expected[0])) > 4  # diverse enough for the comparison to bite
    if setup == "preempt":
        assert preemptions > 0
    if prefix:
        assert all(cached[f"r{i}"] >= 48 for i in (14, 15))


def test_family_configs_read_as_their_families_are(
    tiny_mistral_dir: str, tiny_gemma2_dir: str, tiny_gemma3_dir: str, tiny_phi3_dir: str, tiny_qwen2_moe_dir: str
) -> None:
    mistral = ModelConfig.from_pretrained(tiny_mistral_dir)
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.sliding_window == TINY_WINDOW
    gemma2 = ModelConfig.from_pretrained(tiny_gemma2_dir)
    f = gemma2.features
    assert gemma2.window_of(0) == TINY_WINDOW and gemma2.window_of(1) is None
    assert (f.attn_softcap, f.final_softcap, f.norm_offset, f.activation) == (50.0, 30.0, 1.0, "gelu_tanh")
    assert f.embed_scale == pytest.approx(math.sqrt(gemma2.hidden_size))
    assert f.query_scale == pytest.approx((2 * gemma2.head_dim) ** -0.5)
    gemma3 = ModelConfig.from_pretrained(tiny_gemma3_dir)
    assert gemma3.features.qk_norm and gemma3.rope_local_theta == 10000.0 and gemma3.rope_type == "linear"
    phi3 = ModelConfig.from_pretrained(tiny_phi3_dir)
    assert phi3.features.fused_checkpoint and phi3.rotary_dim == phi3.head_dim // 2 and phi3.rope_type == "longrope"
    moe = ModelConfig.from_pretrained(tiny_qwen2_moe_dir).moe
    assert moe is not None and moe.sparse_layers == (True, False) and moe.shared_intermediate_size > 0


def _base(**changes: object) -> dict:
    raw: dict = {
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "sliding_window": 16,
    }
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "'chunked_attention' are not supported"),
        ({"layer_types": ["full_attention"]}, "one type per layer"),
        ({"sliding_window": 0, "layer_types": ["sliding_attention"] * 2}, "positive sliding_window"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in (0, 1]"),
        ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 0},
         "num_experts_per_tok"),
    ],
)
def test_family_configs_refuse_what_the_decoder_cannot_run(changes: dict, message: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(_base(**changes))
    assert message in str(err.value)


def _dense_attention(q, k, v, scale, window, softcap):  # type: ignore[no-untyped-def]
    """One sequence, every key materialized: [n, heads, d] x [n, kv_heads, d]."""
    n, heads = q.shape[:2]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 5.0), (20, 3.0)])
def test_windowed_attention_equals_dense_masked_attention(window: int | None, softcap: float | None) -> None:
    """A prompt in two chunks and then decode steps, over a shuffled paged cache; the
    blocks wholly before the window are poisoned with NaN, so reading one would show."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    n, heads, kvh, d, bs = 45, 4, 2, 8, 4
    q = torch.randn(n, heads, d, generator=gen)
    k = torch.randn(n, kvh, d, generator=gen)
    v = torch.randn(n, kvh, d, generator=gen)
    want = _dense_attention(q, k, v, 0.3, window, softcap)
    num_blocks = -(-n // bs)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    key_cache = torch.full((num_blocks, bs, kvh, d), float("nan"))
    value_cache = torch.full((num_blocks, bs, kvh, d), float("nan"))
    for pos in range(n):
        key_cache[table[pos // bs], pos % bs] = k[pos]
        value_cache[table[pos // bs], pos % bs] = v[pos]
    got = torch.empty_like(q)
    for start, stop in ((0, 30), (30, 31), *((p, p + 1) for p in range(31, n))):
        if window is not None:  # blocks no query from here on can see: poisoned
            for b in range(max(0, start - window + 1) // bs):
                key_cache[table[b]] = float("nan")
                value_cache[table[b]] = float("nan")
        out = torch.empty(stop - start, heads, d)
        reference.windowed_paged_attention(
            q[start:stop], key_cache, value_cache, table[None, :],
            torch.tensor([0, stop - start], dtype=torch.int32), torch.tensor([stop], dtype=torch.int32),
            0.3, out=out, sliding_window=window, softcap=softcap,
        )
        got[start:stop] = out
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_longrope_long_factors_match_transformers_past_the_original_context(tiny_phi3_dir: str) -> None:
    """Positions at or past original_max_position_embeddings rotate by the long factors
    (what transformers does for a forward whose longest position is past it)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = ModelConfig.from_pretrained(tiny_phi3_dir)
    original = config.rope_scaling["original_max_position_embeddings"]  # type: ignore[index]
    ours = build_cos_sin_cache(config.rope_dim, original * 2, config.rope_theta, config.rope_scaling)
    rotary = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tiny_phi3_dir))
    half = config.rope_dim // 2
    for positions in (torch.arange(0, original), torch.arange(original, 2 * original)):
        cos, sin = rotary(torch.zeros(1, 1), positions[None, :])
        torch.testing.assert_close(ours[positions, :half], cos[0, :, :half], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[positions, half:], sin[0, :, :half], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_mistral_dir", "tiny_gemma2_dir"])
def test_sliding_layers_hold_only_their_window(fixture: str, request: pytest.FixtureRequest) -> None:
    """A sequence of ~8 windows: the sliding layers' blocks stay within the window plus one
    chunk while the full layers' (Gemma 2's every other layer) grow with it; tokens as HF's."""
    from engine_service.kv_cache.sliding import SlidingWindowBlocks
    from tandem.protocol.outputs import EngineCoreRequest

    model_dir = request.getfixturevalue(fixture)
    chunk, bs = 64, 16
    core = EngineCore(EngineConfig(
        model=model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=chunk,
        enable_prefix_caching=False, device="cpu", block_size=bs,
    ))
    window = core.kv_manager.window
    assert window is not None and window.window == TINY_WINDOW
    prompt = [(7 * i) % 1000 + 3 for i in range(150)]
    core.add_request(EngineCoreRequest("long", prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
    tokens: list[int] = []
    held: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens += out.new_token_ids
        held.append(window.num_held("long"))
    bound = SlidingWindowBlocks.blocks_needed_per_request(TINY_WINDOW, bs, chunk)
    assert max(held) <= bound < -(-250 // bs)  # 7 blocks where the whole sequence takes 16
    assert held[-2] <= -(-TINY_WINDOW // bs) + 1  # decoding: the window and the block being filled
    assert tokens == hf_greedy(model_dir, [prompt], 100)[0]
    core.kv_manager.check_all_free()


def test_sliding_window_prefix_hit_needs_the_window_cached() -> None:
    """A prefix hit stops where a block its first step's window reads is gone."""
    from engine_service.kv_cache.sliding import SlidingWindowBlocks

    blocks = SlidingWindowBlocks(num_blocks=16, block_size=4, window=6, enable_caching=True)
    hashes = [bytes([i]) for i in range(8)]
    blocks.allocate("a", 0, 32)
    blocks.cache_blocks("a", 32, hashes)
    blocks.free("a")
    # A hit of 8 blocks reads from position 32 - 6 + 1 = 27 on: blocks 6 and 7.
    assert blocks.longest_hit(hashes, 8) == (8, [blocks.pool.get_cached_block(h) for h in hashes[6:8]])
    blocks.pool.get_new_blocks(16)  # evicts every cached block
    assert blocks.longest_hit(hashes, 8) == (0, [])
    blocks = SlidingWindowBlocks(num_blocks=16, block_size=4, window=6, enable_caching=True)
    blocks.allocate("b", 0, 32)
    blocks.cache_blocks("b", 32, hashes)
    # Block 6 (positions 24-27) gone from the cache: a hit can end at block 6 at most,
    # whose window (positions 19-23) is blocks 4 and 5.
    blocks.pool._evict(blocks.tables["b"][6])  # type: ignore[arg-type]
    assert blocks.longest_hit(hashes, 8)[0] == 6
    blocks.allocate("b", 32, 40)  # the window moved on: blocks before 27 // 4 = 6 freed
    assert [b is None for b in blocks.tables["b"]] == [True] * 6 + [False] * 4
    blocks.free("b")
    blocks.pool.check_all_free()
