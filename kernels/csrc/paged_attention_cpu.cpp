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

#include <algorithm>
#include <cmath>
#include <vector>

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

  // One work item = (decode sequence i, KV head h).
  at::parallel_for(0, b * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim);   // [group, head_dim], pre-scaled
    std::vector<float> acc(group * head_dim);  // [group, head_dim]
    std::vector<float> scores;                 // [group, seq_len]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t tok = tok_ptr[i], seq = seq_ptr[i];
      const int64_t len = len_ptr[seq];
      const int32_t* blocks = bt_ptr + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + tok * q_tok_stride + (h * group + g) * q_head_stride;
        for (int64_t x = 0; x < head_dim; ++x) q[g * head_dim + x] = static_cast<float>(src[x]) * fscale;
      }
      scores.resize(group * len);
      // Pass 1: scores[g, t] = q_g . k_t
      for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
        const T* k = k_ptr + blocks[j] * block_stride + h * head_dim;
        const int64_t rows = std::min(block_size, len - start);
        for (int64_t r = 0; r < rows; ++r, k += row_stride) {
          for (int64_t g = 0; g < group; ++g) scores[g * len + start + r] = dot<D>(q.data() + g * head_dim, k, head_dim);
        }
      }
      // Softmax per query head, in float32.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float m = s[0];  // len >= 1: the new token itself
        for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: acc[g] = sum_t p[g, t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
        const T* v = v_ptr + blocks[j] * block_stride + h * head_dim;
        const int64_t rows = std::min(block_size, len - start);
        for (int64_t r = 0; r < rows; ++r, v += row_stride) {
          for (int64_t g = 0; g < group; ++g) axpy<D>(scores[g * len + start + r], v, acc.data() + g * head_dim, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o_ptr + tok * o_tok_stride + (h * group + g) * o_head_stride;
        for (int64_t x = 0; x < head_dim; ++x) dst[x] = static_cast<T>(acc[g * head_dim + x]);
      }
    }
  });
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

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor token_index, Tensor seq_index, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_attention_decode", c10::DispatchKey::CPU, &paged_attention_decode);
}
