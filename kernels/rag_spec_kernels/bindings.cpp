// The CPU kernels as one Python module (built by cpu_extension.py).
#include <torch/extension.h>

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& packed);
torch::Tensor tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& key,
                                 const torch::Tensor& value, const torch::Tensor& committed,
                                 const torch::Tensor& recent, const torch::Tensor& select,
                                 double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // no Python objects inside: other Python threads run while they compute, as with torch's ops
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("streamed_linear", &streamed_linear, "x @ W.T over a 16-output-block packed weight",
        release());
  m.def("tree_attention_cpu", &tree_attention_cpu,
        "a step's queries over a KV cache under a compact tree mask", release());
}
