// The CPU kernels of the operators streamed.py and cpu_attention.py define (with their outputs'
// shapes, for tracing): compiled steps call them from inductor's code as torch's own.
#include <torch/extension.h>

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& packed);
#if defined(__AVX512F__)
torch::Tensor tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& key,
                                 const torch::Tensor& value, const torch::Tensor& committed,
                                 const torch::Tensor& recent, const torch::Tensor& select,
                                 double scale);
#endif

TORCH_LIBRARY_IMPL(rag_spec_cpu, CPU, m) {
  m.impl("streamed_linear", &streamed_linear);
#if defined(__AVX512F__)  // AVX2 builds: the streamed product only
  m.impl("tree_attention", &tree_attention_cpu);
#endif
}
