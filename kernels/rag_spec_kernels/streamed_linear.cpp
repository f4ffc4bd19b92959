// Few-row float32 products that read the weight from memory while they compute (AVX-512, or
// AVX2 with FMA: the build picks by the flags it is compiled with).
//
// The weight is packed as 16-output blocks, [blocks][in][16]: one input position's 16 weights
// fill one cache line, and a block is read front to back. Every row of a chunk (up to
// CHUNK_ROWS, read in place: its inputs are broadcast from the core's cache) accumulates
// against one block at a time, so a block's lines are used by all rows while the next lines
// are on their way: a software prefetch PREFETCH_LINES ahead, on a group's first chunk only
// (the others find the block in the core's cache). Blocks are split between torch's threads;
// many rows go in groups of chunks, each group past every block. A chunk's accumulators stay
// in registers: 17 rows of one 512-bit vector, or 6 rows of two 256-bit ones (AVX2's 16
// registers hold 12 accumulators, the line's two halves and a broadcast input).
// Each output is summed over the inputs in one fixed order, whatever the number of rows: a
// row's result does not depend on the rows beside it.
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <utility>

#include <immintrin.h>
#include <torch/extension.h>

namespace {

constexpr int64_t PREFETCH_LINES = 256;
constexpr int64_t GROUP_BYTES = 256 * 1024;

#if defined(__AVX512F__)
constexpr int64_t CHUNK_ROWS = 17;

template <int ROWS>
void block(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
           int64_t in, int64_t ldy, bool prefetch) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (k + PREFETCH_LINES) * 16),
                               _MM_HINT_T0);
    const __m512 line = _mm512_loadu_ps(w + k * 16);
    for (int r = 0; r < ROWS; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * in + k]), line, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#else
constexpr int64_t CHUNK_ROWS = 6;

// Named accumulators, not an array: gcc stores an array of 12 vectors back to the stack at
// every step of the loop, which made this kernel compute-bound at a third of the FMA rate.
template <int ROWS>
void block(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
           int64_t in, int64_t ldy, bool prefetch) {
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0,
         lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
#define RAG_SPEC_ROW(r)                                                        \
  if constexpr (ROWS > r) {                                                    \
    const __m256 input = _mm256_broadcast_ss(x + r * in + k);                  \
    lo##r = _mm256_fmadd_ps(input, low, lo##r);                                \
    hi##r = _mm256_fmadd_ps(input, high, hi##r);                               \
  }
  for (int64_t k = 0; k < in; ++k) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (k + PREFETCH_LINES) * 16),
                               _MM_HINT_T0);
    const __m256 low = _mm256_loadu_ps(w + k * 16), high = _mm256_loadu_ps(w + k * 16 + 8);
    RAG_SPEC_ROW(0) RAG_SPEC_ROW(1) RAG_SPEC_ROW(2) RAG_SPEC_ROW(3) RAG_SPEC_ROW(4)
    RAG_SPEC_ROW(5)
  }
#undef RAG_SPEC_ROW
#define RAG_SPEC_STORE(r)                                                      \
  if constexpr (ROWS > r) {                                                    \
    _mm256_storeu_ps(y + r * ldy, lo##r);                                      \
    _mm256_storeu_ps(y + r * ldy + 8, hi##r);                                  \
  }
  RAG_SPEC_STORE(0) RAG_SPEC_STORE(1) RAG_SPEC_STORE(2) RAG_SPEC_STORE(3) RAG_SPEC_STORE(4)
  RAG_SPEC_STORE(5)
#undef RAG_SPEC_STORE
}
#endif

using Block = void (*)(const float*, const float*, float*, int64_t, int64_t, bool);

template <int... R>
constexpr std::array<Block, sizeof...(R)> blocks(std::integer_sequence<int, R...>) {
  return {&block<R + 1>...};
}

constexpr auto BLOCKS = blocks(std::make_integer_sequence<int, CHUNK_ROWS>());

}  // namespace

// x: (rows, in) float32; packed: (blocks, in, 16). Returns (rows, blocks * 16).
torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  packed.dim() == 3 && packed.scalar_type() == torch::kFloat &&
                  packed.size(2) == 16 && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "streamed_linear: contiguous float32 (rows, in) input and (blocks, in, 16) "
              "packed weight");
  const int64_t rows = x.size(0), in = x.size(1), nblocks = packed.size(0), out = nblocks * 16;
  const int64_t chunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
  auto y = torch::empty({rows, out}, x.options());
  const float* px = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* py = y.data_ptr<float>();
  // many rows (a prompt): groups of chunks whose inputs stay in a core's cache while every
  // block passes by, rather than all inputs read again for each block
  const int64_t group = std::max<int64_t>(1, GROUP_BYTES / (in * CHUNK_ROWS * 4));
  for (int64_t first_chunk = 0; first_chunk < chunks; first_chunk += group) {
    const int64_t end_chunk = std::min(chunks, first_chunk + group);
    at::parallel_for(0, nblocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b)
        for (int64_t c = first_chunk; c < end_chunk; ++c) {
          const int64_t n = std::min(CHUNK_ROWS, rows - c * CHUNK_ROWS);
          BLOCKS[n - 1](px + c * CHUNK_ROWS * in, w + b * in * 16,
                        py + c * CHUNK_ROWS * out + b * 16, in, out, c == first_chunk);
        }
    });
  }
  return y;
}
