"""Decode tokens/s of a mixture-of-experts model beside a dense model of the same active
parameters, at batch 1 and 64, on this CPU.

The MoE model is Mixtral's shape at a quarter of its width and depth (``mixtral-small``:
8 experts of 3.5x hidden, top-2); the dense one has one MLP as wide as the two chosen
experts together (``mixtral-small-dense``), so a token reads the same number of weights
in both. Both random-weight, float32, made once into the benchmark cache. Each run:
B requests with ``--prompt-len`` prompts; once every request has its first token, the
remaining steps are timed (decode only).

    python -m benchmarks.moe_decode [--batch 1 64] [--gen 64]
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import cached_model, load_average
from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams

MODELS = (("mixtral-small", "mixtral"), ("mixtral-small-dense", "llama"))


def cpu_name() -> str:
    """Model name, family/model and the vector extensions that pick the kernels."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(info.get("flags", "").split())
    isa = [name for name in ("avx512f", "avx512_vnni", "avx512_bf16", "avx2") if name in flags]
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}; {' '.join(isa)})"


def decode_rate(core: EngineCore, batch: int, prompt_len: int, gen: int, vocab: int, seed: int) -> float:
    """Output tokens/s of the steps after every request's first token."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"s{seed}-{i}", prompt, params))
    started: set[str] = set()
    while len(started) < batch:
        for out in core.step().all_outputs():
            started.add(out.request_id)
    tokens, t0 = 0, time.perf_counter()
    while core.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in core.step().all_outputs())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs per batch size, best kept")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; load before: {load_average()}")
    for preset, arch in MODELS:
        model_dir = cached_model(preset, arch=arch)
        core = EngineCore(EngineConfig(
            model=model_dir, device="cpu", max_model_len=args.prompt_len + args.gen + 16,
            max_num_seqs=max(args.batch), max_num_batched_tokens=max(args.batch) * args.prompt_len,
            enable_prefix_caching=False,
        ))
        vocab = core.model_config.vocab_size
        for batch in args.batch:
            rates = [decode_rate(core, batch, args.prompt_len, args.gen, vocab, seed) for seed in range(args.repeats)]
            print(f"{preset:20s} batch {batch:3d}: {max(rates):8.1f} output tok/s (runs: "
                  + ", ".join(f"{r:.1f}" for r in rates) + ")", flush=True)
        core.shutdown()
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
