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
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

constexpr int64_t GROUP_BYTES = 256 * 1024;
// an input position's 16 weights take a whole cache line in float32, half of one in float16, a
// quarter in 8 bits: the positions that share a line (and its prefetch)
template <typename W>
constexpr int64_t PER_LINE = 64 / (16 * sizeof(W));

#if defined(__AVX512F__)
constexpr int64_t CHUNK_ROWS = 14;
constexpr int PAIR = 2;  // blocks a chunk's rows go past together
// software prefetches: a few lines ahead into the core's first-level cache, and 64 KiB ahead
// into its second level (more reads in flight than the first level's fill buffers allow)
constexpr int64_t NEAR_BYTES = 4 * 1024, FAR_BYTES = 64 * 1024;

inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline __m512 load16(const int8_t* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// NB blocks at once (``stride`` apart): each broadcast input feeds NB lines, so a row costs
// one load per NB multiply-adds; 14 rows of two blocks fill 28 of the 32 vector registers.
// Prefetches stop at ``stop``: the end of the thread's blocks (what lies past it is not ours),
// or the blocks' start where they are in cache already.
template <typename W, int ROWS, int NB>
void block(const float* __restrict__ x, const W* __restrict__ w, float* __restrict__ y,
           int64_t in, int64_t ldy, int64_t stride, const char* stop) {
  __m512 acc[NB][ROWS];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < ROWS; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m512 line[NB];
    for (int b = 0; b < NB; ++b) {
      const char* next = reinterpret_cast<const char*>(w + b * stride + k * 16);
      if (k % PER_LINE<W> == 0) {  // one prefetch per cache line
        if (next + NEAR_BYTES < stop) _mm_prefetch(next + NEAR_BYTES, _MM_HINT_T0);
        if (next + FAR_BYTES < stop) _mm_prefetch(next + FAR_BYTES, _MM_HINT_T1);
      }
      line[b] = load16(w + b * stride + k * 16);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 input = _mm512_set1_ps(x[r * in + k]);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(input, line[b], acc[b][r]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + r * ldy + b * 16, acc[b][r]);
}
#else
constexpr int64_t CHUNK_ROWS = 6;
constexpr int PAIR = 1;
constexpr int64_t PREFETCH_BYTES = 256 * 64;

inline void load16(const float* w, __m256& low, __m256& high) {
  low = _mm256_loadu_ps(w);
  high = _mm256_loadu_ps(w + 8);
}
inline void load16(const uint16_t* w, __m256& low, __m256& high) {
  low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
}
inline void load16(const int8_t* w, __m256& low, __m256& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}

// Named accumulators, not an array: gcc stores an array of 12 vectors back to the stack at
// every step of the loop, which made this kernel compute-bound at a third of the FMA rate.
// One block at a time (no registers are left for a second).
template <typename W, int ROWS, int NB>
void block(const float* __restrict__ x, const W* __restrict__ w, float* __restrict__ y,
           int64_t in, int64_t ldy, int64_t /*stride*/, const char* stop) {
  static_assert(NB == 1, "AVX2 goes past one block at a time");
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0,
         lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
#define RAG_SPEC_ROW(r)                                                        \
  if constexpr (ROWS > r) {                                                    \
    const __m256 input = _mm256_broadcast_ss(x + r * in + k);                  \
    lo##r = _mm256_fmadd_ps(input, low, lo##r);                                \
    hi##r = _mm256_fmadd_ps(input, high, hi##r);                               \
  }
  for (int64_t k = 0; k < in; ++k) {
    const char* next = reinterpret_cast<const char*>(w + k * 16);
    if (k % PER_LINE<W> == 0 && next + PREFETCH_BYTES < stop)  // one prefetch per cache line
      _mm_prefetch(next + PREFETCH_BYTES, _MM_HINT_T0);
    __m256 low, high;
    load16(w + k * 16, low, high);
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

template <typename W>
using Block = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, const char*);

template <typename W, int NB, int... R>
constexpr std::array<Block<W>, sizeof...(R)> blocks(std::integer_sequence<int, R...>) {
  return {&block<W, R + 1, NB>...};
}

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
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& packed) {
  const auto stored = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  packed.dim() == 3 &&
                  (stored == at::kFloat || stored == at::kHalf || stored == at::kChar) &&
                  packed.size(2) == 16 && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "streamed_linear: contiguous float32 (rows, in) input and (blocks, in, 16) "
              "float32, float16 or int8 packed weight");
  const int64_t rows = x.size(0), in = x.size(1), nblocks = packed.size(0);
  auto y = at::empty({rows, nblocks * 16}, x.options());
  if (rows == 0 || in == 0) return y.zero_();  // nothing to split into chunks and groups
  if (stored == at::kChar)
    product(x.data_ptr<float>(), packed.data_ptr<int8_t>(), y.data_ptr<float>(), rows, in,
            nblocks);
  else if (stored == at::kHalf)
    product(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>()),
            y.data_ptr<float>(), rows, in, nblocks);
  else
    product(x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), rows, in,
            nblocks);
  return y;
}
