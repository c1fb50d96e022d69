"""What --model names, resolved (tandem.model_source), GGUF files read and refused, the
model's sampling defaults, and docs/models.md's tables kept equal to what the code accepts.

Small GGUF files are written here with the gguf package's writer from tiny random
checkpoints, so each case runs in well under a second after the shared fixtures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine_service.models.gguf_weights import TENSOR_TYPES, gguf_entries
from engine_service.models.loader import load_model
from engine_service.models.quantized import QuantizedRows
from frontend_service.openai.protocol import ChatCompletionRequest
from tandem.model_source import gguf_sidecar, resolve_model
from tandem.protocol import convert
from tandem.protocol.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from tandem.protocol.sampling_params import SamplingDefaults
from tandem.v1 import common_pb2

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"
T = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (what its converter writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, path: str, qtype: str = "F32", tensor_types: dict[str, str] | None = None) -> None:
    """A GGUF file of the Hugging Face checkpoint ``model_dir`` (Llama family), as llama.cpp's
    converter lays it out: its tensor names, q/k rows permuted, metadata keys."""
    config = ModelConfig.from_pretrained(model_dir)
    arch = config.model_type
    gguf_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    tokens = [added.get(i, piece) for piece, i in vocab] + [added[i] for i in sorted(added) if i >= len(vocab)]
    tokens += [f"[PAD{i}]" for i in range(config.vocab_size - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(config.eos_token_ids[0])
    if len(config.eos_token_ids) > 1:
        writer.add_eot_token_id(config.eos_token_ids[1])
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    writer.add_add_bos_token(False)
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if template is None and os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        template = Path(model_dir, "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)
    table = gguf.get_tensor_name_map(gguf_arch, config.num_layers)
    for name, tensor in load_file(os.path.join(model_dir, "model.safetensors")).items():
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):  # llama.cpp permutes Llama's only
            values = _permute(values, config.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = _permute(values, config.num_kv_heads)
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = (tensor_types or {}).get(gguf_name, qtype)
        if values.ndim == 2 and kind != "F32":
            stored = gguf.quants.quantize(values, T[kind])
            writer.add_tensor(gguf_name, stored, raw_shape=stored.shape, raw_dtype=T[kind])
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")
    write_gguf(tiny_llama_dir, path)
    return path


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def test_a_gguf_file_resolves_to_a_sidecar_checkpoint(tiny_gguf: str, tiny_llama_dir: str) -> None:
    sidecar = resolve_model(tiny_gguf)
    assert os.path.basename(sidecar) == "tiny-llama.F32"  # the served model name
    assert resolve_model(sidecar) == sidecar and resolve_model(tiny_gguf) == sidecar  # idempotent, cached
    assert resolve_model(os.path.dirname(tiny_gguf)) == sidecar  # a directory holding one GGUF
    ours, theirs = ModelConfig.from_pretrained(sidecar), ModelConfig.from_pretrained(tiny_llama_dir)
    for name in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.rope_theta == pytest.approx(theirs.rope_theta)
    from transformers import AutoTokenizer

    mine, orig = AutoTokenizer.from_pretrained(sidecar), AutoTokenizer.from_pretrained(tiny_llama_dir)
    for text in ("Hello world", "the quick brown fox, 123 !?", "naïve ünïcode"):
        assert mine.encode(text, add_special_tokens=False) == orig.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        orig.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_gguf_weights_equal_the_checkpoint(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every family transformers' GGUF reader maps to one Tandem serves loads: names mapped
    (Qwen2's biases, Qwen3's q/k norms), Llama's q/k permutation undone: the same model,
    tensor for tensor."""
    model_dir = request.getfixturevalue(family)
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(model_dir, path)
    sidecar = resolve_model(path)
    ours_config, their_config = ModelConfig.from_pretrained(sidecar), ModelConfig.from_pretrained(model_dir)
    for name in ("architecture", "features", "head_dim", "num_kv_heads", "tie_word_embeddings", "eos_token_ids"):
        assert getattr(ours_config, name) == getattr(their_config, name), name
    ours, _ = load_model(sidecar)
    theirs, _ = load_model(model_dir)
    mine = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        torch.testing.assert_close(mine[name], param, rtol=0, atol=0, msg=name)


def test_q8_0_tensors_keep_their_int8_values_and_scales(tiny_llama_dir: str, tmp_path: Path) -> None:
    path = str(tmp_path / "tiny.Q8_0.gguf")
    write_gguf(tiny_llama_dir, path, "Q8_0")
    config = ModelConfig.from_pretrained(resolve_model(path))
    reference = gguf.GGUFReader(path)
    raw = {t.name: t for t in reference.tensors}
    kept = 0
    for name, shape, read in gguf_entries(path, config):
        value = read(True)
        if not isinstance(value, QuantizedRows):
            continue
        kept += 1
        assert value.values.dtype == torch.int8 and value.scales.shape == (shape[0], shape[1] // 32)
        dequantized = torch.from_numpy(gguf.quants.dequantize(raw[_gguf_name(name, config)].data, T.Q8_0).copy())
        if "q_proj" not in name and "k_proj" not in name:  # (those are un-permuted rows)
            torch.testing.assert_close(value.dequantize(), dequantized.reshape(shape), rtol=0, atol=0)
        torch.testing.assert_close(read(False), value.dequantize(), rtol=0, atol=0)
    assert kept == 1 + 7 * config.num_layers  # the embedding and every layer's 7 matrices


def _gguf_name(hf_name: str, config: ModelConfig) -> str:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers).get_name(
        hf_name, try_suffixes=(".weight", ".bias")
    )


def test_unsupported_gguf_tensor_types_are_refused_by_name(tiny_llama_dir: str, tmp_path: Path) -> None:
    path = str(tmp_path / "tiny.mixed.gguf")
    write_gguf(tiny_llama_dir, path, tensor_types={"blk.0.attn_q.weight": "MXFP4"})
    with pytest.raises(ModelLoadError, match=r"GGUF tensor type\(s\) MXFP4 are not supported \(e\.g\. blk\.0\.attn_q"):
        load_model(resolve_model(path))


def test_gguf_of_an_unserved_family_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'phi3' is not supported"):
        resolve_model(path)


def test_bad_model_names_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        resolve_model(str(tmp_path / "two"))


def test_a_sidecar_is_rebuilt_when_its_file_changes(tiny_gguf: str, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(Path(tiny_gguf).read_bytes())
    first = gguf_sidecar(str(copy))
    os.utime(copy, ns=(1, 1))  # another modification time: another key
    assert gguf_sidecar(str(copy)) != first
    defaults = gguf_sidecar(str(copy), generation_config={"temperature": 0.0})
    assert json.loads(Path(defaults, "generation_config.json").read_text()) == {"temperature": 0.0}


def test_sampling_defaults_fill_only_unset_fields(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}))
    defaults = SamplingDefaults.from_model_dir(str(tmp_path))
    assert defaults.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    unset = convert.sampling_params_from_proto(common_pb2.SamplingParams(), defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.6, 0.95, 20, 0.0)
    given = convert.sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0, top_k=5), defaults)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.95, 5)
    plain = convert.sampling_params_from_proto(common_pb2.SamplingParams())
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, None)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = body.sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)
    assert body.sampling_params().temperature == 1.0
    assert SamplingDefaults.from_model_dir(str(tmp_path / "none")).as_dict() == {}


def _table_after(marker: str) -> list[list[str]]:
    """The body rows (cells, backticks stripped) of the first table after ``marker`` in docs/models.md."""
    lines = DOCS.read_text(encoding="utf-8").split(marker, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2 :]:  # past the header and its --- row
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
    return rows


def test_the_models_page_lists_what_the_code_accepts() -> None:
    architectures = {row[0]: row[1].split(" / ")[0] for row in _table_after("## Architectures")}
    assert architectures == SUPPORTED_ARCHITECTURES
    types = [row[0] for row in _table_after("Tensor\ntypes:")]
    assert types == list(TENSOR_TYPES)


def test_tokenizer_overrides_the_model_s(tiny_llama_dir: str, tiny_gguf: str) -> None:
    """``tokenizer=`` (``--tokenizer``): the frontend side and the engine read that one."""
    from frontend_service import LLM, SamplingParams

    with LLM(tiny_llama_dir, tokenizer=tiny_gguf, max_model_len=128, kv_cache_memory_bytes=4_000_000) as llm:
        sidecar = resolve_model(tiny_gguf)
        assert llm.engine.config.tokenizer == sidecar and llm.engine.config.model == tiny_llama_dir
        assert llm.tokenizer.name_or_path == sidecar
        (out,) = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 2
