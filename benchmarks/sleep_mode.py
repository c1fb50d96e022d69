"""Memory of an engine before, during and after sleep mode (levels 1 and 2), and the
time to sleep and wake, with a check that greedy outputs are unchanged.

    python -m benchmarks.sleep_mode --model ~/.cache/tandem/bench-135m
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import cached_model, format_table, load_average
from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def greedy(core: EngineCore, rid: str) -> list[int]:
    core.add_request(EngineCoreRequest(rid, list(range(10, 42)), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step().all_outputs():
            tokens += out.new_token_ids
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint; default: bench-135m (made on first use)")
    parser.add_argument("--kv-cache-mib", type=int, default=2048)
    args = parser.parse_args(argv)
    model = args.model or cached_model("bench-135m")
    print(f"model {model}; load average {load_average()}", flush=True)
    core = EngineCore(EngineConfig(model=model, max_model_len=512, kv_cache_memory_bytes=args.kv_cache_mib * 2**20))
    reference = greedy(core, "ref")
    rows = [["awake", f"{rss_mib():.0f}", f"{core.kv_cache_bytes / 2**20:.0f}", "", ""]]
    for level in (1, 2):
        start = time.perf_counter()
        core.sleep(level)
        slept = time.perf_counter() - start
        rows.append([f"asleep, level {level}", f"{rss_mib():.0f}", f"{core.kv_cache_bytes / 2**20:.0f}", f"{slept * 1e3:.0f}", ""])
        start = time.perf_counter()
        core.wake_up()
        woke = time.perf_counter() - start
        same = greedy(core, f"after{level}") == reference
        rows.append([f"woken from {level}", f"{rss_mib():.0f}", f"{core.kv_cache_bytes / 2**20:.0f}", f"{woke * 1e3:.0f}", "yes" if same else "NO"])
    print(format_table(["state", "RSS MiB", "KV cache MiB", "sleep / wake ms", "same greedy tokens"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
