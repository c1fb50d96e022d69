"""Helpers shared by the benchmarks: checkpoints, workloads, timing and tables.

Nothing here imports torch or transformers at module level, so a benchmark can set
thread-count environment variables before the first torch import.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

T = TypeVar("T")

# make_model gives special tokens the first ids (pad, bos, eos, im_start, im_end):
# random prompts start above them so that no prompt contains a control token.
FIRST_ORDINARY_TOKEN = 5


# Chat prompts with short answers: the real model's greedy checks (tests/test_real_model.py,
# benchmarks/q4_peer.py).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "List two benefits of exercise.",
    "What planet is known as the Red Planet?",
    "Describe a cat in five words.",
    "What is the largest ocean on Earth?",
    "Suggest a name for a pet goldfish.",
]


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- checkpoints ---------------------------------------------------------------------------


def cache_dir() -> str:
    """``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem"
    )


def cached_model(preset: str, arch: str = "llama", seed: int = 0, root: str | None = None) -> str:
    """Path of a random-weight checkpoint made by ``make_model``, built on first use.

    The directory name carries preset, arch and seed; a checkpoint is built in a
    staging directory and renamed into place, so a half-written one is never used.
    """
    from engine_service.make_model import make_model

    root = root or cache_dir()
    name = preset if (arch, seed) == ("llama", 0) else f"{preset}-{arch}-seed{seed}"
    final = os.path.join(root, name)
    if _is_checkpoint(final):
        return final
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a cache is for everyone
        make_model(staging, arch=arch, preset=preset, seed=seed)  # type: ignore[arg-type]
        try:
            os.replace(staging, final)
        except OSError:  # another process won the race, or a stale directory is there
            if not _is_checkpoint(final):
                raise
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        name.endswith(".safetensors") for name in _listdir(path)
    )


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def read_model_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


# ---- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Prompts of random token ids and the number of output tokens each request wants."""

    prompts: list[list[int]]
    max_tokens: list[int]
    seed: int

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def longest(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.max_tokens))

    def describe(self, args: Any) -> dict[str, Any]:
        """The workload as recorded in a benchmark's JSON (``args``: its parsed flags)."""
        return {
            "num_requests": len(self),
            "prompt_len": [args.min_prompt, args.max_prompt],
            "output_len": [args.min_output, args.max_output],
            "seed": args.seed,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }

    def subset(self, indices: Sequence[int]) -> Workload:
        return Workload(
            [self.prompts[i] for i in indices], [self.max_tokens[i] for i in indices], self.seed
        )


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """``num_requests`` requests, lengths uniform in the closed ranges, ids uniform over
    the ordinary (non-special) tokens of the vocabulary. Same arguments, same workload."""
    for name, (lo, hi) in (("prompt", prompt_len), ("output", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} length range must satisfy 1 <= min <= max, got {lo}..{hi}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary tokens")
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        prompts.append([rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)])
        max_tokens.append(rng.randint(*output_len))
    return Workload(prompts, max_tokens, seed)


# ---- measurement -------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One system's run over a workload."""

    system: str
    output_tokens: int  # tokens the requests asked for and got
    seconds: float
    raw_tokens: int | None = None  # tokens actually generated, padding waste included
    cpu_seconds: float | None = None  # process CPU time (all threads) over the same span

    @property
    def cpu_per_wall(self) -> float | None:
        """CPUs kept busy on average; well below the thread count means contention."""
        if self.cpu_seconds is None or self.seconds <= 0:
            return None
        return self.cpu_seconds / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "output_tokens": self.output_tokens,
            "raw_tokens": self.raw_tokens,
            "seconds": self.seconds,
            "output_tokens_per_s": self.tokens_per_s,
            "cpu_seconds": self.cpu_seconds,
        }


@dataclass(frozen=True)
class Timing:
    seconds: float  # wall clock
    cpu_seconds: float  # this process, all threads


def timed(fn: Callable[[], T]) -> tuple[T, Timing]:
    """Run ``fn`` once; return its result, the wall-clock seconds and the process CPU
    seconds it took."""
    cpu, start = time.process_time(), time.perf_counter()
    result = fn()
    return result, Timing(time.perf_counter() - start, time.process_time() - cpu)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# ---- output ---------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: text columns left-aligned, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[i], int | float) or row[i] is None for row in rows) if rows else False
        for i in range(len(headers))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


# ---- the machine's limit -----------------------------------------------------------------


@dataclass
class MachineLimits:
    matmul_gflops: float  # fp32 GEMM rate with the current torch threads: the best below
    copy_gbps: float  # bytes read + written per second by a large tensor copy
    matmul_gflops_torch: float = 0.0  # torch.mm (the BLAS torch was built with: MKL)
    matmul_gflops_onednn: float = 0.0  # oneDNN with a pre-packed weight; 0 if unavailable
    matmul_gflops_panel: float = 0.0  # Tandem's panel kernel (kernels.panel_linear); 0 if unavailable


def faster_limits(a: MachineLimits, b: MachineLimits) -> MachineLimits:
    """Each rate at the faster of two readings (e.g. before and after a run)."""
    return MachineLimits(**{f.name: max(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)})


def measure_machine(repeats: int = 5) -> MachineLimits:
    """fp32 2048^3 matmul rate and large-copy bandwidth, best of ``repeats``.

    The matmul is timed through torch.mm, through oneDNN with the weight reordered once
    (``kernels.onednn_linear``) and through Tandem's own panel kernel (where it builds):
    on AMD CPUs MKL's fp32 GEMM can reach well under half of what the cores do, and on
    AVX2 the panel kernel is ahead of both, so the machine's rate is the fastest of the three.
    """
    import torch

    from kernels.cpu_ops import native_available
    from kernels.onednn_linear import onednn_linear_available, pack_weight, packed_linear
    from kernels.panel_linear import pack_panels, panel_linear

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    src = torch.randn(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    torch.mm(a, b)
    dst.copy_(src)
    flops = 2 * 2048**3
    best_mm = min(timed(lambda: torch.mm(a, b))[1].seconds for _ in range(repeats))
    onednn = 0.0
    if onednn_linear_available(torch.device("cpu"), torch.float32):
        packed = pack_weight(b)
        packed_linear(a, packed, None)
        onednn = flops / min(timed(lambda: packed_linear(a, packed, None))[1].seconds for _ in range(repeats)) / 1e9
    panel = 0.0
    if native_available():
        panels = pack_panels(b.t(), quantize=False)  # a @ b = a @ (b.T).T
        panel_linear(a, panels, None)
        panel = flops / min(timed(lambda: panel_linear(a, panels, None))[1].seconds for _ in range(repeats)) / 1e9
    best_copy = min(timed(lambda: dst.copy_(src))[1].seconds for _ in range(repeats))
    torch_rate = flops / best_mm / 1e9
    return MachineLimits(
        max(torch_rate, onednn, panel), 2 * src.numel() * 4 / best_copy / 1e9, torch_rate, onednn, panel
    )


@dataclass
class Roofline:
    """Lower bounds for one model on one machine (fp32 weights)."""

    body_flops_per_token: float  # 2 x the parameters every token goes through, LM head excluded
    head_flops_per_token: float  # 2 x the LM head: once per sampled token
    weight_bytes: float  # bytes read per forward step: every parameter used, once
    limits: MachineLimits
    # Attention, per (query token, visible key) pair over all layers: the QK^T and PV
    # multiply-adds of every query head, and the key + value bytes one cached token holds.
    attention_flops_per_pair: float = 0.0
    kv_bytes_per_token: float = 0.0

    @classmethod
    def for_model(cls, model_dir: str, limits: MachineLimits, bytes_per_param: int = 4) -> Roofline:
        from safetensors import safe_open

        config = read_model_config(model_dir)
        total = 0
        names = [f for f in _listdir(model_dir) if f.endswith(".safetensors")]
        for name in names:
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    numel = 1
                    for dim in f.get_slice(key).get_shape():
                        numel *= dim
                    total += numel
        embed = config["vocab_size"] * config["hidden_size"]
        tied = config.get("tie_word_embeddings", False)
        # The embedding is a lookup; the LM head (the same matrix when tied) a matmul.
        body = total - embed - (0 if tied else embed)
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads", heads)
        return cls(
            2.0 * body,
            2.0 * embed,
            (body + embed) * bytes_per_param,
            limits,
            attention_flops_per_pair=4.0 * head_dim * heads * layers,
            kv_bytes_per_token=2.0 * kv_heads * head_dim * layers * 4,  # float32 cache
        )

    @property
    def flops_per_token(self) -> float:
        """A decode token: the body and the LM head."""
        return self.body_flops_per_token + self.head_flops_per_token

    def prefill_tokens_per_s(self) -> float:
        """Compute-bound; the LM head runs once per prompt, not per token: left out."""
        return self.limits.matmul_gflops * 1e9 / self.body_flops_per_token

    def decode_tokens_per_s(self, batch: float) -> float:
        """min(compute-bound, weight-read-bound at ``batch`` sequences per step)."""
        compute = self.limits.matmul_gflops * 1e9 / self.flops_per_token
        weight_bound = batch * self.limits.copy_gbps * 1e9 / self.weight_bytes
        return min(compute, weight_bound)

    def workload_seconds(self, prompt_tokens: int, output_tokens: int, batch: int) -> float:
        """Least time for a workload: prompt tokens compute-bound, outputs at ``batch``
        (weights and their matmuls only: attention is left out)."""
        return prompt_tokens / self.prefill_tokens_per_s() + output_tokens / self.decode_tokens_per_s(batch)

    def workload_seconds_with_attention(self, prompt_lens: Sequence[int], output_lens: Sequence[int], batch: int) -> float:
        """``workload_seconds`` plus the attention every request needs: causal prefill
        FLOPs over its prompt, and for each later output token the FLOPs over its context
        and one read of that context's cached keys and values. Prefill is compute-bound;
        decode, at ``batch`` sequences per step, takes the longer of its FLOPs at the
        matmul rate and its bytes (weights once per step, every context's KV) at the
        copy bandwidth."""
        pairs_prefill = sum(p * (p + 1) / 2 for p in prompt_lens)
        # The first output token comes from the prefill; token j >= 1 sees p + j keys.
        contexts = sum(max(0, o - 1) * p + max(0, o - 1) * o / 2 for p, o in zip(prompt_lens, output_lens))
        decode_tokens = sum(max(0, o - 1) for o in output_lens)
        rate = self.limits.matmul_gflops * 1e9
        prefill = (sum(prompt_lens) * self.body_flops_per_token + pairs_prefill * self.attention_flops_per_pair) / rate
        prefill += len(prompt_lens) * self.head_flops_per_token / rate  # the first tokens' LM head
        decode_flops = decode_tokens * self.flops_per_token + contexts * self.attention_flops_per_pair
        decode_bytes = decode_tokens / batch * self.weight_bytes + contexts * self.kv_bytes_per_token
        decode = max(decode_flops / rate, decode_bytes / (self.limits.copy_gbps * 1e9))
        return prefill + decode


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the /metrics page on 127.0.0.1:``port``: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
