"""What structured output costs: per decode step at batch 1/16/64, and per compile.

Three parts, each printed as a table:
1. ``steps``: decode steps of B requests on ``--model``, unconstrained vs constrained
   (a JSON array of at least 100 strings: structure and free text, and long enough that
   no request completes while measured), with the
   mask filled on the worker thread during the forward (the engine's default) and on the
   step thread (``overlap=False``), plus the time of the mask fill and of its
   application to the logits.
2. ``compile``: a JSON schema, a regex and a grammar compiled through the engine's
   manager, cold (cache empty) and cached.
3. ``--compare-backends``: llguidance against xgrammar (if installed) on the model's
   tokenizer: tokenizer set-up, compile and mask time per token on a random walk
   through each constraint. This is the measurement behind choosing llguidance.

    python -m benchmarks.structured_output --model ~/.cache/tandem/bench-135m
    python -m benchmarks.structured_output --model DIR --compare-backends
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.common import cached_model, format_table, load_average, read_model_config
from benchmarks.step_overhead import _Timers
from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams
from tandem.protocol.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
LONG_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 100}
REGEX = r"[a-z]{3,8}-[0-9]{3,4}(\.[a-z]{2,3})?"
GRAMMAR = 'root ::= item ("," item)*\nitem ::= "(" [0-9]+ ":" [a-z]+ ")"'


# ---- 1. per-step cost ----------------------------------------------------------------


def _decode_steps(core: EngineCore, batch: int, constrained: bool, steps: int) -> dict[str, float]:
    """Mean decode-step wall time (ms) and the mask parts of it, over ``steps`` steps."""
    rng = random.Random(batch)
    vocab = core.model_config.vocab_size
    so = StructuredOutputsParams(json=json.dumps(LONG_SCHEMA)) if constrained else None
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(32)]
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, structured_outputs=so)
        core.add_request(EngineCoreRequest(f"b{batch}-{i}-{constrained}", prompt, params))
    manager = core.structured
    timers = _Timers()
    timers.wrap(manager, "_fill", "fill")
    timers.wrap(manager, "apply", "apply")
    times = []
    try:
        while len(times) < steps + 2 and core.has_unfinished_requests():
            start = time.perf_counter()
            outs = core.step()
            took = time.perf_counter() - start
            if any(o.finish_reason is not None for o in outs.outputs):
                break  # a constrained request completed: the batch is no longer B
            times.append(took)
            if len(times) == 2:  # after the prefill and the first decode
                timers.totals.clear()
    finally:
        timers.unwrap_all()
        core.abort_requests(list(core.scheduler.requests))
        core.step()
    measured = times[2:]
    n = max(len(measured), 1)
    return {
        "step_ms": 1e3 * statistics.mean(measured) if measured else float("nan"),
        "fill_ms": 1e3 * timers.totals["fill"] / n,
        "apply_ms": 1e3 * timers.totals["apply"] / n,
        "steps": len(measured),
    }


def bench_steps(core: EngineCore, batch_sizes: list[int], steps: int) -> None:
    rows = []
    for batch in batch_sizes:
        free = _decode_steps(core, batch, False, steps)
        core.structured.overlap = True
        overlapped = _decode_steps(core, batch, True, steps)
        core.structured.overlap = False
        inline = _decode_steps(core, batch, True, steps)
        core.structured.overlap = True
        rows.append([
            batch,
            f"{free['step_ms']:.1f}",
            f"{overlapped['step_ms']:.1f}",
            f"{inline['step_ms']:.1f}",
            f"{inline['fill_ms']:.2f}",
            f"{inline['apply_ms']:.2f}",
            f"{100 * (inline['fill_ms'] + inline['apply_ms']) / free['step_ms']:.1f}%",
            f"{100 * (overlapped['step_ms'] - free['step_ms']) / free['step_ms']:+.1f}%",
            min(free["steps"], overlapped["steps"], inline["steps"]),
        ])
    print(format_table(
        ["batch", "free step ms", "json step ms (overlap)", "json step ms (inline)", "fill ms", "apply ms",
         "mask / free step", "overlap step vs free", "steps"],
        rows,
    ))


# ---- 2. compile ----------------------------------------------------------------------


def bench_compile(core: EngineCore, repeats: int) -> None:
    manager = core.structured
    manager.tokenizer()  # once per engine, reported separately
    rows = []
    constraints = {
        "json schema": StructuredOutputsParams(json=json.dumps(SCHEMA)),
        "regex": StructuredOutputsParams(regex=REGEX),
        "grammar (GBNF)": StructuredOutputsParams(grammar=GRAMMAR),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    for name, so in constraints.items():
        cold, cached = [], []
        for r in range(repeats):
            manager._cache.clear()
            for bucket in (cold, cached):
                rid = f"c-{name}-{r}-{len(bucket)}"
                req = EngineCoreRequest(rid, [10, 11, 12], SamplingParams(max_tokens=1, structured_outputs=so))
                start = time.perf_counter()
                core.add_request(req)
                request = core.scheduler.requests[rid]
                while not request.structured.ready:
                    manager.wait_for_compile(0.001)
                    manager.poll()
                bucket.append(time.perf_counter() - start)
                core.abort_requests([rid])
                core.step()
        rows.append([name, f"{1e3 * statistics.median(cold):.2f}", f"{1e3 * statistics.median(cached):.3f}"])
    print(format_table(["constraint", "cold ms (median)", "cached ms (median)"], rows))


# ---- 3. backends ---------------------------------------------------------------------


def _walk(fill: Any, accept: Any, done: Any, steps: int, seed: int) -> list[float]:
    """Time ``fill()`` (returns the allowed ids) along a random path of allowed tokens."""
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        if done():
            break
        start = time.perf_counter()
        allowed = fill()
        times.append(time.perf_counter() - start)
        accept(rng.choice(allowed))
    return times


def _allowed(bitmask_row: Any, vocab: int) -> list[int]:
    import numpy as np

    bits = np.unpackbits(np.ascontiguousarray(bitmask_row).view(np.uint8), bitorder="little")[:vocab]
    return np.nonzero(bits)[0].tolist()


def compare_backends(model: str, vocab: int, steps: int) -> None:
    import llguidance
    import llguidance.numpy as lnp
    from transformers import AutoTokenizer

    from engine_service.structured_output.backend import grammar_text, load_tokenizer

    hf = AutoTokenizer.from_pretrained(model)
    cases = {
        "json schema": StructuredOutputsParams(json=json.dumps(SCHEMA)),
        "regex": StructuredOutputsParams(regex=REGEX),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    rows = []
    start = time.perf_counter()
    tok = load_tokenizer(model, vocab)
    rows.append(["llguidance", "tokenizer set-up", f"{1e3 * (time.perf_counter() - start):.1f}", ""])
    for name, so in cases.items():
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar_text(so), log_level=0)
        compile_ms = 1e3 * (time.perf_counter() - start)
        bitmask = lnp.allocate_token_bitmask(1, vocab)

        def fill(m: Any = matcher, b: Any = bitmask) -> list[int]:
            lnp.fill_next_token_bitmask(m, b, 0)
            return _allowed(b[0], vocab)

        times = _walk(fill, matcher.consume_token, matcher.is_stopped, steps, 0)
        rows.append(["llguidance", name, f"{compile_ms:.2f}", f"{1e6 * statistics.mean(times):.0f}"])
    try:
        import xgrammar as xgr
    except ImportError:
        rows.append(["xgrammar", "not installed", "", ""])
    else:
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        rows.append(["xgrammar", "tokenizer set-up", f"{1e3 * (time.perf_counter() - start):.1f}", ""])
        compilers = {
            "json schema": lambda: compiler.compile_json_schema(json.dumps(SCHEMA)),
            "regex": lambda: compiler.compile_regex(REGEX),
            "json_object": compiler.compile_builtin_json_grammar,
        }
        for name, make in compilers.items():
            start = time.perf_counter()
            compiled = make()
            compile_ms = 1e3 * (time.perf_counter() - start)
            matcher = xgr.GrammarMatcher(compiled)
            bitmask = xgr.allocate_token_bitmask(1, vocab)

            def xfill(m: Any = matcher, b: Any = bitmask) -> list[int]:
                m.fill_next_token_bitmask(b, 0)
                return _allowed(b[0].numpy(), vocab)

            times = _walk(xfill, matcher.accept_token, matcher.is_terminated, steps, 0)
            rows.append(["xgrammar", name, f"{compile_ms:.2f}", f"{1e6 * statistics.mean(times):.0f}"])
    print(format_table(["backend", "constraint", "set-up / compile ms", "mask us/token"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint; default: bench-135m (made on first use)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24, help="decode steps measured per batch size")
    parser.add_argument("--repeats", type=int, default=5, help="compiles per constraint")
    parser.add_argument("--compare-backends", action="store_true", help="only the llguidance / xgrammar table")
    parser.add_argument("--skip-steps", action="store_true", help="skip the per-step table")
    args = parser.parse_args(argv)
    model = args.model or cached_model("bench-135m")
    print(f"model {model}; load average {load_average()}", flush=True)
    if args.compare_backends:
        vocab = read_model_config(model)["vocab_size"]
        compare_backends(model, vocab, 64)
        return 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(
        model=model, max_model_len=512, max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(2048, 33 * max(batch_sizes)), enable_prefix_caching=False,
    ))
    bench_compile(core, args.repeats)
    if not args.skip_steps:
        bench_steps(core, batch_sizes, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
