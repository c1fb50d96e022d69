"""LoRA decode throughput: no adapter vs one adapter vs four mixed adapters, one batch.

EngineCore decode steps at a steady batch (default 32 requests): output tokens per second
with no adapter, one adapter on every request, and four adapters mixed round-robin
(rank 16, all seven target modules), each as a ratio to no adapter. Adapters are random
PEFT-format files written here (no peft needed). LoRA is enabled (max_loras=4) in every
row, so the no-adapter row is the LoRA-enabled engine's base path.

    python -m benchmarks.lora --model ~/.cache/tandem/bench-135m     # the NOTES numbers
    python -m benchmarks.lora                                        # tiny model, smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.lora.adapter import module_shapes
from tandem.protocol.lora import LoRARequest
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: str, out: str, rank: int, seed: int) -> str:
    """A random PEFT adapter (the files peft's save_pretrained writes) for every module."""
    config = ModelConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (in_f, out_f) in module_shapes(config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return out


def decode_tok_s(
    core: EngineCore, loras: list[LoRARequest | None], batch: int, prompt_len: int, steps: int
) -> float:
    """Output tokens/s over ``steps`` decode steps of a steady batch of ``batch`` requests."""
    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"b{i}-{time.monotonic()}", prompt, params,
                                           lora_request=loras[i % len(loras)]))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill
    for _ in range(3):
        core.step()  # warm-up decodes
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in core.step().all_outputs())
    elapsed = time.perf_counter() - start
    core.abort_requests(list(core.scheduler.requests))
    core.take_ended_outputs()
    return tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory; default: a tiny model made here")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if not model:
            from engine_service.make_model import make_model

            model = make_model(os.path.join(tmp, "tiny"), preset="tiny", seed=0)
        adapters = [LoRARequest(f"a{i}", i, write_adapter(model, os.path.join(tmp, f"a{i}"), args.rank, i))
                    for i in range(1, 5)]
        core = EngineCore(EngineConfig(
            model=os.path.expanduser(model), enable_lora=True, max_loras=4, max_lora_rank=args.rank,
            max_num_seqs=args.batch, max_model_len=1024, num_threads=args.threads,
        ))
        rows = [("no adapter", [None]), ("1 adapter", adapters[:1]), ("4 mixed adapters", adapters)]
        results = {}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits every row
            for name, loras in rows:
                rate = decode_tok_s(core, loras, args.batch, args.prompt_len, args.steps)
                results[name] = max(results.get(name, 0.0), rate)
    base = results["no adapter"]
    print(f"model {args.model or 'tiny'}  batch {args.batch}  rank {args.rank}  all 7 modules  "
          f"threads {torch.get_num_threads()}  load {os.getloadavg()[0]:.2f}")
    print(f"{'setup':<18} {'out tok/s':>10} {'ratio':>6}")
    for name, _ in rows:
        print(f"{name:<18} {results[name]:>10.1f} {results[name] / base:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
