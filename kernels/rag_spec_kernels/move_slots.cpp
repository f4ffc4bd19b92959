// The KV cache's compaction after a step (``TreeKVCache.keep_slots``): each row's kept slots
// moved to the front of its round, in every layer's keys and values in one call, where torch
// takes three operations per tensor (60 tensors on the default model).
#include <algorithm>
#include <cstring>
#include <vector>

#include <ATen/core/Tensor.h>

// tensors: [rows, heads, slots, dim] CPU tensors (strided, the last dimension contiguous);
// index: [rows, width] slots to gather. Writes tensor[b, h, start + j] = tensor[b, h, index[b,
// j]] for every j, as if every slot were read before any is written.
void move_slots(at::TensorList tensors, const at::Tensor& index, int64_t start) {
  TORCH_CHECK(index.dim() == 2 && index.scalar_type() == at::kLong && index.device().is_cpu(),
              "move_slots: a [rows, width] int64 CPU index");
  const at::Tensor slots = index.contiguous();
  const int64_t* from = slots.data_ptr<int64_t>();
  const int64_t rows = slots.size(0), width = slots.size(1);
  int64_t least = 0, most = -1;  // the slots read, checked once against each tensor's length
  for (int64_t i = 0; i < rows * width; ++i) {
    least = std::min(least, from[i]);
    most = std::max(most, from[i]);
  }
  TORCH_CHECK(least >= 0, "move_slots: a slot index out of range");
  std::vector<char> gathered;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.dim() == 4 && t.device().is_cpu() && t.size(0) == rows && t.stride(3) == 1 &&
                    start >= 0 && start + width <= t.size(2),
                "move_slots: [rows, heads, slots, dim] CPU tensors with room for the moved slots");
    const int64_t size = t.element_size(), bytes = t.size(3) * size;
    TORCH_CHECK(most < t.size(2), "move_slots: a slot index out of range");
    gathered.resize(width * bytes);
    char* base = static_cast<char*>(t.data_ptr());
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < t.size(1); ++h) {
        char* head = base + (b * t.stride(0) + h * t.stride(1)) * size;
        for (int64_t j = 0; j < width; ++j)
          std::memcpy(gathered.data() + j * bytes, head + from[b * width + j] * t.stride(2) * size,
                      bytes);
        for (int64_t j = 0; j < width; ++j)
          std::memcpy(head + (start + j) * t.stride(2) * size, gathered.data() + j * bytes, bytes);
      }
  }
}
