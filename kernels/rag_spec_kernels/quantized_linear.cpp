// Few-row float32 products over weights kept in quantised blocks, as GGUF files hold them
// (quantized.py converts a file's blocks to these layouts): each output's inputs in groups of
// 32 with a scale (and a minimum) per group, the values 4 bits (Q4_0, Q4_1, Q4_K) or 8 bits
// (Q8_0) wide. Weights are read at a sixth or a quarter of float32's bytes.
//
// A thread decodes one segment of a 16-output block (AVX-512: of two) into float32 in its
// first-level cache, once, and every chunk of rows then runs the streamed kernel's
// micro-kernel over it (streamed_block.h): a token tree pays the decoding once, as one token
// does, and its rows cost only their multiply-adds. llama.cpp's kernels for Q4_1 and the
// K-quants instead take a dot product per row and output, decoding again for every row.
//
// Layouts, per 16-output block: 4-bit values (blocks, in, 8) bytes, byte j holding output j in
// its low half and output j + 8 in its high half (AVX2 widens the two halves as its two
// 8-float vectors, AVX-512 interleaves them); 8-bit values (blocks, in, 16); scales and
// minimums (blocks, in / 32, 16) in half precision. A weight is value * scale + minimum,
// rounded once (a fused multiply-add), the same in every product.
//
// Each output is summed in one fixed order (each segment over its inputs, then the segments in
// order), whatever the number of rows or blocks at once: a row's result does not depend on the
// rows beside it. One or two rows go past four or two blocks at once (``few_rows``), so that
// their chains of additions do not wait on one another.
#include "streamed_block.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include <torch/extension.h>

namespace {

using namespace rag_spec_streamed;

constexpr int64_t SEGMENT = 64;  // inputs decoded at once: 4 KiB of float32 per block
constexpr int64_t FEW_BLOCKS = 4;  // blocks one row goes past at once (two rows: 2)
constexpr int64_t GROUP = 32;     // inputs per scale
constexpr int64_t DECODE_PREFETCH = 1024;  // bytes ahead of the decoding

#if defined(__AVX512F__)
template <bool FOUR>
inline __m512 values16(const uint8_t* p) {
  if constexpr (FOUR) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high)));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
}

// ``len`` input positions of one block from ``k0`` (a multiple of GROUP) as float32 weights
template <bool FOUR, bool MIN>
void decode(const uint8_t* values, const uint16_t* scales, const uint16_t* mins, int64_t k0,
            int64_t len, float* out, const char* stop) {
  constexpr int64_t STEP = FOUR ? 8 : 16;  // bytes per input position
  for (int64_t g = 0; g < len; g += GROUP) {
    const int64_t group = (k0 + g) / GROUP;
    const __m512 scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + group * 16)));
    __m512 minimum = _mm512_setzero_ps();
    if constexpr (MIN)
      minimum = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + group * 16)));
    for (int64_t k = k0 + g; k < k0 + g + GROUP; ++k) {
      const uint8_t* p = values + k * STEP;
      const char* next = reinterpret_cast<const char*>(p) + DECODE_PREFETCH;
      if (k % (64 / STEP) == 0 && next < stop) _mm_prefetch(next, _MM_HINT_T0);
      const __m512 q = values16<FOUR>(p);
      _mm512_storeu_ps(out + (k - k0) * 16, MIN ? _mm512_fmadd_ps(q, scale, minimum)
                                                : _mm512_mul_ps(q, scale));
    }
  }
}
#else
template <bool FOUR>
inline void values16(const uint8_t* p, __m256& low, __m256& high) {
  if constexpr (FOUR) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    high = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  }
}

inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <bool FOUR, bool MIN>
void decode(const uint8_t* values, const uint16_t* scales, const uint16_t* mins, int64_t k0,
            int64_t len, float* out, const char* stop) {
  constexpr int64_t STEP = FOUR ? 8 : 16;
  for (int64_t g = 0; g < len; g += GROUP) {
    const int64_t group = (k0 + g) / GROUP;
    const __m256 scale_low = half8(scales + group * 16), scale_high = half8(scales + group * 16 + 8);
    __m256 min_low = _mm256_setzero_ps(), min_high = min_low;
    if constexpr (MIN) {
      min_low = half8(mins + group * 16);
      min_high = half8(mins + group * 16 + 8);
    }
    for (int64_t k = k0 + g; k < k0 + g + GROUP; ++k) {
      const uint8_t* p = values + k * STEP;
      const char* next = reinterpret_cast<const char*>(p) + DECODE_PREFETCH;
      if (k % (64 / STEP) == 0 && next < stop) _mm_prefetch(next, _MM_HINT_T0);
      __m256 low, high;
      values16<FOUR>(p, low, high);
      float* w = out + (k - k0) * 16;
      _mm256_storeu_ps(w, MIN ? _mm256_fmadd_ps(low, scale_low, min_low)
                              : _mm256_mul_ps(low, scale_low));
      _mm256_storeu_ps(w + 8, MIN ? _mm256_fmadd_ps(high, scale_high, min_high)
                                  : _mm256_mul_ps(high, scale_high));
    }
  }
}
#endif

// One or two rows past NB decoded blocks at once (``stride`` apart), as the streamed
// micro-kernel goes past one or two: each output's arithmetic is that kernel's, lane for lane,
// but eight chains of additions run side by side where one block's two would each wait for the
// last addition to finish.
template <int ROWS, int NB>
void few_rows(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
              int64_t len, int64_t ldy, int64_t stride) {
  __m256 acc[NB][ROWS][2];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < ROWS; ++r) acc[b][r][0] = acc[b][r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < len; ++k)
    for (int b = 0; b < NB; ++b) {
      const __m256 low = _mm256_loadu_ps(w + b * stride + k * 16);
      const __m256 high = _mm256_loadu_ps(w + b * stride + k * 16 + 8);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 input = _mm256_broadcast_ss(x + r * len + k);
        acc[b][r][0] = _mm256_fmadd_ps(input, low, acc[b][r][0]);
        acc[b][r][1] = _mm256_fmadd_ps(input, high, acc[b][r][1]);
      }
    }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < ROWS; ++r) {
      _mm256_storeu_ps(y + r * ldy + b * 16, acc[b][r][0]);
      _mm256_storeu_ps(y + r * ldy + b * 16 + 8, acc[b][r][1]);
    }
}

using Few = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t);
// [rows - 1][blocks - 1]: one row past 1-4 blocks, two rows past 1-2
constexpr Few FEW[2][FEW_BLOCKS] = {
    {&few_rows<1, 1>, &few_rows<1, 2>, &few_rows<1, 3>, &few_rows<1, 4>},
    {&few_rows<2, 1>, &few_rows<2, 2>, nullptr, nullptr}};

template <bool FOUR, bool MIN>
void product(const float* px, const uint8_t* values, const uint16_t* scales,
             const uint16_t* mins, float* py, int64_t rows, int64_t in, int64_t nblocks) {
  static constexpr auto SINGLE = blocks<float, 1>(std::make_integer_sequence<int, CHUNK_ROWS>());
  static constexpr auto PAIRED =
      blocks<float, PAIR>(std::make_integer_sequence<int, CHUNK_ROWS>());
  const int64_t out = nblocks * 16, chunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
  // blocks decoded together: one or two rows take the wide micro-kernel above
  const int64_t unit = rows == 1 ? FEW_BLOCKS : rows == 2 ? 2 : PAIR;
  const int64_t size = (rows + chunks - 1) / chunks, units = (nblocks + unit - 1) / unit;
  const int64_t segments = (in + SEGMENT - 1) / SEGMENT;
  const int64_t block_bytes = in * (FOUR ? 8 : 16), block_groups = in / GROUP * 16;
  // the inputs segment by segment, (segments, rows, segment): the micro-kernel reads a row's
  // segment at the segment's length
  std::vector<float> xs(rows * in);
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t k0 = s * SEGMENT, len = std::min(SEGMENT, in - k0);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(xs.data() + rows * k0 + r * len, px + r * in + k0, len * sizeof(float));
  }
  at::parallel_for(0, units, 1, [&](int64_t first, int64_t last) {
    constexpr int64_t MOST = std::max<int64_t>(PAIR, FEW_BLOCKS);
    alignas(64) float decoded[MOST * SEGMENT * 16];
    alignas(64) float part[CHUNK_ROWS * MOST * 16];
    const char* end =
        reinterpret_cast<const char*>(values + std::min(last * unit, nblocks) * block_bytes);
    for (int64_t u = first; u < last; ++u) {
      const int64_t b = u * unit, pair = std::min<int64_t>(unit, nblocks - b);
      const auto& run = pair == PAIR ? PAIRED : SINGLE;
      for (int64_t s = 0; s < segments; ++s) {
        const int64_t k0 = s * SEGMENT, len = std::min(SEGMENT, in - k0);
        for (int64_t j = 0; j < pair; ++j)
          decode<FOUR, MIN>(values + (b + j) * block_bytes, scales + (b + j) * block_groups,
                            MIN ? mins + (b + j) * block_groups : nullptr, k0, len,
                            decoded + j * SEGMENT * 16, end);
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t n = std::min(size, rows - c * size);
          // no prefetches: the decoded weights are in the core's cache
          if (rows <= 2)
            FEW[rows - 1][pair - 1](xs.data() + rows * k0, decoded, part, len, MOST * 16,
                                    SEGMENT * 16);
          else
            run[n - 1](xs.data() + rows * k0 + c * size * len, decoded, part, len,
                       MOST * 16, SEGMENT * 16, reinterpret_cast<const char*>(decoded));
          for (int64_t r = 0; r < n; ++r) {
            float* y = py + (c * size + r) * out + b * 16;
            const float* p = part + r * MOST * 16;
            if (s == 0)
              std::memcpy(y, p, pair * 16 * sizeof(float));
            else
              for (int64_t o = 0; o < pair * 16; ++o) y[o] += p[o];
          }
        }
      }
    }
  });
}

}  // namespace

// x: (rows, in) float32; values: (blocks, in, 8) uint8 (4-bit pairs) or (blocks, in, 16) int8;
// scales and mins: (blocks, in / 32, 16) float16, mins possibly empty (no minimum). Returns
// (rows, blocks * 16) float32.
torch::Tensor quantized_linear(const torch::Tensor& x, const torch::Tensor& values,
                               const torch::Tensor& scales, const torch::Tensor& mins) {
  const bool four = values.scalar_type() == torch::kByte, minimum = mins.numel() > 0;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  values.dim() == 3 && values.is_contiguous() &&
                  (four ? values.size(2) == 8
                        : values.scalar_type() == torch::kChar && values.size(2) == 16) &&
                  values.size(1) == x.size(1) && x.size(1) % GROUP == 0 &&
                  scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == values.size(0) &&
                  scales.size(1) == x.size(1) / GROUP && scales.size(2) == 16 &&
                  (!minimum || (mins.sizes() == scales.sizes() &&
                                mins.scalar_type() == torch::kHalf && mins.is_contiguous())),
              "quantized_linear: contiguous float32 (rows, in) input with in a multiple of 32, "
              "(blocks, in, 8) uint8 or (blocks, in, 16) int8 values, (blocks, in / 32, 16) "
              "float16 scales and minimums (or none)");
  const int64_t rows = x.size(0), in = x.size(1), nblocks = values.size(0);
  auto y = torch::empty({rows, nblocks * 16}, x.options());
  if (rows == 0 || in == 0) return y.zero_();
  const float* px = x.data_ptr<float>();
  const auto* v = reinterpret_cast<const uint8_t*>(values.data_ptr());
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* m = minimum ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>())
                          : nullptr;
  float* py = y.data_ptr<float>();
  if (four && minimum)
    product<true, true>(px, v, s, m, py, rows, in, nblocks);
  else if (four)
    product<true, false>(px, v, s, m, py, rows, in, nblocks);
  else if (minimum)
    product<false, true>(px, v, s, m, py, rows, in, nblocks);
  else
    product<false, false>(px, v, s, m, py, rows, in, nblocks);
  return y;
}
