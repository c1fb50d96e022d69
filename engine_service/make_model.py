"""Write random-weight Hugging Face checkpoints (with a locally trained tokenizer) for tests,
demos and benchmarks: ``tandem make-model --arch llama --preset tiny --out DIR``.

The checkpoint is built with transformers itself (config, model class, ``save_pretrained``)
so that it is exactly what a real checkpoint of that architecture looks like. Weights are
drawn from a seeded generator with a larger spread than transformers' default so that
tiny models give diverse greedy outputs. The same arguments always give the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tandem.model_source import build_directory_once
from tandem.model_source import cache_dir as model_cache_dir

Arch = Literal[
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"
]
PresetName = Literal["tiny", "hop", "demo", "bench-135m", "llama-1b", "mixtral-small", "mixtral-small-dense"]

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# --arch -> transformers' model_type, where the two differ.
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Families whose norms multiply by (1 + w): their stored scales are drawn around 0.
_OFFSET_NORMS = frozenset({"gemma2", "gemma3"})

# Special tokens take the first ids, in this order.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEMO_PRESET_VERSION = 1  # bump when the demo checkpoint's recipe changes


@dataclass(frozen=True)
class Preset:
    """Model shape and weight spread of one named preset."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # the tokenizer is trained to exactly this size
    max_position_embeddings: int
    rope_theta: float
    weight_std: float  # std of every matrix (embeddings included)
    qwen3_head_dim: int  # Qwen3 sets head_dim explicitly; tiny presets make it != hidden / heads


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 128, 1024, 2048, 10000.0, 0.15, qwen3_head_dim=32),
    # Sized so that a step of 256 decoding sequences on a CPU is about as short as a real model's
    # on a GPU: what the gRPC hop costs at that pace (benchmarks/split_cost.py).
    "hop": Preset(96, 3, 3, 1, 256, 2048, 2048, 10000.0, 0.1, qwen3_head_dim=32),
    "demo": Preset(256, 4, 8, 4, 768, 2048, 2048, 10000.0, 0.08, qwen3_head_dim=64),
    "bench-135m": Preset(576, 30, 9, 3, 1536, 49152, 2048, 100000.0, 0.05, qwen3_head_dim=64),
    # Llama-3.2-1B's layers (16 x hidden 2048, 32/8 heads, MLP 8192) with bench-135m's
    # vocabulary: 1.07B parameters, 2.15 GB in bf16 (the GPU check's batch-1 decode).
    "llama-1b": Preset(2048, 16, 32, 8, 8192, 49152, 2048, 500000.0, 0.02, qwen3_head_dim=64),
    # Mixtral 8x7B's proportions at a quarter of its width and depth (experts 3.5x hidden,
    # 8 of them, top-2 with --arch mixtral): 0.77B parameters, 0.21B active a token.
    "mixtral-small": Preset(1024, 8, 16, 4, 3584, 32000, 4096, 1000000.0, 0.02, qwen3_head_dim=64),
    # The same active parameters as one dense MLP (--arch llama): intermediate 2 x 3584.
    "mixtral-small-dense": Preset(1024, 8, 16, 4, 7168, 32000, 4096, 1000000.0, 0.02, qwen3_head_dim=64),
}

# Llama 3.1-style rope scaling of the tiny Llama: original context 256, so that several
# rotary frequencies are actually rescaled.
TINY_LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _arch_settings(arch: str, preset_name: str, preset: Preset) -> dict[str, Any]:
    """Config fields that depend on the architecture (and on the preset for tiny ones)."""
    settings: dict[str, Any] = {}
    if arch in _NEW_FAMILY_SETTINGS:
        return _NEW_FAMILY_SETTINGS[arch](preset_name, preset)
    if arch == "llama":
        settings["rms_norm_eps"] = 1e-5
        settings["tie_word_embeddings"] = True
        rope: dict[str, Any] = {"rope_type": "default"}
        if preset_name == "tiny":
            rope = dict(TINY_LLAMA3_ROPE)
        settings["rope_parameters"] = {**rope, "rope_theta": preset.rope_theta}
        return settings
    settings["rms_norm_eps"] = 1e-6
    settings["tie_word_embeddings"] = preset_name == "bench-135m"
    settings["rope_parameters"] = {"rope_type": "default", "rope_theta": preset.rope_theta}
    settings["use_sliding_window"] = False
    if arch == "qwen3":
        settings["head_dim"] = preset.qwen3_head_dim
    return settings


# The sliding window of the tiny presets: small enough that the parity prompts (up to
# 348 tokens) run far past it.
TINY_WINDOW = 32


def _window(preset_name: str) -> int:
    return TINY_WINDOW if preset_name == "tiny" else 256


def _mistral(preset_name: str, preset: Preset) -> dict[str, Any]:
    return {
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
        "sliding_window": _window(preset_name),
    }


def _gemma(arch: str) -> Any:
    def settings(preset_name: str, preset: Preset) -> dict[str, Any]:
        head_dim = preset.qwen3_head_dim
        out: dict[str, Any] = {
            "rms_norm_eps": 1e-6,
            # Real Gemmas are tied; with random weights a tied head echoes the input token
            # (its embedding, times sqrt(hidden), dominates the residual), so tiny ones are not.
            "tie_word_embeddings": preset_name != "tiny",
            "head_dim": head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            # Not head_dim, so the scale is checked for being the family's own.
            "query_pre_attn_scalar": head_dim * 2,
            "sliding_window": _window(preset_name),
            # Sliding first, then full: both kinds whatever the depth.
            "layer_types": [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(preset.num_layers)
            ],
        }
        if arch == "gemma2":
            out["attn_logit_softcapping"] = 50.0
            out["final_logit_softcapping"] = 30.0
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": preset.rope_theta}
        else:
            out["rope_parameters"] = {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": preset.rope_theta * 100},
                "sliding_attention": {"rope_type": "default", "rope_theta": preset.rope_theta},
            }
        return out

    return settings


def _phi3(preset_name: str, preset: Preset) -> dict[str, Any]:
    head_dim = preset.hidden_size // preset.num_heads
    rotary = head_dim // 2  # partial_rotary_factor 0.5, as Phi-4-mini's 0.75 is partial
    # LongRoPE, its original context above the tests' max_model_len (512): the short
    # factors and the attention factor apply (the long ones: tests/test_families.py).
    gen = random.Random(7)
    return {
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "partial_rotary_factor": 0.5,
        "sliding_window": None,
        "original_max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": preset.rope_theta,
            "short_factor": [round(1 + gen.random(), 3) for _ in range(rotary // 2)],
            "long_factor": [round(2 + 4 * gen.random(), 3) for _ in range(rotary // 2)],
            "original_max_position_embeddings": 512,
            "partial_rotary_factor": 0.5,
        },
    }


def _moe(arch: str) -> Any:
    def settings(preset_name: str, preset: Preset) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
            "num_experts_per_tok": 2,
        }
        if arch == "mixtral":
            out.update(num_local_experts=4, sliding_window=None)
        elif arch == "olmoe":
            out.update(num_experts=8, clip_qkv=2.0, norm_topk_prob=False)
        else:  # qwen2_moe / qwen3_moe: an 8-expert MoE layer, then a dense one
            out.update(
                num_experts=8,
                moe_intermediate_size=preset.intermediate_size // 2,
                decoder_sparse_step=1,
                mlp_only_layers=list(range(1, preset.num_layers, 2)),
                use_sliding_window=False,
                norm_topk_prob=arch == "qwen3_moe",
            )
            if arch == "qwen2_moe":
                out["shared_expert_intermediate_size"] = preset.intermediate_size
            else:
                out["head_dim"] = preset.qwen3_head_dim
        return out

    return settings


_NEW_FAMILY_SETTINGS: dict[str, Any] = {
    "mistral": _mistral,
    "gemma2": _gemma("gemma2"),
    "gemma3": _gemma("gemma3"),
    "phi3": _phi3,
    "mixtral": _moe("mixtral"),
    "qwen2_moe": _moe("qwen2_moe"),
    "qwen3_moe": _moe("qwen3_moe"),
    "olmoe": _moe("olmoe"),
}


# ---- tokenizer ---------------------------------------------------------------------------

_CORPUS: tuple[str, ...] = (
    # English prose
    "The river bends twice before it reaches the old mill, and in spring the water runs "
    "fast enough to turn the wheel again. Children from the village come down to watch it.",
    "A good engine schedules work in small steps: each step takes a few new tokens from "
    "every running request, runs one forward pass, and hands the results back at once.",
    "She wrote the numbers on the board: 3, 14, 159, 2653. Nobody in the room said a word "
    "until the bell rang at a quarter past nine.",
    "When the weather turns cold, the market sells roasted chestnuts, hot cider, wool hats "
    "and candles that smell of pine. Prices rise a little every December.",
    "The library keeps its maps in a long drawer. Some are hand-drawn; others were printed "
    "in 1887 and still show roads that no longer exist.",
    "Memory is measured in blocks. A block holds sixteen tokens; when a request grows past "
    "the end of its last block, the allocator hands it another one from the free list.",
    "Questions? Answers! Quotes: \"yes\", 'no', (maybe) [perhaps] {never}. Done; next: go.",
    "Once upon a time there was a small robot who wanted to learn how to paint the sea.",
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.",
    # Code
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "for (int i = 0; i < n; ++i) {\n    sum += values[i] * weights[i];\n}\nreturn sum / n;\n",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape, y.dtype)\n",
    "SELECT name, COUNT(*) AS total FROM orders WHERE status = 'done' GROUP BY name;\n",
    "fn main() {\n    let v: Vec<u32> = (1..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "<div class=\"card\"><h1>Hello</h1><p>Welcome back, {{ user.name }}!</p></div>\n",
    "{\"id\": 42, \"tags\": [\"alpha\", \"beta\"], \"ok\": true, \"ratio\": 0.75}\n",
    # Other European languages
    "Le petit déjeuner est servi à huit heures. Où est la gare, s'il vous plaît ?",
    "Die Straße war nass, aber die Kinder spielten trotzdem draußen im Garten.",
    "El niño comió una manzana y después jugó al fútbol con sus amigos en la plaza.",
    "Москва — столица России. Сегодня в городе тепло и солнечно.",
    "Η θάλασσα ήταν ήρεμη και ο ουρανός γαλάζιος.",
    # CJK
    "今天天气很好，我们一起去公园散步吧。机器学习模型需要大量的数据。",
    "北京是中国的首都，上海是一个国际化的大城市。我喜欢喝茶，也喜欢看书。",
    "東京は日本の首都です。桜の花がとてもきれいです。ありがとうございます。",
    "ひらがなとカタカナを勉強しています。コンピューターでプログラムを書きます。",
    "안녕하세요. 오늘은 날씨가 좋네요. 저는 한국어를 공부하고 있어요.",
    # Emoji and symbols
    "Great job! 🎉🎉 Let's celebrate 🥳 with pizza 🍕 and cake 🍰. Love it ❤️ 👍",
    "Weather: ☀️ then 🌧️ then ⛈️; temperature 21°C → 14°C. Flags: 🇯🇵 🇫🇷 🇧🇷",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159, α + β = γ, √2 ≈ 1.414. Arrows: ← ↑ → ↓ ⇒",
    "Family 👨‍👩‍👧‍👦, hands 👋🏽, cats 🐱🐈, rocket 🚀 to the moon 🌕.",
)

_SYLLABLES: tuple[str, ...] = tuple(
    c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")
)


def _corpus(vocab_size: int) -> list[str]:
    """The built-in texts, each repeated, plus pseudo-words enough to learn ``vocab_size`` tokens."""
    rng = random.Random(1234)  # fixed: the tokenizer depends only on the vocabulary size
    lines = [text for text in _CORPUS for _ in range(3)]
    num_words = max(0, vocab_size - 600)
    words = (
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        for _ in range(num_words)
    )
    chunk: list[str] = []
    for word in words:
        chunk.append(word)
        if len(chunk) == 16:
            lines.append(" ".join(chunk))
            chunk = []
    if chunk:
        lines.append(" ".join(chunk))
    return lines


def train_tokenizer(vocab_size: int, model_max_length: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(vocab_size), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer training reached {tok.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    # Plain encodes start with BOS, like Llama; the chat template writes its own BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


# ---- model -------------------------------------------------------------------------------


def _randomize_weights(model: torch.nn.Module, seed: int, weight_std: float, norm_center: float = 1.0) -> None:
    """Matrices ~ N(0, weight_std); norm scales ~ norm_center + N(0, 0.1); biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters appear once
            if param.dim() >= 2:
                values = torch.randn(param.shape, generator=gen) * weight_std
            elif "norm" in name:
                values = norm_center + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                values = 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(values)


def make_model(
    out_dir: str | os.PathLike[str],
    arch: Arch = "llama",
    preset: PresetName = "tiny",
    seed: int = 0,
    *,
    weight_std: float | None = None,
    tie_word_embeddings: bool | None = None,
    max_shard_size: int | str | None = None,
    num_kv_heads: int | None = None,
) -> str:
    """Write a random checkpoint plus tokenizer to ``out_dir`` and return its path.

    ``max_shard_size`` (bytes or e.g. "200KB") splits the weights into several files
    with a ``model.safetensors.index.json``; by default they go in one file.
    ``num_kv_heads`` overrides the preset's (it must divide its attention heads).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = PRESETS[preset]
    if num_kv_heads is not None:
        if isinstance(num_kv_heads, bool) or num_kv_heads < 1 or spec.num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={spec.num_heads}, got {num_kv_heads!r}")
        spec = dataclasses.replace(spec, num_kv_heads=num_kv_heads)
    std = spec.weight_std if weight_std is None else weight_std
    if not std > 0:
        raise ValueError(f"weight_std must be positive, got {std!r}")
    settings = _arch_settings(arch, preset, spec)
    if tie_word_embeddings is not None:
        settings["tie_word_embeddings"] = tie_word_embeddings
    config = AutoConfig.for_model(
        _MODEL_TYPES.get(arch, arch),
        architectures=[ARCHITECTURES[arch]],
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=std,
        **settings,
    )
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    tokenizer.save_pretrained(out_dir)

    from transformers.initialization import no_init_weights

    # _randomize_weights sets every parameter: transformers' own init would be wasted
    # (slow for the llama-1b preset).
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # (skipped with the init above)
    _randomize_weights(model, seed, std, norm_center=0.0 if arch in _OFFSET_NORMS else 1.0)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID
    )
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def demo_model_dir(cache_dir: str | None = None) -> str:
    """Path of the cached demo checkpoint (Llama, "demo" preset), made on first use."""
    return cached_model_dir("demo", cache_dir)


def cached_model_dir(preset: PresetName, cache_dir: str | None = None) -> str:
    """Path of the cached Llama checkpoint of ``preset`` (seed 0), made on first use."""
    name = f"demo-llama-v{DEMO_PRESET_VERSION}-seed0" if preset == "demo" else f"{preset}-llama-seed0"
    return build_directory_once(
        os.path.join(cache_dir or model_cache_dir(), name),
        "model.safetensors",
        lambda staging: make_model(staging, arch="llama", preset=preset, seed=0),
    )


# ---- CLI ---------------------------------------------------------------------------------


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``make-model`` on an ``argparse`` subparsers object; handler in ``func``."""
    parser = subparsers.add_parser(
        "make-model",
        help="Write a random-weight checkpoint and tokenizer (for tests, demos, benchmarks).",
        description="Write a random-weight Hugging Face checkpoint with a locally trained "
        "tokenizer. The same arguments always give the same bytes.",
    )
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama",
                        help="Model architecture.")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="Model size preset.")
    parser.add_argument("--out", required=True, help="Output directory (created if missing).")
    parser.add_argument("--seed", type=int, default=0, help="Weight seed; same seed, same bytes.")
    parser.add_argument(
        "--weight-std", type=float, default=None, help="Std of weight matrices; default: the preset's."
    )
    parser.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Tie the LM head to the embeddings; default: as the preset does.",
    )
    parser.add_argument(
        "--max-shard-size", default=None, help="Split weights into shards of this size (e.g. 50MB); default: one file."
    )
    parser.set_defaults(func=run_make_model)
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    """CLI handler of ``make-model``; returns the exit status."""
    path = make_model(
        args.out,
        arch=args.arch,
        preset=args.preset,
        seed=args.seed,
        weight_std=args.weight_std,
        tie_word_embeddings=args.tie_word_embeddings,
        max_shard_size=args.max_shard_size,
    )
    print(f"wrote {args.arch} {args.preset} checkpoint to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m engine_service.make_model --arch ... --out DIR``."""
    parser = argparse.ArgumentParser(prog="python -m engine_service.make_model")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-model", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
