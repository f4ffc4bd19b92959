// The CPU kernels of the operators streamed.py, quantized.py, cpu_attention.py and slots.py define (with
// their outputs' shapes, for tracing): compiled steps call them from inductor's code as torch's
// own; the cache's bookkeeping calls move_slots between steps.
#include <torch/extension.h>

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& packed);
torch::Tensor quantized_linear(const torch::Tensor& x, const torch::Tensor& values,
                               const torch::Tensor& scales, const torch::Tensor& mins);
void move_slots(at::TensorList tensors, const at::Tensor& index, int64_t start);
torch::Tensor row_attention(const torch::Tensor& query, const torch::Tensor& key,
                            const torch::Tensor& value, const torch::Tensor& allowed,
                            double scale);
#if defined(__AVX512F__)
torch::Tensor tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& key,
                                 const torch::Tensor& value, const torch::Tensor& committed,
                                 const torch::Tensor& recent, const torch::Tensor& select,
                                 double scale);
#endif

TORCH_LIBRARY_IMPL(rag_spec_cpu, CPU, m) {
  m.impl("streamed_linear", &streamed_linear);
  m.impl("quantized_linear", &quantized_linear);
  m.impl("move_slots", &move_slots);
  m.impl("row_attention", &row_attention);
#if defined(__AVX512F__)  // AVX2 builds: no tree attention
  m.impl("tree_attention", &tree_attention_cpu);
#endif
}
