"""The CPU backend's native kernels (decode attention, RMSNorm, rotary, cache write) and
the oneDNN linear layers, against the PyTorch reference, with fresh random inputs (the
seed is in every failure message)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops, reference
from kernels.onednn_linear import onednn_linear_available, pack_weight, packed_linear
from tests.test_kernels import _fresh_seed, _paged_batch, _reference_attention_per_seq

_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}

pytestmark = pytest.mark.skipif(
    not cpu_ops.native_available(), reason="no C++ compiler: the cpu backend falls back to torch"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 16, 8), (6, 2, 80, 32), (7, 1, 32, 16)],
)
def test_decode_attention_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Decodes mixed with prefill chunks; every cache row no sequence owns is NaN, so a
    read outside a sequence's context shows up in its output."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(3, 12, (), generator=gen))
    query_lens = [1 if torch.rand((), generator=gen) < 0.7 else int(torch.randint(2, 40, (), generator=gen))
                  for _ in range(num_seqs)]
    query_lens[0] = 1
    prefix_lens = torch.randint(0, 300, (num_seqs,), generator=gen).tolist()
    batch = _paged_batch(gen, dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens, prefix_lens)
    scale = head_dim**-0.5
    expected = _reference_attention_per_seq(batch, scale)
    out = cpu_ops.paged_attention(**batch, scale=scale, workspace={})
    assert not out.isnan().any(), f"seed={seed}"
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol, msg=f"seed={seed}")


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 80)])
def test_decode_attention_split_across_threads_matches_reference(
    threads: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Fewer decode sequences than threads (batch 1, or 2-3 with 5 threads): each long
    context is split into runs of blocks on several threads and merged; NaN outside every
    context, and contexts short enough to stay whole mixed in."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_seqs = 1 if threads == 2 else int(torch.randint(2, 4, (), generator=gen))
    prefix_lens = torch.randint(200, 900, (num_seqs,), generator=gen).tolist()
    if num_seqs > 1:
        prefix_lens[-1] = int(torch.randint(0, 20, (), generator=gen))  # two blocks at most: fewer parts
    batch = _paged_batch(gen, torch.float32, num_heads, num_kv_heads, head_dim, 16, [1] * num_seqs, prefix_lens)
    scale = head_dim**-0.5
    expected = _reference_attention_per_seq(batch, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_ops.paged_attention(**batch, scale=scale, workspace={})
    finally:
        torch.set_num_threads(before)
    assert not out.isnan().any(), f"seed={seed}"
    torch.testing.assert_close(out, expected.float(), atol=2e-5, rtol=2e-5, msg=f"seed={seed}")


@pytest.mark.parametrize("threads", [None, 7])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_native_prefill_attention_matches_reference_on_long_chunks(
    num_heads: int, num_kv_heads: int, head_dim: int, threads: int | None
) -> None:
    """The native prefill kernel (float32, 16-token blocks): chunks longer than its
    32-token query blocks, whole prompts and later chunks of a prompt, NaN outside every
    context and in the output before the call. With 7 threads on fewer cores, threads
    lose their core mid-call and others steal their items: every row must still be written."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(2, 6, (), generator=gen))
    query_lens = torch.randint(2, 150, (num_seqs,), generator=gen).tolist()
    prefix_lens = [0 if torch.rand((), generator=gen) < 0.5 else int(torch.randint(1, 200, (), generator=gen))
                   for _ in range(num_seqs)]
    batch = _paged_batch(gen, torch.float32, num_heads, num_kv_heads, head_dim, 16, query_lens, prefix_lens)
    scale = head_dim**-0.5
    expected = _reference_attention_per_seq(batch, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        out = torch.full_like(batch["query"], float("nan"))
        cpu_ops.paged_attention(**batch, scale=scale, out=out, workspace={})
    finally:
        torch.set_num_threads(before)
    assert not out.isnan().any(), f"seed={seed}"
    torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4, msg=f"seed={seed}")


def test_decode_attention_writes_only_decode_rows_of_a_strided_out() -> None:
    """``out`` may be a view with padded rows (the model's shared scratch is not): the
    kernel honours its strides and leaves everything else alone."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = _paged_batch(gen, torch.float32, 4, 2, 64, 16, [1, 1, 1], [5, 40, 17])
    expected = _reference_attention_per_seq(batch, 0.125)
    backing = torch.full((3, 5, 64), 7.0)
    out = backing[:, 1:, :]  # [3, 4, 64], row stride 5 * 64
    cpu_ops.paged_attention(**batch, scale=0.125, out=out, workspace={})
    torch.testing.assert_close(out, expected, msg=f"seed={seed}")
    assert bool((backing[:, 0, :] == 7.0).all())


def test_decode_attention_rejects_bad_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = _paged_batch(gen, torch.float32, 4, 2, 64, 16, [1, 1], [5, 9])
    out = torch.empty_like(batch["query"])
    tokens = torch.tensor([0, 1])
    args = [batch["query"], batch["key_cache"], batch["value_cache"]]
    with pytest.raises(RuntimeError, match="block_tables"):
        torch.ops.tandem_cpu.paged_attention_decode(
            *args, batch["block_tables"].long(), batch["seq_lens"], tokens, tokens, 0.1, out
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.tandem_cpu.paged_attention_decode(
            *args, batch["block_tables"], batch["seq_lens"], tokens, tokens, 0.1, out.double()
        )



def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, d = int(torch.randint(1, 300, (), generator=gen)), int(torch.randint(1, 9, (), generator=gen)) * 64 + 16
    # x is a column slice of a wider tensor: rows are strided, as a split of a fused output.
    x = _rand(gen, rows, d + 32, dtype=dtype)[:, 16 : 16 + d]
    weight = _rand(gen, d, dtype=dtype)
    residual = _rand(gen, rows, d, dtype=dtype) if with_residual else None
    got, got_res = cpu_ops.rms_norm(x, weight, 1e-6, residual)
    want, want_res = reference.rms_norm(x, weight, 1e-6, residual)
    tol = _TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=f"seed={seed}")
    if with_residual:
        assert got_res is not None and want_res is not None
        torch.testing.assert_close(got_res, want_res, msg=f"seed={seed}")
    else:
        assert got_res is None


def test_silu_and_mul_matches_reference_over_the_float_range() -> None:
    """The native SwiGLU activation (its own vectorized exp) against torch's silu * up,
    on a strided input, an intermediate size that leaves a scalar tail, and gate values
    out to where e^-x overflows or underflows float32."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, inter = int(torch.randint(1, 200, (), generator=gen)), 16 * int(torch.randint(1, 40, (), generator=gen)) + 7
    wide = _rand(gen, rows, 2 * inter + 5).mul_(8.0)
    gate_up = wide[:, 3 : 3 + 2 * inter]
    extremes = torch.tensor([-1e4, -200.0, -104.0, -89.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 89.0, 200.0, 1e4])
    gate_up[0, : extremes.numel()] = extremes
    got = cpu_ops.silu_and_mul(gate_up)
    want = reference.silu_and_mul(gate_up.clone())
    assert torch.isfinite(got).all(), f"seed={seed}"
    torch.testing.assert_close(got, want, atol=1e-30, rtol=4e-6, msg=f"seed={seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_embedding_matches_reference_on_strided_views(dtype: torch.dtype) -> None:
    """q and k are views into one fused qkv row, as the model passes them."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, heads, kv_heads, d = int(torch.randint(1, 200, (), generator=gen)), 6, 2, 64
    max_pos = 512
    cos_sin = _rand(gen, max_pos, d)
    positions = torch.randint(0, max_pos, (n,), generator=gen)
    qkv = _rand(gen, n, (heads + 2 * kv_heads) * d, dtype=dtype)
    expected = qkv.clone()
    for t in (qkv, expected):
        q, k, _ = t.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
        op = cpu_ops.rotary_embedding if t is qkv else reference.rotary_embedding
        op(positions, q.view(n, heads, d), k.view(n, kv_heads, d), cos_sin)
    tol = _TOL[dtype]
    torch.testing.assert_close(qkv.float(), expected.float(), atol=tol, rtol=tol, msg=f"seed={seed}")


def test_rotary_embedding_rejects_positions_outside_the_cache() -> None:
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        cpu_ops.rotary_embedding(torch.tensor([0, 16]), q, k, torch.zeros(16, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kvh, d = 12, 16, 3, 64
    n = int(torch.randint(1, 60, (), generator=gen))
    kv = _rand(gen, n, 2 * kvh * d + 8, dtype=dtype)  # strided token rows, heads contiguous
    key = kv[:, : kvh * d].view(n, kvh, d)
    value = kv[:, kvh * d : 2 * kvh * d].view(n, kvh, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.2] = -1  # padding tokens
    caches = [torch.full((num_blocks, block_size, kvh, d), float("nan"), dtype=dtype) for _ in range(4)]
    cpu_ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, msg=f"seed={seed}")
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, msg=f"seed={seed}")


def test_reshape_and_cache_rejects_a_slot_outside_the_cache() -> None:
    key = torch.zeros(1, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([8]))



def test_argmax_matches_torch_and_takes_the_first_of_ties() -> None:
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = int(torch.randint(1, 80, (), generator=gen)), int(torch.randint(1, 60000, (), generator=gen))
    logits = _rand(gen, rows, vocab + 5)[:, :vocab]  # strided rows
    # Ties: copy each row's max to a random earlier position (or keep it).
    top = logits.argmax(dim=-1)
    for r in range(rows):
        j = int(torch.randint(0, int(top[r]) + 1, (), generator=gen))
        logits[r, j] = logits[r, top[r]]
    assert torch.equal(cpu_ops.argmax(logits), logits.argmax(dim=-1)), f"seed={seed}"
    assert cpu_ops.argmax(torch.empty(0, vocab)).shape == (0,)


def _onednn_param(dtype: torch.dtype) -> object:
    """A dtype whose oneDNN path runs only where torch and the CPU have it; the F.linear
    fallback those CPUs use is tested in tests/test_linear_backend.py on every CPU."""
    missing = not onednn_linear_available(torch.device("cpu"), dtype)
    reason = (f"this CPU/torch has no oneDNN {dtype} linear (bf16 needs AVX-512 BW/VL/DQ or "
              "AVX-NE-CONVERT); the engine uses F.linear there")
    return pytest.param(dtype, marks=pytest.mark.skipif(missing, reason=reason))


@pytest.mark.parametrize("dtype", [_onednn_param(torch.float32), _onednn_param(torch.bfloat16)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    out_f, in_f = int(torch.randint(1, 300, (), generator=gen)), int(torch.randint(1, 300, (), generator=gen))
    weight = torch.randn(out_f, in_f, generator=gen).to(dtype)
    b = torch.randn(out_f, generator=gen).to(dtype) if bias else None
    packed = pack_weight(weight)
    # One packed weight serves any number of rows, including a strided view.
    for m in (1, 7, 64, 301):
        x = torch.randn(m, in_f + 3, generator=gen).to(dtype)[:, :in_f]
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        tol = 1e-4 if dtype == torch.float32 else 0.05 * (in_f**0.5)
        torch.testing.assert_close(packed_linear(x, packed, b).double(), expected, atol=tol, rtol=1e-2,
                                   msg=f"seed={seed} m={m}")
    with pytest.raises(ValueError, match="2-D"):
        pack_weight(weight[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_huge_pages(dtype: torch.dtype) -> None:
    """The KV cache's allocation: zeroed, 2 MiB-aligned, an ordinary writable tensor."""
    shape = (37, 16, 3, 64)
    t = cpu_ops.zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    assert not t.any()
    t[-1, -1] = 1.5
    assert float(t.float().sum()) == 1.5 * 3 * 64
    with pytest.raises(RuntimeError, match="negative"):
        torch.ops.tandem_cpu.empty_huge([2, -1], torch.float32)
