"""Triton kernels against the PyTorch reference, and their compilation for a GPU target.

Why the kernels run in worker processes: whether triton interprets a kernel is decided
from ``TRITON_INTERPRET`` when the kernel is decorated, i.e. when ``kernels.triton_*`` is
first imported. Other test modules in this pytest process may import triton (transformers
does) or ``kernels.triton_ops`` before this module runs, and setting the variable here
would leak into their tests. So each mode gets a worker process whose environment is
fixed before Python starts: one with ``TRITON_INTERPRET=1`` that checks numerics on CPU,
one without it that compiles kernels for sm_90 down to cubin, and, where this machine has
CUDA, one that runs the same numerics cases compiled on the GPU
(``TANDEM_KERNEL_TEST_DEVICE=cuda``: inputs are drawn on CPU from the seed, the kernels run
on the GPU, the reference on CPU). Each test sends the
worker one case (a ``case_*`` function of this module, by name) and gets back one JSON
line. This process never imports triton.

Inputs are fresh random values every run; the seed is in every failure message.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_REPLY_PREFIX = "@@kernel-worker "
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol) per dtype. bf16 allows ~2 ulp: besides rounding in the reference, the
# interpreter truncates (instead of rounding) fp32 -> bf16 casts.
_TOL = {"float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3), "bfloat16": (1.6e-2, 1.6e-2)}
# Shared memory one block may use on sm_90 (227 KiB).
_SM90_MAX_SHARED = 232448


# ------------------------------------------------------------------ worker plumbing


class KernelWorker:
    """A child Python that runs ``case_*`` functions of this module on request."""

    def __init__(self, env: dict[str, str], log_path: Path, module: str = "tests.test_kernels") -> None:
        """``module``: the test module whose ``case_*`` functions the worker runs (its
        ``serve`` is this module's ``serve`` over its own ``_CASES``)."""
        self._env = env
        self._log_path = log_path
        self._module = module
        self._proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        log = self._log_path.open("a")
        code = f"import {self._module} as t; t.serve()"
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=self._env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        return proc

    def call(self, case: str, **params: Any) -> Any:
        """Run ``case_<case>(**params)`` in the worker; fail the test if it raised."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"case": case, "params": params}) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith(_REPLY_PREFIX):
                reply = json.loads(line[len(_REPLY_PREFIX) :])
                if not reply["ok"]:
                    pytest.fail(f"{case}({params}) failed in the worker:\n{reply['error']}")
                return reply["result"]
        tail = self._log_path.read_text()[-4000:]
        pytest.fail(f"kernel worker exited during {case}({params}); its log ends:\n{tail}")

    def close(self) -> None:
        if self._proc is None:
            return
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def serve(cases: dict[str, Callable[..., Any]] | None = None) -> None:
    """Worker main loop: one JSON request per stdin line, one reply line per request;
    ``cases``: by name (default: this module's ``case_*`` functions)."""
    cases = _CASES if cases is None else cases
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to the log, not into the reply stream
    torch.set_num_threads(1)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = cases[request["case"]](**request["params"])
            reply = {"ok": True, "result": result}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(_REPLY_PREFIX + json.dumps(reply) + "\n")


def _worker_env(interpret: bool, cache_dir: Path, device: str = "cpu") -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TANDEM_KERNEL_TEST_DEVICE"] = device
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    elif device == "cpu":
        env["TRITON_DUMP_PTXAS_LOG"] = "1"  # register/spill report, checked below
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # compile for real, not from an old cache
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def interp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelWorker]:
    tmp = tmp_path_factory.mktemp("triton-interp")
    worker = KernelWorker(_worker_env(True, tmp / "cache"), tmp / "worker.log")
    yield worker
    worker.close()


# Where the numerics cases run: always the interpreter, and the GPU where there is one.
_NUMERICS_MODES = ["interpreter", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(scope="module", params=_NUMERICS_MODES)
def numerics(
    request: pytest.FixtureRequest, interp: KernelWorker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KernelWorker]:
    """The worker that runs a numerics case: the interpreter's, or one on CUDA."""
    if request.param == "interpreter":
        yield interp
        return
    tmp = tmp_path_factory.mktemp("triton-cuda")
    worker = KernelWorker(_worker_env(False, tmp / "cache", "cuda"), tmp / "worker.log")
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def gpu_compiler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelWorker]:
    tmp = tmp_path_factory.mktemp("triton-compile")
    worker = KernelWorker(_worker_env(False, tmp / "cache"), tmp / "worker.log")
    yield worker
    worker.close()


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ------------------------------------------------------------------ input builders
# These run in the workers.


def _device() -> torch.device:
    """Where this worker runs the kernels (the reference always runs on CPU)."""
    return torch.device(os.environ.get("TANDEM_KERNEL_TEST_DEVICE", "cpu"))


def _interpreting() -> bool:
    return _device().type == "cpu"


def _on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(_device()) for name, t in batch.items()}


def _check_close(actual: torch.Tensor, expected: torch.Tensor, dtype: str, what: str) -> float:
    atol, rtol = _TOL[dtype]
    actual = actual.cpu().float()
    torch.testing.assert_close(actual, expected.float(), atol=atol, rtol=rtol, msg=what)
    return float((actual - expected.float()).abs().max())


class Guarded:
    """A tensor that is a view into the middle of a larger buffer, with random guard
    regions on both sides that an out-of-bounds write would change."""

    def __init__(self, shape: tuple[int, ...], fill: torch.Tensor, gen: torch.Generator) -> None:
        numel = fill.numel()
        self.guard = max(4096, numel // max(shape[0], 1))  # at least one outer row
        head = torch.randn(self.guard, generator=gen).to(fill.dtype)
        tail = torch.randn(self.guard, generator=gen).to(fill.dtype)
        device = _device()
        self.buffer = torch.cat([head, fill.reshape(-1), tail]).to(device)
        self._head, self._tail = head.to(device), tail.to(device)
        self.view = self.buffer[self.guard : self.guard + numel].view(shape)

    def check_guards(self, what: str) -> None:
        assert torch.equal(self.buffer[: self.guard], self._head), f"{what}: wrote before start"
        assert torch.equal(self.buffer[-self.guard :], self._tail), f"{what}: wrote past end"


def _paged_batch(
    gen: torch.Generator,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    prefix_lens: list[int],
) -> dict[str, torch.Tensor]:
    """A random flattened batch over a shuffled paged cache.

    Every cache row that no sequence owns (spare blocks, the tail of each last block)
    holds NaN, and block tables are padded with a NaN block: reading anything outside
    a sequence's context poisons its output.
    """
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    physical = torch.randperm(num_blocks, generator=gen)
    nan_block = int(physical[-1])
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), nan_block, dtype=torch.int32)
    next_block = 0
    for s, seq_len in enumerate(seq_lens):
        for j in range(blocks_per_seq[s]):
            b = int(physical[next_block])
            next_block += 1
            block_tables[s, j] = b
            rows = min(block_size, seq_len - j * block_size)
            key_cache[b, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
            value_cache[b, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


def _reference_attention_per_seq(batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The reference, one sequence at a time (so it never reads another one's padding)."""
    from kernels import reference

    starts = batch["query_start_loc"].tolist()
    out = torch.zeros_like(batch["query"])
    for s in range(batch["seq_lens"].shape[0]):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        out[lo:hi] = reference.paged_attention(
            batch["query"][lo:hi],
            batch["key_cache"],
            batch["value_cache"],
            batch["block_tables"][s : s + 1],
            torch.tensor([0, hi - lo], dtype=torch.int32),
            batch["seq_lens"][s : s + 1],
            scale,
        )
    return out


# ------------------------------------------------------------------ cases (run in workers)


def case_interpreter_is_on() -> bool:
    import triton

    from kernels import triton_ops

    return bool(triton.knobs.runtime.interpret) and triton_ops.interpreting()


def case_compiled_on_cuda() -> bool:
    """True when this worker runs compiled kernels on a CUDA device."""
    from kernels import triton_ops

    return _device().type == "cuda" and not triton_ops.interpreting()


def case_paged_attention(
    seed: int,
    dtype: str,
    head_dim: int,
    block_size: int,
    group: int,
    num_kv_heads: int,
    query_lens: list[int],
    prefix_lens: list[int],
    block_m: int | None = None,
    tile_n: int | None = None,
) -> float:
    from kernels import triton_ops

    gen = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    batch = _paged_batch(
        gen, _DTYPES[dtype], num_heads, num_kv_heads, head_dim, block_size, query_lens, prefix_lens
    )
    scale = head_dim**-0.5
    out = Guarded(batch["query"].shape, torch.full_like(batch["query"], float("nan")), gen)
    tiles = None if block_m is None else triton_ops.AttentionTiles(block_m, tile_n or 32)
    launch = triton_ops.plan_paged_attention(
        **_on_device(batch), scale=scale, out=out.view, tiles=tiles, interpret=_interpreting()
    )
    launch.run()
    out.check_guards(f"paged_attention out, seed={seed}")
    expected = _reference_attention_per_seq(batch, scale)
    return _check_close(out.view, expected, dtype, f"paged_attention seed={seed}")


def case_paged_attention_public_api(seed: int) -> float:
    """The public entry point (default tiles, no ``out``) on a mixed batch."""
    from kernels import dispatch

    gen = torch.Generator().manual_seed(seed)
    batch = _paged_batch(gen, torch.float16, 8, 2, 64, 16, [1, 23, 1], [40, 9, 0])
    ops = dispatch.get_ops("triton")
    out = ops.paged_attention(**_on_device(batch), scale=0.125)
    expected = _reference_attention_per_seq(batch, 0.125)
    return _check_close(out, expected, "float16", f"public paged_attention seed={seed}")


def _split_kv_empty_segments(
    batch: dict[str, torch.Tensor], num_splits: int, tile_n: int
) -> torch.Tensor:
    """[num_tokens, num_splits] bool: which key segments of each token are empty, by the
    split kernel's rule (a token sees ``visible`` keys, up to its own position, cut into
    segments of cdiv(visible, num_splits) keys rounded up to tile_n)."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    starts = batch["query_start_loc"].tolist()
    empty = torch.zeros(starts[-1], num_splits, dtype=torch.bool)
    for s, seq_len in enumerate(batch["seq_lens"].tolist()):
        q_len = starts[s + 1] - starts[s]
        for t in range(q_len):
            visible = seq_len - q_len + t + 1  # keys 0..position
            chunk = cdiv(cdiv(visible, num_splits), tile_n) * tile_n
            for j in range(num_splits):
                empty[starts[s] + t, j] = j * chunk >= visible
    return empty


def case_split_kv_attention(
    seed: int,
    dtype: str,
    head_dim: int,
    block_size: int,
    group: int,
    num_kv_heads: int,
    seq_lens: list[int],
    query_lens: list[int] | None = None,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> dict[str, Any]:
    """The split-KV path, planned directly (whatever the rule says), against the
    reference. Partials and out are NaN-filled views with guards, so an unwritten
    partial or an out-of-bounds write shows; empty segments must hold max -inf, denom 0
    and acc 0."""
    from kernels import triton_ops

    gen = torch.Generator().manual_seed(seed)
    what = f"split-KV attention seed={seed}"
    query_lens = query_lens if query_lens is not None else [1] * len(seq_lens)
    prefix_lens = [n - q for n, q in zip(seq_lens, query_lens)]
    num_heads = group * num_kv_heads
    batch = _paged_batch(
        gen, _DTYPES[dtype], num_heads, num_kv_heads, head_dim, block_size, query_lens, prefix_lens
    )
    num_tokens = batch["query"].shape[0]
    if num_splits is None:
        num_splits = triton_ops.split_kv_splits(
            len(seq_lens), num_kv_heads, triton_ops._num_sms(_device())
        )
    shape = (num_tokens, num_heads, num_splits)
    nan = float("nan")
    acc = Guarded((*shape, head_dim), torch.full((*shape, head_dim), nan), gen)
    row_max = Guarded(shape, torch.full(shape, nan), gen)
    denom = Guarded(shape, torch.full(shape, nan), gen)
    partials = triton_ops.SplitKVPartials(acc=acc.view, row_max=row_max.view, denom=denom.view)
    scale = head_dim**-0.5
    out = Guarded(batch["query"].shape, torch.full_like(batch["query"], nan), gen)
    launch = triton_ops.plan_split_kv_attention(
        **_on_device(batch), scale=scale, out=out.view, num_splits=num_splits,
        partials=partials, tile_n=tile_n, interpret=_interpreting(),
    )  # fmt: skip
    assert launch.split.grid == (num_tokens, num_kv_heads, num_splits), launch.split.grid
    assert launch.reduce.grid == (num_tokens, num_heads), launch.reduce.grid
    launch.run()
    for guarded, name in ((out, "out"), (acc, "acc"), (row_max, "row_max"), (denom, "denom")):
        guarded.check_guards(f"{what}: {name}")
    m, d, a = row_max.view.cpu(), denom.view.cpu(), acc.view.cpu()
    assert not (m.isnan().any() or d.isnan().any() or a.isnan().any()), f"{what}: unwritten partials"
    empty = _split_kv_empty_segments(batch, num_splits, launch.split.constexprs["TILE_N"])
    empty = empty[:, None, :].expand(shape)  # [num_tokens, num_heads, num_splits]
    assert bool((m[empty] == float("-inf")).all() and (d[empty] == 0).all()), f"{what}: empty split"
    assert bool((a[empty] == 0).all()), f"{what}: empty split's acc"
    # The top-scoring key of a segment adds exp2(0) = 1 to its denominator.
    assert bool(m[~empty].isfinite().all() and (d[~empty] >= 1).all()), f"{what}: non-empty split"
    expected = _reference_attention_per_seq(batch, scale)
    error = _check_close(out.view, expected, dtype, what)
    return {"error": error, "num_splits": num_splits, "empty": int(empty[:, 0, :].sum())}


def case_split_kv_rule(seed: int) -> dict[str, Any]:
    """Which path the public op takes with ``split_kv=True``: the split path for a
    batch-1 decode (two launches, the step's partials kept in ``workspace`` and shared by
    a second "layer"), the unified kernel for a batch with a prefill chunk, and for the
    batch-1 decode without ``split_kv``; all against the reference."""
    from kernels import triton_ops

    gen = torch.Generator().manual_seed(seed)
    taken: dict[str, Any] = {}
    for name, query_lens, prefix_lens, split_kv in (
        ("batch1_decode", [1], [300], True),
        ("mixed_prefill", [1, 17], [40, 3], True),
        ("batch1_decode_unsplit", [1], [300], False),
    ):
        workspace: dict[str, Any] = {}
        triton_ops._PLANS._plans.clear()
        for layer in range(2):  # two layers of one step: new caches, one workspace
            batch = _paged_batch(gen, torch.float16, 32, 8, 64, 16, query_lens, prefix_lens)
            device_batch = _on_device(batch)
            got = triton_ops.paged_attention(**device_batch, scale=0.125, workspace=workspace, split_kv=split_kv)
            expected = _reference_attention_per_seq(batch, 0.125)
            _check_close(got, expected, "float16", f"{name} layer {layer}, seed={seed}")
            partials = workspace.get("triton_split_kv_partials", {})
            if layer == 0:
                first = {key: id(p) for key, p in partials.items()}
            assert {key: id(p) for key, p in partials.items()} == first, "partials not reused"
        taken[name] = {
            "plans": sorted(key[0] for key in triton_ops._PLANS._plans),
            "num_splits": triton_ops.attention_num_splits(
                device_batch["query"], device_batch["key_cache"], device_batch["seq_lens"], split_kv
            ),
            "partials": len(first),
        }
    # What the rule gives batch 1 x 8 KV heads on this device (32 on 132 SMs).
    taken["expected_splits"] = triton_ops.split_kv_splits(1, 8, triton_ops._num_sms(_device()))
    return taken


def case_reshape_and_cache(
    seed: int,
    dtype: str,
    cache_dtype: str,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_tokens: int,
) -> int:
    from kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = Guarded(shape, torch.randn(shape, generator=gen).to(_DTYPES[cache_dtype]), gen)
    value_cache = Guarded(shape, torch.randn(shape, generator=gen).to(_DTYPES[cache_dtype]), gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(_DTYPES[dtype])
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(_DTYPES[dtype])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    padding = torch.rand(num_tokens, generator=gen) < 0.2
    padding[0] = True
    slots[padding] = -1
    expected_k, expected_v = key_cache.view.cpu().clone(), value_cache.view.cpu().clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    dev = _device()
    triton_ops.reshape_and_cache(
        key.to(dev), value.to(dev), key_cache.view, value_cache.view, slots.to(dev)
    )
    key_cache.check_guards(f"key cache, seed={seed}")
    value_cache.check_guards(f"value cache, seed={seed}")
    # A copy is exact; skipped slots must keep their old (random) contents.
    assert torch.equal(key_cache.view.cpu(), expected_k), f"key cache differs, seed={seed}"
    assert torch.equal(value_cache.view.cpu(), expected_v), f"value cache differs, seed={seed}"
    return int((~padding).sum())


def case_rms_norm(
    seed: int, dtype: str, hidden: int, num_tokens: int, with_residual: bool, row_pad: int
) -> float:
    from kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    # row_pad > 0 makes x a strided view, as a slice of a wider activation would be.
    wide = torch.randn(num_tokens, hidden + row_pad, generator=gen).mul(3).to(torch_dtype)
    x = wide[:, :hidden]
    weight = torch.randn(hidden, generator=gen).to(torch_dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(torch_dtype)
    residual = residual if with_residual else None
    expected, expected_res = reference.rms_norm(x, weight, 1e-5, residual)
    dev = _device()
    x, weight = wide.to(dev)[:, :hidden], weight.to(dev)
    residual = None if residual is None else residual.to(dev)
    out = torch.full((num_tokens, hidden), float("nan"), dtype=torch_dtype, device=dev)
    new_res = torch.full_like(out, float("nan")) if with_residual else None
    triton_ops.plan_rms_norm(x, weight, 1e-5, residual, out, new_res).run()
    err = _check_close(out, expected, dtype, f"rms_norm out, seed={seed}")
    if expected_res is not None:
        assert new_res is not None
        if dtype == "bfloat16":  # the interpreter truncates fp32 -> bf16; the reference rounds
            _check_close(new_res, expected_res, dtype, f"rms_norm residual, seed={seed}")
        else:
            assert torch.equal(new_res.cpu(), expected_res), f"rms_norm residual, seed={seed}"
    public_out, public_res = triton_ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(public_out, out), "public rms_norm differs from the planned launch"
    assert (public_res is None) == (residual is None)
    return err


def _cos_sin_cache(max_position: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)  # [max_pos, d/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def case_plan_cache(seed: int) -> int:
    """Public ops called twice on new tensors of one layout (as the layers of a step
    call them) reuse the first call's checked plan but compute on the new tensors; the
    cache keeps no tensor; another layout gets a plan of its own."""
    import gc
    import weakref

    from kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(seed)
    dev = _device()
    before = len(triton_ops._PLANS._plans)
    refs = []
    for hidden in (48, 48, 80):
        x = torch.randn(5, hidden, generator=gen)
        w = torch.randn(hidden, generator=gen)
        res = torch.randn(5, hidden, generator=gen)
        want, want_res = reference.rms_norm(x, w, 1e-6, res)
        got, got_res = triton_ops.rms_norm(x.to(dev), w.to(dev), 1e-6, res.to(dev))
        _check_close(got, want, "float32", f"rms_norm through the plan cache, seed={seed}")
        _check_close(got_res, want_res, "float32", f"residual through the plan cache, seed={seed}")
        gate_up = torch.randn(3, 2 * hidden, generator=gen)
        _check_close(triton_ops.silu_and_mul(gate_up.to(dev)), reference.silu_and_mul(gate_up), "float32",
                     f"silu_and_mul through the plan cache, seed={seed}")
        refs.append(weakref.ref(x))
        del x, got, got_res
    gc.collect()
    assert all(r() is None for r in refs), "the plan cache holds a tensor"
    return len(triton_ops._PLANS._plans) - before


def case_rotary_embedding(
    seed: int,
    dtype: str,
    cache_dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
) -> float:
    from kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    # q and k are strided views into one fused qkv activation, as the model produces them.
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen).to(torch_dtype)
    expected = qkv.clone()
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    cache = _cos_sin_cache(4096, head_dim, _DTYPES[cache_dtype])

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, :q_width].view(num_tokens, num_heads, head_dim)
        k = t[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
        return q, k

    reference.rotary_embedding(positions, *views(expected), cache)
    dev = _device()
    qkv = qkv.to(dev)
    triton_ops.rotary_embedding(positions.to(dev), *views(qkv), cache.to(dev))
    qkv = qkv.cpu()
    assert torch.equal(qkv[:, q_width + kv_width :], expected[:, q_width + kv_width :]), (
        "rotary_embedding wrote into the value part"
    )
    return _check_close(qkv, expected, dtype, f"rotary_embedding seed={seed}")


def case_silu_and_mul(seed: int, dtype: str, num_tokens: int, inter: int, row_pad: int) -> float:
    from kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    # row_pad > 0 makes gate_up a strided view, as a slice of a wider activation would be.
    # Scaled by 4 so that silu's saturated tails are exercised too.
    wide = torch.randn(num_tokens, 2 * inter + row_pad, generator=gen).mul(4).to(torch_dtype)
    gate_up = wide[:, : 2 * inter]
    expected = reference.silu_and_mul(gate_up)
    # The kernel computes in float32 and rounds once; the reference rounds twice in
    # float16/bfloat16, so also check against the float32 result, at the same tolerance.
    expected_f32 = reference.silu_and_mul(gate_up.float())
    dev = _device()
    gate_up = wide.to(dev)[:, : 2 * inter]
    nan = torch.full((num_tokens, inter), float("nan")).to(torch_dtype)
    out = Guarded((num_tokens, inter), nan, gen)
    triton_ops.plan_silu_and_mul(gate_up, out.view).run()
    out.check_guards(f"silu_and_mul out, seed={seed}")
    err = _check_close(out.view, expected, dtype, f"silu_and_mul seed={seed}")
    _check_close(out.view, expected_f32, dtype, f"silu_and_mul vs float32, seed={seed}")
    public = triton_ops.silu_and_mul(gate_up)
    assert public.dtype == gate_up.dtype and public.shape == (num_tokens, inter)
    assert torch.equal(public, out.view), "public silu_and_mul differs from the planned launch"
    return err


def case_silu_and_mul_grid(num_tokens: int, inter: int) -> list[int]:
    """The grid the plan picks, over empty CPU tensors (nothing runs)."""
    from kernels import triton_ops

    gate_up = torch.empty(num_tokens, 2 * inter, dtype=torch.bfloat16)
    out = torch.empty(num_tokens, inter, dtype=torch.bfloat16)
    return list(triton_ops.plan_silu_and_mul(gate_up, out).grid)


def case_rotary_and_cache(
    seed: int,
    dtype: str,
    cache_dtype: str,
    cos_sin_dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_tokens: int,
) -> int:
    """The fused kernel against ``reference.rotary_and_cache`` (rotary_embedding then
    reshape_and_cache). Returns how many tokens were written into the cache."""
    from kernels import reference, triton_ops

    gen = torch.Generator().manual_seed(seed)
    torch_dtype, kv_dtype = _DTYPES[dtype], _DTYPES[cache_dtype]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    # q, k and v are strided views into one fused qkv activation, as the model produces them.
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen).to(torch_dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    cos_sin = _cos_sin_cache(4096, head_dim, _DTYPES[cos_sin_dtype])
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = Guarded(shape, torch.randn(shape, generator=gen).to(kv_dtype), gen)
    value_cache = Guarded(shape, torch.randn(shape, generator=gen).to(kv_dtype), gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    padding = torch.rand(num_tokens, generator=gen) < 0.2
    padding[0] = True
    slots[padding] = -1

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = t[:, :q_width].view(num_tokens, num_heads, head_dim)
        k = t[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
        v = t[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_dim)
        return q, k, v

    expected = qkv.clone()
    expected_k, expected_v = key_cache.view.cpu().clone(), value_cache.view.cpu().clone()
    q, k, v = views(expected)
    reference.rotary_and_cache(positions, q, k, v, cos_sin, expected_k, expected_v, slots)

    dev = _device()
    inputs = (positions.to(dev), cos_sin.to(dev), slots.to(dev))
    public_qkv = qkv.to(dev).clone()  # for the public op, below
    qkv = qkv.to(dev)
    q, k, v = views(qkv)
    triton_ops.plan_rotary_and_cache(
        inputs[0], q, k, v, inputs[1], key_cache.view, value_cache.view, inputs[2]
    ).run()
    key_cache.check_guards(f"key cache, seed={seed}")
    value_cache.check_guards(f"value cache, seed={seed}")
    what = f"rotary_and_cache seed={seed}"
    got = qkv.cpu()
    assert torch.equal(got[:, q_width + kv_width :], expected[:, q_width + kv_width :]), (
        f"{what}: wrote into the value part"
    )
    _check_close(got, expected, dtype, f"{what}: q and k")
    got_k, got_v = key_cache.view.cpu(), value_cache.view.cpu()
    flat = (-1, num_kv_heads, head_dim)
    written = slots[~padding]
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unwritten[written] = False
    # Slots that no token writes keep their old (random) contents exactly.
    assert torch.equal(got_k.view(flat)[unwritten], expected_k.view(flat)[unwritten]), what
    assert torch.equal(got_v.view(flat)[unwritten], expected_v.view(flat)[unwritten]), what
    # The value is copied exactly; the cached key is exactly the kernel's own rotated key.
    assert torch.equal(got_v, expected_v), f"{what}: value cache differs"
    rotated_k = got[:, q_width : q_width + kv_width].reshape(flat)
    cached_k = got_k.view(flat)[written]
    assert torch.equal(cached_k, rotated_k[~padding].to(kv_dtype)), f"{what}: cached key != key"
    # ... and close to the reference's (rounding may differ by an ulp of key's dtype).
    tol_dtype = dtype if _TOL[dtype] > _TOL[cache_dtype] else cache_dtype
    _check_close(got_k, expected_k, tol_dtype, f"{what}: key cache")

    # The public op does exactly what the planned launch did.
    public_k, public_v = key_cache.view.clone(), value_cache.view.clone()
    public_k.view(flat)[written.to(dev)] = 0
    public_v.view(flat)[written.to(dev)] = 0
    q, k, v = views(public_qkv)
    triton_ops.rotary_and_cache(inputs[0], q, k, v, inputs[1], public_k, public_v, inputs[2])
    assert torch.equal(public_qkv.cpu(), got), f"{what}: public op's q/k differ"
    assert torch.equal(public_k.cpu(), got_k), f"{what}: public op's key cache differs"
    assert torch.equal(public_v.cpu(), got_v), f"{what}: public op's value cache differs"
    return int((~padding).sum())


def case_rejects_bad_input(op: str) -> str:
    from kernels import triton_ops

    f16 = torch.float16
    cache = torch.randn(4, 16, 2, 64).to(f16)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    calls: dict[str, Callable[[], Any]] = {
        "gqa_ratio": lambda: triton_ops.paged_attention(
            torch.randn(1, 3, 64).to(f16), cache, cache, table, qsl, lens, 0.1
        ),
        "dtype_mismatch": lambda: triton_ops.paged_attention(
            torch.randn(1, 4, 64), cache, cache, table, qsl, lens, 0.1
        ),
        "query_start_loc_len": lambda: triton_ops.paged_attention(
            torch.randn(1, 4, 64).to(f16), cache, cache, table, qsl[:1], lens, 0.1
        ),
        "split_kv_num_splits": lambda: triton_ops.plan_split_kv_attention(
            torch.randn(1, 4, 64).to(f16), cache, cache, table, qsl, lens, 0.1,
            torch.empty(1, 4, 64).to(f16), num_splits=3,
        ),
        "split_kv_partials": lambda: triton_ops.plan_split_kv_attention(
            torch.randn(1, 4, 64).to(f16), cache, cache, table, qsl, lens, 0.1,
            torch.empty(1, 4, 64).to(f16), num_splits=4,
            partials=triton_ops.SplitKVPartials.empty(1, 4, 2, 64, torch.device("cpu")),
        ),
        "slot_mapping_len": lambda: triton_ops.reshape_and_cache(
            torch.randn(3, 2, 64).to(f16),
            torch.randn(3, 2, 64).to(f16),
            cache,
            cache,
            torch.zeros(2, dtype=torch.int64),
        ),
        "rms_weight": lambda: triton_ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6),
        "rotary_width": lambda: triton_ops.rotary_embedding(
            torch.zeros(2, dtype=torch.int64),
            torch.randn(2, 4, 64),
            torch.randn(2, 2, 64),
            torch.randn(10, 32),
        ),
        "silu_odd_width": lambda: triton_ops.silu_and_mul(torch.randn(2, 9)),
        "silu_dims": lambda: triton_ops.silu_and_mul(torch.randn(2, 3, 8)),
        "silu_int": lambda: triton_ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.int32)),
        "rotary_cache_kv_heads": lambda: triton_ops.rotary_and_cache(
            torch.zeros(3, dtype=torch.int64),
            torch.randn(3, 4, 64).to(f16),
            torch.randn(3, 4, 64).to(f16),  # 4 KV heads; the cache has 2
            torch.randn(3, 4, 64).to(f16),
            torch.randn(10, 64),
            cache,
            cache,
            torch.zeros(3, dtype=torch.int64),
        ),
        "rotary_cache_value_shape": lambda: triton_ops.rotary_and_cache(
            torch.zeros(3, dtype=torch.int64),
            torch.randn(3, 4, 64).to(f16),
            torch.randn(3, 2, 64).to(f16),
            torch.randn(2, 2, 64).to(f16),
            torch.randn(10, 64),
            cache,
            cache,
            torch.zeros(3, dtype=torch.int64),
        ),
        "rotary_cache_slot_dtype": lambda: triton_ops.rotary_and_cache(
            torch.zeros(3, dtype=torch.int64),
            torch.randn(3, 4, 64).to(f16),
            torch.randn(3, 2, 64).to(f16),
            torch.randn(3, 2, 64).to(f16),
            torch.randn(10, 64),
            cache,
            cache,
            torch.zeros(3),
        ),
        "rotary_cache_width": lambda: triton_ops.rotary_and_cache(
            torch.zeros(3, dtype=torch.int64),
            torch.randn(3, 4, 64).to(f16),
            torch.randn(3, 2, 64).to(f16),
            torch.randn(3, 2, 64).to(f16),
            torch.randn(10, 32),
            cache,
            cache,
            torch.zeros(3, dtype=torch.int64),
        ),
    }
    try:
        calls[op]()
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{op}: bad input was accepted")


def _plan_for_compile(kernel: str, cfg: dict[str, Any]) -> Any:
    """A launch plan over empty CPU tensors: compiling needs only shapes and dtypes."""
    from kernels import triton_ops

    dtype = _DTYPES[cfg["dtype"]]
    if kernel == "paged_attention":
        kvh, group, hd, tokens = cfg["num_kv_heads"], cfg["group"], cfg["head_dim"], cfg["tokens"]
        seqs = cfg["num_seqs"]  # 1 makes the JIT turn num_seqs into a constant
        cache = torch.empty(64, cfg["block_size"], kvh, hd, dtype=dtype)
        query = torch.empty(seqs * tokens, kvh * group, hd, dtype=dtype)
        qsl = torch.arange(seqs + 1, dtype=torch.int32) * tokens
        lens = torch.full((seqs,), 100, dtype=torch.int32)
        table = torch.zeros(seqs, 8, dtype=torch.int32)
        return triton_ops.plan_paged_attention(
            query, cache, cache, table, qsl, lens, 0.1, torch.empty_like(query)
        )
    if kernel in ("split_kv_attention", "split_kv_reduce"):
        kvh, group, hd, seqs = cfg["num_kv_heads"], cfg["group"], cfg["head_dim"], cfg["num_seqs"]
        cache = torch.empty(64, cfg["block_size"], kvh, hd, dtype=dtype)
        query = torch.empty(seqs, kvh * group, hd, dtype=dtype)  # one token per sequence
        qsl = torch.arange(seqs + 1, dtype=torch.int32)
        lens = torch.full((seqs,), 100, dtype=torch.int32)
        table = torch.zeros(seqs, 8, dtype=torch.int32)
        # num_splits as paged_attention picks it for 132 SMs (these tensors are on CPU).
        split = triton_ops.plan_split_kv_attention(
            query, cache, cache, table, qsl, lens, 0.1, torch.empty_like(query)
        )
        return split.split if kernel == "split_kv_attention" else split.reduce
    if kernel == "reshape_and_cache":
        key = torch.empty(8, cfg["num_kv_heads"], cfg["head_dim"], dtype=dtype)
        shape = (16, 16, cfg["num_kv_heads"], cfg["head_dim"])
        cache = torch.empty(shape, dtype=_DTYPES[cfg["cache_dtype"]])
        slots = torch.zeros(8, dtype=torch.int64)
        return triton_ops.plan_reshape_and_cache(key, key, cache, cache, slots)
    if kernel == "rms_norm":
        x = torch.empty(8, cfg["hidden"], dtype=dtype)
        res = torch.empty_like(x) if cfg["residual"] else None
        return triton_ops.plan_rms_norm(x, x[0], 1e-6, res, torch.empty_like(x), res)
    if kernel == "rotary_embedding":
        hd = cfg["head_dim"]
        q = torch.empty(8, cfg["num_heads"], hd, dtype=dtype)
        k = torch.empty(8, cfg["num_kv_heads"], hd, dtype=dtype)
        positions = torch.zeros(8, dtype=torch.int64)
        return triton_ops.plan_rotary_embedding(positions, q, k, torch.empty(64, hd))
    if kernel == "silu_and_mul":
        gate_up = torch.empty(cfg["tokens"], 2 * cfg["inter"], dtype=dtype)
        out = torch.empty(cfg["tokens"], cfg["inter"], dtype=dtype)
        return triton_ops.plan_silu_and_mul(gate_up, out)
    if kernel == "rotary_and_cache":
        hd, kvh = cfg["head_dim"], cfg["num_kv_heads"]
        q = torch.empty(8, cfg["num_heads"], hd, dtype=dtype)
        k = torch.empty(8, kvh, hd, dtype=dtype)
        cache = torch.empty(16, 16, kvh, hd, dtype=_DTYPES[cfg["cache_dtype"]])
        positions = torch.zeros(8, dtype=torch.int64)
        slots = torch.zeros(8, dtype=torch.int64)
        return triton_ops.plan_rotary_and_cache(
            positions, q, k, torch.empty_like(k), torch.empty(64, hd), cache, cache, slots
        )
    raise ValueError(f"unknown kernel {kernel!r}")


def case_compile_sm90(kernel: str, cfg: dict[str, Any]) -> dict[str, int]:
    """Compile one launch for sm_90 down to cubin; check shared memory and spills."""
    return compile_sm90(_plan_for_compile(kernel, cfg))


def compile_sm90(launch: Any) -> dict[str, int]:
    """``launch`` (a KernelLaunch) compiled for sm_90 down to cubin, with its shared
    memory and ptxas's register and spill report checked (in a compiling worker)."""
    import triton
    from triton.backends.compiler import GPUTarget

    params = list(launch.args) + list(launch.constexprs)
    assert params == launch.kernel.arg_names, f"plan order {params} != {launch.kernel.arg_names}"
    ptxas_log = io.StringIO()
    with contextlib.redirect_stdout(ptxas_log):  # TRITON_DUMP_PTXAS_LOG prints it
        compiled = triton.compile(
            launch.ast_source(),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": launch.num_warps},
        )
    cubin = compiled.asm["cubin"]
    assert isinstance(cubin, bytes) and len(cubin) > 0, "no cubin produced"
    assert compiled.metadata.shared <= _SM90_MAX_SHARED, f"shared {compiled.metadata.shared}"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", ptxas_log.getvalue())]
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", ptxas_log.getvalue())]
    assert spills and regs, f"no ptxas report captured:\n{ptxas_log.getvalue()}"
    assert max(spills) == 0, f"register spills: {ptxas_log.getvalue()}"
    return {"registers": max(regs), "shared": compiled.metadata.shared}


_CASES: dict[str, Callable[..., Any]] = {
    name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")
}


# ------------------------------------------------------------------ tests: interpreter

# A decode token at context 1, decodes at 37 / 96 / 17, a 17-token chunk over a 13-token
# prefix and a fresh 40-token prefill, all in one batch.
_MIXED_QUERY = [1, 1, 17, 1, 40, 1]
_MIXED_PREFIX = [0, 36, 13, 95, 0, 16]

# (dtype, head_dim, block_size, group, num_kv_heads): every dtype meets every head dim,
# both block sizes, and GQA ratios 1 / 4 / 8.
_ATTENTION_CONFIGS = [
    ("float16", 128, 16, 4, 2),
    ("float16", 64, 16, 1, 1),
    ("float16", 32, 32, 8, 2),
    ("bfloat16", 64, 32, 8, 1),
    ("bfloat16", 128, 16, 1, 2),
    ("bfloat16", 32, 32, 4, 2),
    ("float32", 32, 16, 1, 4),
    ("float32", 64, 32, 4, 2),
    ("float32", 128, 32, 8, 1),
]


def test_worker_runs_the_interpreter(interp: KernelWorker) -> None:
    assert interp.call("interpreter_is_on") is True


def test_numerics_worker_runs_where_it_says(numerics: KernelWorker, interp: KernelWorker) -> None:
    """The CUDA worker runs compiled kernels on the GPU, the interpreter's stays on CPU."""
    assert numerics.call("compiled_on_cuda") is (numerics is not interp)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "group", "num_kv_heads"), _ATTENTION_CONFIGS
)
def test_paged_attention_mixed_batch(
    numerics: KernelWorker,
    dtype: str,
    head_dim: int,
    block_size: int,
    group: int,
    num_kv_heads: int,
) -> None:
    numerics.call(
        "paged_attention",
        seed=_fresh_seed(),
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        group=group,
        num_kv_heads=num_kv_heads,
        query_lens=_MIXED_QUERY,
        prefix_lens=_MIXED_PREFIX,
    )


@pytest.mark.parametrize(("block_m", "tile_n"), [(16, 16), (32, 64), (128, 32)])
def test_paged_attention_tile_shapes(numerics: KernelWorker, block_m: int, tile_n: int) -> None:
    """Query tiles smaller and larger than a chunk, keys tiles smaller and larger than
    a cache block, and a sequence with no new tokens."""
    numerics.call(
        "paged_attention",
        seed=_fresh_seed(),
        dtype="float16",
        head_dim=64,
        block_size=32,
        group=2,
        num_kv_heads=2,
        query_lens=[1, 33, 0, 70, 1],
        prefix_lens=[63, 31, 5, 0, 0],
        block_m=block_m,
        tile_n=tile_n,
    )


def test_paged_attention_odd_group_and_head_dim(numerics: KernelWorker) -> None:
    """GQA ratio 3 and head dim 80 exercise the padded query-row and head-dim masks."""
    numerics.call(
        "paged_attention",
        seed=_fresh_seed(),
        dtype="float16",
        head_dim=80,
        block_size=16,
        group=3,
        num_kv_heads=2,
        query_lens=[1, 20, 1],
        prefix_lens=[50, 7, 0],
    )


def test_paged_attention_long_decode(numerics: KernelWorker) -> None:
    """An 8k-token decode next to a 1-token one; fp32 so the tolerance is tight enough
    that one key too many or too few (a 1/8192 share) would show."""
    numerics.call(
        "paged_attention",
        seed=_fresh_seed(),
        dtype="float32",
        head_dim=64,
        block_size=32,
        group=4,
        num_kv_heads=1,
        query_lens=[1, 1],
        prefix_lens=[8191, 0],
    )


def test_paged_attention_public_api(numerics: KernelWorker) -> None:
    numerics.call("paged_attention_public_api", seed=_fresh_seed())


# Decode batches for the split-KV path: context 1, one shorter than a key tile, one just
# past a block boundary, two longer ones that are no multiple of the tile. With the automatic
# split count (16 or 32 for these grids) most segments are empty.
_SPLIT_KV_SEQ_LENS = [1, 5, 33, 70, 200]

# (dtype, head_dim, block_size, group, num_kv_heads): every dtype meets head dims 64, 128
# and 80 and GQA groups 1, 4 and 8; both block sizes.
_SPLIT_KV_CONFIGS = [
    ("float16", 64, 16, 4, 2),
    ("float16", 128, 32, 8, 1),
    ("float16", 80, 16, 1, 2),
    ("bfloat16", 64, 32, 1, 2),
    ("bfloat16", 128, 16, 4, 1),
    ("bfloat16", 80, 32, 8, 1),
    ("float32", 64, 16, 8, 1),
    ("float32", 128, 32, 1, 2),
    ("float32", 80, 16, 4, 2),
]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "group", "num_kv_heads"), _SPLIT_KV_CONFIGS
)
def test_split_kv_attention_decode(
    numerics: KernelWorker,
    dtype: str,
    head_dim: int,
    block_size: int,
    group: int,
    num_kv_heads: int,
) -> None:
    report = numerics.call(
        "split_kv_attention",
        seed=_fresh_seed(),
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        group=group,
        num_kv_heads=num_kv_heads,
        seq_lens=_SPLIT_KV_SEQ_LENS,
    )
    # 5 or 10 programs unsplit: 32 or 16 splits (132 SMs; on a GPU, its SM count).
    assert report["num_splits"] >= 16 and report["empty"] > 0, report


@pytest.mark.parametrize(("num_splits", "tile_n"), [(1, 32), (2, 16), (8, 16), (64, 16)])
def test_split_kv_attention_split_counts(
    numerics: KernelWorker, num_splits: int, tile_n: int
) -> None:
    """Forced split counts from 1 to 64 with 16-key tiles, so that segments hold several
    tiles (and, at 64 splits, the 100-token context leaves most of them empty)."""
    report = numerics.call(
        "split_kv_attention",
        seed=_fresh_seed(),
        dtype="float16",
        head_dim=64,
        block_size=16,
        group=4,
        num_kv_heads=2,
        seq_lens=[1, 17, 100, 301],
        num_splits=num_splits,
        tile_n=tile_n,
    )
    assert report["num_splits"] == num_splits, report


def test_split_kv_attention_long_beside_short(numerics: KernelWorker) -> None:
    """A ~4k-token decode beside a 3-token one: 32 splits of 128 keys, every one of them
    in use for the long context (the last holds 123), one for the short; fp32 so the
    tolerance is tight enough that one key too many or too few (1/4091) would show."""
    report = numerics.call(
        "split_kv_attention",
        seed=_fresh_seed(),
        dtype="float32",
        head_dim=64,
        block_size=32,
        group=4,
        num_kv_heads=1,
        seq_lens=[4091, 3],
    )
    assert report["num_splits"] == 32 and report["empty"] == 31, report


def test_split_kv_attention_uneven_token_counts(numerics: KernelWorker) -> None:
    """num_tokens == num_seqs without one token each (a 3-token chunk, two sequences with
    none): tokens find their sequence by search, each with its own causal limit."""
    numerics.call(
        "split_kv_attention",
        seed=_fresh_seed(),
        dtype="float32",
        head_dim=64,
        block_size=16,
        group=2,
        num_kv_heads=2,
        seq_lens=[13, 5, 0, 41],
        query_lens=[3, 0, 0, 1],
        num_splits=4,
        tile_n=16,
    )


def test_split_kv_rule_picks_the_path(numerics: KernelWorker) -> None:
    """paged_attention(split_kv=True) splits a batch-1 decode (Llama-3.2-1B's 32 / 8
    heads: 32 splits) and keeps the unified kernel for a batch with a prefill chunk;
    without split_kv, the unified kernel throughout."""
    taken = numerics.call("split_kv_rule", seed=_fresh_seed())
    assert taken["expected_splits"] >= 16, taken  # 32 on an H100 / H200 or the interpreter
    assert taken["batch1_decode"] == {
        "plans": ["paged_attention_reduce", "paged_attention_split"],
        "num_splits": taken["expected_splits"],
        "partials": 1,
    }, taken
    unified = {"plans": ["paged_attention"], "num_splits": 0, "partials": 0}
    assert taken["mixed_prefill"] == unified, taken
    assert taken["batch1_decode_unsplit"] == unified, taken  # split_kv is opt-in


def test_split_kv_rule() -> None:
    """The rule on its own (pure Python: this process never imports triton, so the
    worker-free check goes through a child)."""
    code = (
        "from kernels import triton_ops as t\n"
        "sms = 132\n"
        "assert t.use_split_kv(1, 1, 8, sms) and t.split_kv_splits(1, 8, sms) == 32\n"
        "assert t.use_split_kv(8, 8, 8, sms) and t.split_kv_splits(8, 8, sms) == 4\n"
        "assert t.use_split_kv(33, 33, 2, sms) and t.split_kv_splits(33, 2, sms) == 4\n"
        "assert not t.use_split_kv(9, 9, 8, sms)  # 72 programs: over half the SMs\n"
        "assert not t.use_split_kv(18, 2, 8, sms)  # a prefill chunk\n"
        "assert not t.use_split_kv(0, 1, 8, sms)\n"
        "assert t.split_kv_splits(1, 1, sms) == 32 and t.split_kv_splits(64, 64, sms) == 2\n"
        "assert [t.split_kv_splits(b, 8, sms) for b in (1, 2, 3, 4, 5)] == [32, 16, 8, 8, 4]\n"
        "from kernels.dispatch import get_ops\n"
        "assert get_ops('triton', split_kv=True).paged_attention.keywords == {'split_kv': True}\n"
        "assert get_ops('triton').paged_attention is t.paged_attention\n"
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = _run_python(["-c", code], env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "num_kv_heads", "head_dim", "block_size"),
    [
        ("float16", "float16", 8, 128, 16),
        ("bfloat16", "bfloat16", 2, 64, 32),
        ("float32", "float32", 1, 32, 16),
        ("float32", "float16", 4, 64, 16),
        ("bfloat16", "float32", 3, 32, 32),
    ],
)
def test_reshape_and_cache(
    numerics: KernelWorker,
    dtype: str,
    cache_dtype: str,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    written = numerics.call(
        "reshape_and_cache",
        seed=_fresh_seed(),
        dtype=dtype,
        cache_dtype=cache_dtype,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_tokens=45,
    )
    assert 0 < written < 45


def test_plan_cache_reuses_checks_not_tensors(numerics: KernelWorker) -> None:
    # two layouts x two ops (the second call of the first layout hits)
    assert numerics.call("plan_cache", seed=_fresh_seed()) == 4


@pytest.mark.parametrize(
    ("dtype", "hidden", "with_residual", "row_pad"),
    [
        ("float32", 64, True, 0),
        ("float16", 100, True, 12),
        ("bfloat16", 4096, True, 0),
        ("float16", 256, False, 0),
        ("bfloat16", 100, False, 28),
        ("float32", 1000, False, 0),
    ],
)
def test_rms_norm(
    numerics: KernelWorker, dtype: str, hidden: int, with_residual: bool, row_pad: int
) -> None:
    numerics.call(
        "rms_norm",
        seed=_fresh_seed(),
        dtype=dtype,
        hidden=hidden,
        num_tokens=7,
        with_residual=with_residual,
        row_pad=row_pad,
    )


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "num_heads", "num_kv_heads", "head_dim"),
    [
        ("float32", "float32", 8, 8, 32),
        ("float16", "float32", 8, 2, 64),
        ("bfloat16", "float32", 8, 1, 128),
        ("float16", "float16", 12, 4, 128),
        ("bfloat16", "bfloat16", 4, 4, 64),
    ],
)
def test_rotary_embedding(
    numerics: KernelWorker,
    dtype: str,
    cache_dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    numerics.call(
        "rotary_embedding",
        seed=_fresh_seed(),
        dtype=dtype,
        cache_dtype=cache_dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_tokens=9,
    )


@pytest.mark.parametrize(
    ("dtype", "num_tokens", "inter", "row_pad"),
    [
        ("float32", 7, 64, 0),
        ("float16", 5, 1000, 24),  # a partial last column block, strided rows
        ("bfloat16", 1, 8192, 0),  # batch-1 decode: one row over many programs
        ("float16", 3, 11, 2),  # narrower than one block
        ("bfloat16", 70, 1536, 0),  # the wide-block path (>= 64 tokens)
        ("float32", 2, 4864, 16),
    ],
)
def test_silu_and_mul(
    numerics: KernelWorker, dtype: str, num_tokens: int, inter: int, row_pad: int
) -> None:
    numerics.call(
        "silu_and_mul",
        seed=_fresh_seed(),
        dtype=dtype,
        num_tokens=num_tokens,
        inter=inter,
        row_pad=row_pad,
    )


def test_silu_and_mul_spreads_one_token_over_many_programs(interp: KernelWorker) -> None:
    tokens, blocks = interp.call("silu_and_mul_grid", num_tokens=1, inter=8192)
    assert tokens == 1 and blocks >= 16
    tokens, blocks = interp.call("silu_and_mul_grid", num_tokens=256, inter=8192)
    assert tokens == 256 and blocks >= 8


@pytest.mark.parametrize(
    (
        "dtype",
        "cache_dtype",
        "cos_sin_dtype",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "block_size",
    ),
    [
        ("float32", "float32", "float32", 8, 8, 32, 16),
        ("float16", "float16", "float32", 32, 8, 64, 16),  # GQA 4, Llama-3.2-1B's heads
        ("bfloat16", "bfloat16", "float32", 32, 8, 64, 32),
        ("bfloat16", "bfloat16", "bfloat16", 8, 1, 128, 16),
        ("float16", "float32", "float16", 12, 4, 80, 16),  # head_dim 80: padded halves
        ("float32", "float16", "float32", 6, 3, 96, 32),  # 3 KV heads: padded heads
        ("bfloat16", "float32", "float32", 7, 7, 16, 16),
    ],
)
def test_rotary_and_cache(
    numerics: KernelWorker,
    dtype: str,
    cache_dtype: str,
    cos_sin_dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    written = numerics.call(
        "rotary_and_cache",
        seed=_fresh_seed(),
        dtype=dtype,
        cache_dtype=cache_dtype,
        cos_sin_dtype=cos_sin_dtype,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_tokens=21,
    )
    assert 0 < written < 21


@pytest.mark.parametrize(
    "op",
    [
        "gqa_ratio",
        "dtype_mismatch",
        "query_start_loc_len",
        "split_kv_num_splits",
        "split_kv_partials",
        "slot_mapping_len",
        "rms_weight",
        "rotary_width",
        "silu_odd_width",
        "silu_dims",
        "silu_int",
        "rotary_cache_kv_heads",
        "rotary_cache_value_shape",
        "rotary_cache_slot_dtype",
        "rotary_cache_width",
    ],
)
def test_rejects_bad_input(interp: KernelWorker, op: str) -> None:
    message = interp.call("rejects_bad_input", op=op)
    assert message


def test_reference_ignores_unwritten_cache_rows() -> None:
    """The reference's batched decode path reads past shorter sequences (up to the
    longest one); NaN in those unwritten rows must not leak into their outputs."""
    from kernels import reference

    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = _paged_batch(gen, torch.float32, 4, 2, 32, 16, [1, 1, 5, 1], [4, 40, 3, 20])
    batched = reference.paged_attention(**batch, scale=0.2)
    per_seq = _reference_attention_per_seq(batch, 0.2)
    torch.testing.assert_close(batched, per_seq, msg=f"seed={seed}")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_rotary_and_cache_falls_back_to_the_backends_own_ops(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend without a fused ``rotary_and_cache`` gets its own ``rotary_embedding``
    then its own ``reshape_and_cache``; the result is the reference's."""
    from kernels import cpu_ops, dispatch, reference

    if backend == "cpu" and not cpu_ops.native_available():
        pytest.skip("no C++ compiler: the cpu backend is not available")
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 9, 8, 2, 32, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen)
    cos_sin = _cos_sin_cache(256, head_dim, torch.float32)
    caches = torch.randn(2, 5, block_size, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(5 * block_size, generator=gen)[:num_tokens]
    slots[[0, 4]] = -1

    def run(fn: Callable[..., None], qkv: torch.Tensor, caches: torch.Tensor) -> None:
        q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
        fn(positions, q, k, v, cos_sin, caches[0], caches[1], slots)

    expected_qkv, expected_caches = qkv.clone(), caches.clone()
    run(reference.rotary_and_cache, expected_qkv, expected_caches)

    mod = cpu_ops if backend == "cpu" else reference
    calls: list[str] = []
    for name in ("rotary_embedding", "reshape_and_cache"):
        original = getattr(mod, name)

        def spy(*args: Any, _name: str = name, _original: Any = original) -> None:
            calls.append(_name)
            _original(*args)

        monkeypatch.setattr(mod, name, spy)
    if backend == "torch":  # the reference defines the composition itself: hide it
        monkeypatch.delattr(reference, "rotary_and_cache")
    run(dispatch.get_ops(backend).rotary_and_cache, qkv, caches)
    assert calls == ["rotary_embedding", "reshape_and_cache"]
    torch.testing.assert_close(qkv, expected_qkv, msg=f"seed={seed}")
    torch.testing.assert_close(caches, expected_caches, msg=f"seed={seed}")


def test_triton_backend_has_the_fused_ops() -> None:
    """The Triton backend exports its own ``silu_and_mul`` and ``rotary_and_cache`` (so
    ``get_ops('triton')`` takes them, not the fallbacks). Checked in a child process:
    this one never imports triton."""
    code = (
        "from kernels import dispatch, triton_ops\n"
        "ops = dispatch.get_ops('triton')\n"
        "assert ops.silu_and_mul is triton_ops.silu_and_mul\n"
        "assert ops.rotary_and_cache is triton_ops.rotary_and_cache\n"
    )
    result = _run_python(["-c", code])
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------ tests: sm_90 compilation

_COMPILE_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    *[
        (
            "paged_attention",
            {
                "dtype": d,
                "head_dim": hd,
                "block_size": bs,
                "group": g,
                "num_kv_heads": 2,
                "tokens": t,
                "num_seqs": n,
            },
        )
        for d, hd, bs, g, t, n in [
            ("float16", 128, 16, 4, 1, 2),  # decode tiles
            ("float16", 128, 16, 4, 40, 2),  # prefill tiles
            ("bfloat16", 128, 32, 8, 1, 2),
            ("bfloat16", 128, 32, 8, 40, 2),
            ("bfloat16", 64, 16, 1, 40, 1),
            ("float32", 128, 16, 4, 40, 2),
            ("float16", 80, 16, 3, 40, 2),
        ]
    ],
    *[
        (
            kernel,
            {
                "dtype": d,
                "head_dim": hd,
                "block_size": bs,
                "group": g,
                "num_kv_heads": kvh,
                "num_seqs": n,
            },
        )
        for kernel in ("split_kv_attention", "split_kv_reduce")
        for d, hd, bs, g, kvh, n in [
            ("bfloat16", 64, 16, 4, 8, 1),  # Llama-3.2-1B at batch 1: 32 splits
            ("float16", 128, 16, 4, 8, 4),  # Llama-3-8B at batch 4: 8 splits
            ("float16", 128, 32, 8, 1, 1),
            ("float32", 128, 16, 4, 2, 1),
            ("bfloat16", 80, 16, 3, 2, 2),
        ]
    ],
    (
        "reshape_and_cache",
        {"dtype": "float16", "cache_dtype": "float16", "num_kv_heads": 8, "head_dim": 128},
    ),
    (
        "reshape_and_cache",
        {"dtype": "bfloat16", "cache_dtype": "bfloat16", "num_kv_heads": 2, "head_dim": 64},
    ),
    ("rms_norm", {"dtype": "bfloat16", "hidden": 4096, "residual": True}),
    ("rms_norm", {"dtype": "float16", "hidden": 8192, "residual": False}),
    (
        "rotary_embedding",
        {"dtype": "bfloat16", "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
    ),
    ("rotary_embedding", {"dtype": "float16", "num_heads": 12, "num_kv_heads": 4, "head_dim": 64}),
    ("silu_and_mul", {"dtype": "bfloat16", "tokens": 1, "inter": 8192}),
    ("silu_and_mul", {"dtype": "float16", "tokens": 256, "inter": 14336}),
    ("silu_and_mul", {"dtype": "float32", "tokens": 3, "inter": 1000}),
    *[
        (
            "rotary_and_cache",
            {"dtype": d, "cache_dtype": c, "num_heads": h, "num_kv_heads": kvh, "head_dim": hd},
        )
        for d, c, h, kvh, hd in [
            ("bfloat16", "bfloat16", 32, 8, 64),  # Llama-3.2-1B
            ("bfloat16", "bfloat16", 32, 8, 128),  # Llama-3-8B
            ("float16", "float16", 64, 8, 128),  # Llama-3-70B
            ("float16", "float32", 12, 4, 80),
        ]
    ],
]


@pytest.mark.parametrize(
    ("kernel", "cfg"),
    _COMPILE_CONFIGS,
    ids=lambda v: str(v) if isinstance(v, str) else "-".join(map(str, v.values())),
)
def test_compiles_for_sm90(gpu_compiler: KernelWorker, kernel: str, cfg: dict[str, Any]) -> None:
    report = gpu_compiler.call("compile_sm90", kernel=kernel, cfg=cfg)
    assert report["registers"] <= 255


# ------------------------------------------------------------------ tests: packaging, benchmark


def _run_python(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_kernels_package_does_not_import_triton() -> None:
    code = (
        "import sys, kernels, kernels.reference, kernels.dispatch\n"
        "kernels.dispatch.get_ops('torch')\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    result = _run_python(["-c", code])
    assert result.returncode == 0, result.stderr


def test_benchmark_smoke() -> None:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --smoke
    result = _run_python(["-m", "benchmarks.kernels", "--smoke"], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "paged_attention" in result.stdout and "GB/s" in result.stdout, result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the full set")
def test_benchmark_without_cuda_exits_cleanly() -> None:
    result = _run_python(["-m", "benchmarks.kernels"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CUDA" in result.stdout
