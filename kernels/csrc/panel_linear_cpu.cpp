// Linear layers over weights packed in 16-column panels: y = x @ W.T * scale + bias.
//
// Layouts (kernels/panel_linear.py packs them):
//   x       [M, K] float32, rows contiguous (row stride may exceed K)
//   panels  float32 [P, K, 16]: panel p holds output columns 16p..16p+15,
//           element [p, k, j] = W[16p + j, k]; columns past N are zero
//           int8 [P, K2, 32] (K2 = ceil(K / 2)): k in pairs, element [p, i, 2j + h] =
//           W[16p + j, 2i + h] (k past K zero), the layout of a 16-bit pair dot product
//   scale   [16P] float32 (int8 weights: per-output-channel scale) or an empty tensor;
//           int8 weights may instead have group scales [P, G, 16] float16 (G = K / group,
//           group even and dividing 256): element [p, g, j] scales W[16p + j, k] for
//           group * g <= k < group * (g + 1). [16P] is the same layout with G = 1.
//   bias    [N] float32 or an empty tensor
//   out     [M, N] float32, rows contiguous
// uint8 panels are 4- or 5-bit weights (codes [ceil(N / 32), K / 32, 512 or 640], scale
// [ceil(N / 32), K / 32, 64]): every entry point here hands them to int4_linear_cpu.cpp's
// kernel (its own layout and comments).
//
// One pass over the weights serves every row of x: a tile of 2 panels (32 columns) is
// read once per block of up to kMaxRows rows (8 with AVX-512, whose sums fill 16 of its
// 32 vector registers; 6 with AVX2, one panel at a time in 12 of its 16), the block's
// partial sums staying in registers while k runs. Threads split the tiles (and steal
// from each other's back ends when one runs ahead); a step too small to pay a thread
// wake-up stays on one thread.
//
// int8 weights (weight-only quantization, a quarter of the bytes a step reads): x is
// rounded to 16-bit fixed point per row and per block of 256 k (step 2^-15 of the
// block's largest |x|), and each (16-bit x, 8-bit w) pair product is summed in int32
// (AVX-512 VNNI vpdpwssd: 32 multiply-adds an instruction, no widening to float; AVX2:
// vpmaddwd then an add, 16 per pair of instructions); a
// block's int32 sums (< 2^31: 128 pairs x 2 x 127 x 32767) are scaled into float32.
// The AVX2 build takes that path below kInt8AsFloatRows rows only; from there a tile of
// int8 panels is dequantized into float32 and run through the float loop.
// Group scales: the int32 sums are flushed into float32 every group of k (a group never
// straddles a block of x) times the group's 16 scales of the panel, and those block sums
// into the output's sums times x's block step; the per-channel scale is applied once at
// the end instead. The group scales are float16 (GGUF Q8_0's own d: half the bytes streamed
// beside the panels of float32 ones), widened to float32 in registers as they are loaded.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "half.h"
#include "work_stealing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// The AVX2 build without AVX-512: 6-row register blocks through a hand-scheduled loop
// (which int8 products of many rows use as well).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TANDEM_AVX2_FLOAT 1
#endif

namespace {

constexpr int64_t kLanes = 16;     // columns per panel
// Rows of x per register block: 8 with 32 vector registers (and in the portable loops),
// 6 with AVX2's 16.
#if defined(TANDEM_AVX2_FLOAT)
constexpr int kMaxRows = 6;
#else
constexpr int kMaxRows = 8;
#endif
#if !defined(__AVX512BW__) && defined(__AVX2__)
constexpr int kInt8Rows = 4;
#else
constexpr int kInt8Rows = 8;
#endif
// Rows per register block of the grouped int8 kernel. AVX-512: 4, not 8. With 8 rows the
// R x T = 16 int32 sums leave no registers for the block's 16 float32 sums, which every
// group flush (16 pairs at Q8_0's group of 32) loads and stores; with 4, 8 + 8 of them fit
// (the weights are read twice per 8 rows, from cache). 64 rows, 1 thread, Zen 4: grouped
// / per-channel 1.15-1.22x -> 1.01-1.06x (6 rows: 1.03-1.04x).
#if defined(__AVX512BW__)
constexpr int kGroupedInt8Rows = 4;
#else
constexpr int kGroupedInt8Rows = kInt8Rows;
#endif
constexpr int64_t kTilePanels = 2; // panels per tile
constexpr int64_t kFloatPrefetchBytes = 2048;  // how far ahead a small batch asks for weights

// A byte range to pull into cache while a pass computes: spread over the pass's k loop,
// one line per call of `step` at most (a batch of more than 8 rows reads a tile once from
// memory, then computes on it from cache; fetching the next tile meanwhile overlaps the
// two).
// After `step` has covered k values 0..k, floor((k + 1) * lines / k_size) lines are asked
// for; kept by an error term instead of a division per k.
struct Prefetch {
  const char* begin = nullptr;
  int64_t lines = 0;   // cache lines to ask for over the pass
  int64_t owed = 0;    // lines * (k values covered) - issued * k_size
  int64_t issued = 0;  // lines asked for so far
  inline void step(int64_t ks, int64_t k_size) {  // covers `ks` more values of k
    if (begin == nullptr) return;
    for (owed += lines * ks; owed >= k_size; owed -= k_size) __builtin_prefetch(begin + 64 * issued++);
  }
};

#if defined(__AVX512F__)

// acc[r][t] += x[r, k] * panel_t[k, :] over all k, for R rows and T panels. With few
// rows, U interleaved accumulator sets (k mod U) hide the fused multiply-add latency.
// `Stream`: this pass is the tile's only one, so it reads the weights from memory and asks
// for them ahead (a pass over a tile already in cache would only waste load slots on it).
template <int R, int T, bool Stream>
inline void block_kernel(const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* scale,
                         const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n, Prefetch pf) {
  constexpr int U = R * T >= 8 ? 1 : (R * T >= 4 ? 2 : 4);
  __m512 acc[U][R][T];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[u][r][t] = _mm512_setzero_ps();
  const int64_t panel_stride = k_size * kLanes;
  int64_t k = 0;
  for (; k + U <= k_size; k += U) {
    pf.step(U, k_size);
    for (int u = 0; u < U; ++u) {
      __m512 w[T];
      for (int t = 0; t < T; ++t) {
        const float* row = panel + t * panel_stride + (k + u) * kLanes;
        // A panel row is one cache line: ask for the one kFloatPrefetchBytes ahead.
        if constexpr (Stream) _mm_prefetch(reinterpret_cast<const char*>(row) + kFloatPrefetchBytes, _MM_HINT_T0);
        w[t] = _mm512_loadu_ps(row);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k + u]);
        for (int t = 0; t < T; ++t) acc[u][r][t] = _mm512_fmadd_ps(xv, w[t], acc[u][r][t]);
      }
    }
  }
  for (; k < k_size; ++k) {
    for (int t = 0; t < T; ++t) {
      const __m512 w = _mm512_loadu_ps(panel + t * panel_stride + k * kLanes);
      for (int r = 0; r < R; ++r) acc[0][r][t] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[0][r][t]);
    }
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[0][r][t] = _mm512_add_ps(acc[0][r][t], acc[u][r][t]);
  for (int t = 0; t < T; ++t) {
    const int64_t col = n0 + t * kLanes;
    if (col >= n) break;
    const int64_t valid = std::min<int64_t>(kLanes, n - col);
    const __mmask16 mask = valid == kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 s = scale ? _mm512_loadu_ps(scale + col) : _mm512_set1_ps(1.f);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + col, mask, _mm512_fmadd_ps(acc[0][r][t], s, b));
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

// One k of the hand-scheduled AVX2 loop below: the panel row's two halves into ymm12-13,
// x[r, k] broadcast into ymm14 / ymm15 by turns (rows 0-2 at x0 + r * ld, rows 3-5 at x3 +
// (r - 3) * ld: two base registers serve six rows), row r's sums in ymm(2r), ymm(2r + 1).
#define TANDEM_ROW(XADDR, TMP, ACC0, ACC1)                        \
  "vbroadcastss " XADDR ", %%ymm" #TMP "\n\t"                     \
  "vfmadd231ps %%ymm12, %%ymm" #TMP ", %%ymm" #ACC0 "\n\t"        \
  "vfmadd231ps %%ymm13, %%ymm" #TMP ", %%ymm" #ACC1 "\n\t"
#define TANDEM_K(KOFF, BOFF)                                                     \
  "vmovups " #BOFF "(%[b]), %%ymm12\n\t"                                         \
  "vmovups " #BOFF "+32(%[b]), %%ymm13\n\t"                                      \
  TANDEM_ROW(#KOFF "(%[x0])", 14, 0, 1)                                          \
  TANDEM_ROW(#KOFF "(%[x0],%[ld],1)", 15, 2, 3)                                  \
  TANDEM_ROW(#KOFF "(%[x0],%[ld],2)", 14, 4, 5)                                  \
  TANDEM_ROW(#KOFF "(%[x3])", 15, 6, 7)                                          \
  ".if %c[rows] > 4\n\t" TANDEM_ROW(#KOFF "(%[x3],%[ld],1)", 14, 8, 9) ".endif\n\t" \
  ".if %c[rows] > 5\n\t" TANDEM_ROW(#KOFF "(%[x3],%[ld],2)", 15, 10, 11) ".endif\n\t"

// sums[r, :] = sum over k < 4 * iters of x[r * ldx + k] * panel[k, :] for R (4..6) rows,
// P (0, 1, 2 or 4) cache lines from `pf` on asked for per 4 k. Written out by hand: the
// compiler's schedule of the same intrinsics (address arithmetic per row, loads folded
// into multiply-adds, no unrolling) ran at ~60% of this loop's rate on a Zen 3 (a 6-row
// block from L1/L2: 58-65 vs 90-100 GFLOP/s on one core, whose fma peak is ~100).
template <int R, int P>
inline void rows_x16_avx2(const float* x, int64_t ldx, const float* panel, int64_t iters, const char* pf,
                          float (*sums)[kLanes]) {
  static_assert(R >= 4 && R <= 6 && (P == 0 || P == 1 || P == 2 || P == 4));
  const float* x3 = x + 3 * ldx;
  const int64_t ld = ldx * static_cast<int64_t>(sizeof(float));
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\tvxorps %%ymm1, %%ymm1, %%ymm1\n\tvxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\tvxorps %%ymm4, %%ymm4, %%ymm4\n\tvxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\tvxorps %%ymm7, %%ymm7, %%ymm7\n\tvxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\tvxorps %%ymm10, %%ymm10, %%ymm10\n\tvxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "testq %[n], %[n]\n\t"
      "jz 2f\n\t"
      "1:\n\t"
      TANDEM_K(0, 0) TANDEM_K(4, 64) TANDEM_K(8, 128) TANDEM_K(12, 192)
      ".if %c[p] > 0\n\tprefetcht0 (%[pf])\n\t.endif\n\t"
      ".if %c[p] > 1\n\tprefetcht0 64(%[pf])\n\t.endif\n\t"
      ".if %c[p] > 2\n\tprefetcht0 128(%[pf])\n\tprefetcht0 192(%[pf])\n\t.endif\n\t"
      ".if %c[p] > 0\n\taddq $%c[p] * 64, %[pf]\n\t.endif\n\t"
      "addq $16, %[x0]\n\taddq $16, %[x3]\n\taddq $256, %[b]\n\t"
      "decq %[n]\n\tjnz 1b\n\t"
      "2:\n\t"
      "vmovups %%ymm0, (%[c])\n\tvmovups %%ymm1, 32(%[c])\n\tvmovups %%ymm2, 64(%[c])\n\t"
      "vmovups %%ymm3, 96(%[c])\n\tvmovups %%ymm4, 128(%[c])\n\tvmovups %%ymm5, 160(%[c])\n\t"
      "vmovups %%ymm6, 192(%[c])\n\tvmovups %%ymm7, 224(%[c])\n\tvmovups %%ymm8, 256(%[c])\n\t"
      "vmovups %%ymm9, 288(%[c])\n\tvmovups %%ymm10, 320(%[c])\n\tvmovups %%ymm11, 352(%[c])\n\t"
      : [x0] "+r"(x), [x3] "+r"(x3), [b] "+r"(panel), [n] "+r"(iters), [pf] "+r"(pf)
      : [ld] "r"(ld), [c] "r"(&sums[0][0]), [rows] "i"(R), [p] "i"(P)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef TANDEM_K
#undef TANDEM_ROW

// AVX2 has 16 vector registers of 8 lanes: a panel row is two of them. One panel at a
// time, a block of R <= 6 rows keeps its 2R sums in registers (at R = 6: 12 sums, the
// panel row's two halves, one broadcast of x); with few rows, U interleaved sets (k mod
// U) hide the multiply-add latency; `pf` is spread over this panel's k loop.
template <int R, bool Stream>
inline void panel_block_avx2(const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* scale,
                             const float* bias, float* out, int64_t ldo, int64_t col, int64_t n, Prefetch pf) {
  constexpr int U = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  __m256 acc[U][R][2];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  if constexpr (R >= 4) {  // k in steps of 4 by the hand-scheduled loop, the rest (k_size % 4) below
    alignas(32) float sums[6][kLanes];
    const int64_t iters = k_size / 4;
    if constexpr (Stream) {  // the panel itself, 4 lines (4 k) a step, kFloatPrefetchBytes ahead
      rows_x16_avx2<R, 4>(x, ldx, panel, iters, reinterpret_cast<const char*>(panel) + kFloatPrefetchBytes, sums);
    } else {  // pf's lines spread over the loop: 1, 2 or 4 a step, rounded up
      const int64_t per_step = iters > 0 && pf.begin != nullptr ? (pf.lines + iters - 1) / iters : 0;
      if (per_step == 0)
        rows_x16_avx2<R, 0>(x, ldx, panel, iters, nullptr, sums);
      else if (per_step == 1)
        rows_x16_avx2<R, 1>(x, ldx, panel, iters, pf.begin, sums);
      else if (per_step == 2)
        rows_x16_avx2<R, 2>(x, ldx, panel, iters, pf.begin, sums);
      else
        rows_x16_avx2<R, 4>(x, ldx, panel, iters, pf.begin, sums);
      pf = Prefetch{};
    }
    for (int r = 0; r < R; ++r) {
      acc[0][r][0] = _mm256_load_ps(sums[r]);
      acc[0][r][1] = _mm256_load_ps(sums[r] + 8);
    }
    k = 4 * iters;
  }
  for (; k + U <= k_size; k += U) {
    pf.step(U, k_size);
    for (int u = 0; u < U; ++u) {
      const float* row = panel + (k + u) * kLanes;
      if constexpr (Stream) _mm_prefetch(reinterpret_cast<const char*>(row) + kFloatPrefetchBytes, _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k + u);
        acc[u][r][0] = _mm256_fmadd_ps(xv, w0, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xv, w1, acc[u][r][1]);
      }
    }
  }
  for (; k < k_size; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kLanes), w1 = _mm256_loadu_ps(panel + k * kLanes + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc[0][r][0] = _mm256_fmadd_ps(xv, w0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(xv, w1, acc[0][r][1]);
    }
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) acc[0][r][h] = _mm256_add_ps(acc[0][r][h], acc[u][r][h]);
  // Stored one row at a time, scale and bias re-read from L1: with all 2R sums live, any
  // more live registers here make the compiler spill the sums inside the k loop.
  // (Fully unrolled: an array of sums indexed at run time would live in memory.)
  const int64_t valid = std::min<int64_t>(kLanes, n - col);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int64_t c = col + 8 * h;
      __m256 v = acc[0][r][h];
      if (valid == kLanes) {
        if (scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + c));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
        _mm256_storeu_ps(out + r * ldo + c, v);
      } else {  // the last panel: columns past n masked off
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid - 8 * h)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        if (scale) v = _mm256_mul_ps(v, _mm256_maskload_ps(scale + c, m));
        if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias + c, m));
        _mm256_maskstore_ps(out + r * ldo + c, m, v);
      }
    }
  }
}

// The tile's T panels one after another (the rows of x stay in L1 between them); the
// first carries the next tile's prefetch.
template <int R, int T, bool Stream>
inline void block_kernel(const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* scale,
                         const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n, Prefetch pf) {
  for (int t = 0; t < T; ++t) {
    const int64_t col = n0 + t * kLanes;
    if (col >= n) break;
    panel_block_avx2<R, Stream>(x, ldx, panel + t * k_size * kLanes, k_size, scale, bias, out, ldo, col, n,
                                t == 0 ? pf : Prefetch{});
  }
}

#else  // portable: the compiler vectorizes the 16-lane loops for the ISA it builds for

template <int R, int T, bool Stream>
inline void block_kernel(const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* scale,
                         const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n, Prefetch pf) {
  float acc[R][T][kLanes] = {};
  const int64_t panel_stride = k_size * kLanes;
  for (int64_t k = 0; k < k_size; ++k) {
    pf.step(1, k_size);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int t = 0; t < T; ++t) {
        const float* w = panel + t * panel_stride + k * kLanes;
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[r][t][j] += xv * w[j];
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t col = n0 + t * kLanes + j;
      if (col >= n) break;
      const float s = scale ? scale[col] : 1.f;
      const float b = bias ? bias[col] : 0.f;
      for (int r = 0; r < R; ++r) out[r * ldo + col] = acc[r][t][j] * s + b;
    }
  }
}

#endif

// block_kernel<rows, T, Stream> for 1 <= rows <= kMaxRows, the row count known at run time.
template <int T, bool Stream, int R = 1>
inline void block_kernel_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t k_size,
                              const float* scale, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n,
                              Prefetch pf) {
  if constexpr (R < kMaxRows) {
    if (rows != R) {
      block_kernel_rows<T, Stream, R + 1>(rows, x, ldx, panel, k_size, scale, bias, out, ldo, n0, n, pf);
      return;
    }
  }
  block_kernel<R, T, Stream>(x, ldx, panel, k_size, scale, bias, out, ldo, n0, n, pf);
}

// `next`: the tile this thread computes after this one (nullptr: none), fetched in equal
// parts during this tile's passes when there is more than one.
template <int T>
void rows_kernel(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t k_size, const float* scale,
                 const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n, const float* next) {
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t next_bytes = kTilePanels * k_size * kLanes * static_cast<int64_t>(sizeof(float));
  auto prefetch = [&](int64_t pass) {
    Prefetch pf;
    if (next != nullptr && passes > 1) {
      const int64_t first = pass * next_bytes / passes;
      pf.begin = reinterpret_cast<const char*>(next) + first;
      pf.lines = ((pass + 1) * next_bytes / passes - first) / 64;
    }
    return pf;
  };
  if (passes == 1) {  // up to kMaxRows rows: one pass, weights streamed from memory
    block_kernel_rows<T, true>(rows, x, ldx, panel, k_size, scale, bias, out, ldo, n0, n, Prefetch{});
    return;
  }
  // Several passes: the first reads the tile from memory, the rest from cache, and each
  // asks for its share of the next tile.
  int64_t r = 0, pass = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows, ++pass)
    block_kernel<kMaxRows, T, false>(x + r * ldx, ldx, panel, k_size, scale, bias, out + r * ldo, ldo, n0, n,
                                     prefetch(pass));
  const float* xr = x + r * ldx;
  float* outr = out + r * ldo;
  const Prefetch pf = prefetch(pass);
  if (rows > r) block_kernel_rows<T, false>(rows - r, xr, ldx, panel, k_size, scale, bias, outr, ldo, n0, n, pf);
}

// Rows of x per chunk, so that the chunk a tile pass reuses stays in L2 (<= 256 KiB);
// `row_bytes`: one row of x as the kernel reads it.
// `block`: the kernel's rows per register block (a chunk is a multiple of it).
int64_t rows_per_chunk(int64_t row_bytes, int64_t block) {
  return std::max<int64_t>(block, (256 * 1024 / std::max<int64_t>(row_bytes, 1)) / block * block);
}

// fn(r0, rows, tile, end) for every chunk of up to `row_chunk` rows and every tile; per
// chunk the tiles are split between threads with stealing (work_stealing.h; `end`: one
// past the last tile of the range this tile came from, for prefetching the next).
template <typename F>
void for_each_chunk_and_tile(int64_t m, int64_t row_chunk, int64_t num_tiles, int64_t grain, const F& fn) {
  const int64_t shares = std::min<int64_t>(at::get_num_threads(), (num_tiles + grain - 1) / grain);
  for (int64_t r0 = 0; r0 < m; r0 += row_chunk) {
    const int64_t rows = std::min(row_chunk, m - r0);
    tandem_cpu::parallel_steal(num_tiles, shares, [&](const auto& take) {
      int64_t tile, end;
      while (take(tile, end)) fn(r0, rows, tile, end);
    });
  }
}

// fn(r0, rows, tile, end) over float32 rows of x of length k_size (for_each_chunk_and_tile,
// with the float loop's row chunk and thread grain).
template <typename F>
void for_each_float_tile(int64_t m, int64_t k_size, int64_t num_tiles, const F& fn) {
  const int64_t row_chunk = rows_per_chunk(k_size * static_cast<int64_t>(sizeof(float)), kMaxRows);
  // A chunk of work should hold >= ~64k multiply-adds to pay a thread hand-off.
  const int64_t tile_work = std::max<int64_t>(1, std::min(m, row_chunk) * k_size * kTilePanels * kLanes);
  for_each_chunk_and_tile(m, row_chunk, num_tiles, std::max<int64_t>(1, 65536 / tile_work), fn);
}

// The float loop over one tile: `panels` (kTilePanels of them, or 1 at the end) of k_size
// rows each, for output columns n0.. (`next`: the following tile to prefetch, or nullptr).
void float_tile(int64_t rows, const float* x, int64_t ldx, const float* panels, int64_t panel_count, int64_t k_size,
                const float* scale, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n,
                const float* next) {
  if (panel_count == kTilePanels)
    rows_kernel<kTilePanels>(rows, x, ldx, panels, k_size, scale, bias, out, ldo, n0, n, next);
  else
    rows_kernel<1>(rows, x, ldx, panels, k_size, scale, bias, out, ldo, n0, n, nullptr);
}

// Called by a thread right after it wrote out[r0:r0+rows, n0:n1) (the tile still in its
// cache): panel_linear passes a no-op, panel_linear_argmax its running argmax.
struct NoTileHook {
  inline void operator()(int64_t, int64_t, int64_t, int64_t) const {}
};

// ---- int8 weights --------------------------------------------------------------------

constexpr int64_t kBlockPairs = 128;  // k pairs per fixed-point block of x (256 k)
// How far ahead a small-batch pass asks for weights (it streams them from memory once).
// The AVX-512 kernel reads a tile's panels side by side (two streams, each asked for 2 KiB
// ahead). The AVX2 kernel reads them one block of 128 k pairs (4 KiB) after the other, so
// 2 KiB ahead in one panel never asks for the other panel's next block before it is read;
// 8 KiB ahead reaches the rows that come next in that order. M=1 on a 2-core Zen 3, the
// distance alternated in one process: LM-head-sized calls 2048 -> 8192 bytes +15-21%, down /
// gate_up-sized +19-25%, o_proj-sized +8-18% (12 and 16 KiB no better).
#if defined(__AVX512BW__)
constexpr int64_t kPrefetchBytes = 2048;
#else
constexpr int64_t kPrefetchBytes = 8192;
#endif

// x [M, K] float32 -> xq [M, K2] int32 (two int16: k = 2i low half, 2i + 1 high half)
// and xs [M, NB] float32 (the step of each row's block b of kBlockPairs pairs).
void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k_size, int32_t* xq, float* xs) {
  const int64_t k2 = (k_size + 1) / 2, nb = (k2 + kBlockPairs - 1) / kBlockPairs;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k_size, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * ldx;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * kBlockPairs * 2, k1 = std::min(k_size, k0 + kBlockPairs * 2);
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
        const float step = amax > 0.f ? amax / 32767.f : 1.f;
        const float inv = 1.f / step;
        xs[r * nb + b] = step;
        int32_t* q = xq + r * k2;
        for (int64_t i = k0 / 2; i < (k1 + 1) / 2; ++i) {
          const int64_t k = 2 * i;
          const int32_t lo = static_cast<int32_t>(std::nearbyint(xr[k] * inv));
          const int32_t hi = k + 1 < k1 ? static_cast<int32_t>(std::nearbyint(xr[k + 1] * inv)) : 0;
          q[i] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
        }
      }
    }
  });
}

// Where an int8 tile's scales apply. Per-channel (`Grouped` false): `scale` [16P], the
// block's int32 sums flushed into float32 once per block of x (span = kBlockPairs) times
// x's step, the scale applied to the final sums. Grouped: `scale` [P, G, 16], the int32
// sums flushed every `span` = group / 2 pairs (span divides kBlockPairs, so a group lies
// in one block) times the group's scales of the panel into the block's float32 sums,
// those times x's step at the end of the block; no final scale.
// `groups` = G (1 when per-channel). Panel p's scales for group g: half + (p G + g) 16.
struct Int8Scale {
  const float* scale;    // per-channel [16P] float32 (null when grouped)
  const uint16_t* half;  // grouped: [P, G, 16] float16 bits (null when per-channel)
  int64_t span;          // k pairs per flush of the int32 sums
  int64_t groups;        // G
};

using tandem_cpu::half_to_float;

#if defined(__AVX2__)
using tandem_cpu::load_half8;
#endif

#if defined(__AVX512BW__)

inline __m512i pair_dot(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// The block's float32 sums live in memory (updated once per flush: 256 k, or a group), so
// that the R x T int32 sums, the T weight rows and x fit the 32 vector registers; with few
// rows, U interleaved int32 sets (pair index mod U) hide the dot product's latency.
template <int R, int T, bool Grouped>
inline void int8_block_kernel(const int32_t* xq, int64_t k2, const float* xs, int64_t nb, const int8_t* panel,
                              const Int8Scale& sc, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n) {
  constexpr int U = R * T >= 8 ? 1 : (R * T >= 4 ? 2 : 4);
  alignas(64) float accf[R][T][kLanes] = {};
  alignas(64) float accb[R][T][kLanes];  // grouped: the block's sums, before x's step
  const int64_t panel_stride = k2 * 2 * kLanes;
  const int64_t span = Grouped ? sc.span : kBlockPairs;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i_end = std::min(k2, (b + 1) * kBlockPairs);
    for (int64_t i0 = b * kBlockPairs; i0 < i_end; i0 += span) {
      __m512i iacc[U][R][T];
      for (int u = 0; u < U; ++u)
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < T; ++t) iacc[u][r][t] = _mm512_setzero_si512();
      const int64_t i1 = std::min(i_end, i0 + span);
      int64_t i = i0;
      for (; i + U <= i1; i += U) {
        for (int u = 0; u < U; ++u) {
          __m512i w[T];
          for (int t = 0; t < T; ++t) {
            const int8_t* row = panel + t * panel_stride + (i + u) * 2 * kLanes;
            if (R <= 2 && ((i + u) & 1) == 0)
              _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
            w[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
          }
          for (int r = 0; r < R; ++r) {
            const __m512i xv = _mm512_set1_epi32(xq[r * k2 + i + u]);
            for (int t = 0; t < T; ++t) iacc[u][r][t] = pair_dot(iacc[u][r][t], w[t], xv);
          }
        }
      }
      for (; i < i1; ++i) {
        for (int t = 0; t < T; ++t) {
          const __m512i w = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + t * panel_stride + i * 2 * kLanes)));
          for (int r = 0; r < R; ++r) iacc[0][r][t] = pair_dot(iacc[0][r][t], w, _mm512_set1_epi32(xq[r * k2 + i]));
        }
      }
      if constexpr (Grouped) {  // into the block's sums, times the group's scales of each panel
        const int64_t g = i0 / span;
        __m512 gs[T];
        for (int t = 0; t < T; ++t)
          gs[t] = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc.half + ((n0 / kLanes + t) * sc.groups + g) * kLanes)));
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < T; ++t) {
            __m512i sum = iacc[0][r][t];
            for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, iacc[u][r][t]);
            const __m512 prev = i0 == b * kBlockPairs ? _mm512_setzero_ps() : _mm512_load_ps(accb[r][t]);
            _mm512_store_ps(accb[r][t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), gs[t], prev));
          }
      } else {
        for (int r = 0; r < R; ++r) {
          const __m512 step = _mm512_set1_ps(xs[r * nb + b]);
          for (int t = 0; t < T; ++t) {
            __m512i sum = iacc[0][r][t];
            for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, iacc[u][r][t]);
            _mm512_store_ps(accf[r][t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), step, _mm512_load_ps(accf[r][t])));
          }
        }
      }
    }
    if constexpr (Grouped) {  // the block's sums times x's step
      for (int r = 0; r < R; ++r) {
        const __m512 step = _mm512_set1_ps(xs[r * nb + b]);
        for (int t = 0; t < T; ++t)
          _mm512_store_ps(accf[r][t], _mm512_fmadd_ps(_mm512_load_ps(accb[r][t]), step, _mm512_load_ps(accf[r][t])));
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = n0 + t * kLanes;
    if (col >= n) break;
    const int64_t valid = std::min<int64_t>(kLanes, n - col);
    const __mmask16 mask = valid == kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 s = Grouped ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(sc.scale + col);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + col, mask, _mm512_fmadd_ps(_mm512_load_ps(accf[r][t]), s, bv));
  }
}

#elif defined(__AVX2__)

// AVX2 (no VNNI): a panel row (16 columns x 2 k of int8) widens to two registers of 8
// columns' 16-bit pairs, and vpmaddwd sums each (x pair, w pair) product into int32,
// added to the flush's sums. One panel at a time: R x 2 int32 sums, the two weight
// halves, x's broadcast pair and a product fit the 16 registers for R <= 4 (more rows spill).
template <int R, int T, bool Grouped>
inline void int8_block_kernel(const int32_t* xq, int64_t k2, const float* xs, int64_t nb, const int8_t* panel,
                              const Int8Scale& sc, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n) {
  alignas(32) float accf[R][T][kLanes] = {};
  alignas(32) float accb[R][kLanes];  // grouped: panel t's sums over the block, before x's step
  const int64_t panel_stride = k2 * 2 * kLanes;
  const int64_t span = Grouped ? sc.span : kBlockPairs;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i_begin = b * kBlockPairs, i_end = std::min(k2, (b + 1) * kBlockPairs);
#pragma GCC unroll 2
    for (int t = 0; t < T; ++t) {
      const int8_t* p = panel + t * panel_stride;
      for (int64_t i0 = i_begin; i0 < i_end; i0 += span) {
        __m256i iacc[R][2];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) iacc[r][0] = iacc[r][1] = _mm256_setzero_si256();
        const int64_t i1 = std::min(i_end, i0 + span);
        for (int64_t i = i0; i < i1; ++i) {
          const int8_t* row = p + i * 2 * kLanes;
          if (R <= 2 && (i & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
          const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
          const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_set1_epi32(xq[r * k2 + i]);
            iacc[r][0] = _mm256_add_epi32(iacc[r][0], _mm256_madd_epi16(w0, xv));
            iacc[r][1] = _mm256_add_epi32(iacc[r][1], _mm256_madd_epi16(w1, xv));
          }
        }
        if constexpr (Grouped) {  // into the block's sums, times the group's scales
          const uint16_t* gs = sc.half + ((n0 / kLanes + t) * sc.groups + i0 / span) * kLanes;
          const bool first = i0 == i_begin;
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
              float* a = accb[r] + 8 * h;
              const __m256 prev = first ? _mm256_setzero_ps() : _mm256_load_ps(a);
              _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][h]), load_half8(gs + 8 * h), prev));
            }
          }
        } else {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 step = _mm256_set1_ps(xs[r * nb + b]);
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
              float* a = accf[r][t] + 8 * h;
              _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][h]), step, _mm256_load_ps(a)));
            }
          }
        }
      }
      if constexpr (Grouped) {  // the block's sums times x's step
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 step = _mm256_set1_ps(xs[r * nb + b]);
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            float* a = accf[r][t] + 8 * h;
            _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_load_ps(accb[r] + 8 * h), step, _mm256_load_ps(a)));
          }
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = n0 + t * kLanes;
    if (col >= n) break;
    for (int64_t j = 0; j < std::min<int64_t>(kLanes, n - col); ++j) {
      const float bv = bias ? bias[col + j] : 0.f;
      const float s = Grouped ? 1.f : sc.scale[col + j];
      for (int r = 0; r < R; ++r) out[r * ldo + col + j] = accf[r][t][j] * s + bv;
    }
  }
}

#else  // portable: the same integer arithmetic in plain loops

template <int R, int T, bool Grouped>
inline void int8_block_kernel(const int32_t* xq, int64_t k2, const float* xs, int64_t nb, const int8_t* panel,
                              const Int8Scale& sc, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n) {
  float acc[R][T][kLanes] = {};
  const int64_t panel_stride = k2 * 2 * kLanes;
  const int64_t span = Grouped ? sc.span : kBlockPairs;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i_end = std::min(k2, (b + 1) * kBlockPairs);
    for (int64_t i0 = b * kBlockPairs; i0 < i_end; i0 += span) {
      int32_t iacc[R][T][kLanes] = {};
      const int64_t i1 = std::min(i_end, i0 + span);
      for (int64_t i = i0; i < i1; ++i) {
        for (int r = 0; r < R; ++r) {
          const int32_t packed = xq[r * k2 + i];
          const int32_t lo = static_cast<int16_t>(packed & 0xFFFF), hi = static_cast<int16_t>(packed >> 16);
          for (int t = 0; t < T; ++t) {
            const int8_t* w = panel + t * panel_stride + i * 2 * kLanes;
#pragma omp simd
            for (int64_t j = 0; j < kLanes; ++j) iacc[r][t][j] += w[2 * j] * lo + w[2 * j + 1] * hi;
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) {
          const uint16_t* gs = Grouped ? sc.half + ((n0 / kLanes + t) * sc.groups + i0 / span) * kLanes : nullptr;
          for (int64_t j = 0; j < kLanes; ++j)
            acc[r][t][j] +=
                static_cast<float>(iacc[r][t][j]) * (Grouped ? xs[r * nb + b] * half_to_float(gs[j]) : xs[r * nb + b]);
        }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t col = n0 + t * kLanes + j;
      if (col >= n) break;
      const float bv = bias ? bias[col] : 0.f;
      const float s = Grouped ? 1.f : sc.scale[col];
      for (int r = 0; r < R; ++r) out[r * ldo + col] = acc[r][t][j] * s + bv;
    }
  }
}

#endif

// int8_block_kernel<rows, T, Grouped> for 1 <= rows <= kInt8Rows, the row count known at run time.
template <int T, bool Grouped, int R = 1>
inline void int8_block_kernel_rows(int64_t rows, const int32_t* xq, int64_t k2, const float* xs, int64_t nb,
                                   const int8_t* panel, const Int8Scale& sc, const float* bias, float* out,
                                   int64_t ldo, int64_t n0, int64_t n) {
  if constexpr (R < kInt8Rows) {
    if (rows != R) {
      int8_block_kernel_rows<T, Grouped, R + 1>(rows, xq, k2, xs, nb, panel, sc, bias, out, ldo, n0, n);
      return;
    }
  }
  int8_block_kernel<R, T, Grouped>(xq, k2, xs, nb, panel, sc, bias, out, ldo, n0, n);
}

template <int T, bool Grouped>
void int8_rows_kernel(int64_t rows, const int32_t* xq, int64_t k2, const float* xs, int64_t nb, const int8_t* panel,
                      const Int8Scale& sc, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n) {
  constexpr int kRows = Grouped ? kGroupedInt8Rows : kInt8Rows;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    int8_block_kernel<kRows, T, Grouped>(xq + r * k2, k2, xs + r * nb, nb, panel, sc, bias, out + r * ldo, ldo,
                                             n0, n);
  if (rows > r)
    int8_block_kernel_rows<T, Grouped>(rows - r, xq + r * k2, k2, xs + r * nb, nb, panel, sc, bias, out + r * ldo, ldo,
                                       n0, n);
}

#if defined(TANDEM_AVX2_FLOAT)

// From this many rows the AVX2 build runs int8 weights through the float32 loop, a tile
// at a time dequantized into a float32 buffer that stays in L2 (2 panels x K x 64 bytes):
// once a tile serves a few row blocks, the hand-scheduled float loop more than pays for
// the conversion (the weights still come from memory as int8). x is then not rounded to
// 16 bits. bench-135m's shapes, GFLOP/s int8 loop / dequantized tile + float loop, 2 threads
// on a Zen 3: 8 rows 84-101 / 69-78, 12 rows 92-108 / 97-106, 16 rows 98-108 / 102-115,
// 32 rows 99-117 / 122-131, 64 rows 110-118 / 127-152.
constexpr int64_t kInt8AsFloatRows = 16;

// int8 panels [T, K2, 32] (k in pairs) -> float32 panels [T, K, 16], column j of panel t
// times its scale for k: `scale` [T, 16] float32 (one per channel, G = 1) or `half`
// [T, G, 16] float16 (the tile's panels' group scales; the other null), each of the G
// groups `group_pairs` k pairs long (G * group_pairs >= K2).
void dequantize_panels(const int8_t* src, int64_t t_count, int64_t k2, int64_t k_size, const float* scale,
                       const uint16_t* half, int64_t groups, int64_t group_pairs, float* dst) {
  // Per 128-bit lane: the even bytes (k = 2i) of its 8 columns, then the odd (k = 2i + 1).
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                         12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t t = 0; t < t_count; ++t) {
    const int8_t* p = src + t * k2 * 2 * kLanes;
    float* d = dst + t * k_size * kLanes;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (t * groups + g) * kLanes;
      const __m256 s0 = half ? load_half8(half + at) : _mm256_loadu_ps(scale + at);
      const __m256 s1 = half ? load_half8(half + at + 8) : _mm256_loadu_ps(scale + at + 8);
      for (int64_t i = g * group_pairs; i < std::min(k2, (g + 1) * group_pairs); ++i) {
        __m256i v =
            _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 2 * kLanes)), split);
        v = _mm256_permute4x64_epi64(v, 0xD8);  // [k = 2i: columns 0-15 | k = 2i + 1: columns 0-15]
        for (int h = 0; h < 2 && 2 * i + h < k_size; ++h) {
          const __m128i q = h == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
          float* row = d + (2 * i + h) * kLanes;
          _mm256_storeu_ps(row, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s0));
          _mm256_storeu_ps(row + 8,
                           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), s1));
        }
      }
    }
  }
}

template <typename OnTile>
void panel_linear_int8_as_float(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const Int8Scale& sc,
                                bool grouped, const float* bias, const OnTile& on_tile) {
  const int64_t m = x.size(0), k_size = x.size(1), n = out.size(1);
  const int64_t k2 = panels.size(1), num_panels = panels.size(0);
  const int64_t num_tiles = (num_panels + kTilePanels - 1) / kTilePanels;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = panels.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  for_each_float_tile(m, k_size, num_tiles, [&](int64_t r0, int64_t rows, int64_t tile, int64_t) {
    thread_local std::vector<float> tile_buffer;
    tile_buffer.resize(kTilePanels * k_size * kLanes);
    const int64_t p0 = tile * kTilePanels, panel_count = std::min(kTilePanels, num_panels - p0);
    dequantize_panels(wp + p0 * k2 * 2 * kLanes, panel_count, k2, k_size, grouped ? nullptr : sc.scale + p0 * kLanes,
                      grouped ? sc.half + p0 * sc.groups * kLanes : nullptr, sc.groups, grouped ? sc.span : k2,
                      tile_buffer.data());
    float_tile(rows, xp + r0 * ldx, ldx, tile_buffer.data(), panel_count, k_size, nullptr, bias, op + r0 * ldo, ldo,
               p0 * kLanes, n, nullptr);
    on_tile(r0, rows, p0 * kLanes, std::min(n, (p0 + panel_count) * kLanes));
  });
}

#endif

template <typename OnTile>
void panel_linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const Int8Scale& sc,
                       bool grouped, const float* bias, const OnTile& on_tile) {
  const int64_t m = x.size(0), k_size = x.size(1), n = out.size(1);
#if defined(TANDEM_AVX2_FLOAT)
  if (m >= kInt8AsFloatRows) {
    panel_linear_int8_as_float(out, x, panels, sc, grouped, bias, on_tile);
    return;
  }
#endif
  const int64_t k2 = panels.size(1), nb = (k2 + kBlockPairs - 1) / kBlockPairs;
  const int64_t num_panels = panels.size(0);
  const int64_t num_tiles = (num_panels + kTilePanels - 1) / kTilePanels;
  at::Tensor xq = at::empty({m, k2}, at::kInt);
  at::Tensor xs = at::empty({m, nb}, at::kFloat);
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k_size, xq.data_ptr<int32_t>(), xs.data_ptr<float>());
  const int32_t* xqp = xq.data_ptr<int32_t>();
  const float* xsp = xs.data_ptr<float>();
  const int8_t* wp = panels.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const int64_t row_chunk = rows_per_chunk(k2 * static_cast<int64_t>(sizeof(int32_t)), kInt8Rows);
  const int64_t tile_work = std::max<int64_t>(1, std::min(m, row_chunk) * k2 * 2 * kTilePanels * kLanes);
  const int64_t grain = std::max<int64_t>(1, 131072 / tile_work);
  for_each_chunk_and_tile(m, row_chunk, num_tiles, grain, [&](int64_t r0, int64_t rows, int64_t tile, int64_t) {
    const int64_t p0 = tile * kTilePanels;
    const int8_t* panel = wp + p0 * k2 * 2 * kLanes;
    const int64_t n0 = p0 * kLanes;
    const int32_t* xr = xqp + r0 * k2;
    const float* sr = xsp + r0 * nb;
    float* outr = op + r0 * ldo;
    const bool whole = p0 + kTilePanels <= num_panels;
    if (grouped) {
      if (whole)
        int8_rows_kernel<kTilePanels, true>(rows, xr, k2, sr, nb, panel, sc, bias, outr, ldo, n0, n);
      else
        int8_rows_kernel<1, true>(rows, xr, k2, sr, nb, panel, sc, bias, outr, ldo, n0, n);
    } else {
      if (whole)
        int8_rows_kernel<kTilePanels, false>(rows, xr, k2, sr, nb, panel, sc, bias, outr, ldo, n0, n);
      else
        int8_rows_kernel<1, false>(rows, xr, k2, sr, nb, panel, sc, bias, outr, ldo, n0, n);
    }
    on_tile(r0, rows, n0, std::min(n, n0 + kTilePanels * kLanes));
  });
}

template <typename OnTile>
void panel_linear_float(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const float* scale,
                        const float* bias, const OnTile& on_tile) {
  const int64_t m = x.size(0), k_size = x.size(1), n = out.size(1);
  const int64_t num_panels = panels.size(0);
  const int64_t num_tiles = (num_panels + kTilePanels - 1) / kTilePanels;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  for_each_float_tile(m, k_size, num_tiles, [&](int64_t r0, int64_t rows, int64_t tile, int64_t end) {
    const int64_t p0 = tile * kTilePanels;
    const float* panel = wp + p0 * k_size * kLanes;
    const bool next_here = tile + 1 < end && p0 + 2 * kTilePanels <= num_panels;
    const float* next = next_here ? panel + kTilePanels * k_size * kLanes : nullptr;
    const int64_t panel_count = std::min(kTilePanels, num_panels - p0);
    float_tile(rows, xp + r0 * ldx, ldx, panel, panel_count, k_size, scale, bias, op + r0 * ldo, ldo, p0 * kLanes, n,
               next);
    on_tile(r0, rows, p0 * kLanes, std::min(n, (p0 + panel_count) * kLanes));
  });
}

// Checks the operands; runs out = x @ W.T * scale + bias, calling on_tile after each tile.
template <typename OnTile>
void panel_linear_with(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const at::Tensor& bias, const OnTile& on_tile) {
  if (panels.scalar_type() == at::kByte) {  // 4-bit panels: int4_linear_cpu.cpp
    tandem_cpu::int4_linear(
        out, x, panels, scale, bias,
        [](const void* ctx, int64_t r0, int64_t rows, int64_t n0, int64_t n1) {
          (*static_cast<const OnTile*>(ctx))(r0, rows, n0, n1);
        },
        &on_tile);
    return;
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32");
  const bool int8 = panels.scalar_type() == at::kChar;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == (int8 ? 2 * kLanes : kLanes) && panels.is_contiguous(),
              "panels must be contiguous [P, K, 16] float32 or [P, ceil(K / 2), 32] int8");
  TORCH_CHECK(panels.size(1) == (int8 ? (x.size(1) + 1) / 2 : x.size(1)), "x has ", x.size(1),
              " columns, which do not match the panels' ", panels.size(1), " rows");
  TORCH_CHECK(!int8 || scale.numel() > 0, "int8 panels need their scale");
  // Group scales [P, G, 16] (int8 only): G groups of `group` = K / G k each.
  const bool grouped = scale.dim() == 3;
  int64_t group = 0;
  if (grouped) {
    TORCH_CHECK(int8, "group scales [P, G, 16] need int8 panels");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.size(0) == panels.size(0) &&
                    scale.size(1) > 0 && scale.size(2) == kLanes,
                "group scales must be contiguous [P, G, 16] float16");
    group = x.size(1) / scale.size(1);
    TORCH_CHECK(group * scale.size(1) == x.size(1) && group % 2 == 0 && (2 * kBlockPairs) % group == 0,
                "group scales [P, ", scale.size(1), ", 16] need K (", x.size(1),
                ") = G * group with group even and dividing ", 2 * kBlockPairs);
  }
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0),
              "out must be [M, N] float32");
  TORCH_CHECK(out.size(1) <= panels.size(0) * kLanes, "out has more columns than the panels");
  const bool has_scale = scale.numel() > 0, has_bias = bias.numel() > 0;
  if (has_scale && !grouped)
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
                    scale.numel() == panels.size(0) * kLanes,
                "scale must be [16P] float32 (or int8 group scales [P, G, 16] float16)");
  if (has_bias)
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == out.size(1),
                "bias must be [N] float32");
  const float* s = has_scale && !grouped ? scale.data_ptr<float>() : nullptr;
  const uint16_t* half = grouped ? reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()) : nullptr;
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (x.size(0) == 0) return;
  if (int8)
    panel_linear_int8(out, x, panels,
                      Int8Scale{s, half, grouped ? group / 2 : kBlockPairs, grouped ? scale.size(1) : 1}, grouped, b,
                      on_tile);
  else if (panels.scalar_type() == at::kFloat)
    panel_linear_float(out, x, panels, s, b, on_tile);
  else
    TORCH_CHECK(false, "panels must be int8 or float32, got ", panels.scalar_type());
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                  const at::Tensor& bias) {
  panel_linear_with(out, x, panels, scale, bias, NoTileHook{});
}

// tokens[r] = the first column of the row's largest value in out = x @ W.T * scale + bias
// (greedy sampling from an LM head). Each thread keeps the running (value, column) of every
// row over the tiles it computes, reading each tile while it is still in its cache instead
// of the whole [M, N] again afterwards (12.6 MB at 64 rows of a 49k vocabulary); the
// threads' results are merged after the region (equal values: the smaller column).
void panel_linear_argmax(at::Tensor out, at::Tensor tokens, const at::Tensor& x, const at::Tensor& panels,
                         const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous() &&
                  tokens.size(0) == x.size(0),
              "tokens must be contiguous int64 [M]");
  TORCH_CHECK(out.dim() == 2 && out.size(1) > 0, "out must have at least one column");
  const int64_t m = x.size(0), threads = at::get_num_threads();
  std::vector<float> best(threads * m, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> where(threads * m, -1);  // -1: this thread saw no column of the row
  const float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  panel_linear_with(out, x, panels, scale, bias, [&](int64_t r0, int64_t rows, int64_t n0, int64_t n1) {
    const int64_t t = at::get_thread_num();
    for (int64_t r = r0; r < r0 + rows; ++r) {
      float& b = best[t * m + r];
      int64_t& w = where[t * m + r];
      const float* row = op + r * ldo;
      float tile_max = row[n0];
#pragma omp simd reduction(max : tile_max)
      for (int64_t c = n0 + 1; c < n1; ++c) tile_max = std::max(tile_max, row[c]);
      // A thread's tiles need not come in column order (work is stolen): equal values
      // keep the smaller column (a tile below w lies wholly below it).
      if (w < 0 || tile_max > b || (tile_max == b && n0 < w)) {
        int64_t c = n0;
        while (c + 1 < n1 && row[c] != tile_max) ++c;
        b = tile_max;
        w = c;
      }
    }
  });
  int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    float b = -std::numeric_limits<float>::infinity();
    int64_t w = -1;
    for (int64_t t = 0; t < threads; ++t) {
      const float v = best[t * m + r];
      const int64_t c = where[t * m + r];
      if (c >= 0 && (w < 0 || v > b || (v == b && c < w))) {
        b = v;
        w = c;
      }
    }
    tp[r] = w < 0 ? 0 : w;
  }
}

// True when v is neither inf nor NaN (from its bits: -ffast-math folds std::isfinite).
inline bool finite_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// panel_linear_argmax(x, float32 panels) for a few rows, reading a quarter of the bytes:
// every column is first scored against an int8 copy of the weight (`screen`, `screen_scale`:
// pack_panels(w, quantize=True)), and only the tiles that could hold a row's maximum are
// recomputed in float32. The tokens are panel_linear_argmax's, bit for bit.
//
// Why it is exact. Row j of the screen is w'_j = q_j * scale_j; the int8 kernel scores it
// as a_j against x' (x rounded to 16 bits per block of 256 k); the float32 kernel would
// give s_j. With d >= |x - x'| (0.51 of a block's step per element) and
//   bounds[0, j] = U_j >= |w_j - w'_j| + eta (|w_j| + |w'_j|)
//   bounds[1, j] = V_j >= |w'_j| + eta (|w_j| + |w'_j|),  eta = 2 (K + 16) 2^-24
// (2-norms; kernels/panel_linear.py's argmax_screen builds them), Cauchy-Schwarz for the
// weight and x differences and the standard bound gamma_K sum |x_i w_i| on both kernels'
// float32 sums give |s_j - a_j| <= B_j = |x| U_j + d V_j. Let L = max_j (a_j - B_j),
// which is at most the row's maximum: every column whose s_j is the maximum has
// a_j + B_j >= L, a candidate. (Computed in float32, B_j is widened by 2^-20 (B_j + |a_j|),
// which covers the rounding of B_j and of a_j -+ B_j.) The candidates' tiles are
// recomputed for all rows through float_tile exactly as panel_linear_float calls it (a
// row's float32 result depends on how many rows share its register block, so the rows stay
// together), and the first candidate column of the largest value is the token. When a
// row's candidates span more than max_tiles tiles, or its |x| or L is not finite, every row
// takes the full panel_linear_argmax. Returns 0 when the screen decided, else the number
// of rows found undecided before handing over (the check stops at the first).
int64_t panel_linear_argmax_screened(at::Tensor out, at::Tensor tokens, const at::Tensor& x, const at::Tensor& panels,
                                     const at::Tensor& screen, const at::Tensor& screen_scale,
                                     const at::Tensor& bounds, int64_t max_tiles) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat && screen.scalar_type() == at::kChar,
              "panels must be float32 and the screen int8");
  TORCH_CHECK(screen.dim() == 3 && panels.dim() == 3 && screen.size(0) == panels.size(0),
              "the screen must have as many panels as the float32 weight");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous() &&
                  tokens.size(0) == x.size(0),
              "tokens must be contiguous int64 [M]");
  TORCH_CHECK(out.dim() == 2 && out.size(1) > 0, "out must have at least one column");
  const int64_t num_panels = panels.size(0), width = num_panels * kLanes;
  TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.is_contiguous() && bounds.dim() == 2 &&
                  bounds.size(0) == 2 && bounds.size(1) == width,
              "bounds must be contiguous float32 [2, 16P]");
  const at::Tensor no_bias = at::empty({0}, at::kFloat);
  // The screen's scores (checks x and out as panel_linear does).
  panel_linear_with(out, x, screen, screen_scale, no_bias, NoTileHook{});
  const int64_t m = x.size(0), k_size = x.size(1), n = out.size(1);
  constexpr int64_t kTileCols = kTilePanels * kLanes;
  const int64_t num_tiles = (n + kTileCols - 1) / kTileCols;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const float* u_j = bounds.data_ptr<float>();
  const float* v_j = u_j + width;
  const float widen = std::ldexp(1.f, -20);

  std::vector<std::vector<int64_t>> candidates(m);
  std::vector<char> recompute(num_tiles, 0);
  std::vector<float> tile_hi(num_tiles);  // max over the tile of a_j + B_j
  int64_t undecided = 0;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = xp + r * ldx;
    double nx2 = 0.0, d2 = 0.0;
    for (int64_t k0 = 0; k0 < k_size; k0 += 2 * kBlockPairs) {
      const int64_t k1 = std::min(k_size, k0 + 2 * kBlockPairs);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) {
        amax = std::max(amax, std::fabs(xr[k]));
        nx2 += static_cast<double>(xr[k]) * xr[k];
      }
      const double half_step = 0.51 * (static_cast<double>(amax) / 32767.0);
      d2 += static_cast<double>(k1 - k0) * half_step * half_step;
    }
    // Rounded up to float32 (the bound only grows).
    const float nx = std::nextafter(static_cast<float>(std::sqrt(nx2)), std::numeric_limits<float>::infinity());
    const float d = std::nextafter(static_cast<float>(std::sqrt(d2)), std::numeric_limits<float>::infinity());
    const float* a = op + r * ldo;
    // B_j, widened for float32 rounding (both passes below must use this one formula).
    const auto bound = [&](int64_t j) {
      const float b = nx * u_j[j] + d * v_j[j];
      return b + widen * (b + std::fabs(a[j]));
    };
    float floor = -std::numeric_limits<float>::max();  // L
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t j0 = t * kTileCols, j1 = std::min(n, j0 + kTileCols);
      float lo = -std::numeric_limits<float>::max(), hi = -std::numeric_limits<float>::max();
#pragma omp simd reduction(max : lo, hi)
      for (int64_t j = j0; j < j1; ++j) {
        const float b = bound(j);
        lo = std::max(lo, a[j] - b);
        hi = std::max(hi, a[j] + b);
      }
      floor = std::max(floor, lo);
      tile_hi[t] = hi;
    }
    if (!finite_bits(nx) || !finite_bits(d) || nx > 1e18f || !finite_bits(floor)) {  // no overflow below
      ++undecided;
      break;
    }
    int64_t tiles = 0;
    std::vector<int64_t>& cand = candidates[r];
    for (int64_t t = 0; t < num_tiles && tiles <= max_tiles; ++t) {
      if (!(tile_hi[t] >= floor)) continue;
      ++tiles;
      recompute[t] = 1;
      for (int64_t j = t * kTileCols; j < std::min(n, (t + 1) * kTileCols); ++j)
        if (a[j] + bound(j) >= floor) cand.push_back(j);
    }
    if (tiles > max_tiles || cand.empty()) {
      ++undecided;
      break;
    }
  }
  if (undecided > 0) {
    panel_linear_argmax(out, tokens, x, panels, at::empty({0}, at::kFloat), no_bias);
    return undecided;
  }
  // The candidate tiles in float32, every row at once (as panel_linear_float computes them).
  std::vector<int64_t> tiles;
  for (int64_t t = 0; t < num_tiles; ++t)
    if (recompute[t]) tiles.push_back(t);
  const float* wp = panels.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p0 = tiles[i] * kTilePanels, panel_count = std::min(kTilePanels, num_panels - p0);
      float_tile(m, xp, ldx, wp + p0 * k_size * kLanes, panel_count, k_size, nullptr, nullptr, op, ldo, p0 * kLanes,
                 n, nullptr);
    }
  });
  int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    const float* s = op + r * ldo;
    int64_t w = candidates[r].front();
    for (const int64_t j : candidates[r])
      if (s[j] > s[w]) w = j;  // ascending columns: equal values keep the first
    tp[r] = w;
  }
  return 0;
}

// The float32 kernel this build compiled: "avx512", "avx2" (the hand-scheduled loop) or
// "portable"; kernels/panel_linear.py picks its torch.mm threshold by it.
std::string panel_kernel_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(TANDEM_AVX2_FLOAT)
  return "avx2";
#else
  return "portable";
#endif
}

// Rows from which int8 products run dequantized through the float loop (x unrounded);
// INT64_MAX where this build never does. kernels/panel_linear.py's reference follows it.
int64_t panel_int8_float_rows() {
#if defined(TANDEM_AVX2_FLOAT)
  return kInt8AsFloatRows;
#else
  return std::numeric_limits<int64_t>::max();
#endif
}

}  // namespace

namespace tandem_cpu {
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                  const at::Tensor& bias) {
  ::panel_linear(out, x, panels, scale, bias);
}

// The loops above one tile at a time, for callers that split the work themselves (the
// grouped MoE kernel, moe_cpu.cpp). Contracts: cpu_kernels.h.
static_assert(kPanelTilePanels == kTilePanels && kPanelLanes == kLanes, "cpu_kernels.h disagrees with this file");

int64_t panel_row_chunk(int64_t k_size, bool int8) {
  return int8 ? rows_per_chunk(((k_size + 1) / 2) * static_cast<int64_t>(sizeof(int32_t)), kInt8Rows)
              : rows_per_chunk(k_size * static_cast<int64_t>(sizeof(float)), kMaxRows);
}

void panel_float_tile(int64_t rows, const float* x, int64_t ldx, const float* panels, int64_t panel_count,
                      int64_t k_size, const float* scale, const float* bias, float* out, int64_t ldo, int64_t n0,
                      int64_t n, const float* next) {
  float_tile(rows, x, ldx, panels, panel_count, k_size, scale, bias, out, ldo, n0, n,
             panel_count == kTilePanels ? next : nullptr);
}

void panel_quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k_size, int32_t* xq, float* xs) {
  quantize_rows(x, ldx, m, k_size, xq, xs);
}

void panel_int8_tile(int64_t rows, const int32_t* xq, int64_t k2, const float* xs, int64_t nb, const int8_t* panels,
                     int64_t panel_count, const float* scale, const float* bias, float* out, int64_t ldo, int64_t n0,
                     int64_t n) {
  const Int8Scale sc{scale, nullptr, kBlockPairs, 1};
  if (panel_count == kTilePanels)
    int8_rows_kernel<kTilePanels, false>(rows, xq, k2, xs, nb, panels, sc, bias, out, ldo, n0, n);
  else
    int8_rows_kernel<1, false>(rows, xq, k2, xs, nb, panels, sc, bias, out, ldo, n0, n);
}

bool panel_int8_tile_as_float(int64_t rows, const float* x, int64_t ldx, const int8_t* panels, int64_t panel_count,
                              int64_t k_size, const float* scale, const float* bias, float* out, int64_t ldo,
                              int64_t n0, int64_t n) {
#if defined(TANDEM_AVX2_FLOAT)
  thread_local std::vector<float> tile_buffer;
  tile_buffer.resize(kTilePanels * k_size * kLanes);
  const int64_t k2 = (k_size + 1) / 2;
  dequantize_panels(panels, panel_count, k2, k_size, scale + n0, nullptr, 1, k2, tile_buffer.data());
  float_tile(rows, x, ldx, tile_buffer.data(), panel_count, k_size, nullptr, bias, out, ldo, n0, n, nullptr);
  return true;
#else
  (void)rows, (void)x, (void)ldx, (void)panels, (void)panel_count, (void)k_size, (void)scale, (void)bias, (void)out,
      (void)ldo, (void)n0, (void)n;
  return false;
#endif
}

int64_t panel_int8_as_float_rows() { return ::panel_int8_float_rows(); }
}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor scale, Tensor bias) -> ()");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
  m.def("panel_linear_argmax(Tensor(a!) out, Tensor(b!) tokens, Tensor x, Tensor panels, Tensor scale, Tensor bias) -> ()");
  m.impl("panel_linear_argmax", c10::DispatchKey::CPU, &panel_linear_argmax);
  m.def(
      "panel_linear_argmax_screened(Tensor(a!) out, Tensor(b!) tokens, Tensor x, Tensor panels, Tensor screen, "
      "Tensor screen_scale, Tensor bounds, int max_tiles) -> int");
  m.impl("panel_linear_argmax_screened", c10::DispatchKey::CPU, &panel_linear_argmax_screened);
  m.def("panel_int8_float_rows() -> int");
  m.impl("panel_int8_float_rows", c10::DispatchKey::CatchAll, &panel_int8_float_rows);
  m.def("panel_kernel_isa() -> str");
  m.impl("panel_kernel_isa", c10::DispatchKey::CatchAll, &panel_kernel_isa);
}
