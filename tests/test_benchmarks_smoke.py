"""The offline throughput benchmark runs end to end in --smoke mode (no timing asserts)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "result.json"
    env = dict(os.environ, TANDEM_CACHE_DIR=str(tmp / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offline_throughput", "--smoke", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout, json.loads(out.read_text())


def test_json_has_all_three_systems(smoke_run: tuple[str, dict]) -> None:
    _, doc = smoke_run
    wanted = doc["workload"]["output_tokens"]
    assert wanted > 0
    tandem = doc["tandem"]
    static = doc["hf_generate"]
    cb = doc["hf_continuous_batching"]
    for result in [tandem, *static["per_batch_size"], static["best"], cb]:
        assert result["output_tokens"] == wanted, result
        assert result["seconds"] > 0
        assert result["output_tokens_per_s"] > 0
    # Static batches pad: they generate at least what was asked for.
    assert all(r["raw_tokens"] >= wanted for r in static["per_batch_size"])
    assert len(static["per_batch_size"]) == 2
    assert doc["torch_threads"] >= 1
    assert cb["config"]["num_blocks"] > 0


def test_parity_and_agreement(smoke_run: tuple[str, dict]) -> None:
    stdout, doc = smoke_run
    assert doc["parity"]["ok"], doc["parity"]
    assert "parity: ok" in stdout
    n = doc["workload"]["num_requests"]
    # Reported for each HF run as "same/total"; batched numerics may differ, so no equality.
    agreement = doc["token_agreement_with_tandem"]
    assert len(agreement) == 3
    assert all(v.endswith(f"/{n}") for v in agreement.values())


def test_table_lists_every_system(smoke_run: tuple[str, dict]) -> None:
    stdout, _ = smoke_run
    for name in (
        "Tandem EngineCore",
        "HF generate() bs=2",
        "HF generate() best",
        "HF generate_batch() CB",
    ):
        assert name in stdout, stdout
    assert "torch threads:" in stdout


def test_roofline_is_reported(smoke_run: tuple[str, dict]) -> None:
    stdout, doc = smoke_run
    roof = doc["roofline"]
    assert roof["matmul_gflops"] > 0 and roof["copy_gbps"] > 0
    assert roof["flops_per_token"] > 0 and roof["weight_bytes"] > 0
    # The bound rests on rates measured in the same run, so only its sign is certain.
    assert roof["workload_seconds"] > 0 and roof["tandem_fraction"] > 0
    assert "roofline for this workload" in stdout
    assert roof["workload_seconds_with_attention"] > 0 and "roofline with attention" in stdout


def test_smg_serving_benchmark_runs_both_front_doors(tmp_path: Path) -> None:
    from benchmarks.smg_peer import smg_executable

    if smg_executable() is None:
        pytest.skip("the smg wheel is not installed (pip install smg)")
    out = tmp_path / "smg.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.smg_serving", "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    runs = json.loads(out.read_text())["runs"]
    assert [r["front_door"] for r in runs] == ["tandem frontend", "smg (cache_aware)"]
    for run in runs:
        assert run["summary"]["completed"] == run["summary"]["num_requests"] == 4
        assert run["summary"]["output_throughput"] > 0


def test_decode_profile_accounts_for_the_step() -> None:
    """benchmarks.decode_profile prints every bucket, the step and its roofline, and the
    buckets add up to the step (they are scaled to it)."""
    import io
    from contextlib import redirect_stdout

    from benchmarks import decode_profile

    out = io.StringIO()
    with redirect_stdout(out):
        assert decode_profile.main(["--steps", "3", "--batch-sizes", "1,2", "--prompt-len", "8"]) == 0
    rows = {line.split()[0] if not line.startswith(("lm head", "kv write", "other ops", "between ops", "of roofline"))
            else " ".join(line.split()[:2]): line for line in out.getvalue().splitlines()}
    for name in (*decode_profile.ORDER, "step", "roofline", "of roofline"):
        assert name in rows, (name, out.getvalue())

    def values(name: str) -> list[float]:
        return [float(v) for v in rows[name].split()[len(name.split()):]]

    step = values("step")
    total = [sum(col) for col in zip(*(values(n) for n in decode_profile.ORDER))]
    for got, want in zip(total, step):
        assert got == pytest.approx(want, rel=0.02, abs=0.05)


def test_llama_cpp_peer_tandem_side_and_accuracy() -> None:
    """benchmarks.llama_cpp_peer without llama.cpp: both Tandem configurations at a tiny
    size, every cell a positive rate, and the int8 accuracy line with counts in range."""
    import io
    import re
    from contextlib import redirect_stdout

    from benchmarks import llama_cpp_peer

    out = io.StringIO()
    with redirect_stdout(out):
        assert llama_cpp_peer.main(["--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "4",
                                    "--repeats", "1", "--accuracy-prompts", "3"]) == 0
    text = out.getvalue()
    for config in ("fp32", "int8"):
        for batch in (1, 2):
            row = re.search(rf"^Tandem {config}\s+{batch}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", text, re.M)
            assert row is not None, (config, batch, text)
            assert all(float(v) > 0 for v in row.groups()), row.group(0)
    acc = re.search(r"first token equal (\d+)/3, identical sequences (\d+)/3", text)
    assert acc is not None, text
    assert all(0 <= int(v) <= 3 for v in acc.groups())


def test_tensor_parallel_benchmark_smoke(tmp_path: Path) -> None:
    """TP=1 vs TP=2 and the gloo all-reduce measurement at a tiny size (numbers printed, not asserted)."""
    env = dict(os.environ, TANDEM_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tensor_parallel", "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert "gloo all-reduce, 2 ranks" in proc.stdout
    assert "Llama-3.1-70B" in proc.stdout
    assert "greedy tokens TP=1 vs TP=2: same" in proc.stdout


def test_grpc_hop_parts_run_and_agree(tokenizer: Any) -> None:
    # In-process, tiny: the serialization part checks that each side reads back what
    # was sent; the frontend-step part that every request got its RequestOutput.
    from benchmarks import grpc_hop

    ser = grpc_hop.bench_serialization(8, repeats=3)
    assert ser["protobuf_us"] > 0 and ser["msgspec_us"] > 0 and ser["protobuf_objects_us"] > 0
    assert ser["protobuf_bytes"] > 8
    front = grpc_hop.bench_frontend_step(tokenizer, 8, repeats=3)
    assert front["columns_us"] > 0 and front["objects_us"] > 0


def test_roofline_with_attention_counts_prefill_pairs_and_decode_kv_reads() -> None:
    """One request, 4 prompt tokens, 3 outputs, on a machine of 1 GFLOP/s and 1 GB/s."""
    from benchmarks.common import MachineLimits, Roofline

    roof = Roofline(
        body_flops_per_token=10.0,
        head_flops_per_token=5.0,
        weight_bytes=100.0,
        limits=MachineLimits(matmul_gflops=1.0, copy_gbps=1.0),
        attention_flops_per_pair=2.0,
        kv_bytes_per_token=7.0,
    )
    # Prefill: 4 x 10 body + 10 causal pairs x 2 + one LM head of 5 = 65 FLOPs.
    # Decode: outputs 2 and 3 see 5 and 6 keys: 2 x 15 FLOPs + 11 pairs x 2 = 52 FLOPs;
    # bytes at batch 1: 2 steps x 100 of weights + 11 cached tokens x 7 = 277 (the bound).
    got = roof.workload_seconds_with_attention([4], [3], batch=1)
    assert got == pytest.approx((65 + 277) * 1e-9)
    # At batch 2 the weights are read once per two tokens: 100 + 77 bytes.
    assert roof.workload_seconds_with_attention([4], [3], batch=2) == pytest.approx((65 + 177) * 1e-9)


def test_split_cost_runs_every_path_with_the_same_tokens(tiny_llama_dir: str, tmp_path: Path) -> None:
    """In-process, gRPC DELTA and FINAL_ONLY and the HTTP stream: every run reports its
    CPU per token, and the gRPC runs' tokens equal the in-process run's (exit 1 if not)."""
    out = tmp_path / "split.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.split_cost", "--smoke", "--model", tiny_llama_dir, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert [r["mode"] for r in doc["runs"]] == ["delta", "final", "http"]
    assert doc["local"]["batch"]["steps"] > 0
    for run in doc["runs"]:
        assert run["tokens"] == doc["local"]["tokens"] > 0
        assert run["us_per_token"]["frontend"] > 0 and run["us_per_token"]["engine"] > 0
        # The engine's batches, from its metrics: every step ran at least one request.
        assert run["batch"]["requests"] >= run["batch"]["steps"] > 0
        if run["mode"] != "http":
            assert run["digest"] == doc["local"]["digest"]


def test_message_cost_benchmark_measures_every_case(tmp_path: Path) -> None:
    out = tmp_path / "messages.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.message_cost", "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert set(doc["us_per_message"]) == {
        "socket", "grpc.aio client stream", "grpc sync client stream", "grpc.aio server stream"
    }
    for case in doc["us_per_message"].values():
        assert set(case) == {"back to back", "spaced"}
        # Sender and receiver, each a number (50 messages are too few for the 10 ms CPU
        # clock of another process to say more).
        assert all(len(pair) == 2 and all(math.isfinite(x) for x in pair) for pair in case.values())


def test_contention_benchmark_runs_quiet_and_beside_a_neighbour(tiny_llama_dir: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.contention", "--model", tiny_llama_dir,
         "--scenarios", "quiet,neighbour", "--num-requests", "3", "--input-len", "8",
         "--output-len", "4", "--concurrency", "2", "--", "--max-model-len", "256"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = {line.split(":")[0].strip(): line for line in proc.stdout.splitlines() if "tok/s" in line}
    assert set(lines) == {"quiet", "neighbour"}
    assert "failed 0" in lines["quiet"] and "x quiet" in lines["neighbour"]


def test_disaggregation_benchmark_runs_both_layouts_and_moves_kv(tiny_llama_dir: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.disaggregation", "--model", tiny_llama_dir,
         "--streams", "2", "--stream-prompt-len", "8", "--stream-output-len", "8",
         "--long-prompts", "2", "--long-prompt-len", "64", "--long-output-len", "2",
         "--long-rate", "10", "--long-delay", "0.1", "--max-model-len", "256"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert "aggregated: streams ITL" in proc.stdout and "disaggregated: streams ITL" in proc.stdout
    assert "KV moved:" in proc.stdout and "(0 failed)" in proc.stdout
    assert "disaggregated / aggregated" in proc.stdout
