"""Our decoder vs Hugging Face's modelling code, through a paged KV cache; loader errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine_service.attention import AttentionMetadata
from engine_service.models import DecoderForCausalLM, ModelConfig, ModelLoadError, load_model
from engine_service.models.rotary import _INV_FREQ_BUILDERS, build_cos_sin_cache
from kernels.dispatch import get_ops
from tandem.protocol.model_config import SUPPORTED_ROPE_TYPES

BLOCK_SIZE = 16
NUM_BLOCKS = 24
ARCH_FIXTURES = ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]


class PagedBatchBuilder:
    """Hands out shuffled KV blocks per sequence and builds one step's AttentionMetadata."""

    def __init__(self, config: ModelConfig, generator: torch.Generator) -> None:
        shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        # Finite garbage: a kernel reading an unwritten slot changes the logits.
        self.kv_caches = [
            (torch.randn(shape, generator=generator) * 5, torch.randn(shape, generator=generator) * 5)
            for _ in range(config.num_layers)
        ]
        self.free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        self.blocks: dict[int, list[int]] = {}

    def step(
        self, chunks: list[tuple[int, int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``chunks``: (sequence id, tokens already cached, new token ids) per sequence."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq, num_cached, new in chunks:
            blocks = self.blocks.setdefault(seq, [])
            total = num_cached + len(new)
            while len(blocks) * BLOCK_SIZE < total:
                blocks.append(self.free.pop())
            for pos in range(num_cached, total):
                positions.append(pos)
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += new
            starts.append(starts[-1] + len(new))
            seq_lens.append(total)
        width = max(len(self.blocks[seq]) for seq, _, _ in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (seq, _, _) in enumerate(chunks):
            tables[row, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_query_len=max(len(new) for _, _, new in chunks),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize(("backend", "pack"), [("torch", None), ("cpu", "onednn"), ("cpu", "panel")])
@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_paged_forward_matches_hf(
    fixture: str, backend: str, pack: str | None, request: pytest.FixtureRequest
) -> None:
    """The CPU set-ups: PyTorch reference ops with F.linear, and native decode attention
    with oneDNN-packed or panel-packed (the float32 default) linear layers and LM head."""
    model_dir: str = request.getfixturevalue(fixture)
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"), get_ops(backend))
    if pack:
        model.pack_linears(pack)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = config.vocab_size
    prompt_lens = {0: 1, 1: 21, 2: 33}  # sequence 3 arrives later as a 45-token prompt in 2 chunks
    seqs = {s: torch.randint(0, vocab, (n,), generator=gen).tolist() for s, n in prompt_lens.items()}
    long_prompt = torch.randint(0, vocab, (45,), generator=gen).tolist()
    paged = PagedBatchBuilder(config, gen)
    max_err = 0.0

    def run(chunks: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        nonlocal max_err
        ids, positions, meta = paged.step(chunks)
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, positions, paged.kv_caches, meta))
        assert logits.shape == (ids.shape[0], vocab) and logits.dtype == torch.float32
        rows = []
        for s, (seq, num_cached, new) in enumerate(chunks):
            ours = logits[meta.query_start_loc[s] : meta.query_start_loc[s + 1]]
            full = seqs[seq] if seq in seqs else long_prompt[: num_cached + len(new)]
            expected = _hf_logits(hf, full)[num_cached:]
            max_err = max(max_err, (ours - expected).abs().max().item())
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
            rows.append(ours[-1])
        return rows

    # (a) one flattened prefill of three prompts (lengths 1, 21, 33).
    last = run([(s, 0, list(t)) for s, t in seqs.items()])
    # (b) decodes mixed with a chunked prefill: sequence 3's 45 tokens as 20 + 25.
    for step, (chunk_start, chunk_end) in enumerate([(0, 20), (20, 45), (None, None)]):
        chunks = []
        for s in seqs:
            next_token = int(last[s].argmax())
            seqs[s].append(next_token)
            chunks.append((s, len(seqs[s]) - 1, [next_token]))
        if chunk_start is not None:
            chunks.append((3, chunk_start, long_prompt[chunk_start:chunk_end]))
        last = run(chunks)
        assert len(last) == len(chunks), step
    assert max_err < 1e-4


def test_lean_forward_keeps_caches_and_rejects_bad_input(tiny_qwen3_dir: str) -> None:
    model, config = load_model(tiny_qwen3_dir, torch.float32, torch.device("cpu"), get_ops("torch"))
    paged = PagedBatchBuilder(config, torch.Generator().manual_seed(1))
    ids, positions, meta = paged.step([(0, 0, [5, 6, 7])])
    with pytest.raises(ValueError, match="KV caches"):
        model(ids, positions, paged.kv_caches[:-1], meta)
    with pytest.raises(ValueError, match="num_tokens"):
        model(ids[None], positions[None], paged.kv_caches, meta)
    with torch.inference_mode():
        hidden = model(ids, positions, paged.kv_caches, meta)
    assert hidden.shape == (3, config.hidden_size)
    # The new keys landed in the cache slots named by slot_mapping.
    key_cache = paged.kv_caches[0][0].view(-1, config.num_kv_heads, config.head_dim)
    assert not torch.equal(key_cache[meta.slot_mapping], torch.zeros(3, config.num_kv_heads, config.head_dim))


def test_model_config_fields(tiny_llama_dir: str, tiny_qwen2_dir: str, tiny_qwen3_dir: str) -> None:
    llama = ModelConfig.from_pretrained(tiny_llama_dir)
    assert llama.architecture == "LlamaForCausalLM" and llama.tie_word_embeddings
    assert llama.rope_type == "llama3" and llama.rope_scaling is not None
    assert llama.rope_scaling["original_max_position_embeddings"] == 256
    assert llama.eos_token_ids == [2, 4] and llama.bos_token_id == 1
    assert llama.torch_dtype == "float32" and llama.head_dim == 16
    qwen2 = ModelConfig.from_pretrained(tiny_qwen2_dir)
    assert qwen2.features.qkv_bias and not qwen2.features.o_proj_bias and not qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_pretrained(tiny_qwen3_dir)
    assert qwen3.features.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    assert qwen3.rope_type == "default" and qwen3.rope_scaling is None


def test_model_config_reads_transformers4_rope_fields() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [7, 8],
    }
    config = ModelConfig.from_dict(raw, generation_config={"eos_token_id": 9})
    assert config.rope_theta == 500000.0 and config.rope_type == "linear"
    assert config.num_kv_heads == 4 and config.head_dim == 16
    assert config.eos_token_ids == [7, 8, 9] and not config.tie_word_embeddings


@pytest.mark.parametrize(
    ("rope_type", "scaling"),
    [
        ("default", {}),
        ("linear", {"factor": 4.0}),
        (
            "llama3",
            {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
        ),
    ],
)
def test_rotary_cache_matches_transformers(rope_type: str, scaling: dict[str, float]) -> None:
    head_dim, theta, max_pos = 32, 10000.0, 300
    hf_config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": rope_type, "rope_theta": theta, **scaling},
    )
    if rope_type == "default":
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        assert factor == 1.0
    cache = build_cos_sin_cache(head_dim, max_pos, theta, {"rope_type": rope_type, **scaling})
    assert cache.shape == (max_pos, head_dim) and cache.dtype == torch.float32
    angles = torch.outer(torch.arange(max_pos).float(), inv_freq.float())
    torch.testing.assert_close(cache[:, : head_dim // 2], angles.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, head_dim // 2 :], angles.sin(), atol=1e-6, rtol=0)


def test_rope_types_agree_and_unknown_is_refused() -> None:
    assert set(_INV_FREQ_BUILDERS) == SUPPORTED_ROPE_TYPES
    with pytest.raises(ModelLoadError, match="'yarn'"):
        build_cos_sin_cache(16, 32, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="'low_freq_factor'"):
        build_cos_sin_cache(16, 32, 10000.0, {"rope_type": "llama3", "factor": 2.0})


def _state(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_identical_weights(tiny_qwen2_dir: str, tmp_path: Path) -> None:
    from engine_service.make_model import make_model

    sharded = make_model(tmp_path / "sharded", arch="qwen2", preset="tiny", seed=0, max_shard_size="100KB")
    index = json.loads((Path(sharded) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (Path(sharded) / "model.safetensors").exists()
    single, _ = load_model(tiny_qwen2_dir)
    split, _ = load_model(sharded)
    a, b = _state(single), _state(split)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_tied_embeddings_share_storage(tiny_llama_dir: str, tiny_llama_untied_dir: str) -> None:
    tied, _ = load_model(tiny_llama_dir)
    assert tied.lm_head is None and tied.lm_head_weight is tied.embed_tokens
    untied, _ = load_model(tiny_llama_untied_dir)
    assert untied.lm_head is not None
    assert not torch.equal(untied.lm_head_weight, untied.embed_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load(tiny_llama_dir: str, dtype: torch.dtype) -> None:
    model, config = load_model(tiny_llama_dir, dtype)
    full, _ = load_model(tiny_llama_dir, torch.float32)
    assert all(p.dtype == dtype for p in model.parameters())
    assert torch.equal(model.embed_tokens, full.embed_tokens.to(dtype))
    builder = PagedBatchBuilder(config, torch.Generator().manual_seed(2))
    ids, positions, meta = builder.step([(0, 0, torch.randint(0, config.vocab_size, (9,)).tolist())])
    caches = [(k.to(dtype), v.to(dtype)) for k, v in builder.kv_caches]
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, caches, meta))
        ref = full.compute_logits(full(ids, positions, builder.kv_caches, meta))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # Loose: half precision through 2 layers; the argmax mostly agrees.
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


# ---- loader errors -------------------------------------------------------------------------


def _copy(src: str, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(ckpt: Path, **changes: object) -> None:
    path = ckpt / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def test_missing_dir_and_files(tiny_llama_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    ckpt = _copy(tiny_llama_dir, tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(str(ckpt))
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(ckpt))


def test_bad_config_fields(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(ckpt))
    _edit_config(ckpt, architectures=["LlamaForCausalLM"], hidden_size=None)
    with pytest.raises(ModelLoadError, match=r"config\.json.*'hidden_size' is missing"):
        load_model(str(ckpt))
    _edit_config(ckpt, hidden_size=64, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        load_model(str(ckpt))
    _edit_config(ckpt, num_key_value_heads=2, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope type 'yarn'"):
        load_model(str(ckpt))


def test_tensor_shape_and_completeness_errors(tiny_qwen2_dir: str, tmp_path: Path) -> None:
    ckpt = _copy(tiny_qwen2_dir, tmp_path)
    weights_path = ckpt / "model.safetensors"
    original = load_file(weights_path)

    bad = dict(original)
    name = "model.layers.1.self_attn.k_proj.weight"
    bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
    save_file(bad, weights_path)
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors.*{name}.*\[33, 64\].*\[32, 64\]"):
        load_model(str(ckpt))

    missing = {k: v for k, v in original.items() if k != "model.layers.0.self_attn.q_proj.bias"}
    save_file(missing, weights_path)
    with pytest.raises(ModelLoadError, match=r"lacks tensors model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(str(ckpt))

    save_file({**original, "model.extra.weight": torch.zeros(2)}, weights_path)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.extra\.weight'"):
        load_model(str(ckpt))

    # An untied checkpoint must carry lm_head.weight.
    save_file({k: v for k, v in original.items() if k != "lm_head.weight"}, weights_path)
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_model(str(ckpt))


def test_duplicate_tensor_across_shards(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2 + 1]}, ckpt / "a.safetensors")
    save_file({n: tensors[n] for n in names[len(names) // 2 :]}, ckpt / "b.safetensors")
    (ckpt / "model.safetensors").unlink()
    weight_map = {n: "a.safetensors" for n in names[: len(names) // 2 + 1]}
    weight_map.update({n: "b.safetensors" for n in names[len(names) // 2 + 1 :]})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    dup = names[len(names) // 2]
    with pytest.raises(ModelLoadError, match=rf"b\.safetensors.*'{dup}' was already loaded"):
        load_model(str(ckpt))


def test_bad_dtype_is_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_llama_dir, torch.int8)
