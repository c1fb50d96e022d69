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
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                  const at::Tensor& bias);

}  // namespace tandem_cpu
