// Linear layers over 4-bit (and 5-bit) weights packed in 16-column panels: y = x @ W.T +
// bias with W[n, k] = code[n, k] * scale[n, k / 32] + min[n, k / 32] (GGUF Q4_0 / Q4_1 /
// Q4_K, GPTQ, AWQ; GGUF Q5_0 / Q5_1 / Q5_K with a fifth bit a code: every such format in
// its one common form, engine_service/models/quantized.py's Int4Rows).
//
// Layouts (kernels/int4_linear.py packs them):
//   x      [M, K] float32, rows contiguous (row stride may exceed K); K a multiple of 32
//   codes  uint8 [Q, G, 512] (G = K / 32; Q = ceil(N / 32) tiles of two 16-column panels):
//          [q, g, 256 t + 64 c + 4 j + b] holds the codes of column 32q + 16t + j (panel t
//          of tile q, j = 0..15) for k = 32g + 8c + b in its low nibble and k = 32g + 8c + 4
//          + b in its high one (chunk c = 0..3 of the group, b = 0..3). A chunk is one 64-byte
//          AVX-512 register: its low nibbles are 16 columns x 4 consecutive k, the unsigned
//          operand of vpdpbusd against the 4 int8 values of x at those k broadcast to every
//          lane; its high nibbles the same for the next 4 k. A tile's groups follow each
//          other and tiles follow tiles: a thread walking its tiles reads one stream.
//          5-bit weights: [Q, G, 640], each group's 512 bytes followed by 128 of fifth bits:
//          [q, g, 512 + 64 t + 16 c + 8 h + i], bit e of byte i for byte 8i + e of chunk c's
//          low (h = 0) or high (h = 1) nibbles: one AVX-512 byte mask a half-chunk, which adds
//          16 to those codes.
//   scale  [Q, G, 64] float32 or float16: [q, g, 32 t + j] is the scale of column 32q +
//          16t + j over k = 32g..32g+31, [q, g, 32 t + 16 + j] its min. Columns past N:
//          code, scale and min 0.
//   bias   [N] float32 or an empty tensor
//   out    [M, N] float32, rows contiguous
//
// x is quantized per row and group of 32 k, as llama.cpp quantizes activations for its
// 4-bit dot products (Q8_1: d = max|x| / 127, q1 = round(x / d) in int8, ties to even), and
// by default also its rounding residual: q2 = round(256 (x / d - q1)) in int8, so that
// x' = d (q1 + q2 / 256), about 16 bits a value where q1 alone keeps 8. The one-part form
// (x_bits 8: llama.cpp's own numerics) is ~1.6x faster at batch 64 but changes greedy
// answers of a real model (SmolLM2-135M Q4_1: 8 of 16 chat prompts within 24 tokens, the
// same way llama.cpp does; two parts: none). With v = 256 q1 + q2 (or q1):
//   y[r, n] += (d' scale[n, g]) sum_k code[n, k] v[r, k] + min[n, g] (d' sum_k v[r, k])
// d' = d / 256 (or d), the integer sums exact in int32 (|.| <= 32 x 31 x 32767), the rest in
// float32: x' @ W.T in real arithmetic (kernels/int4_linear.py's reference). The min term
// uses the quantized x's sum, not the float one: its error is then x's rounding error times
// W itself (centred) rather than times code * scale (all of one sign).
//
// ISA paths: AVX-512 BW with VNNI (vpdpbusd: 64 multiply-adds an instruction, u4 codes x s8
// x), AVX-512 BW without (vpmaddubsw pairs into int16, summed over the group, then vpmaddwd
// into int32: 8 pair sums of <= 3,810 fit int16; 5-bit codes widen every chunk), AVX2 (the
// same on 8-lane registers, one panel half at a time) and portable loops. A register block
// is R rows x T panels (T = 2, a tile of 32 columns): every 64-byte chunk is unpacked once
// per block and serves its R rows; the block's int32 sums are flushed into float32 once per
// group. Threads split the tiles with stealing, as the panel kernel does; the tile's codes
// come from memory for the first row block and from cache for the rest.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "half.h"
#include "work_stealing.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;                     // columns per panel
constexpr int64_t kGroup = 32;                     // k per scale / min (and per block of x)
constexpr int64_t kChunkBytes = 64;                // 8 k of one panel
constexpr int64_t kGroupBytes = kGroup / 8 * kChunkBytes;  // 256: a group of one panel
constexpr int64_t kTilePanels = 2;                 // panels per tile
constexpr int64_t kTileGroupBytes = kTilePanels * kGroupBytes;  // 512: a group of a tile
constexpr int64_t kBitBytes = kTilePanels * kGroupBytes / 4;    // 128: its fifth bits (5-bit)
constexpr int64_t kTileGroupScales = kTilePanels * 2 * kLanes;  // 64 scales and mins: a group of a tile
// How many groups ahead a streaming pass asks for codes and scales (2 KiB of codes).
constexpr int64_t kPrefetchGroups = 4;

// Bytes of a tile's group: codes, and with 5-bit codes their fifth bits.
template <bool Five>
constexpr int64_t group_bytes() {
  return Five ? kTileGroupBytes + kBitBytes : kTileGroupBytes;
}

// x's precision for every product of the process (int4_x_bits): 16 (two int8 parts) or 8.
std::atomic<int> g_x_bits{16};

// Rows per register block. AVX-512: 4 rows x 2 panels of int32 sums (two sets with the
// residual), their float32 sums and the chunk's 4 unpacked registers (the float32 sums of the
// residual form spill: once a group, no faster with 3 rows). AVX2: one 8-column half of a
// panel at a time, 2 rows (4 one-part) in its 16.
template <bool Two>
constexpr int block_rows() {
#if defined(__AVX512BW__)
  return 4;
#elif defined(__AVX2__)
  return Two ? 2 : 4;
#else
  return 4;
#endif
}

// The quantized rows of x. `q`: per row, per chunk of 8 k, their 8 int8 q1 and (Two) 8 q2
// (a record of 8 or 16 bytes); `d`: [M, G] the step d' of one unit of v (d / 256 or d);
// `dsum`: [M, G] d' times the group's sum of v.
struct QuantizedX {
  const int8_t* q;
  const float* d;
  const float* dsum;
  int64_t stride;  // bytes of q per row: K or 2K
  int64_t groups;  // G (d's row stride)
};

// x [M, K] (row stride ldx) -> q, d, dsum as above.
template <bool Two>
void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* q, float* d, float* dsum) {
  const int64_t groups = k / kGroup;
  constexpr int64_t rec = Two ? 16 : 8;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * ldx;
      int8_t* qr = q + r * (Two ? 2 * k : k);
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = xr + g * kGroup;
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        float q1[kGroup], q2[kGroup];
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < kGroup; ++j) {
          const float t = xg[j] * inv;
          q1[j] = std::min(127.f, std::max(-127.f, std::nearbyint(t)));
          // t - q1 is exact (|t| <= 127.5); times 256 exact: the residual in units of d / 256.
          q2[j] = Two ? std::min(127.f, std::max(-127.f, std::nearbyint((t - q1[j]) * 256.f))) : 0.f;
          sum += Two ? 256 * static_cast<int32_t>(q1[j]) + static_cast<int32_t>(q2[j]) : static_cast<int32_t>(q1[j]);
        }
        for (int64_t c = 0; c < kGroup / 8; ++c)
          for (int64_t b = 0; b < 8; ++b) {
            qr[(g * 4 + c) * rec + b] = static_cast<int8_t>(q1[c * 8 + b]);
            if (Two) qr[(g * 4 + c) * rec + 8 + b] = static_cast<int8_t>(q2[c * 8 + b]);
          }
        const float step = Two ? amax / 127.f / 256.f : amax / 127.f;
        d[r * groups + g] = step;
        dsum[r * groups + g] = step * static_cast<float>(sum);
      }
    }
  });
}

using tandem_cpu::half_to_float;
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return half_to_float(v); }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Asks for the tile's codes and scales kPrefetchGroups groups past group g (the next tile's
// when this one ends: a thread's tiles are consecutive).
template <bool Five, typename S>
inline void prefetch_group(const uint8_t* codes, const S* scale, int64_t g) {
  const char* c = reinterpret_cast<const char*>(codes + (g + kPrefetchGroups) * group_bytes<Five>());
  for (int64_t b = 0; b < group_bytes<Five>(); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
  const char* s = reinterpret_cast<const char*>(scale + (g + kPrefetchGroups) * kTileGroupScales);
  for (int64_t b = 0; b < kTileGroupScales * static_cast<int64_t>(sizeof(S)); b += 64) _mm_prefetch(s + b, _MM_HINT_T0);
}
#endif

#if defined(__AVX512BW__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc += the chunk's codes (lo: k..k+3, hi: k+4..k+7) times x's 4 + 4 int8 values. Without
// VNNI the int16 pair sums are summed over a group's 4 chunks (<= 8 x 3810 with 4-bit codes)
// and widened at its end, or (`Wide`: 5-bit codes, pair sums up to 7874) at once.
template <bool Wide>
inline __m512i dot_chunk(__m512i acc, __m512i lo, __m512i xa, __m512i hi, __m512i xb) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xa), hi, xb);
#else
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xa), _mm512_maddubs_epi16(hi, xb));
  if constexpr (Wide) return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  return _mm512_add_epi16(acc, pairs);
#endif
}
template <bool Wide>
inline __m512i widen_group(__m512i acc) {
#if defined(__AVX512VNNI__)
  return acc;
#else
  if constexpr (Wide) return acc;
  return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
#endif
}

// out[r, n0 + j] (j < 32) for R rows (x's rows r0..r0+R-1) of one tile: `codes` and `scale`
// its [G, 512 or 640] and [G, 64]. `stream`: this pass reads the tile from memory (ask ahead).
template <int R, bool Two, bool Five, typename S>
inline void int4_block(const QuantizedX& xq, int64_t r0, const uint8_t* codes, const S* scale, const float* bias,
                       float* out, int64_t ldo, int64_t n0, int64_t n, bool stream) {
  constexpr int T = kTilePanels;
  constexpr int64_t rec = Two ? 16 : 8;
  const int64_t groups = xq.groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(16);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int8_t* xrow = xq.q + r0 * xq.stride;
  for (int64_t g = 0; g < groups; ++g) {
    if (stream) prefetch_group<Five>(codes, scale, g);
    __m512i i1[R][T], i2[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) i1[r][t] = i2[r][t] = _mm512_setzero_si512();
    const uint8_t* gp = codes + g * group_bytes<Five>();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i lo[T], hi[T];
      for (int t = 0; t < T; ++t) {
        const __m512i v = _mm512_loadu_si512(gp + t * kGroupBytes + c * kChunkBytes);
        lo[t] = _mm512_and_si512(v, nibble);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (Five) {
          const uint8_t* bits = gp + kTileGroupBytes + t * kChunkBytes + c * 16;
          lo[t] = _mm512_mask_add_epi8(lo[t], _cvtu64_mask64(load_u64(bits)), lo[t], sixteen);
          hi[t] = _mm512_mask_add_epi8(hi[t], _cvtu64_mask64(load_u64(bits + 8)), hi[t], sixteen);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xk = xrow + r * xq.stride + (g * 4 + c) * rec;
        const __m512i xa = _mm512_set1_epi32(load_i32(xk)), xb = _mm512_set1_epi32(load_i32(xk + 4));
        for (int t = 0; t < T; ++t) i1[r][t] = dot_chunk<Five>(i1[r][t], lo[t], xa, hi[t], xb);
        if constexpr (Two) {
          const __m512i ya = _mm512_set1_epi32(load_i32(xk + 8)), yb = _mm512_set1_epi32(load_i32(xk + 12));
          for (int t = 0; t < T; ++t) i2[r][t] = dot_chunk<Five>(i2[r][t], lo[t], ya, hi[t], yb);
        }
      }
    }
    __m512 sc[T], mn[T];
    for (int t = 0; t < T; ++t) {
      sc[t] = load16(scale + g * kTileGroupScales + t * 2 * kLanes);
      mn[t] = load16(scale + g * kTileGroupScales + t * 2 * kLanes + kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(xq.d[(r0 + r) * groups + g]);
      const __m512 dsum = _mm512_set1_ps(xq.dsum[(r0 + r) * groups + g]);
      for (int t = 0; t < T; ++t) {
        __m512i sums = widen_group<Five>(i1[r][t]);
        if constexpr (Two) sums = _mm512_add_epi32(_mm512_slli_epi32(sums, 8), widen_group<Five>(i2[r][t]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), sc[t]), d, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(mn[t], dsum, acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = n0 + t * kLanes;
    if (col >= n) break;
    const int64_t valid = std::min<int64_t>(kLanes, n - col);
    const __mmask16 mask = valid == kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + col, mask, _mm512_add_ps(acc[r][t], b));
  }
}

#elif defined(__AVX2__)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return tandem_cpu::load_half8(p); }

// As AVX-512's without VNNI: int16 pair sums over the group (4-bit), or widened at once (5-bit).
template <bool Wide>
inline __m256i dot_chunk(__m256i acc, __m256i lo, __m256i xa, __m256i hi, __m256i xb) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
  if constexpr (Wide) return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  return _mm256_add_epi16(acc, pairs);
}

// 32 bits -> 32 bytes, 16 where the bit is set (byte i: bit i).
inline __m256i bits_to_sixteens(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                          3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, select), select), _mm256_set1_epi8(16));
}

// AVX2: each panel as two 8-column halves (bytes 0-31 and 32-63 of a chunk), one after the
// other; vpmaddubsw pair sums in int16 over the group's 4 chunks, then vpmaddwd.
template <int R, bool Two, bool Five, typename S>
inline void int4_block(const QuantizedX& xq, int64_t r0, const uint8_t* codes, const S* scale, const float* bias,
                       float* out, int64_t ldo, int64_t n0, int64_t n, bool stream) {
  constexpr int64_t rec = Two ? 16 : 8;
  const int64_t groups = xq.groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xrow = xq.q + r0 * xq.stride;
  for (int t = 0; t < kTilePanels; ++t) {
    const int64_t col = n0 + t * kLanes;
    if (col >= n) break;
    const int64_t valid = std::min<int64_t>(kLanes, n - col);
    for (int h = 0; h < 2 && 8 * h < valid; ++h) {
      const S* hs = scale + t * 2 * kLanes + 8 * h;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        // The whole tile's group at the first half (the later ones read it from cache).
        if (stream && t == 0 && h == 0) prefetch_group<Five>(codes, scale, g);
        const uint8_t* gp = codes + g * group_bytes<Five>();
        __m256i i1[R], i2[R];
        for (int r = 0; r < R; ++r) i1[r] = i2[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(gp + t * kGroupBytes + c * kChunkBytes + 32 * h));
          __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          if constexpr (Five) {
            const uint8_t* bits = gp + kTileGroupBytes + t * kChunkBytes + c * 16;
            lo = _mm256_add_epi8(lo, bits_to_sixteens(static_cast<uint32_t>(load_u64(bits) >> (32 * h))));
            hi = _mm256_add_epi8(hi, bits_to_sixteens(static_cast<uint32_t>(load_u64(bits + 8) >> (32 * h))));
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xk = xrow + r * xq.stride + (g * 4 + c) * rec;
            i1[r] = dot_chunk<Five>(i1[r], lo, _mm256_set1_epi32(load_i32(xk)), hi,
                                    _mm256_set1_epi32(load_i32(xk + 4)));
            if constexpr (Two)
              i2[r] = dot_chunk<Five>(i2[r], lo, _mm256_set1_epi32(load_i32(xk + 8)), hi,
                                      _mm256_set1_epi32(load_i32(xk + 12)));
          }
        }
        const S* gs = hs + g * kTileGroupScales;
        const __m256 sc = load8(gs), mn = load8(gs + kLanes);
        for (int r = 0; r < R; ++r) {
          __m256i sums = Five ? i1[r] : _mm256_madd_epi16(i1[r], ones);
          if constexpr (Two)
            sums = _mm256_add_epi32(_mm256_slli_epi32(sums, 8), Five ? i2[r] : _mm256_madd_epi16(i2[r], ones));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), sc),
                                   _mm256_set1_ps(xq.d[(r0 + r) * groups + g]), acc[r]);
          acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xq.dsum[(r0 + r) * groups + g]), acc[r]);
        }
      }
      const int64_t c0 = col + 8 * h;
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid - 8 * h)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 b = bias ? _mm256_maskload_ps(bias + c0, m) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) _mm256_maskstore_ps(out + r * ldo + c0, m, _mm256_add_ps(acc[r], b));
    }
  }
}

#else  // portable: the same integer arithmetic in plain loops

template <int R, bool Two, bool Five, typename S>
inline void int4_block(const QuantizedX& xq, int64_t r0, const uint8_t* codes, const S* scale, const float* bias,
                       float* out, int64_t ldo, int64_t n0, int64_t n, bool) {
  constexpr int T = kTilePanels;
  constexpr int64_t rec = Two ? 16 : 8;
  const int64_t groups = xq.groups;
  float acc[R][T][kLanes] = {};
  for (int64_t g = 0; g < groups; ++g) {
    int32_t iacc[R][T][kLanes] = {};
    const uint8_t* gp = codes + g * group_bytes<Five>();
    for (int t = 0; t < T; ++t) {
      for (int c = 0; c < 4; ++c) {
        const uint8_t* p = gp + t * kGroupBytes + c * kChunkBytes;
        const uint64_t lo_bits = Five ? load_u64(gp + kTileGroupBytes + t * kChunkBytes + c * 16) : 0;
        const uint64_t hi_bits = Five ? load_u64(gp + kTileGroupBytes + t * kChunkBytes + c * 16 + 8) : 0;
        for (int r = 0; r < R; ++r) {
          const int8_t* xk = xq.q + (r0 + r) * xq.stride + (g * 4 + c) * rec;
          int32_t v[8];
          for (int b = 0; b < 8; ++b) v[b] = Two ? 256 * xk[b] + xk[8 + b] : xk[b];
          for (int64_t j = 0; j < kLanes; ++j) {
            int32_t s = 0;
            for (int b = 0; b < 4; ++b) {
              const int64_t i = 4 * j + b;
              const int32_t lo = (p[i] & 0x0F) + 16 * static_cast<int32_t>((lo_bits >> i) & 1);
              const int32_t hi = (p[i] >> 4) + 16 * static_cast<int32_t>((hi_bits >> i) & 1);
              s += lo * v[b] + hi * v[4 + b];
            }
            iacc[r][t][j] += s;
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const S* gs = scale + g * kTileGroupScales + t * 2 * kLanes;
      for (int r = 0; r < R; ++r) {
        const float d = xq.d[(r0 + r) * groups + g], dsum = xq.dsum[(r0 + r) * groups + g];
        for (int64_t j = 0; j < kLanes; ++j)
          acc[r][t][j] += static_cast<float>(iacc[r][t][j]) * to_float(gs[j]) * d + to_float(gs[kLanes + j]) * dsum;
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t col = n0 + t * kLanes + j;
      if (col >= n) break;
      const float b = bias ? bias[col] : 0.f;
      for (int r = 0; r < R; ++r) out[r * ldo + col] = acc[r][t][j] + b;
    }
}

#endif

// int4_block<rows, Two, Five, S> for 1 <= rows <= block_rows<Two>(), known at run time.
template <bool Two, bool Five, typename S, int R = 1>
inline void int4_block_rows(int64_t rows, const QuantizedX& xq, int64_t r0, const uint8_t* codes, const S* scale,
                            const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n, bool stream) {
  if constexpr (R < block_rows<Two>()) {
    if (rows != R) {
      int4_block_rows<Two, Five, S, R + 1>(rows, xq, r0, codes, scale, bias, out, ldo, n0, n, stream);
      return;
    }
  }
  int4_block<R, Two, Five, S>(xq, r0, codes, scale, bias, out, ldo, n0, n, stream);
}

// Rows r0..r0+rows of one tile: register blocks of block_rows rows, the first streaming the
// tile's codes from memory, the others reading them from cache.
template <bool Two, bool Five, typename S>
void int4_tile(int64_t rows, const QuantizedX& xq, int64_t r0, const uint8_t* codes, const S* scale,
               const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n) {
  constexpr int kRows = block_rows<Two>();
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    int4_block<kRows, Two, Five, S>(xq, r0 + r, codes, scale, bias, out + r * ldo, ldo, n0, n, r == 0);
  if (rows > r)
    int4_block_rows<Two, Five, S>(rows - r, xq, r0 + r, codes, scale, bias, out + r * ldo, ldo, n0, n, r == 0);
}

template <bool Two, bool Five, typename S>
void int4_linear_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const S* scale,
                       const float* bias, tandem_cpu::TileHook hook, const void* ctx) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t num_tiles = codes.size(0), groups = k / kGroup;
  const int64_t stride = Two ? 2 * k : k;
  // The quantized x, in buffers of the calling thread (the workers only read them).
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf;
  q_buf.resize(m * stride);
  d_buf.resize(2 * m * groups);
  quantize_rows<Two>(x.data_ptr<float>(), x.stride(0), m, k, q_buf.data(), d_buf.data(), d_buf.data() + m * groups);
  const QuantizedX xq{q_buf.data(), d_buf.data(), d_buf.data() + m * groups, stride, groups};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  constexpr int kRows = block_rows<Two>();
  // Rows per chunk: the chunk's quantized x stays in L2 (256 KiB) while every tile passes it.
  const int64_t row_chunk = std::max<int64_t>(kRows, (256 * 1024 / stride) / kRows * kRows);
  // A thread hand-off should bring >= ~128k multiply-adds.
  const int64_t tile_work = std::max<int64_t>(1, std::min(m, row_chunk) * k * kTilePanels * kLanes);
  const int64_t grain = std::max<int64_t>(1, 131072 / tile_work);
  const int64_t shares = std::min<int64_t>(at::get_num_threads(), (num_tiles + grain - 1) / grain);
  for (int64_t r0 = 0; r0 < m; r0 += row_chunk) {
    const int64_t rows = std::min(row_chunk, m - r0);
    tandem_cpu::parallel_steal(num_tiles, shares, [&](const auto& take) {
      int64_t tile, end;
      while (take(tile, end)) {
        const int64_t n0 = tile * kTilePanels * kLanes;
        int4_tile<Two, Five, S>(rows, xq, r0, cp + tile * groups * group_bytes<Five>(),
                                scale + tile * groups * kTileGroupScales, bias, op + r0 * ldo, ldo, n0, n);
        if (hook != nullptr) hook(ctx, r0, rows, n0, std::min(n, n0 + kTilePanels * kLanes));
      }
    });
  }
}

// The op's checks.
void check_int4(const at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kGroup == 0, "4-bit panels need K a multiple of ", kGroup, ", got K = ", k);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(1) == k / kGroup &&
                  (codes.size(2) == kTileGroupBytes || codes.size(2) == kTileGroupBytes + kBitBytes),
              "codes must be contiguous uint8 [ceil(N / 32), K / 32, 512 (4-bit) or 640 (5-bit)] (K = ", k, ")");
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) && scale.dim() == 3 &&
                  scale.is_contiguous() && scale.size(0) == codes.size(0) && scale.size(1) == k / kGroup &&
                  scale.size(2) == kTileGroupScales,
              "4-bit scales must be contiguous [ceil(N / 32), K / 32, 64] float32 or float16");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0),
              "out must be [M, N] float32");
  TORCH_CHECK(out.size(1) <= codes.size(0) * kTilePanels * kLanes, "out has more columns than the panels");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                                    bias.numel() == out.size(1)),
              "bias must be [N] float32");
}

void int4_linear_bits(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const at::Tensor& bias, int64_t x_bits, tandem_cpu::TileHook hook, const void* ctx) {
  check_int4(out, x, codes, scale, bias);
  TORCH_CHECK(x_bits == 8 || x_bits == 16, "x_bits must be 8 or 16, got ", x_bits);
  if (x.size(0) == 0 || out.size(1) == 0) return;
  const float* b = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  const bool half = scale.scalar_type() == at::kHalf;
  const uint16_t* hs = half ? reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()) : nullptr;
  const float* fs = half ? nullptr : scale.data_ptr<float>();
  const bool five = codes.size(2) != kTileGroupBytes;
  // (x_bits, 5-bit codes, float16 scales): each its instantiation.
  const int which = (x_bits == 16 ? 4 : 0) + (five ? 2 : 0) + (half ? 1 : 0);
  switch (which) {
    case 0: int4_linear_typed<false, false>(out, x, codes, fs, b, hook, ctx); break;
    case 1: int4_linear_typed<false, false>(out, x, codes, hs, b, hook, ctx); break;
    case 2: int4_linear_typed<false, true>(out, x, codes, fs, b, hook, ctx); break;
    case 3: int4_linear_typed<false, true>(out, x, codes, hs, b, hook, ctx); break;
    case 4: int4_linear_typed<true, false>(out, x, codes, fs, b, hook, ctx); break;
    case 5: int4_linear_typed<true, false>(out, x, codes, hs, b, hook, ctx); break;
    case 6: int4_linear_typed<true, true>(out, x, codes, fs, b, hook, ctx); break;
    default: int4_linear_typed<true, true>(out, x, codes, hs, b, hook, ctx); break;
  }
}

}  // namespace

namespace tandem_cpu {

void int4_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                 const at::Tensor& bias, TileHook hook, const void* ctx) {
  int4_linear_bits(out, x, codes, scale, bias, g_x_bits.load(std::memory_order_relaxed), hook, ctx);
}

}  // namespace tandem_cpu

namespace {

// out = x @ W.T + bias with x quantized to `x_bits` (0: the process's setting).
void int4_linear_op(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                    const at::Tensor& bias, int64_t x_bits) {
  int4_linear_bits(out, x, codes, scale, bias, x_bits > 0 ? x_bits : g_x_bits.load(), nullptr, nullptr);
}

// The process's x precision for 4-bit products (panel_linear, the native decode loop):
// sets it to `bits` (8 or 16) unless 0; returns the setting before.
int64_t int4_x_bits(int64_t bits) {
  TORCH_CHECK(bits == 0 || bits == 8 || bits == 16, "bits must be 8 or 16 (0: only read), got ", bits);
  return bits == 0 ? g_x_bits.load() : g_x_bits.exchange(static_cast<int>(bits));
}

// x [M, K] float32 -> x' [M, K] float32, x as the kernel quantizes it with `x_bits` (each
// value d' v, rounded to float32): for the reference that multiplies what it multiplies.
at::Tensor int4_quantize_x(const at::Tensor& x, int64_t x_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32");
  TORCH_CHECK(x_bits == 8 || x_bits == 16, "x_bits must be 8 or 16, got ", x_bits);
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of ", kGroup);
  const bool two = x_bits == 16;
  std::vector<int8_t> q(m * (two ? 2 * k : k));
  std::vector<float> d(m * groups), dsum(m * groups);
  if (two)
    quantize_rows<true>(x.data_ptr<float>(), x.stride(0), m, k, q.data(), d.data(), dsum.data());
  else
    quantize_rows<false>(x.data_ptr<float>(), x.stride(0), m, k, q.data(), d.data(), dsum.data());
  at::Tensor out = at::empty({m, k}, at::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t rec = two ? 16 : 8;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kk = 0; kk < k; ++kk) {
      const int8_t* xk = q.data() + r * (two ? 2 * k : k) + (kk / 8) * rec;
      const int32_t v = two ? 256 * xk[kk % 8] + xk[8 + kk % 8] : xk[kk % 8];
      op[r * k + kk] = d[r * groups + kk / kGroup] * static_cast<float>(v);
    }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("int4_linear(Tensor(a!) out, Tensor x, Tensor codes, Tensor scale, Tensor bias, int x_bits=0) -> ()");
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear_op);
  m.def("int4_x_bits(int bits=0) -> int");
  m.impl("int4_x_bits", c10::DispatchKey::CatchAll, &int4_x_bits);
  m.def("int4_quantize_x(Tensor x, int x_bits) -> Tensor");
  m.impl("int4_quantize_x", c10::DispatchKey::CPU, &int4_quantize_x);
}
