"""Disaggregated prefill and decode against aggregated engines on the same cores: do long
prompts arriving stall the tokens of running streams?

Two layouts of ``tandem serve``, each engine with ``--threads`` torch threads:

- ``aggregated``: ``--engines 2``, every engine prefills and decodes;
- ``disaggregated``: ``--prefill-engines 1 --decode-engines 1`` (a producer prefills and
  holds the KV, a consumer pulls it over ``tandem.v1.KvTransfer`` and decodes).

The same load runs against each: ``--streams`` decode streams (short prompts, long
outputs) held open the whole run, and meanwhile ``--long-prompts`` long prompts arriving
(Poisson, ``--long-rate`` per second) that each generate a few tokens. Printed per layout:
the streams' inter-token latency p50 / p99 and TPOT, the long prompts' TTFT p50 / p90,
output tok/s, and for the disaggregated layout the KV moved (the consumer's
``tandem:kv_transfer_*`` counters): bytes, loads, and GB/s and ms per load.

    python -m benchmarks.disaggregation --model DIR
    python -m benchmarks.disaggregation --model DIR --layouts disaggregated --long-prompts 4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.common import FIRST_ORDINARY_TOKEN, read_model_config, scrape
from benchmarks.serve_bench import (
    LaunchedStack,
    RequestSpec,
    TandemBackend,
    distribution,
    free_port_range,
    run_load,
)

LAYOUTS = {
    "aggregated": ["--engines", "2"],
    "disaggregated": ["--prefill-engines", "1", "--decode-engines", "1"],
}


def make_specs(args: argparse.Namespace, vocab: int) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(decode streams, long prompts): fresh random token ids, so no prefix is shared."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(n)]

    streams = [RequestSpec(i, "stream", prompt(args.stream_prompt_len), args.stream_output_len)
               for i in range(args.streams)]
    longs = [RequestSpec(args.streams + i, "long", prompt(args.long_prompt_len), args.long_output_len)
             for i in range(args.long_prompts)]
    return streams, longs


def transfer_totals(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    def total(name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in samples.items()
                   if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))

    return {
        "bytes": total("tandem:kv_transfer_bytes_total", direction="received"),
        "seconds": total("tandem:kv_transfer_seconds_total"),
        "loads": total("tandem:kv_transfer_loads_total", outcome="ok"),
        "failed": total("tandem:kv_transfer_loads_total", outcome="failed"),
    }


async def run_layout(args: argparse.Namespace, layout: str, streams: list[RequestSpec],
                     longs: list[RequestSpec], tmp: str) -> dict[str, Any]:
    metrics_base = free_port_range(2)  # both engines' metrics ports free, not just the first
    serve_args = [*LAYOUTS[layout], "--engine-metrics-base-port", str(metrics_base)]
    engine_args = ["--num-threads", str(args.threads), "--max-model-len", str(args.max_model_len)]
    stack = LaunchedStack(args.model, 2, engine_args, os.path.join(tmp, f"{layout}.log"), serve_args)
    try:
        stack.wait_serving(args.launch_timeout)
        backend = TandemBackend(stack.target)
        await backend.start()
        try:
            warm = RequestSpec(-1, "warmup", streams[0].prompt[:8], 2)
            await backend.send(warm, args.timeout)
            before = transfer_totals(scrape(metrics_base + 1))  # engine 1: the consumer
            decode = asyncio.create_task(run_load(backend, streams, math.inf, None, args.timeout,
                                                  args.seed, False))
            await asyncio.sleep(args.long_delay)
            long_run = await run_load(backend, longs, args.long_rate, None, args.timeout, args.seed, False)
            decode_run = await decode
            after = transfer_totals(scrape(metrics_base + 1))
        finally:
            await backend.close()
    finally:
        stack.stop()
    ok_streams = [r for r in decode_run.records if r.success]
    ok_longs = [r for r in long_run.records if r.success]
    moved = {k: after[k] - before[k] for k in after}
    return {
        "layout": layout,
        "failed": len(decode_run.records) - len(ok_streams) + len(long_run.records) - len(ok_longs),
        "itl_ms": distribution([x for r in ok_streams for x in r.itl], 1000.0),
        "tpot_ms": distribution([r.tpot for r in ok_streams if r.tpot is not None], 1000.0),
        "long_ttft_ms": distribution([r.ttft for r in ok_longs if r.ttft is not None], 1000.0),
        "output_tok_s": sum(r.output_tokens for r in ok_streams + ok_longs) / decode_run.duration,
        "transfer": moved,
    }


def format_row(res: dict[str, Any]) -> str:
    itl, ttft, t = res["itl_ms"], res["long_ttft_ms"], res["transfer"]
    line = (f"{res['layout']:>13}: streams ITL p50 {itl['p50']:6.1f} ms  p99 {itl['p99']:7.1f} ms  "
            f"TPOT p50 {res['tpot_ms']['p50']:6.1f} ms | long prompts TTFT p50 {ttft['p50']:7.0f} ms  "
            f"p90 {ttft['p90']:7.0f} ms | {res['output_tok_s']:6.1f} output tok/s  failed {res['failed']}")
    if t["loads"]:
        rate = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else math.nan
        line += (f"\n{'':>15}KV moved: {t['bytes'] / 1e6:.1f} MB in {t['loads']:.0f} loads "
                 f"({t['failed']:.0f} failed), {rate:.2f} GB/s, {t['seconds'] / t['loads'] * 1e3:.1f} ms a load")
    return line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--streams", type=int, default=6, help="decode streams held open")
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=192)
    p.add_argument("--long-prompts", type=int, default=8)
    p.add_argument("--long-prompt-len", type=int, default=1024)
    p.add_argument("--long-output-len", type=int, default=4)
    p.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second (Poisson)")
    p.add_argument("--long-delay", type=float, default=1.0, help="seconds before the first long prompt")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--launch-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    vocab = read_model_config(args.model)["vocab_size"]
    streams, longs = make_specs(args, vocab)
    print(f"load: {os.getloadavg()[0]:.2f}; {args.streams} streams of {args.stream_output_len} tokens, "
          f"{args.long_prompts} prompts of {args.long_prompt_len} tokens at {args.long_rate}/s, "
          f"{args.threads} thread(s) per engine", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tandem-disagg-") as tmp:
        for layout in args.layouts.split(","):
            results[layout] = asyncio.run(run_layout(args, layout, streams, longs, tmp))
            print(format_row(results[layout]), flush=True)
    if len(results) == 2:
        agg, dis = results["aggregated"], results["disaggregated"]
        print(f"streams' ITL p99, disaggregated / aggregated: "
              f"{dis['itl_ms']['p99'] / agg['itl_ms']['p99']:.2f}x", flush=True)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
