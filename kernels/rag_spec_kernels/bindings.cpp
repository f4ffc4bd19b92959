// The CPU kernels of the operators streamed.py, quantized.py, cpu_attention.py and slots.py define (with
// their outputs' shapes, for tracing): compiled steps call them from inductor's code as torch's
// own; the cache's bookkeeping calls move_slots between steps.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& packed);
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values,
                            const at::Tensor& scales, const at::Tensor& mins,
                            const at::Tensor& factors);
void move_slots(at::TensorList tensors, const at::Tensor& index, int64_t start);
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const at::Tensor& allowed, double scale);
#if defined(__AVX512F__)
at::Tensor tree_attention_cpu(const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& committed,
                              const at::Tensor& recent, const at::Tensor& select,
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
