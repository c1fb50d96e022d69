"""What the frontend/engine split costs when an engine step takes about a millisecond.

On a GPU a decode step of a small model takes 1-2 ms, and then the output path, not
the model, decides throughput. This benchmark shows that on a CPU: the "hop" preset
(a random Llama, hidden size 96, 3 layers) decodes 256 sequences in a few ms a step.
The same workload runs

- in-process: ``LLM.generate`` in a child process (tokenizer, detokenizer and engine
  in one Python process, no gRPC);
- through ``tandem serve`` (one engine, ``--frontends`` frontend processes), driven by
  ``--clients`` client processes that hold ``--concurrency`` streams between them:
  gRPC ``Generate`` with OUTPUT_KIND_DELTA and with FINAL_ONLY, and the OpenAI HTTP
  stream (``/v1/completions``, ``stream: true``).

Each run prints output tok/s and the CPU microseconds per output token of every
process (frontend(s), engine; the in-process child), measured from /proc over the
run; beside them the client processes' own CPU (not the stack's cost, but on a small
machine it comes out of the same cores) and, for gRPC runs, the time from a call to its
first message as the clients see it (p50 / p90; it includes gRPC accepting the call,
which the frontend's time-to-first-token metric cannot see). Every process runs one
torch thread (``--num-threads 1``, ``OMP_NUM_THREADS=1``),
so threads spinning for work do not count as work. Greedy, ``ignore_eos``: each
request's tokens are the same on every path, and the runs check it (a digest of every
request's token ids; HTTP streams text only, so it counts tokens from the usage).

    python -m benchmarks.split_cost                       # 512 requests, 256 streams
    python -m benchmarks.split_cost --frontends 2         # two frontend processes
    python -m benchmarks.split_cost --smoke               # a few requests (tests)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import scrape
from benchmarks.serve_bench import percentile

MODES = ("delta", "final", "http")


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def to_json(self) -> str:
        return json.dumps({"prompts": self.prompts, "max_tokens": self.max_tokens})

    @classmethod
    def from_json(cls, text: str) -> Workload:
        doc = json.loads(text)
        return cls(doc["prompts"], doc["max_tokens"])

    def slice(self, start: int, step: int) -> Workload:
        return Workload(self.prompts[start::step], self.max_tokens[start::step])


def make_workload(num_requests: int, vocab: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def digest(token_lists: list[list[int]]) -> str:
    """One hash of every request's token ids, in request order."""
    h = hashlib.sha256()
    for tokens in token_lists:
        h.update(json.dumps(tokens).encode())
    return h.hexdigest()[:16]


def divergence(want: list[list[int]], got: list[list[int]]) -> str:
    """How two runs' token lists differ: how many requests, and where each first differs
    (greedy runs in bfloat16 that batch requests differently drift apart late, if at all)."""
    firsts = []
    for a, b in zip(want, got, strict=True):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    if not firsts:
        return "none"
    firsts.sort()
    return (f"{len(firsts)} of {len(want)} requests, first differing token at position {firsts[0]} "
            f"(median {firsts[len(firsts) // 2]})")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the client process --------------------------------------------------------------------


async def _run_grpc(target: str, work: Workload, concurrency: int, final_only: bool, num_channels: int
                    ) -> tuple[list[list[int]], int, list[float]]:
    """Every request's token ids, how many messages carried them, and each request's
    time from the call to its first message (seconds)."""
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

    kind = common_pb2.OUTPUT_KIND_FINAL_ONLY if final_only else common_pb2.OUTPUT_KIND_DELTA
    results: list[list[int]] = [[] for _ in work.prompts]
    messages = [0] * work.num_requests
    first_seconds = [0.0] * work.num_requests
    gate = asyncio.Semaphore(concurrency)
    # One connection per channel: several let the kernel spread a client's streams over
    # the frontend processes sharing the port (--frontends N).
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(num_channels)]
    stubs = [frontend_pb2_grpc.GenerationStub(c) for c in channels]
    try:

        async def one(i: int) -> None:
            stub = stubs[i % len(stubs)]
            params = common_pb2.SamplingParams(
                temperature=0.0, max_tokens=work.max_tokens[i], ignore_eos=True, output_kind=kind
            )
            req = frontend_pb2.GenerateRequest(
                prompt_token_ids=frontend_pb2.TokenIds(token_ids=work.prompts[i]), sampling_params=params
            )
            async with gate:
                tokens = results[i]
                start = time.perf_counter()
                async for resp in stub.Generate(req, timeout=3600):
                    if not messages[i]:
                        first_seconds[i] = time.perf_counter() - start
                    tokens.extend(resp.outputs[0].token_ids)
                    messages[i] += 1

        await asyncio.gather(*(one(i) for i in range(work.num_requests)))
    finally:
        for channel in channels:
            await channel.close()
    return results, sum(messages), first_seconds


async def _run_http(base_url: str, work: Workload, concurrency: int) -> list[int]:
    from benchmarks.serve_bench import OpenAIBackend, RequestSpec

    backend = OpenAIBackend(base_url, model="")
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        spec = RequestSpec(index=i, kind="bench", prompt=work.prompts[i], max_tokens=work.max_tokens[i])
        async with gate:
            record = await backend.send(spec, timeout=3600)
        if not record.success:
            raise RuntimeError(f"request {i} failed: {record.status} {record.error}")
        return record.output_tokens

    return list(await asyncio.gather(*(one(i) for i in range(work.num_requests))))


def client_main(args: argparse.Namespace) -> int:
    """One client process: run its share of the workload, print a JSON line."""
    with open(args.work) as f:
        work = Workload.from_json(f.read()).slice(args.index, args.of)
    # Wait for the parent's go (a line on stdin) so every client starts together.
    sys.stdin.readline()
    start, cpu0 = time.perf_counter(), time.process_time()
    if args.mode == "http":
        counts = asyncio.run(_run_http(args.target, work, args.concurrency))
        doc: dict[str, Any] = {"tokens": sum(counts), "lists": None, "messages": None, "first_seconds": None}
    else:
        lists, messages, first_seconds = asyncio.run(
            _run_grpc(args.target, work, args.concurrency, args.mode == "final", args.channels)
        )
        doc = {"tokens": sum(map(len, lists)), "lists": lists, "messages": messages,
               "first_seconds": first_seconds}
    doc["seconds"] = time.perf_counter() - start
    doc["cpu"] = time.process_time() - cpu0
    print(json.dumps(doc), flush=True)
    return 0


# ---- the in-process child -------------------------------------------------------------------


def local_main(args: argparse.Namespace) -> int:
    """In-process ``LLM.generate`` of the workload: one untimed warm-up pass of a tenth
    of it, then the timed pass; prints a JSON line."""
    from frontend_service import LLM, SamplingParams

    with open(args.work) as f:
        work = Workload.from_json(f.read())
    llm = LLM(model=args.model, **json.loads(args.engine_kwargs))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    warm = max(1, len(prompts) // 10)
    llm.generate(prompts[:warm], params[:warm])
    observer = llm.engine.observer
    steps0, reqs0 = observer.steps, observer.scheduled_reqs
    cpu0, start = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    lists = [list(o.outputs[0].token_ids) for o in outs]
    batch = {"steps": observer.steps - steps0, "requests": observer.scheduled_reqs - reqs0}
    print(json.dumps({"tokens": sum(map(len, lists)), "digest": digest(lists), "lists": lists,
                      "seconds": seconds, "cpu": cpu, "batch": batch}), flush=True)
    return 0


# ---- the driver --------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


def run_local(model: str, work_path: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.split_cost", "local", "--model", model,
           "--work", work_path, "--engine-kwargs", json.dumps(engine_kwargs)]
    out = subprocess.run(cmd, env=_child_env(), check=True, capture_output=True, text=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    doc["tok_s"] = doc["tokens"] / doc["seconds"]
    doc["us_per_token"] = {"in-process": doc["cpu"] / doc["tokens"] * 1e6}
    return doc


class Stack:
    """``tandem serve`` with one engine, its processes told apart by their command lines."""

    def __init__(self, model: str, frontends: int, engine_args: list[str], serve_args: list[str] = ()) -> None:
        self.port, self.http_port, self.engine_metrics_port = free_port(), free_port(), free_port()
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "serve", "--model", model,
               "--port", str(self.port), "--engine-base-port", str(free_port()),
               "--http-port", str(self.http_port), "--metrics-port", "0", "--admin-port", "0",
               "--engine-metrics-base-port", str(self.engine_metrics_port)]
        if frontends != 1:
            cmd += ["--frontends", str(frontends)]
        cmd += list(serve_args)
        self.proc = subprocess.Popen([*cmd, "--", *engine_args], env=_child_env())
        self.started = time.perf_counter()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def engine_batches(self) -> dict[str, float]:
        """The engine's steps so far and the requests they ran (its
        ``tandem:iteration_requests`` histogram)."""
        samples = scrape(self.engine_metrics_port)
        return {
            "steps": sum(v for (name, _), v in samples.items() if name == "tandem:iteration_requests_count"),
            "requests": sum(v for (name, _), v in samples.items() if name == "tandem:iteration_requests_sum"),
        }

    def wait_ready(self, timeout: float = 300) -> float:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.time() + timeout
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tandem serve exited with {self.proc.returncode}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        return time.perf_counter() - self.started
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"frontend at {self.target} not SERVING after {timeout}s")

    def processes(self) -> dict[str, list[int]]:
        """{"engine": pids, "frontend": pids}: the serve process runs a frontend itself."""
        roles: dict[str, list[int]] = {"engine": [], "frontend": [self.proc.pid]}
        for pid in descendants(self.proc.pid):
            line = cmdline(pid)
            if "engine" in line:
                roles["engine"].append(pid)
            elif "frontend" in line or "frontend_service" in " ".join(line):
                roles["frontend"].append(pid)
        return roles

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_profilers(roles: dict[str, list[int]], out_dir: str, mode: str) -> list[subprocess.Popen[bytes]]:
    """py-spy (raw stacks, 100 Hz, without pausing the process) on the first process of
    each role, until ``stop_profilers``; writes ``<out_dir>/<mode>-<role>.txt``."""
    procs = []
    for role, pids in roles.items():
        if pids:
            path = os.path.join(out_dir, f"{mode}-{role}.txt")
            procs.append(subprocess.Popen(
                ["py-spy", "record", "-p", str(pids[0]), "-r", "100", "-f", "raw", "-o", path, "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
    return procs


def stop_profilers(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def run_clients(stack: Stack, mode: str, work_path: str, clients: int, concurrency: int, channels: int = 1,
                profile_dir: str = "") -> dict[str, Any]:
    """``clients`` client processes at once; CPU of every stack process over the run
    (``profile_dir``: and a py-spy profile of the engine and the frontend)."""
    target = f"http://127.0.0.1:{stack.http_port}" if mode == "http" else stack.target
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.split_cost", "client", "--target", target,
             "--mode", mode, "--work", work_path, "--index", str(i), "--of", str(clients),
             "--concurrency", str(max(1, concurrency // clients)), "--channels", str(channels)],
            env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for i in range(clients)
    ]
    time.sleep(1.0)  # the clients import grpc before the clock starts
    roles = stack.processes()
    profilers = start_profilers(roles, profile_dir, mode) if profile_dir else []
    before = {pid: cpu_seconds(pid) for pids in roles.values() for pid in pids}
    batches = stack.engine_batches()
    start = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    docs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"client exited with {p.returncode}")
        docs.append(json.loads(out.strip().splitlines()[-1]))
    seconds = time.perf_counter() - start
    batches = {k: v - batches[k] for k, v in stack.engine_batches().items()}
    stop_profilers(profilers)
    cpu = {role: sum(cpu_seconds(pid) - before[pid] for pid in pids) for role, pids in roles.items()}
    tokens = sum(d["tokens"] for d in docs)
    clients_cpu = sum(d["cpu"] for d in docs)
    firsts = [t for d in docs for t in d["first_seconds"] or ()]
    lists: list[list[int]] | None = None
    if all(d["lists"] is not None for d in docs):  # client i ran requests i, i + clients, ...
        lists = [[] for _ in range(sum(len(d["lists"]) for d in docs))]
        for i, d in enumerate(docs):
            lists[i::clients] = d["lists"]
    return {
        "mode": mode, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
        "cpu": cpu, "us_per_token": {role: c / tokens * 1e6 for role, c in cpu.items()},
        "digest": None if lists is None else digest(lists),
        "messages": None if lists is None else sum(d["messages"] for d in docs),
        "lists": lists, "batch": batches, "clients_us_per_token": clients_cpu / tokens * 1e6,
        "first_message_s": {"p50": percentile(firsts, 50), "p90": percentile(firsts, 90)} if firsts else None,
    }


def mean_batch(batch: dict[str, float]) -> str:
    """The engine's steps and requests per step over a run (fewer per step: more CPU a
    token, as each step's fixed cost is shared by fewer)."""
    steps = batch["steps"]
    return f"{steps:.0f} steps of {batch['requests'] / steps:.1f} requests" if steps else "no steps"


def _engine_kwargs(args: list[str]) -> dict[str, Any]:
    """Engine flags as ``LLM`` keyword arguments: ``--max-num-seqs 256`` -> 256, a bare
    ``--async-scheduling`` -> True, ``--no-x`` -> x False."""
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name = args[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            kwargs[name] = int(value) if value.isdigit() else value
            i += 2
        else:
            if name.startswith("no_"):
                kwargs[name.removeprefix("no_")] = False
            else:
                kwargs[name] = True
            i += 1
    return kwargs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="role")
    c = sub.add_parser("client", help="(internal) one client process")
    c.add_argument("--target", required=True)
    c.add_argument("--mode", choices=MODES, required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--index", type=int, default=0)
    c.add_argument("--of", type=int, default=1)
    c.add_argument("--concurrency", type=int, default=128)
    c.add_argument("--channels", type=int, default=1)
    loc = sub.add_parser("local", help="(internal) the in-process run")
    loc.add_argument("--model", required=True)
    loc.add_argument("--work", required=True)
    loc.add_argument("--engine-kwargs", default="{}")
    ap.add_argument("--model", default="", help="checkpoint; default: the cached --preset")
    ap.add_argument("--preset", default="hop", help="make_model preset when no --model (default hop)")
    ap.add_argument("--engine-args", default="",
                    help="more engine flags for both sides, e.g. '--device cuda --dtype bfloat16'")
    ap.add_argument("--serve-args", default="",
                    help="more tandem serve (frontend) flags, e.g. '--engine-output-window 1'")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256, help="streams open at once, all clients together")
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--frontends", type=int, default=1, help="tandem serve --frontends")
    ap.add_argument("--channels", type=int, default=0,
                    help="gRPC connections per client process (default: 1, or 2 per frontend with --frontends > 1)")
    ap.add_argument("--prompt-range", default="16,64")
    ap.add_argument("--output-range", default="64,128")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--no-local", action="store_true", help="skip the in-process run")
    ap.add_argument("--no-stack", action="store_true", help="only the in-process run")
    ap.add_argument("--profile", default="", help="modes to profile with py-spy (comma-separated; needs py-spy)")
    ap.add_argument("--profile-dir", default=".", help="where the profiles go (default .)")
    ap.add_argument("--smoke", action="store_true", help="16 requests, 8 streams, short outputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.role == "client":
        return client_main(args)
    if args.role == "local":
        return local_main(args)

    from tandem.protocol.model_config import ModelConfig

    if args.profile and shutil.which("py-spy") is None:
        ap.error("--profile needs py-spy on PATH (pip install py-spy)")
    if args.smoke:
        args.num_requests, args.concurrency, args.output_range = 16, 8, "8,16"
    model = args.model
    if not model:
        from engine_service.make_model import cached_model_dir

        model = cached_model_dir(args.preset)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    prange = tuple(int(x) for x in args.prompt_range.split(","))
    orange = tuple(int(x) for x in args.output_range.split(","))
    work = make_workload(args.num_requests, vocab, prange, orange, args.seed)  # type: ignore[arg-type]
    modes = [m for m in args.modes.split(",") if m]
    channels = args.channels or (1 if args.frontends == 1 else 2 * args.frontends)
    engine_args = ["--num-threads", "1", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
                   *shlex.split(args.engine_args)]
    engine_kwargs = _engine_kwargs(engine_args)
    mismatches = 0
    result: dict[str, Any] = {"model": model, "num_requests": args.num_requests,
                              "concurrency": args.concurrency, "clients": args.clients,
                              "frontends": args.frontends, "channels": channels, "runs": []}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(work.to_json())
        work_path = f.name
    print(f"{args.num_requests} requests, prompts {args.prompt_range} / outputs {args.output_range} tokens,"
          f" greedy; model {os.path.basename(model)}; {args.concurrency} streams from {args.clients}"
          f" client processes ({channels} connection(s) each); {args.frontends} frontend(s)", flush=True)
    try:
        if not args.no_local:
            local = run_local(model, work_path, engine_kwargs)
            result["local"] = local
            print(f"  in-process LLM     {local['tok_s']:9.1f} tok/s   CPU/token: "
                  f"{local['us_per_token']['in-process']:.1f} us; {mean_batch(local['batch'])}", flush=True)
        if args.no_stack:
            modes = []
        stack = Stack(model, args.frontends, engine_args, shlex.split(args.serve_args)) if modes else None
        try:
            if stack is not None:
                result["ready_s"] = stack.wait_ready()
                print(f"  (stack SERVING {result['ready_s']:.1f} s after launch)", flush=True)
                # Warm-up, untimed: a tenth of the workload through gRPC.
                warm = work.slice(0, 10)
                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                    f.write(warm.to_json())
                run_clients(stack, "delta", f.name, 1, args.concurrency)
                os.unlink(f.name)
                for mode in modes:
                    profile_dir = args.profile_dir if mode in args.profile.split(",") else ""
                    run = run_clients(stack, mode, work_path, args.clients, args.concurrency, channels, profile_dir)
                    result["runs"].append(run)
                    us = run["us_per_token"]
                    total = us["frontend"] + us["engine"]
                    line = (f"  stack {mode:<12} {run['tok_s']:9.1f} tok/s   CPU/token: frontend"
                            f" {us['frontend']:.1f} + engine {us['engine']:.1f} = {total:.1f} us")
                    if "local" in result:
                        line += f"  ({total / result['local']['us_per_token']['in-process']:.2f}x in-process)"
                    if run["messages"]:
                        line += f"; {run['tokens'] / run['messages']:.2f} tokens/message"
                    line += f"; {mean_batch(run['batch'])}; clients {run['clients_us_per_token']:.1f} us/token"
                    if run["first_message_s"]:
                        first = run["first_message_s"]
                        line += f"; first message p50 {first['p50'] * 1e3:.0f} / p90 {first['p90'] * 1e3:.0f} ms"
                    print(line, flush=True)
                    local = result.get("local")
                    if local is not None and run["tokens"] != local["tokens"]:
                        mismatches += 1
                        print(f"    ! {run['tokens']} tokens, in-process {local['tokens']}", flush=True)
                    if local is not None and run["digest"] not in (None, local["digest"]):
                        mismatches += 1
                        print(f"    ! token ids differ from the in-process run's: "
                              f"{divergence(local['lists'], run['lists'])}", flush=True)
                    run.pop("lists", None)
        finally:
            if stack is not None:
                stack.stop()
    finally:
        os.unlink(work_path)
    if args.json:
        result.get("local", {}).pop("lists", None)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
