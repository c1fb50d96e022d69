"""``python -m benchmarks.chaos``: the reliability figures of a local stack.

Starts ``--engines`` engines and a frontend on the tiny checkpoint (or ``--model``),
then runs, in order: the fuzz (``--fuzz`` calls), the mid-stream cancels
(``--cancels``), the soak (``--soak`` requests, RSS of each process before/after), and
an engine SIGKILLed under load (``--kill-streams`` streams). Prints each scenario's
figures; exits 1 if any fuzzed call answered outside the allowed status codes, a
cancel left requests or blocks behind, or a stream of the kill scenario did not complete
(its engine's streams migrate to the other engine; the time from the kill to each
stream's next token is printed). Scaled down: ``--fuzz 500 --cancels 50 --soak 200
--soak-warmup 200``; the migration cost alone: ``--fuzz 0 --cancels 0 --soak 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.chaos import scenarios
from benchmarks.chaos.procs import DEFAULT_ENGINE_ARGS, ChaosStack


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint dir (default: the cached tiny Llama)")
    p.add_argument("--engines", type=int, default=2, help="engine processes (default 2; >= 2 for the kill)")
    p.add_argument("--fuzz", type=int, default=10_000, help="fuzzed calls (default 10000)")
    p.add_argument("--cancels", type=int, default=1_000, help="mid-stream cancels (default 1000)")
    p.add_argument("--soak", type=int, default=10_000, help="soak requests (default 10000)")
    p.add_argument("--kill-streams", type=int, default=8, help="streams running when an engine is killed (default 8; 0: skip)")
    p.add_argument("--soak-warmup", type=int, default=5_000,
                   help="requests before the soak's first RSS reading (default 5000: engines' caches fill over "
                        "their first few thousand requests; the growth during it is printed too)")
    p.add_argument("--concurrency", type=int, default=16, help="calls in flight at once (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fuzz and the workloads (default 0)")
    p.add_argument("--log-dir", default="", help="where the services' logs go (default: a temp dir)")
    p.add_argument("--engine-args", default=" ".join(DEFAULT_ENGINE_ARGS),
                   help="arguments of every engine (default: %(default)s; a larger model needs a larger "
                        "--kv-cache-memory-bytes)")
    return p


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run(args: argparse.Namespace, stack: ChaosStack) -> bool:
    ok = True
    if args.fuzz:
        fuzz = await scenarios.fuzz(stack, args.fuzz, args.seed, args.concurrency)
        print(f"\n== fuzz: {fuzz.total} calls in {fuzz.seconds:.1f}s")
        for code, count in fuzz.by_code().most_common():
            print(f"  {code:20s} {count}")
        for (method, code), count in sorted(fuzz.counts.items()):
            print(f"    {method:14s} {code:20s} {count}")
        print(f"  outside the allowed codes: {len(fuzz.bad)}")
        for line in fuzz.bad[:20]:
            print(f"    {line}")
        healthy = [s.health() for s in stack.services]
        completes = await scenarios.normal_request_completes(stack)
        idle = await asyncio.to_thread(stack.wait_idle, 60.0)
        print(f"  after: health {healthy} (1 = SERVING), a normal request completes: {completes}, "
              f"engines (running, waiting, blocks in use): {idle}")
        ok &= not fuzz.bad and completes and all(h == 1 for h in healthy) and all(x == (0, 0, 0) for x in idle)
    if args.cancels:
        res = await scenarios.cancels(stack, args.cancels, args.seed, args.concurrency)
        print(f"\n== cancels: {res.cancelled} cancelled mid-stream in {res.seconds:.1f}s "
              f"(ended first: {dict(res.other_endings)})")
        print(f"  left on the engines after (running, waiting, blocks in use): {res.leftover}")
        ok &= all(x == (0, 0, 0) for x in res.leftover)
    if args.soak:
        res = await scenarios.soak(stack, args.soak, args.seed, args.concurrency, warmup=args.soak_warmup)
        print(f"\n== soak: {res.requests} requests in {res.seconds:.1f}s ({res.requests / res.seconds:.1f}/s), "
              f"endings {dict(res.endings)}")
        for name, start in res.rss_start.items():
            print(f"  {name:10s} warm-up ({res.warmup} requests): RSS {start / 2**20:8.1f} MiB -> "
                  f"{res.rss_before[name] / 2**20:8.1f} MiB")
        for name, growth in res.growth().items():
            print(f"  {name:10s} RSS {res.rss_before[name] / 2**20:8.1f} MiB -> "
                  f"{res.rss_after[name] / 2**20:8.1f} MiB  ({growth * 100:+.2f}%, target < 5%)")
    if args.kill_streams and len(stack.engines) >= 2:
        res = await scenarios.engine_kill(stack, args.kill_streams)
        times = res.unavailable_after_s
        print(f"\n== engine SIGKILL under load: {res.streams} streams, engines (running, waiting, "
              f"blocks in use) before: {res.load_before}")
        print(f"  endings: {dict(res.endings)}; other failures: {res.other_failures or 'none'}")
        if times:
            print(f"  kill -> UNAVAILABLE: median {statistics.median(times) * 1000:.0f} ms, "
                  f"max {max(times) * 1000:.0f} ms over {len(times)} streams")
        if res.resumed_after_s:
            waits = sorted(res.resumed_after_s)
            print(f"  kill -> next token per stream (ms; the slowest are the migrated ones): "
                  f"{[round(t * 1000) for t in waits]}")
        used = res.restarted_used_after_s
        print("  restarted engine used again: "
              + (f"yes, {used:.1f}s after it was SERVING" if used is not None else "NO"))
        ok &= not res.other_failures and used is not None and res.endings["completed"] == res.streams
    return ok


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model
    if not model:
        from benchmarks.common import cached_model

        model = cached_model("tiny")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-chaos-"))
    print(f"chaos: model {model}, {args.engines} engine(s), logs in {log_dir}")
    with ChaosStack(model, args.engines, log_dir, shlex.split(args.engine_args)) as stack:
        ok = asyncio.run(run(args, stack))
    print("\nresult:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
