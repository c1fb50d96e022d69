// Mixture-of-experts MLP over panel-packed expert weights (kernels/moe.py packs them):
//   out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j].
//
// Layouts:
//   x          [T, H] float32, rows contiguous (row stride may exceed H)
//   w13        the experts' gate and up projections, panel by panel interleaved:
//              float32 [E, P13, H, 16] or int8 [E, P13, ceil(H / 2), 32] (panel_linear_cpu.cpp's
//              panel layouts), P13 = 2 ceil(I / 16); expert e's panel 2q holds gate rows
//              16q..16q+15, panel 2q + 1 up rows 16q..16q+15 (rows past I zero), so one tile
//              (2 panels) yields gate and up of the same 16 intermediate columns
//   w13_scale  int8: [E, 16 P13] float32 per-channel scales in the same interleaved order;
//              float32 panels: empty
//   w2         the down projections: float32 [E, P2, I, 16] or int8 [E, P2, ceil(I / 2), 32],
//              P2 = ceil(H / 16)
//   w2_scale   int8: [E, 16 P2] float32; float32 panels: empty
//   weights    [T, k] float32 routing weights;  ids [T, k] int32 or int64 expert ids
//   out        [T, H] float32, rows contiguous
//
// The T k (token, choice) slots are grouped by expert (a counting sort, stable in slot
// order) and their rows of x gathered into that order, so each expert's rows are one
// block. Then, with no loop over experts outside the parallel regions:
//   1. gate/up: work items (expert, chunk of its rows, tile of P13) split between threads
//      with stealing (work_stealing.h); each runs panel_linear's tile loop into a small
//      [rows, 32] buffer and writes silu(gate) * up of its 16 intermediate columns
//   2. down: items (expert, chunk, tile of P2), each writing its columns of y, one row
//      per slot
//   3. out[t] = sum_j w[t, j] y[slot (t, j)], in float32, choices in order: a weighted
//      gather rather than a scatter-add, so no two threads write one output row and the
//      result does not depend on the thread count
// int8 weights run panel_linear's int8 loops: x (and the activation, before the down
// projection) rounded to 16 bits per row and block of 256 k; the AVX2 build runs an
// expert with panel_int8_as_float_rows() rows or more through dequantized tiles instead,
// as panel_linear does for a product of that many rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "work_stealing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace {

constexpr int64_t kTileCols = tandem_cpu::kPanelTilePanels * tandem_cpu::kPanelLanes;  // 32
constexpr int64_t kHalf = tandem_cpu::kPanelLanes;  // intermediate columns per gate/up tile

struct Item {
  int32_t expert;
  int32_t tile;
  int64_t r0;    // first row, within the expert's block
  int64_t rows;
};

// Items (expert, chunk of `chunk` rows, tile) for every expert with rows, in that order
// (consecutive tiles of an expert are consecutive in memory); `work`: multiply-adds.
std::vector<Item> make_items(const std::vector<int64_t>& count, int64_t chunk, int64_t tiles, int64_t k_size,
                             int64_t& work) {
  std::vector<Item> items;
  work = 0;
  for (size_t e = 0; e < count.size(); ++e) {
    for (int64_t r0 = 0; r0 < count[e]; r0 += chunk) {
      const int64_t rows = std::min(chunk, count[e] - r0);
      for (int64_t t = 0; t < tiles; ++t) items.push_back({static_cast<int32_t>(e), static_cast<int32_t>(t), r0, rows});
      work += rows * tiles * kTileCols * k_size;
    }
  }
  return items;
}

// Threads for `work` multiply-adds: one per ~64k (a thread hand-off costs about that).
int64_t shares_for(int64_t work, int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), items, work / 65536}));
}

// act[r, :16] = silu(gu[r, :16]) * gu[r, 16:32] for `rows` rows of a [rows, 32] buffer.
inline void silu_mul_tile(const float* gu, int64_t rows, float* act, int64_t lda) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * kTileCols;
    float* a = act + r * lda;
#if defined(__AVX512F__)
    const __m512 gv = _mm512_loadu_ps(g);
    const __m512 e = tandem_cpu::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                      _mm512_loadu_ps(g + kHalf)));
#else
#pragma omp simd  // e^-g saturated as exp512 does: 1 / (1 + inf) under -ffast-math is NaN
    for (int64_t j = 0; j < kHalf; ++j) a[j] = g[j] / (1.f + std::exp(std::min(-g[j], 88.f))) * g[kHalf + j];
#endif
  }
}

template <typename Id>
void group_slots(const Id* ids, int64_t slots, int64_t num_experts, std::vector<int64_t>& count,
                 std::vector<int64_t>& start, std::vector<int64_t>& order, std::vector<int64_t>& where) {
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t e = static_cast<int64_t>(ids[s]);
    TORCH_CHECK(e >= 0 && e < num_experts, "topk_ids holds expert ", e, ", outside [0, ", num_experts, ")");
    ++count[e];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] = start[e] + count[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t pos = fill[static_cast<int64_t>(ids[s])]++;
    order[pos] = s;
    where[s] = pos;
  }
}

void check_panels(const at::Tensor& w, const at::Tensor& scale, int64_t k_size, bool int8, const char* name) {
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous(), name, " must be contiguous [E, P, K, 16] or [E, P, ceil(K / 2), 32]");
  TORCH_CHECK(w.scalar_type() == (int8 ? at::kChar : at::kFloat), name, ": both weights must be float32 or int8");
  TORCH_CHECK(w.size(2) == (int8 ? (k_size + 1) / 2 : k_size) && w.size(3) == (int8 ? 2 : 1) * tandem_cpu::kPanelLanes,
              name, " ", w.sizes(), " does not take inputs of ", k_size, " features");
  if (int8) {
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                    scale.size(0) == w.size(0) && scale.size(1) == w.size(1) * tandem_cpu::kPanelLanes,
                name, "'s scale must be [E, 16 P] float32");
  } else {
    TORCH_CHECK(scale.numel() == 0, name, ": float32 panels take no scale");
  }
}

void moe_panels(at::Tensor out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w13_scale,
                const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& topk_weights,
                const at::Tensor& topk_ids, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [T, H] float32");
  const int64_t t_count = x.size(0), h = x.size(1);
  const bool int8 = w13.scalar_type() == at::kChar;
  TORCH_CHECK(inter > 0 && w13.dim() == 4 && w13.size(1) == 2 * ((inter + kHalf - 1) / kHalf),
              "w13 must hold 2 ceil(I / 16) panels per expert for I = ", inter);
  check_panels(w13, w13_scale, h, int8, "w13");
  check_panels(w2, w2_scale, inter, int8, "w2");
  const int64_t num_experts = w13.size(0), p13 = w13.size(1), p2 = w2.size(1);
  TORCH_CHECK(w2.size(0) == num_experts && p2 == (h + tandem_cpu::kPanelLanes - 1) / tandem_cpu::kPanelLanes,
              "w2 must hold ceil(H / 16) panels for each of the ", num_experts, " experts");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == t_count && topk_ids.is_contiguous() &&
                  (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "topk_ids must be contiguous [T, k] int32 or int64");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights must be contiguous [T, k] float32");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == t_count &&
                  out.size(1) == h,
              "out must be [T, H] float32");
  if (t_count == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }

  // Slots grouped by expert: slot s = t k + j sits at row where[s] of its expert's block.
  const int64_t slots = t_count * k;
  std::vector<int64_t> count(num_experts, 0), start(num_experts + 1, 0), order(slots), where(slots);
  if (topk_ids.scalar_type() == at::kInt)
    group_slots(topk_ids.data_ptr<int32_t>(), slots, num_experts, count, start, order, where);
  else
    group_slots(topk_ids.data_ptr<int64_t>(), slots, num_experts, count, start, order, where);

  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::Tensor xs = at::empty({slots, h}, at::kFloat);
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, slots, std::max<int64_t>(1, 65536 / h), [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end; ++pos)
      std::memcpy(xsp + pos * h, xp + (order[pos] / k) * ldx, h * sizeof(float));
  });
  // int8: the rows as the int8 loop reads them (16-bit, per block of 256 k).
  const int64_t h2 = (h + 1) / 2, nbh = (h2 + 127) / 128;
  const int64_t i2 = (inter + 1) / 2, nbi = (i2 + 127) / 128;
  const int64_t as_float_rows = int8 ? tandem_cpu::panel_int8_as_float_rows() : 0;
  at::Tensor xq, xsc;
  if (int8) {
    xq = at::empty({slots, h2}, at::kInt);
    xsc = at::empty({slots, nbh}, at::kFloat);
    tandem_cpu::panel_quantize_rows(xsp, h, slots, h, xq.data_ptr<int32_t>(), xsc.data_ptr<float>());
  }

  // 1. gate/up and silu-and-mul: act [slots, Ip] (Ip = 16 P13 / 2; columns past I are 0).
  const int64_t ip = p13 / 2 * kHalf;
  at::Tensor act = at::empty({slots, ip}, at::kFloat);
  float* actp = act.data_ptr<float>();
  {
    const int64_t chunk = tandem_cpu::panel_row_chunk(h, int8), tiles = p13 / 2;
    int64_t work;
    const std::vector<Item> items = make_items(count, chunk, tiles, h, work);
    const float* wf = int8 ? nullptr : w13.data_ptr<float>();
    const int8_t* wq = int8 ? w13.data_ptr<int8_t>() : nullptr;
    const float* sc = int8 ? w13_scale.data_ptr<float>() : nullptr;
    const int32_t* xqp = int8 ? xq.data_ptr<int32_t>() : nullptr;
    const float* xscp = int8 ? xsc.data_ptr<float>() : nullptr;
    const int64_t n_items = static_cast<int64_t>(items.size());
    tandem_cpu::parallel_steal(n_items, shares_for(work, n_items), [&](const auto& take) {
      thread_local std::vector<float> gu;
      gu.resize(chunk * kTileCols);
      int64_t i, end;
      while (take(i, end)) {
        const Item& it = items[i];
        const int64_t row = start[it.expert] + it.r0;
        const int64_t panel = it.expert * p13 + 2 * it.tile;
        if (!int8) {
          const float* w = wf + panel * h * tandem_cpu::kPanelLanes;
          const float* next = it.tile + 1 < tiles ? w + 2 * h * tandem_cpu::kPanelLanes : nullptr;
          tandem_cpu::panel_float_tile(it.rows, xsp + row * h, h, w, 2, h, nullptr, nullptr, gu.data(), kTileCols, 0,
                                       kTileCols, next);
        } else {
          const int8_t* w = wq + panel * h2 * 2 * tandem_cpu::kPanelLanes;
          const float* s = sc + panel * tandem_cpu::kPanelLanes;
          if (count[it.expert] < as_float_rows ||
              !tandem_cpu::panel_int8_tile_as_float(it.rows, xsp + row * h, h, w, 2, h, s, nullptr, gu.data(),
                                                    kTileCols, 0, kTileCols))
            tandem_cpu::panel_int8_tile(it.rows, xqp + row * h2, h2, xscp + row * nbh, nbh, w, 2, s, nullptr,
                                        gu.data(), kTileCols, 0, kTileCols);
        }
        silu_mul_tile(gu.data(), it.rows, actp + row * ip + it.tile * kHalf, ip);
      }
    });
  }

  // 2. down: y [slots, H].
  at::Tensor aq, asc;
  if (int8) {
    aq = at::empty({slots, i2}, at::kInt);
    asc = at::empty({slots, nbi}, at::kFloat);
    tandem_cpu::panel_quantize_rows(actp, ip, slots, inter, aq.data_ptr<int32_t>(), asc.data_ptr<float>());
  }
  at::Tensor y = at::empty({slots, h}, at::kFloat);
  float* yp = y.data_ptr<float>();
  {
    const int64_t chunk = tandem_cpu::panel_row_chunk(inter, int8), tiles = (p2 + 1) / 2;
    int64_t work;
    const std::vector<Item> items = make_items(count, chunk, tiles, inter, work);
    const float* wf = int8 ? nullptr : w2.data_ptr<float>();
    const int8_t* wq = int8 ? w2.data_ptr<int8_t>() : nullptr;
    const float* sc = int8 ? w2_scale.data_ptr<float>() : nullptr;
    const int32_t* aqp = int8 ? aq.data_ptr<int32_t>() : nullptr;
    const float* ascp = int8 ? asc.data_ptr<float>() : nullptr;
    const int64_t n_items = static_cast<int64_t>(items.size());
    tandem_cpu::parallel_steal(n_items, shares_for(work, n_items), [&](const auto& take) {
      int64_t i, end;
      while (take(i, end)) {
        const Item& it = items[i];
        const int64_t row = start[it.expert] + it.r0;
        const int64_t panel = it.expert * p2 + 2 * it.tile;
        const int64_t panel_count = std::min<int64_t>(2, p2 - 2 * it.tile);
        const int64_t n0 = it.tile * kTileCols;
        if (!int8) {
          const float* w = wf + panel * inter * tandem_cpu::kPanelLanes;
          const float* next = it.tile + 1 < tiles ? w + 2 * inter * tandem_cpu::kPanelLanes : nullptr;
          tandem_cpu::panel_float_tile(it.rows, actp + row * ip, ip, w, panel_count, inter, nullptr, nullptr,
                                       yp + row * h, h, n0, h, next);
        } else {
          const int8_t* w = wq + panel * i2 * 2 * tandem_cpu::kPanelLanes;
          const float* s = sc + it.expert * p2 * tandem_cpu::kPanelLanes;  // indexed by output column
          if (count[it.expert] < as_float_rows ||
              !tandem_cpu::panel_int8_tile_as_float(it.rows, actp + row * ip, ip, w, panel_count, inter, s, nullptr,
                                                    yp + row * h, h, n0, h))
            tandem_cpu::panel_int8_tile(it.rows, aqp + row * i2, i2, ascp + row * nbi, nbi, w, panel_count, s,
                                        nullptr, yp + row * h, h, n0, h);
        }
      }
    });
  }

  // 3. out[t] = sum_j w[t, j] y[where[t k + j]].
  const float* wp = topk_weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, t_count, std::max<int64_t>(1, 32768 / (h * k)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * ldo;
      const float w0 = wp[t * k];
      const float* y0 = yp + where[t * k] * h;
#pragma omp simd
      for (int64_t c = 0; c < h; ++c) o[c] = w0 * y0[c];
      for (int64_t j = 1; j < k; ++j) {
        const float wj = wp[t * k + j];
        const float* yj = yp + where[t * k + j] * h;
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) o[c] += wj * yj[c];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "moe_panels(Tensor(a!) out, Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, "
      "Tensor topk_weights, Tensor topk_ids, int inter) -> ()");
  m.impl("moe_panels", c10::DispatchKey::CPU, &moe_panels);
}
