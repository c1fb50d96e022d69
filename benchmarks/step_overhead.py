"""Per-step CPU time spent outside the model forward, at 1, 16 and 64 running requests.

Every part of ``EngineCore.step()`` is timed with wall clock around the real calls
(schedule, input preparation, forward, sampling, update, outputs), on decode steps of a
steady batch. The forward of a tiny model is short, so what remains is the engine's own
overhead; the same parts are reported for any ``--model``.

    python -m benchmarks.step_overhead                 # tiny model made on the fly
    python -m benchmarks.step_overhead --model DIR --batch-sizes 1,16,64
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams


class _Timers:
    """Wraps bound methods so each call adds its wall time to a named bucket."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, bucket: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)
        if name in vars(owner):
            self._undo.append(lambda: setattr(owner, name, original))
        else:
            self._undo.append(lambda: delattr(owner, name))

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[bucket] += time.perf_counter() - start

        setattr(owner, name, timed)

    def unwrap_all(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def measure(core: EngineCore, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    rng = random.Random(batch)
    vocab = core.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"b{batch}-{i}", prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()  # prefill; not measured
    timers = _Timers()
    runner, sched = core.runner, core.scheduler
    timers.wrap(sched, "schedule", "schedule")
    timers.wrap(runner, "_prepare", "prepare inputs")
    timers.wrap(runner.model, "forward", "model forward")
    timers.wrap(runner.model, "compute_logits", "lm head")
    timers.wrap(runner.model, "greedy_tokens", "lm head")  # greedy rows: LM head and argmax in one
    timers.wrap(runner.sampler, "argmax", "sampling")  # greedy rows: the whole of sampling
    timers.wrap(sched, "update_after_step", "update")
    timers.wrap(core.outputs, "make", "outputs")
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    elapsed = time.perf_counter() - start
    core.abort_requests(list(core.scheduler.requests))
    core.step()
    timers.unwrap_all()
    result = {k: v / steps * 1e6 for k, v in timers.totals.items()}
    result["step (total)"] = elapsed / steps * 1e6
    result["outside forward"] = result["step (total)"] - result["model forward"] - result["lm head"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = args.model
    if not model:
        from engine_service.make_model import make_model

        model = make_model(tempfile.mkdtemp(prefix="tandem-overhead-"), "llama", "tiny", seed=0)
    core = EngineCore(EngineConfig(model=model, max_model_len=1024, max_num_seqs=256,
                                   kv_cache_memory_bytes=256 * 2**20, num_threads=args.threads))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows = {b: measure(core, b, args.prompt_len, args.steps) for b in sizes}
    names = list(next(iter(rows.values())))
    print(f"model {model}; microseconds per decode step (mean over {args.steps} steps)")
    print(f"{'part':<18}" + "".join(f"{f'{b} reqs':>12}" for b in sizes))
    for name in names:
        print(f"{name:<18}" + "".join(f"{rows[b][name]:>12.0f}" for b in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
