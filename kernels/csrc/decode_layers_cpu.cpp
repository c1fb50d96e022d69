// A decode step's decoder layers in one native call (Llama / Qwen2 / Qwen3 on the CPU).
//
// At decode batch sizes a layer's dozen ops each cost a few microseconds of Python and
// dispatch, about as much as their work: 30 layers x ~40 framework calls took 2-6 ms of
// a 20 ms batch-1 step. This loop runs the same kernels in the same order as
// engine_service/models/decoder.py (native RMSNorm with the residual add, panel linear
// layers, rotary, cache write, in-place decode attention, SiLU-and-mul) from C++, with
// the step's buffers allocated once. Every sequence has exactly one new token.
//
// Inputs (T tokens = T sequences, H hidden, L layers):
//   hidden [T, H] float32 (the embeddings), positions [T] int64, slot_mapping [T] int64,
//   block_tables [T, max_blocks] int32, seq_lens [T] int32, token_index = seq_index =
//   [T] int64 (0..T-1), cos_sin_cache [max_pos, head_dim] float32,
//   key_caches / value_caches: L tensors [num_blocks, block_size, kv_heads, head_dim],
//   weights: L x kPerLayer tensors in the order of the Slot enum (absent: empty tensor);
//     a projection's panels, scale and bias go to tandem_cpu::panel_linear as they are, so
//     an int8 scale may be per channel [16P] or per group [P, K / group, 16] (GGUF Q8_0),
//     and uint8 panels with their [ceil(N / 32), K / 32, 64] scales and mins are 4- or 5-bit
//     weights (GGUF Q4_*, Q5_*: int4_linear_cpu.cpp, which quantizes x per 32 columns itself),
//   final_norm [H].
// Returns the final RMSNorm of the residual stream, [T, H].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "vec_math.h"

namespace {

enum Slot : int64_t {
  kInputNorm,
  kPostNorm,
  kQkv,
  kQkvScale,
  kQkvBias,
  kO,
  kOScale,
  kOBias,
  kGateUp,
  kGateUpScale,
  kGateUpBias,
  kDown,
  kDownScale,
  kDownBias,
  kQNorm,
  kKNorm,
  kPerLayer,
};

// out[t, :] = silu(gate_up[t, :I]) * gate_up[t, I:]
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = out.size(0), inter = out.size(1);
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(inter, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * gs;
      const float* ur = gr + inter;
      float* orow = o + r * os;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 g = _mm512_loadu_ps(gr + i);
        const __m512 e = tandem_cpu::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(orow + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(ur + i)));
      }
#endif
#pragma omp simd  // e^-g saturated as exp512 does: 1 / (1 + inf) under -ffast-math is NaN
      for (int64_t j = i; j < inter; ++j) orow[j] = gr[j] / (1.f + std::exp(std::min(-gr[j], 88.f))) * ur[j];
    }
  });
}

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_index,
                         const at::Tensor& seq_index, const at::Tensor& cos_sin_cache, at::TensorList key_caches,
                         at::TensorList value_caches, at::TensorList weights, const at::Tensor& final_norm,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                         double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "hidden must be contiguous float32 [T, H]");
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "expected ", kPerLayer, " weights and one key/value cache per layer");
  const int64_t t = hidden.size(0), h = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::TensorOptions f32 = hidden.options();

  at::Tensor normed = at::empty({t, h}, f32);
  at::Tensor proj = at::empty({t, h}, f32);  // o_proj's, then down_proj's output
  // The residual stream is residual + proj (proj not yet added). Additions write into
  // the stream buffer the stream is not in; the caller's embeddings are never written.
  at::Tensor residual = hidden;
  at::Tensor stream[2] = {at::empty({t, h}, f32), at::empty({t, h}, f32)};
  int next = 0;
  auto add_and_norm = [&](at::Tensor& out, const at::Tensor& weight) {
    tandem_cpu::fused_add_rms_norm(out, stream[next], proj, residual, weight, eps);
    residual = stream[next];
    next ^= 1;
  };
  at::Tensor qkv = at::empty({t, q_size + 2 * kv_size}, f32);
  at::Tensor attn = at::empty({t, num_heads, head_dim}, f32);
  at::Tensor gate_up = at::empty({t, 2 * intermediate}, f32);
  at::Tensor act = at::empty({t, intermediate}, f32);
  // Views of the step's buffers, made once, not per layer (each is a dispatcher call and a
  // tensor allocation).
  const at::Tensor qkv_q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
  const at::Tensor qkv_k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
  const at::Tensor qkv_v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
  const at::Tensor attn_rows = attn.view({t, q_size});

  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    if (l == 0)
      tandem_cpu::rms_norm(normed, hidden, w[kInputNorm], eps);
    else  // the previous layer's MLP output joins the stream
      add_and_norm(normed, w[kInputNorm]);
    tandem_cpu::panel_linear(qkv, normed, w[kQkv], w[kQkvScale], w[kQkvBias]);
    at::Tensor q = qkv_q, k = qkv_k;
    const at::Tensor& v = qkv_v;
    if (w[kQNorm].numel() > 0) {  // Qwen3: per-head RMSNorm of q and k
      at::Tensor qn = at::empty({t * num_heads, head_dim}, f32);
      at::Tensor kn = at::empty({t * num_kv_heads, head_dim}, f32);
      tandem_cpu::rms_norm(qn, q.reshape({-1, head_dim}), w[kQNorm], eps);
      tandem_cpu::rms_norm(kn, k.reshape({-1, head_dim}), w[kKNorm], eps);
      q = qn.view({t, num_heads, head_dim});
      k = kn.view({t, num_kv_heads, head_dim});
    }
    tandem_cpu::rotary_embedding(positions, q, k, cos_sin_cache);
    tandem_cpu::reshape_and_cache(k, v, key_caches[l], value_caches[l], slot_mapping);
    tandem_cpu::paged_attention_decode(q, key_caches[l], value_caches[l], block_tables, seq_lens, token_index,
                                       seq_index, scale, attn);
    tandem_cpu::panel_linear(proj, attn_rows, w[kO], w[kOScale], w[kOBias]);
    add_and_norm(normed, w[kPostNorm]);
    tandem_cpu::panel_linear(gate_up, normed, w[kGateUp], w[kGateUpScale], w[kGateUpBias]);
    silu_and_mul(act, gate_up);
    tandem_cpu::panel_linear(proj, act, w[kDown], w[kDownScale], w[kDownBias]);
  }
  at::Tensor out = at::empty({t, h}, f32);
  add_and_norm(out, final_norm);
  return out;
}

// The op: shapes checked here, the loop above.
void silu_and_mul_op(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1,
              "gate_up must be [T, 2I] float32 with unit column stride");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2,
              "out must be [T, I] float32 with unit column stride");
  silu_and_mul(out, gate_up);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul_op);
  m.def(
      "decode_layers(Tensor hidden, Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor token_index, Tensor seq_index, Tensor cos_sin_cache, Tensor[] key_caches, Tensor[] value_caches, "
      "Tensor[] weights, Tensor final_norm, int num_heads, int num_kv_heads, int head_dim, int intermediate_size, "
      "float eps, "
      "float scale) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
