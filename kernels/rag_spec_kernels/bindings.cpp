// The CPU kernels as one Python module (built by cpu_extension.py).
#include <torch/extension.h>

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& packed);
torch::Tensor tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& key,
                                 const torch::Tensor& value, const torch::Tensor& committed,
                                 const torch::Tensor& recent, const torch::Tensor& select,
                                 double scale);

// The CPU kernel of an operator streamed.py defines (with its output's shape, for tracing).
TORCH_LIBRARY_IMPL(rag_spec_cpu, CPU, m) { m.impl("streamed_linear", &streamed_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // no Python objects inside: other Python threads run while they compute, as with torch's ops
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("tree_attention_cpu", &tree_attention_cpu,
        "a step's queries over a KV cache under a compact tree mask", release());
}
