// Prefill attention on the CPU reading the paged KV cache in place (float32).
//
// Causal attention for the sequences of a step with more than one new token (whole
// prompts and later chunks of a prompt): query token i of a chunk of q_len tokens sits
// at position seq_len - q_len + i and sees the cached keys 0..that position.
//
// Flash-style: a work item is (sequence, KV head, block of kQueryRows query tokens); the
// item's query rows are the block's tokens times the KV head's group of query heads.
// For each cached block of keys (block_size tokens) it
//   1. transposes the block's keys for this KV head into kt[d][block_size], so that one
//      vector holds a query row's scores against every key of the block (broadcast
//      multiply-adds, no horizontal sums);
//   2. keeps an online softmax per row (running max and sum, float32);
//   3. adds the block's probabilities times its values into the row's output.
// Blocks past the item's last query position are skipped; the diagonal ones masked.
//
// Layouts (as kernels/reference.py): query/out [num_tokens, num_heads, head_dim] (row
// stride may be padded), key/value_cache [num_blocks, block_size, num_kv_heads,
// head_dim] contiguous, block_tables [num_seqs, max_blocks] int32, query_start_loc
// [num_seqs + 1] int32, seq_lens [num_seqs] int32, prefill_seqs [P] int64 (the
// sequences to compute; others' rows are left alone).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"
#include "work_stealing.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQueryRows = 32;  // query tokens per work item
constexpr int64_t kBlock = 16;      // cache block size this kernel takes (the engine's default)
constexpr int64_t kSpanBlocks = 4;  // cache blocks per online-softmax update (64 keys)

struct Item {
  int64_t seq, kv_head, q_begin, q_end;  // q_* index the chunk's tokens, 0-based
};

// sc[row, :] = q[row, :] . kt[:, r] for every row and the block's 16 keys r.
// kt [d, 16]: the block's keys transposed. Eight rows at a time: eight independent
// multiply-add chains, one key vector load shared by them.
void block_scores(const float* q, int64_t rows, int64_t d, const float* kt, float* sc, int64_t sc_stride) {
#if defined(__AVX512F__)
  int64_t row = 0;
  for (; row + 8 <= rows; row += 8) {
    __m512 s[8];
    for (int i = 0; i < 8; ++i) s[i] = _mm512_setzero_ps();
    for (int64_t x = 0; x < d; ++x) {
      const __m512 k = _mm512_loadu_ps(kt + x * kBlock);
      for (int i = 0; i < 8; ++i) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[(row + i) * d + x]), k, s[i]);
    }
    for (int i = 0; i < 8; ++i) _mm512_storeu_ps(sc + (row + i) * sc_stride, s[i]);
  }
  for (; row < rows; ++row) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t x = 0;
    for (; x + 2 <= d; x += 2) {
      s0 = _mm512_fmadd_ps(_mm512_set1_ps(q[row * d + x]), _mm512_loadu_ps(kt + x * kBlock), s0);
      s1 = _mm512_fmadd_ps(_mm512_set1_ps(q[row * d + x + 1]), _mm512_loadu_ps(kt + (x + 1) * kBlock), s1);
    }
    for (; x < d; ++x) s0 = _mm512_fmadd_ps(_mm512_set1_ps(q[row * d + x]), _mm512_loadu_ps(kt + x * kBlock), s0);
    _mm512_storeu_ps(sc + row * sc_stride, _mm512_add_ps(s0, s1));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // Six rows at a time: 12 sums (a row's 16 scores are two registers), the key vector's
  // two halves and a broadcast of q fit AVX2's 16 registers.
  int64_t row = 0;
  for (; row + 6 <= rows; row += 6) {
    __m256 s[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
    for (int64_t x = 0; x < d; ++x) {
      const __m256 k0 = _mm256_loadu_ps(kt + x * kBlock), k1 = _mm256_loadu_ps(kt + x * kBlock + 8);
#pragma GCC unroll 6
      for (int i = 0; i < 6; ++i) {
        const __m256 qv = _mm256_broadcast_ss(q + (row + i) * d + x);
        s[i][0] = _mm256_fmadd_ps(qv, k0, s[i][0]);
        s[i][1] = _mm256_fmadd_ps(qv, k1, s[i][1]);
      }
    }
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      _mm256_storeu_ps(sc + (row + i) * sc_stride, s[i][0]);
      _mm256_storeu_ps(sc + (row + i) * sc_stride + 8, s[i][1]);
    }
  }
  for (; row < rows; ++row) {  // two interleaved sets of sums per remaining row
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    int64_t x = 0;
    for (; x + 2 <= d; x += 2) {
      const __m256 q0 = _mm256_broadcast_ss(q + row * d + x), q1 = _mm256_broadcast_ss(q + row * d + x + 1);
      a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kt + x * kBlock), a0);
      a1 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kt + x * kBlock + 8), a1);
      b0 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kt + (x + 1) * kBlock), b0);
      b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kt + (x + 1) * kBlock + 8), b1);
    }
    if (x < d) {
      const __m256 q0 = _mm256_broadcast_ss(q + row * d + x);
      a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kt + x * kBlock), a0);
      a1 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kt + x * kBlock + 8), a1);
    }
    _mm256_storeu_ps(sc + row * sc_stride, _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(sc + row * sc_stride + 8, _mm256_add_ps(a1, b1));
  }
#else
  for (int64_t row = 0; row < rows; ++row) {
    float s[kBlock] = {};
    for (int64_t x = 0; x < d; ++x) {
      const float qx = q[row * d + x];
#pragma omp simd
      for (int64_t r = 0; r < kBlock; ++r) s[r] += qx * kt[x * kBlock + r];
    }
    for (int64_t r = 0; r < kBlock; ++r) sc[row * sc_stride + r] = s[r];
  }
#endif
}

// o[:d] = o * correction + sum_r p[r] * v_r over the first `visible` keys of a span
// of cache blocks (key r lives in block vb[r / kBlock], row r % kBlock).
inline const float* value_row(const float* const* vb, int64_t r, int64_t row_stride) {
  return vb[r / kBlock] + (r % kBlock) * row_stride;
}

#if defined(__AVX512F__)
// d = 16 N: two interleaved sets of N sums (2N multiply-add chains), N known at compile
// time so that the sums stay in registers.
template <int N>
void add_values_fixed(float* o, float correction, const float* p, int64_t visible, const float* const* vb,
                      int64_t row_stride) {
  __m512 a0[N], a1[N];
  const __m512 c = _mm512_set1_ps(correction);
  for (int i = 0; i < N; ++i) {
    a0[i] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * i), c);
    a1[i] = _mm512_setzero_ps();
  }
  int64_t r = 0;
  for (; r + 2 <= visible; r += 2) {
    const __m512 p0 = _mm512_set1_ps(p[r]), p1 = _mm512_set1_ps(p[r + 1]);
    const float* v0 = value_row(vb, r, row_stride);
    const float* v1 = value_row(vb, r + 1, row_stride);
    for (int i = 0; i < N; ++i) {
      a0[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * i), a0[i]);
      a1[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * i), a1[i]);
    }
  }
  if (r < visible) {
    const __m512 p0 = _mm512_set1_ps(p[r]);
    const float* v0 = value_row(vb, r, row_stride);
    for (int i = 0; i < N; ++i) a0[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * i), a0[i]);
  }
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_add_ps(a0[i], a1[i]));
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: o[:8N] over the value rows' columns [col, col + 8N); S interleaved sets of N sums
// (S N <= 8 registers of sums), N and S known at compile time.
template <int N, int S>
void add_values_fixed(float* o, float correction, const float* p, int64_t visible, const float* const* vb,
                      int64_t row_stride, int64_t col) {
  __m256 a[S][N];
  const __m256 c = _mm256_set1_ps(correction);
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
    a[0][i] = _mm256_mul_ps(_mm256_loadu_ps(o + 8 * i), c);
#pragma GCC unroll 4
    for (int j = 1; j < S; ++j) a[j][i] = _mm256_setzero_ps();
  }
  int64_t r = 0;
  for (; r + S <= visible; r += S) {
#pragma GCC unroll 4
    for (int j = 0; j < S; ++j) {
      const __m256 pj = _mm256_set1_ps(p[r + j]);
      const float* v = value_row(vb, r + j, row_stride) + col;
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) a[j][i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), a[j][i]);
    }
  }
  for (; r < visible; ++r) {
    const __m256 pr = _mm256_set1_ps(p[r]);
    const float* v = value_row(vb, r, row_stride) + col;
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) a[0][i] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 8 * i), a[0][i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
#pragma GCC unroll 4
    for (int j = 1; j < S; ++j) a[0][i] = _mm256_add_ps(a[0][i], a[j][i]);
    _mm256_storeu_ps(o + 8 * i, a[0][i]);
  }
}
#endif

void add_values(float* o, int64_t d, float correction, const float* p, int64_t visible, const float* const* vb,
                int64_t row_stride) {
#if defined(__AVX512F__)
  switch (d) {
    case 32: add_values_fixed<2>(o, correction, p, visible, vb, row_stride); return;
    case 64: add_values_fixed<4>(o, correction, p, visible, vb, row_stride); return;
    case 128: add_values_fixed<8>(o, correction, p, visible, vb, row_stride); return;
    default: break;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (d) {
    case 32: add_values_fixed<4, 2>(o, correction, p, visible, vb, row_stride, 0); return;
    case 64: add_values_fixed<8, 1>(o, correction, p, visible, vb, row_stride, 0); return;
    case 128:  // two passes over the keys, 64 columns each
      add_values_fixed<8, 1>(o, correction, p, visible, vb, row_stride, 0);
      add_values_fixed<8, 1>(o + 64, correction, p, visible, vb, row_stride, 64);
      return;
    default: break;
  }
#endif
#pragma omp simd
  for (int64_t x = 0; x < d; ++x) o[x] *= correction;
  for (int64_t r = 0; r < visible; ++r) {
    const float pr = p[r];
    const float* vr = value_row(vb, r, row_stride);
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) o[x] += pr * vr[x];
  }
}

void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& prefill_seqs, double scale, at::Tensor out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "prefill_attention: float32 only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1,
              "query and out must be [num_tokens, heads, head_dim] with contiguous head rows");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.size(3) == query.size(2),
              "key/value cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.size(1) == kBlock, "prefill_attention takes block_size ", kBlock);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  prefill_seqs.scalar_type() == at::kLong && prefill_seqs.is_contiguous(),
              "block_tables/query_start_loc/seq_lens int32, prefill_seqs int64, all contiguous");
  const int64_t num_heads = query.size(1), d = query.size(2);
  constexpr int64_t bs = kBlock;
  const int64_t kvh = key_cache.size(2);
  TORCH_CHECK(num_heads % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t group = num_heads / kvh;
  const int64_t row_stride = kvh * d, block_stride = bs * row_stride;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t* seqs = prefill_seqs.data_ptr<int64_t>();

  std::vector<Item> items;
  for (int64_t p = 0; p < prefill_seqs.numel(); ++p) {
    const int64_t s = seqs[p];
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len <= lens[s] && (lens[s] + bs - 1) / bs <= max_blocks, "sequence ", s,
                ": more query tokens than context, or a context past its block table");
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryRows)
      for (int64_t h = 0; h < kvh; ++h) items.push_back({s, h, q0, std::min(q_len, q0 + kQueryRows)});
  }
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Items differ in cost (a later query chunk sees more keys): threads steal them.
  tandem_cpu::parallel_steal(static_cast<int64_t>(items.size()), at::get_num_threads(), [&](const auto& take) {
    const int64_t max_rows = kQueryRows * group;
    constexpr int64_t span = kSpanBlocks * bs;  // keys per softmax update
    std::vector<float> qs(max_rows * d), acc(max_rows * d), kt(kSpanBlocks * d * bs), sc(max_rows * span);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    std::vector<int64_t> row_pos(max_rows);
    for (int64_t it, range_end; take(it, range_end);) {
      const Item& item = items[it];
      const int64_t len = lens[item.seq], q_len = qsl[item.seq + 1] - qsl[item.seq];
      const int64_t first_pos = len - q_len;  // position of the chunk's token 0
      const int64_t tokens = item.q_end - item.q_begin, rows = tokens * group;
      // Row (t, g): query token item.q_begin + t, head kv_head * group + g; pre-scaled.
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = t * group + g;
          const float* src = q_ptr + (qsl[item.seq] + item.q_begin + t) * q_tok + (item.kv_head * group + g) * q_head;
          float* dst = qs.data() + row * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * fscale;
          row_pos[row] = first_pos + item.q_begin + t;
        }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(row_max.begin(), row_max.begin() + rows, neg_inf);
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
      const int64_t key_end = first_pos + item.q_end;  // keys past the item's last query are unseen
      const int32_t* blocks = bt + item.seq * max_blocks;
      for (int64_t k0 = 0; k0 < key_end; k0 += span) {
        const int64_t nk = std::min(span, key_end - k0);  // keys of this span anyone sees
        const int64_t nb = (nk + bs - 1) / bs;
        const float* vb[kSpanBlocks];
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t block = blocks[k0 / bs + b];
          const float* kb = k_ptr + block * block_stride + item.kv_head * d;
          vb[b] = v_ptr + block * block_stride + item.kv_head * d;
          const int64_t rows_here = std::min(bs, nk - b * bs);
          float* ktb = kt.data() + b * d * bs;
          for (int64_t r = 0; r < rows_here; ++r)
            for (int64_t x = 0; x < d; ++x) ktb[x * bs + r] = kb[r * row_stride + x];
          for (int64_t r = rows_here; r < bs; ++r)
            for (int64_t x = 0; x < d; ++x) ktb[x * bs + r] = 0.f;
        }
        // Rows before first_row see none of this span (their position is before k0).
        int64_t first_row = 0;
        while (first_row < rows && row_pos[first_row] < k0) ++first_row;
        for (int64_t b = 0; b < nb; ++b)
          block_scores(qs.data() + first_row * d, rows - first_row, d, kt.data() + b * d * bs,
                       sc.data() + first_row * span + b * bs, span);
        for (int64_t row = first_row; row < rows; ++row) {
          const int64_t visible = std::min(nk, row_pos[row] - k0 + 1);
          float* p = sc.data() + row * span;
          const float m = tandem_cpu::max_of(p, visible, row_max[row]);
          const float correction = std::exp(row_max[row] - m);  // 0 on the first span (-inf)
          const float sum = tandem_cpu::exp_shift_sum(p, visible, m);
          row_max[row] = m;
          row_sum[row] = row_sum[row] * correction + sum;
          add_values(acc.data() + row * d, d, correction, p, visible, vb, row_stride);
        }
      }
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = t * group + g;
          const float inv = 1.f / row_sum[row];
          float* dst = o_ptr + (qsl[item.seq] + item.q_begin + t) * o_tok + (item.kv_head * group + g) * o_head;
          const float* o = acc.data() + row * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) dst[x] = o[x] * inv;
        }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor prefill_seqs, float scale, Tensor(a!) out) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention);
}
