"""Session fixtures: tiny random checkpoints made once per test session with make-model."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine_service.make_model import make_model


def _make(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: object) -> str:
    out: Path = tmp_path_factory.mktemp(name)
    return make_model(out, preset="tiny", seed=0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama, tied embeddings, llama3 rope scaling."""
    return _make(tmp_path_factory, "tiny_llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama with a separate lm_head."""
    return _make(tmp_path_factory, "tiny_llama_untied", arch="llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2: q/k/v biases, untied."""
    return _make(tmp_path_factory, "tiny_qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3: q/k norms, head_dim 32 != hidden_size / num_heads."""
    return _make(tmp_path_factory, "tiny_qwen3", arch="qwen3")


# The families beyond Llama/Qwen (tests/test_families.py), one tiny checkpoint each,
# made on first use: fixture name -> (make-model --arch, what it exercises).
FAMILY_FIXTURES: dict[str, tuple[str, str]] = {
    "tiny_mistral_dir": ("mistral", "every layer sliding (window 32)"),
    "tiny_gemma2_dir": ("gemma2", "soft-capping, sliding/full layers, sandwich norms, GeGLU"),
    "tiny_gemma3_dir": ("gemma3", "QK-norm, local and global rope, linear rope scaling"),
    "tiny_phi3_dir": ("phi3", "fused qkv/gate_up tensors, LongRoPE, partial rotary"),
    "tiny_mixtral_dir": ("mixtral", "4 experts, top-2, renormalized"),
    "tiny_qwen2_moe_dir": ("qwen2_moe", "8 experts with a gated shared expert, a dense layer"),
    "tiny_qwen3_moe_dir": ("qwen3_moe", "8 experts, norm_topk_prob, QK-norm, a dense layer"),
    "tiny_olmoe_dir": ("olmoe", "8 experts, whole-q/k norms, clip_qkv"),
}


def _family_fixture(name: str, arch: str, doc: str) -> Any:
    @pytest.fixture(scope="session", name=name)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> str:
        return _make(tmp_path_factory, name.removesuffix("_dir"), arch=arch)

    fixture.__doc__ = doc
    return fixture


for _name, (_arch, _doc) in FAMILY_FIXTURES.items():
    globals()[_name] = _family_fixture(_name, _arch, _doc)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """A small byte-level BPE with CJK and emoji, trained in-process (text tests)."""
    from tests.text_factories import build_test_tokenizer

    return build_test_tokenizer()


@pytest.fixture
def rng() -> random.Random:
    """A fresh random seed per test, printed so a failure can be replayed."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"random seed {seed}")  # shown by pytest on failure
    return random.Random(seed)
