"""make-model: deterministic bytes, a usable tokenizer and chat template, diverse greedy output."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_service.make_model import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    add_cli,
    demo_model_dir,
    make_model,
    train_tokenizer,
)
from engine_service.models import ModelConfig

MULTILINGUAL = [
    "Hello, world! The engine runs 3 steps.",
    "今天天气很好，我们一起去公园散步吧。",
    "東京は日本の首都です。",
    "Party time 🎉🥳 with pizza 🍕 and family 👨‍👩‍👧‍👦!",
    "def f(x):\n    return x * 2  # ∑ π ≈ 3.14",
    "Ünïcödé café naïve — «quotes» and 안녕하세요",
]


def _read(path: Path) -> bytes:
    return path.read_bytes()


def test_same_seed_same_bytes(tmp_path: Path, tiny_qwen3_dir: str) -> None:
    a = Path(make_model(tmp_path / "a", arch="qwen3", preset="tiny", seed=0))
    b = Path(tiny_qwen3_dir)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert _read(a / name) == _read(b / name), name
    c = Path(make_model(tmp_path / "c", arch="qwen3", preset="tiny", seed=1))
    assert _read(c / "model.safetensors") != _read(a / "model.safetensors")
    assert _read(c / "tokenizer.json") == _read(a / "tokenizer.json")  # tokenizer is seed-free


def test_tokenizer_round_trips_multibyte_text(tiny_llama_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = ModelConfig.from_pretrained(tiny_llama_dir)
    assert len(tok) == config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, 0)
    for text in MULTILINGUAL:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        with_bos = tok.encode(text)
        assert with_bos[0] == BOS_ID and with_bos[1:] == ids
    # Learned merges cover multi-byte characters: fewer tokens than UTF-8 bytes.
    cjk = "今天天气很好"
    assert len(tok.encode(cjk, add_special_tokens=False)) < len(cjk.encode("utf-8")) // 2
    # Some single tokens are only part of a character (byte-level BPE).
    emoji_ids = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji_ids) > 1 or "\ufffd" in tok.decode(emoji_ids[:1])
    partial = [i for i in range(5, len(tok)) if "\ufffd" in tok.decode([i])]
    assert partial, "expected tokens that hold an incomplete UTF-8 sequence"


def test_chat_template_renders(tiny_qwen2_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text.startswith(without) and not without.endswith("assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1 and IM_END_ID in ids
    assert tok.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi 👋\nassistant\n"


def test_generation_config_lists_both_stop_tokens(tiny_llama_dir: str) -> None:
    gen = json.loads((Path(tiny_llama_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOS_ID, IM_END_ID]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_greedy_outputs_are_diverse(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: str = request.getfixturevalue(fixture)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    continuations = []
    for prompt in ["The river", "今天天气", "def fibonacci(n):", "Hello 🎉"]:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) == 32
        assert len(set(new)) >= 4, f"{prompt!r}: {new}"
        continuations.append(tuple(new))
    assert len(set(continuations)) == len(continuations)


def test_cli_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tandem")
    add_cli(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "cli"
    args = parser.parse_args(
        ["make-model", "--arch", "qwen2", "--preset", "tiny", "--out", str(out), "--seed", "3",
         "--no-tie-word-embeddings", "--max-shard-size", "200KB"]
    )
    assert args.func(args) == 0
    assert str(out) in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file()
    config = ModelConfig.from_pretrained(out)
    assert config.architecture == "Qwen2ForCausalLM" and not config.tie_word_embeddings
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", "--arch", "gpt2", "--out", str(out)])


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_model(tmp_path, arch="gpt2", preset="tiny")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preset"):
        make_model(tmp_path, arch="llama", preset="huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        make_model(tmp_path, arch="llama", preset="tiny", seed=-1)


def test_demo_model_is_cached(tmp_path: Path) -> None:
    path = demo_model_dir(str(tmp_path))
    config = ModelConfig.from_pretrained(path)
    assert (config.architecture, config.hidden_size, config.num_layers) == ("LlamaForCausalLM", 256, 4)
    stamp = os.stat(Path(path) / "model.safetensors").st_mtime_ns
    assert demo_model_dir(str(tmp_path)) == path
    assert os.stat(Path(path) / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]  # no staging left behind


def test_bench_vocab_tokenizer_reaches_49152() -> None:
    tok = train_tokenizer(49152, 2048)
    assert len(tok) == 49152
    text = MULTILINGUAL[1] + MULTILINGUAL[3]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
