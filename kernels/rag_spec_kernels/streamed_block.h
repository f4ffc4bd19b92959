// The streamed kernel's per-block micro-kernels (streamed_linear.cpp's header comment says
// how they read a weight), shared with the quantised products (quantized_linear.cpp), which
// run them over blocks they decode into the core's cache.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include <immintrin.h>
#include <torch/extension.h>

namespace rag_spec_streamed {

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

}  // namespace rag_spec_streamed
