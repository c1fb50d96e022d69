"""PEFT adapters made with ``peft`` itself, and the Hugging Face + PEFT greedy oracle."""

from __future__ import annotations

import os
from collections.abc import Sequence

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTENTION + MLP


def make_peft_adapter(
    model_dir: str,
    out_dir: str,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Sequence[str] = ALL_MODULES,
    seed: int = 0,
    std: float = 0.1,
    use_rslora: bool = False,
) -> str:
    """Write a random adapter for ``model_dir`` to ``out_dir`` with ``save_pretrained``.

    PEFT initialises lora_B to zero (the adapter would change nothing), so both A and B
    are drawn from N(0, std^2) with a seeded generator."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), use_rslora=use_rslora,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def hf_peft_greedy(
    model_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy continuations from Hugging Face with the adapter applied by PEFT (None: base)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            out.append(gen[0, len(prompt):].tolist())
    return out
