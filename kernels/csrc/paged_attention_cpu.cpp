// Native CPU kernels of the `cpu` backend (contracts in kernels/reference.py):
//   paged_attention_decode  decode attention reading the paged KV cache in place;
//   rms_norm / fused_add_rms_norm, rotary_embedding, reshape_and_cache: each one pass
//   over its rows where the PyTorch reference takes 5-20 elementwise ops per layer;
//   argmax_rows: greedy sampling (torch's CPU argmax is not vectorized: 1.7 ms for
//   [64, 49152] float32 on the bench machine, 6x its amax);
//   apply_token_bitmask: a structured-output grammar's token mask applied to the logits;
//   seeded_uniform: seeded sampling's counter-based uniforms (SplitMix64), ~10x numpy.
//
// Decode attention on CPU that reads the paged KV cache in place.
//
// One query token per sequence (the decode case): for each (sequence, KV head) pair the
// kernel computes the scores of the KV head's query group against the sequence's cached
// keys block by block, a float32 softmax, and the weighted sum of the cached values.
// Nothing is gathered or padded: only the seq_len rows a sequence owns are read, once.
//
// Layouts (as in kernels/reference.py):
//   query, out      [num_tokens, num_heads, head_dim]          (row stride may be padded)
//   key/value_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   block_tables    [num_seqs, max_blocks_per_seq] int32
//   seq_lens        [num_seqs] int32: tokens in the cache, the new one included
//   token_index     [b] int64: row of query/out of decode sequence i
//   seq_index       [b] int64: row of block_tables/seq_lens of decode sequence i
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "vec_math.h"
#include "work_stealing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

template <int64_t D, typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  if constexpr (D > 0) d = D;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <int64_t D, typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
  if constexpr (D > 0) d = D;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * static_cast<float>(v[i]);
}

// Ask for one cached row (all KV heads of a token), a cache line at a time.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// D: head_dim known at compile time (fully unrolled inner loops), or 0 for any.
template <typename T, int64_t D>
void decode_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& token_index,
                   const at::Tensor& seq_index, double scale, at::Tensor& out) {
  const int64_t b = token_index.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_tok_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_tok_stride = out.stride(0), o_head_stride = out.stride(1);
  const int64_t row_stride = num_kv_heads * head_dim;  // one cached token, all KV heads
  const int64_t block_stride = block_size * row_stride;

  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = seq_lens.data_ptr<int32_t>();
  const int64_t* tok_ptr = token_index.data_ptr<int64_t>();
  const int64_t* seq_ptr = seq_index.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // One work unit = a run of one decode sequence's cached blocks, all its KV heads: a
  // block is read as whole contiguous rows (every KV head of a token together), in
  // block-table order, with the next block prefetched (blocks sit anywhere in the cache,
  // so the hardware prefetcher cannot find the next one). A unit leaves each query
  // head's running max m, sum l of exp(score - m) and unnormalized sum acc of exp(score -
  // m) * v; a sequence that is one unit writes acc / l at once, one split into several
  // (fewer sequences than threads: batch 1) is merged after the parallel region, so a
  // single stream's attention runs on every thread instead of one. Units are split
  // between threads by their token counts, not their number.
  struct Unit {
    int64_t i, j0, j1;  // decode sequence; its blocks [j0, j1)
    int64_t slot;       // partial results' slot, -1: written to out directly
  };
  const int64_t threads = at::get_num_threads();
  const int64_t per_token = head_dim * (num_heads + num_kv_heads);
  int64_t total_len = 0;
  for (int64_t i = 0; i < b; ++i) total_len += len_ptr[seq_ptr[i]];
  // Split sequences only when there are fewer than threads and enough work to pay for a
  // parallel region: ~128k multiply-adds, ~170 tokens of a 9-head, 3-KV-head, d=64 model
  // (measured on a 2-core Zen 3, one sequence whose blocks come from memory: 128 tokens
  // 16-19 us either way; 450 tokens 62-94 -> 50-64 us; 2000 tokens 398-424 -> 236-261 us).
  const int64_t parts = b < threads && total_len * per_token >= (int64_t{1} << 17) ? (threads + b - 1) / b : 1;
  std::vector<Unit> units;
  std::vector<int64_t> unit_end;  // prefix sums of the units' token counts
  units.reserve(b * parts);
  unit_end.reserve(b * parts);
  int64_t num_slots = 0, covered = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = len_ptr[seq_ptr[i]];
    const int64_t num_blocks_used = (len + block_size - 1) / block_size;
    const int64_t p = std::min(parts, num_blocks_used);
    for (int64_t u = 0; u < p; ++u) {
      const int64_t j0 = num_blocks_used * u / p, j1 = num_blocks_used * (u + 1) / p;
      units.push_back({i, j0, j1, p > 1 ? num_slots++ : -1});
      unit_end.push_back(covered += std::min(j1 * block_size, len) - j0 * block_size);
    }
  }
  const int64_t n_units = static_cast<int64_t>(units.size());
  std::vector<float> part_stats(num_slots * num_heads * 2);         // [slot, head]: m, l
  std::vector<float> part_acc(num_slots * num_heads * head_dim);   // [slot, head, head_dim]

  const int64_t max_chunks = std::max<int64_t>(1, (total_len * per_token) >> 18);
  const int64_t chunks = std::min<int64_t>({n_units, std::max(max_chunks, parts > 1 ? n_units : 1), 4 * threads});
  // Chunks of units with equal token counts; threads take chunks, stealing (work_stealing.h).
  tandem_cpu::parallel_steal(chunks, threads, [&](const auto& take) {
    std::vector<float> q(num_heads * head_dim);    // [num_heads, head_dim], pre-scaled
    std::vector<float> acc(num_heads * head_dim);  // [num_heads, head_dim]
    std::vector<float> stats(num_heads * 2);       // [num_heads]: m, l
    std::vector<float> scores;                     // [num_heads, tokens of the unit]
    for (int64_t chunk, chunks_end; take(chunk, chunks_end);) {
      // The units whose last token falls in this chunk's share of the total.
      const int64_t lo = total_len * chunk / chunks, hi = total_len * (chunk + 1) / chunks;
      const int64_t first = chunk == 0 ? 0 : std::upper_bound(unit_end.begin(), unit_end.end(), lo) - unit_end.begin();
      const int64_t last =
          chunk + 1 == chunks ? n_units : std::upper_bound(unit_end.begin(), unit_end.end(), hi) - unit_end.begin();
      for (int64_t w = first; w < last; ++w) {
        const Unit& unit = units[w];
        const int64_t tok = tok_ptr[unit.i], seq = seq_ptr[unit.i];
        const int64_t len = len_ptr[seq];
        const int32_t* blocks = bt_ptr + seq * max_blocks;
        const int64_t t0 = unit.j0 * block_size, n = std::min(unit.j1 * block_size, len) - t0;
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const T* src = q_ptr + tok * q_tok_stride + hq * q_head_stride;
          for (int64_t x = 0; x < head_dim; ++x) q[hq * head_dim + x] = static_cast<float>(src[x]) * fscale;
        }
        // fn(t, row) for the unit's cached rows t = 0..n-1 of `cache` (token t0 + t, every
        // KV head), block by block; row r of the next block is asked for with row r of this.
        auto for_each_row = [&](const T* cache, const auto& fn) {
          for (int64_t start = 0, j = unit.j0; start < n; start += block_size, ++j) {
            const T* row = cache + blocks[j] * block_stride;
            const T* next = j + 1 < unit.j1 ? cache + blocks[j + 1] * block_stride : nullptr;
            const int64_t rows = std::min(block_size, n - start);
            for (int64_t r = 0; r < rows; ++r, row += row_stride) {
              if (next) prefetch_row(next + r * row_stride, row_stride * static_cast<int64_t>(sizeof(T)));
              fn(start + r, row);
            }
          }
        };
        scores.resize(num_heads * n);
        // Pass 1: scores[hq, t] = q_hq . k_(t0 + t)[hq / group]
        for_each_row(k_ptr, [&](int64_t t, const T* k) {
          for (int64_t hq = 0; hq < num_heads; ++hq)
            scores[hq * n + t] = dot<D>(q.data() + hq * head_dim, k + (hq / group) * head_dim, head_dim);
        });
        // scores -> exp(score - m) per query head, in float32; l = their sum.
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          float* sc = scores.data() + hq * n;
          stats[2 * hq] = tandem_cpu::max_of(sc, n, sc[0]);  // n >= 1
          stats[2 * hq + 1] = tandem_cpu::exp_shift_sum(sc, n, stats[2 * hq]);
        }
        // Pass 2: acc[hq] = sum_t exp(score - m)[hq, t] * v_(t0 + t)[hq / group]
        std::fill(acc.begin(), acc.end(), 0.f);
        for_each_row(v_ptr, [&](int64_t t, const T* v) {
          for (int64_t hq = 0; hq < num_heads; ++hq)
            axpy<D>(scores[hq * n + t], v + (hq / group) * head_dim, acc.data() + hq * head_dim, head_dim);
        });
        if (unit.slot >= 0) {
          std::copy(stats.begin(), stats.end(), part_stats.begin() + unit.slot * num_heads * 2);
          std::copy(acc.begin(), acc.end(), part_acc.begin() + unit.slot * num_heads * head_dim);
          continue;
        }
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          T* dst = o_ptr + tok * o_tok_stride + hq * o_head_stride;
          const float inv = 1.f / stats[2 * hq + 1];
          for (int64_t x = 0; x < head_dim; ++x) dst[x] = static_cast<T>(acc[hq * head_dim + x] * inv);
        }
      }
    }
  });
  // Merge the split sequences' units (consecutive, in block order): with M the units'
  // largest m, out = sum_u e^(m_u - M) acc_u / sum_u e^(m_u - M) l_u.
  std::vector<float> merged(head_dim);
  for (int64_t w = 0; w < n_units;) {
    int64_t end = w + 1;
    while (end < n_units && units[end].i == units[w].i) ++end;
    if (units[w].slot >= 0) {
      const int64_t tok = tok_ptr[units[w].i];
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        float big = -std::numeric_limits<float>::infinity();
        for (int64_t u = w; u < end; ++u) big = std::max(big, part_stats[(units[u].slot * num_heads + hq) * 2]);
        float l = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t u = w; u < end; ++u) {
          const float* st = part_stats.data() + (units[u].slot * num_heads + hq) * 2;
          const float f = std::exp(st[0] - big);
          l += f * st[1];
          axpy<D>(f, part_acc.data() + (units[u].slot * num_heads + hq) * head_dim, merged.data(), head_dim);
        }
        T* dst = o_ptr + tok * o_tok_stride + hq * o_head_stride;
        for (int64_t x = 0; x < head_dim; ++x) dst[x] = static_cast<T>(merged[x] / l);
      }
    }
    w = end;
  }
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& token_index, const at::Tensor& seq_index, const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &key_cache, &value_cache, &block_tables, &seq_lens, &token_index,
                              &seq_index, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention_decode: every tensor must be on the CPU");
  }
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out rows must be contiguous in head_dim");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key/value cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "query, caches and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be contiguous int32");
  TORCH_CHECK(token_index.scalar_type() == at::kLong && seq_index.scalar_type() == at::kLong &&
                  token_index.is_contiguous() && seq_index.is_contiguous() &&
                  token_index.numel() == seq_index.numel(),
              "token_index and seq_index must be contiguous int64 of the same length");
}

void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& token_index,
                            const at::Tensor& seq_index, double scale, at::Tensor out) {
  check_inputs(query, key_cache, value_cache, block_tables, seq_lens, token_index, seq_index, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_decode", [&] {
    const int64_t d = query.size(2);
    if (d == 64) {
      decode_kernel<scalar_t, 64>(query, key_cache, value_cache, block_tables, seq_lens, token_index, seq_index,
                                  scale, out);
    } else if (d == 128) {
      decode_kernel<scalar_t, 128>(query, key_cache, value_cache, block_tables, seq_lens, token_index, seq_index,
                                   scale, out);
    } else {
      decode_kernel<scalar_t, 0>(query, key_cache, value_cache, block_tables, seq_lens, token_index, seq_index,
                                 scale, out);
    }
  });
}

// ---- elementwise ops ----------------------------------------------------------------

// Rows of `d` elements per parallel chunk: small batches (decode) stay on one thread,
// where a parallel region would cost more than the work.
inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)); }

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t d) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == d && t.stride(1) == 1,
              name, " must be [rows, d] with contiguous rows");
}

// out[r] = x[r] / rms(x[r]) * weight; with a residual: h = x + residual is written to
// residual_out and normalized instead. float32 math, outputs in x's dtype.
template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out,
                     const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* r_ptr = residual ? residual->data_ptr<T>() : nullptr;
  T* ro_ptr = residual_out ? residual_out->data_ptr<T>() : nullptr;
  const T* w_ptr = weight.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t rs = residual ? residual->stride(0) : 0, ros = residual_out ? residual_out->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_ptr + r * xs;
      float ss = 0.f;
      if (r_ptr) {
        const T* rr = r_ptr + r * rs;
        T* ror = ro_ptr + r * ros;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; ++i) {
          const float v = static_cast<float>(xr[i]) + static_cast<float>(rr[i]);
          h[i] = v;
          ror[i] = static_cast<T>(v);
          ss += v * v;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; ++i) {
          const float v = static_cast<float>(xr[i]);
          h[i] = v;
          ss += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + feps);
      T* orow = o_ptr + r * os;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) orow[i] = static_cast<T>(h[i] * inv * static_cast<float>(w_ptr[i]));
    }
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  check_rows(x, "x", rows, d);
  check_rows(out, "out", rows, d);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous(), "weight must be [d], contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, weight and out must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(out, x, nullptr, nullptr, weight, eps);
  });
}

void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  check_rows(x, "x", rows, d);
  check_rows(out, "out", rows, d);
  check_rows(residual, "residual", rows, d);
  check_rows(residual_out, "residual_out", rows, d);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous(), "weight must be [d], contiguous");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &residual, &residual_out, &weight}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "x, residual, weight and outputs must share a dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(out, x, &residual, &residual_out, weight, eps);
  });
}

// Neox-style rotary embedding (rotate halves) in place on t [num_tokens, heads, head_dim].
template <typename T>
void rotate(at::Tensor& t, const int64_t* pos, const float* cache, int64_t cache_stride) {
  const int64_t n = t.size(0), heads = t.size(1), half = t.size(2) / 2;
  const int64_t ts = t.stride(0), hs = t.stride(1);
  T* base = t.data_ptr<T>();
  at::parallel_for(0, n, row_grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* cos = cache + pos[i] * cache_stride;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = base + i * ts + h * hs;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = static_cast<float>(x1[j]), b = static_cast<float>(x2[j]);
          x1[j] = static_cast<T>(a * cos[j] - b * sin[j]);
          x2[j] = static_cast<T>(b * cos[j] + a * sin[j]);
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(positions.device().is_cpu() && query.device().is_cpu() && key.device().is_cpu() &&
                  cos_sin_cache.device().is_cpu(),
              "rotary_embedding: every tensor must be on the CPU");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous(),
              "positions must be contiguous int64 [num_tokens]");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == positions.size(0) &&
                  key.size(0) == positions.size(0) && query.size(2) == key.size(2) && query.size(2) % 2 == 0,
              "query/key must be [num_tokens, heads, head_dim] with an even head_dim");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "query/key rows must be contiguous in head_dim");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.stride(1) == 1 && cos_sin_cache.size(1) == query.size(2),
              "cos_sin_cache must be float32 [max_position, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t i = 0; i < positions.size(0); ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " is outside the rotary cache");
  }
  const float* cache = cos_sin_cache.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    rotate<scalar_t>(query, pos, cache, cos_sin_cache.stride(0));
    rotate<scalar_t>(key, pos, cache, cos_sin_cache.stride(0));
  });
}

// key/value [num_tokens, kv_heads, head_dim] -> cache slot slot_mapping[t]; slots < 0 skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&key, &value, &key_cache, &value_cache, &slot_mapping}) {
    TORCH_CHECK(t->device().is_cpu(), "reshape_and_cache: every tensor must be on the CPU");
  }
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key/value cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  const int64_t n = key.size(0), kvh = key_cache.size(2), d = key_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == kvh && key.size(2) == d,
              "key/value must be [num_tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == d && value.stride(2) == 1 && value.stride(1) == d,
              "key/value heads must be contiguous within a token");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key, value and caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == n &&
                  slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [num_tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slots[i] < num_slots, "slot ", slots[i], " is outside the cache (", num_slots, " slots)");
  }
  const int64_t row = kvh * d;
  const int64_t bytes = row * key.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  at::parallel_for(0, n, row_grain(row), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      std::memcpy(kc + slots[i] * bytes, k + i * ks, bytes);
      std::memcpy(vc + slots[i] * bytes, v + i * vs, bytes);
    }
  });
}

// (best, idx) = the largest of n lane candidates, the smallest index among equals.
inline void merge_lanes(const float* vals, const int32_t* poss, int64_t n, float& best, int64_t& idx) {
  best = vals[0];
  idx = poss[0];
  for (int64_t l = 1; l < n; ++l)
    if (vals[l] > best || (vals[l] == best && poss[l] < idx)) {
      best = vals[l];
      idx = poss[l];
    }
}

// First index of the largest of x[0..v). Rows with NaNs (undefined under -ffast-math)
// still get an index inside the row.
// AVX-512 (AVX2): one pass, four chains of sixteen (eight) lanes each keeping their running
// max and its index (a strict > keeps a lane's first occurrence); ties between lanes go to
// the smaller index. Portable: two passes the compiler vectorizes (the max, then a scan
// for it).
inline int64_t argmax_row(const float* x, int64_t v) {
  int64_t i = 0;
  float best = x[0];
  int64_t idx = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  constexpr int64_t L = 16, C = 4;
  if (v >= L * C) {
    __m512 val[C];
    __m512i pos[C];
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int c = 0; c < C; ++c) {
      val[c] = _mm512_loadu_ps(x + c * L);
      pos[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(c * L)));
    }
    for (i = L * C; i + L * C <= v; i += L * C) {
      for (int c = 0; c < C; ++c) {
        const __m512 xv = _mm512_loadu_ps(x + i + c * L);
        const __mmask16 gt = _mm512_cmp_ps_mask(xv, val[c], _CMP_GT_OQ);
        val[c] = _mm512_mask_blend_ps(gt, val[c], xv);
        pos[c] = _mm512_mask_blend_epi32(gt, pos[c], _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(i + c * L))));
      }
    }
    alignas(64) float vals[C * L];
    alignas(64) int32_t poss[C * L];
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(vals + c * L, val[c]);
      _mm512_store_epi32(poss + c * L, pos[c]);
    }
    merge_lanes(vals, poss, C * L, best, idx);
  }
#else
  // AVX2: the same one pass in eight-lane registers: a compare and two blends per vector.
  constexpr int64_t L = 8, C = 4;
  if (v >= L * C) {
    __m256 val[C];
    __m256i pos[C];
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int c = 0; c < C; ++c) {
      val[c] = _mm256_loadu_ps(x + c * L);
      pos[c] = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(c * L)));
    }
    for (i = L * C; i + L * C <= v; i += L * C) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256 xv = _mm256_loadu_ps(x + i + c * L);
        const __m256 gt = _mm256_cmp_ps(xv, val[c], _CMP_GT_OQ);
        val[c] = _mm256_blendv_ps(val[c], xv, gt);
        const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(i + c * L)));
        pos[c] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(pos[c]), _mm256_castsi256_ps(at), gt));
      }
    }
    alignas(32) float vals[C * L];
    alignas(32) int32_t poss[C * L];
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(vals + c * L, val[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(poss + c * L), pos[c]);
    }
    merge_lanes(vals, poss, C * L, best, idx);
  }
#endif
  for (; i < v; ++i)
    if (x[i] > best) {
      best = x[i];
      idx = i;
    }
  return idx;
#else
  constexpr int64_t L = 16;  // lanes: the compiler keeps these in one vector register
  const int64_t body = v - v % L;
  float lane[L];
  for (int64_t l = 0; l < L; ++l) lane[l] = x[0];
  for (i = 0; i < body; i += L)
    for (int64_t l = 0; l < L; ++l) lane[l] = lane[l] > x[i + l] ? lane[l] : x[i + l];
  for (int64_t l = 0; l < L; ++l) best = lane[l] > best ? lane[l] : best;
  for (i = body; i < v; ++i) best = x[i] > best ? x[i] : best;
  for (i = 0; i < body; i += L) {  // the first block holding the max, a vector compare per block
    bool hit = false;
    for (int64_t l = 0; l < L; ++l) hit |= x[i + l] == best;
    if (hit) break;
  }
  for (; i < v; ++i)
    if (x[i] == best) {
      idx = i;
      break;
    }
  return idx;
#endif
}

// out[r] = argmax_row(logits[r]).
void argmax_rows(const at::Tensor& logits, at::Tensor out) {
  TORCH_CHECK(logits.device().is_cpu() && out.device().is_cpu(), "argmax_rows: tensors must be on the CPU");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == logits.size(0) && out.is_contiguous(),
              "out must be contiguous int64 [rows]");
  const int64_t rows = logits.size(0), v = logits.size(1), stride = logits.stride(0);
  const float* base = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * stride, v);
  });
}

// Structured output: logits[rows[k], t] = -inf for every token t whose bit in
// bitmask[k] is 0 (bit t % 32 of int32 word t / 32, llguidance's layout). Words with
// every bit set (most of a permissive mask) are skipped with one compare.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu() && rows.device().is_cpu(),
              "apply_token_bitmask: tensors must be on the CPU");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be contiguous int32 [K, words]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "rows must be contiguous int64 [K]");
  const int64_t k = bitmask.size(0), words = bitmask.size(1), v = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(words * 32 >= v, "bitmask has ", words, " words, too few for a vocabulary of ", v);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "rows[", i, "]=", r[i], " is outside the logits");
  }
  float* base = logits.data_ptr<float>();
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, k, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* x = base + r[i] * stride;
      const uint32_t* m = mask + i * words;
      for (int64_t w = 0; w * 32 < v; ++w) {
        const uint32_t word = m[w];
        if (word == 0xffffffffu) continue;
        const int64_t lo = w * 32, n = std::min<int64_t>(32, v - lo);
        float* y = x + lo;
        if (n == 32) {  // a branch-free select the compiler vectorizes
          for (int64_t j = 0; j < 32; ++j) y[j] = ((word >> j) & 1u) ? y[j] : neg_inf;
        } else {
          for (int64_t j = 0; j < n; ++j) y[j] = ((word >> j) & 1u) ? y[j] : neg_inf;
        }
      }
    }
  });
}

// out[i, v] = U(splitmix64 state offsets[i] + (v + 1) * GAMMA): seeded sampling's
// uniforms (contract and why in kernels/reference.py, seeded_uniform). uint64 arithmetic
// wraps by definition; the loop over v vectorizes (64-bit multiplies).
void seeded_uniform(at::Tensor out, const at::Tensor& offsets) {
  TORCH_CHECK(out.device().is_cpu() && offsets.device().is_cpu(), "seeded_uniform: tensors must be on the CPU");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "out must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                  offsets.size(0) == out.size(0),
              "offsets must be contiguous int64 [rows]");
  const int64_t rows = out.size(0), v = out.size(1);
  const uint64_t* off = reinterpret_cast<const uint64_t*>(offsets.data_ptr<int64_t>());
  float* base = out.data_ptr<float>();
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (v + kChunk - 1) / kChunk;
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t r = c / chunks, lo = (c % chunks) * kChunk, hi = std::min(v, lo + kChunk);
      const uint64_t start = off[r] + static_cast<uint64_t>(lo + 1) * kGamma;
      float* y = base + r * v;
      for (int64_t i = lo; i < hi; ++i) {
        uint64_t z = start + static_cast<uint64_t>(i - lo) * kGamma;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        y[i] = (static_cast<float>(z >> 41) + 0.5f) * (1.0f / 8388608.0f);
      }
    }
  });
}

}  // namespace

namespace tandem_cpu {  // entry points for other translation units (cpu_kernels.h)

void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& token_index, const at::Tensor& seq_index, double scale,
                            at::Tensor out) {
  ::paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, token_index, seq_index, scale,
                           out);
}
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  ::rms_norm(out, x, weight, eps);
}
void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  ::fused_add_rms_norm(out, residual_out, x, residual, weight, eps);
}
void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key,
                      const at::Tensor& cos_sin_cache) {
  ::rotary_embedding(positions, query, key, cos_sin_cache);
}
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping) {
  ::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
}

}  // namespace tandem_cpu

TORCH_LIBRARY(tandem_cpu, m) {
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor token_index, Tensor seq_index, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_attention_decode", c10::DispatchKey::CPU, &paged_attention_decode);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def(
      "fused_add_rms_norm(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor residual, Tensor weight, "
      "float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.impl("reshape_and_cache", c10::DispatchKey::CPU, &reshape_and_cache);
  m.def("argmax_rows(Tensor logits, Tensor(a!) out) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.impl("apply_token_bitmask", c10::DispatchKey::CPU, &apply_token_bitmask);
  m.def("seeded_uniform(Tensor(a!) out, Tensor offsets) -> ()");
  m.impl("seeded_uniform", c10::DispatchKey::CPU, &seeded_uniform);
}
