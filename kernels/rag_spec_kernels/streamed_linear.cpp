// Few-row float32 products that read the weight from memory while they compute (AVX-512, or
// AVX2 with FMA: the build picks by the flags it is compiled with).
//
// The weight is packed as 16-output blocks, [blocks][in][16]: one input position's 16 weights
// fill one cache line, and a block is read front to back. Every row of a chunk (up to
// CHUNK_ROWS, read in place: its inputs are broadcast from the core's cache) accumulates
// against one block at a time (AVX-512: a pair of blocks, each broadcast input feeding both),
// so a block's lines are used by all rows while the next lines are on their way: software
// prefetches ahead of the arithmetic (AVX-512: near ones into the first-level cache and far ones
// into the second, for more reads in flight), on a group's first chunk only (the others find
// the block in the core's cache). Blocks are split between torch's threads; many rows go in
// groups of chunks, each group past every block. A chunk's accumulators stay in registers: 14
// rows of two 512-bit vectors (a pair of blocks), or 6 rows of two 256-bit ones (AVX2's 16
// registers hold 12 accumulators, the line's two halves and a broadcast input).
// A packed weight may be stored in half precision, or as 8-bit integers (a draft head's: half
// or a quarter of the bytes to read; the caller scales each output of an integer product);
// each 16-weight group is widened to float32 as it is loaded, and the arithmetic stays float32.
// Each output is summed over the inputs in one fixed order, whatever the number of rows or
// blocks at once: a row's result does not depend on the rows beside it.
#include "streamed_block.h"

#include <ATen/Parallel.h>
#include <algorithm>

#include <torch/extension.h>

namespace {

using namespace rag_spec_streamed;

template <typename W>
void product(const float* px, const W* w, float* py, int64_t rows, int64_t in, int64_t nblocks) {
  static constexpr auto SINGLE = blocks<W, 1>(std::make_integer_sequence<int, CHUNK_ROWS>());
  static constexpr auto PAIRED = blocks<W, PAIR>(std::make_integer_sequence<int, CHUNK_ROWS>());
  // rows in chunks of even size (17: 9 and 8, not 14 and 3), each at most CHUNK_ROWS
  const int64_t out = nblocks * 16, chunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t size = (rows + chunks - 1) / chunks, units = (nblocks + PAIR - 1) / PAIR;
  // many rows (a prompt): groups of chunks whose inputs stay in a core's cache while every
  // block passes by, rather than all inputs read again for each block
  const int64_t group = std::max<int64_t>(1, GROUP_BYTES / (in * size * 4));
  for (int64_t first_chunk = 0; first_chunk < chunks; first_chunk += group) {
    const int64_t end_chunk = std::min(chunks, first_chunk + group);
    at::parallel_for(0, units, 1, [&](int64_t first, int64_t last) {
      const W* end = w + std::min(last * PAIR, nblocks) * in * 16;
      for (int64_t u = first; u < last; ++u) {
        const int64_t b = u * PAIR;  // a unit's blocks: PAIR of them, the last maybe one
        const auto& run = b + PAIR <= nblocks ? PAIRED : SINGLE;
        for (int64_t c = first_chunk; c < end_chunk; ++c) {
          const int64_t n = std::min(size, rows - c * size);
          // prefetches on a group's first chunk only (the others find the blocks in cache)
          const W* blocks = w + b * in * 16;
          run[n - 1](px + c * size * in, blocks, py + c * size * out + b * 16, in, out, in * 16,
                     reinterpret_cast<const char*>(c == first_chunk ? end : blocks));
        }
      }
    });
  }
}

}  // namespace

// x: (rows, in) float32; packed: (blocks, in, 16) float32, float16 or int8 (unscaled). Returns
// (rows, blocks * 16) float32.
torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  const auto stored = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  packed.dim() == 3 &&
                  (stored == torch::kFloat || stored == torch::kHalf || stored == torch::kChar) &&
                  packed.size(2) == 16 && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "streamed_linear: contiguous float32 (rows, in) input and (blocks, in, 16) "
              "float32, float16 or int8 packed weight");
  const int64_t rows = x.size(0), in = x.size(1), nblocks = packed.size(0);
  auto y = torch::empty({rows, nblocks * 16}, x.options());
  if (rows == 0 || in == 0) return y.zero_();  // nothing to split into chunks and groups
  if (stored == torch::kChar)
    product(x.data_ptr<float>(), packed.data_ptr<int8_t>(), y.data_ptr<float>(), rows, in,
            nblocks);
  else if (stored == torch::kHalf)
    product(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>()),
            y.data_ptr<float>(), rows, in, nblocks);
  else
    product(x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), rows, in,
            nblocks);
  return y;
}
