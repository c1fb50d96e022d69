// The native CPU ops one translation unit offers another (the fused decode loop calls
// them directly, without the dispatcher). Contracts: kernels/reference.py and the
// comments at each definition.
#pragma once

#include <ATen/ATen.h>

namespace tandem_cpu {

void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& token_index, const at::Tensor& seq_index, double scale,
                            at::Tensor out);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key,
                      const at::Tensor& cos_sin_cache);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping);
// Float32, int8 and (uint8 panels: forwarded to int4_linear) 4-bit panels alike.
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                  const at::Tensor& bias);

// ---- panel_linear's loops, one tile at a time (panel_linear_cpu.cpp) ------------------
// For a caller that splits the work between threads itself (moe_cpu.cpp). A tile is
// kPanelTilePanels panels (32 output columns), fewer at the weight's end; `panels` points
// at its first panel (layouts: panel_linear_cpu.cpp). Each writes out[r * ldo + c] for
// r < rows and n0 <= c < min(n, n0 + 16 * panel_count): x[r] . W[c] * scale[c] + bias[c]
// (scale, bias: null for none; indexed by output column like out). Called from inside a
// parallel region; none starts one.
constexpr int64_t kPanelLanes = 16;
constexpr int64_t kPanelTilePanels = 2;
// Rows of x per chunk for which a tile stays worth re-reading from cache (L2-sized x).
int64_t panel_row_chunk(int64_t k_size, bool int8);
// float32 panels [.., K, 16]; `next`: the tile to prefetch meanwhile (or null).
void panel_float_tile(int64_t rows, const float* x, int64_t ldx, const float* panels, int64_t panel_count,
                      int64_t k_size, const float* scale, const float* bias, float* out, int64_t ldo, int64_t n0,
                      int64_t n, const float* next);
// x [m, K] -> the int8 loop's 16-bit rows xq [m, ceil(K / 2)] and block steps xs [m, ceil(K / 256)]
// (parallel over rows: call outside a parallel region).
void panel_quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k_size, int32_t* xq, float* xs);
// int8 panels [.., ceil(K / 2), 32] with per-channel scales, x as panel_quantize_rows made it
// (k2 = ceil(K / 2), nb = ceil(K / 256)).
void panel_int8_tile(int64_t rows, const int32_t* xq, int64_t k2, const float* xs, int64_t nb, const int8_t* panels,
                     int64_t panel_count, const float* scale, const float* bias, float* out, int64_t ldo, int64_t n0,
                     int64_t n);
// AVX2 builds: the tile dequantized, then the float loop on unrounded x (what panel_linear
// does from panel_int8_as_float_rows() rows); false (nothing done) on other builds.
bool panel_int8_tile_as_float(int64_t rows, const float* x, int64_t ldx, const int8_t* panels, int64_t panel_count,
                              int64_t k_size, const float* scale, const float* bias, float* out, int64_t ldo,
                              int64_t n0, int64_t n);
int64_t panel_int8_as_float_rows();
// Called by a thread right after it wrote out[r0:r0+rows, n0:n1) (int4_linear's tiles).
using TileHook = void (*)(const void* ctx, int64_t r0, int64_t rows, int64_t n0, int64_t n1);
// out = x @ W.T + bias over 4-bit (or 5-bit) panels (int4_linear_cpu.cpp: codes uint8
// [ceil(N / 32), K / 32, 512 or 640], scale [ceil(N / 32), K / 32, 64] float32 or float16);
// `hook(ctx, ...)` after each tile of 32 columns, if not null.
void int4_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                 const at::Tensor& bias, TileHook hook, const void* ctx);

}  // namespace tandem_cpu
