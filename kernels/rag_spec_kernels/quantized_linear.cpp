// Few-row products over weights kept in quantised blocks, as GGUF files hold them (quantized.py
// converts a file's blocks to these layouts): each output's inputs in groups of 32 (16 for
// Q6_K) with a scale (and a minimum) per group, the values 4 bits (Q4_0, Q4_1, Q4_K) or 8 bits
// (Q8_0, Q6_K widened) wide. Weights are read at a sixth or a quarter of float32's bytes, and
// multiplied as integers.
//
// As llama.cpp does for these formats, each row's inputs are first quantised to 8 bits per
// group (a scale of the group's largest magnitude / 127, values rounded to nearest even);
// a group's integer dot product with a weight's is exact, and only its scaling is float. Unlike
// llama.cpp's, whose dot products go one row and one output at a time, a weight's block is
// loaded (and its 4-bit values unpacked) once for up to four rows (eight with VNNI): a token
// tree costs its rows' integer arithmetic, not another read of the weight.
//
// Layout, per block of 8 outputs (one 32-bit lane each): 8-bit values (blocks, in / 4, 32),
// byte 4 * o + i holding output o's input 4 * c + i; 4-bit values (blocks, in / 8, 32), the
// same byte holding input 8 * c + i in its low half and 8 * c + 4 + i in its high half; scales
// and minimums (blocks, in / group, 8) in half precision; or, for the K-quants, whose scales
// are 6- or 8-bit numbers times a half-precision one per 256 inputs, those numbers as bytes and
// their factors (blocks, in / 256, 16: 8 outputs' scale factors, then their minimums') in single
// precision, multiplied here (exactly, so the same bits as precomputed scales, in fewer bytes).
// A weight is value * scale + minimum, each scale over a group of 32 inputs, or of 16 (Q6_K);
// each row's inputs are quantised by the same groups.
//
// Byte products take 4-bit values as they are and 8-bit ones as magnitudes with the sign moved
// to the input. On AVX2 (vpmaddubsw: unsigned by signed, pairs summed to 16 bits) no sum can
// saturate (a 16-bit lane sums 16 of a group's 4-bit products, under 2^15). Where the CPU has
// AVX-512 VNNI (a build with -mavx512vnni), vpdpbusd sums a lane's four products straight into
// 32 bits, one instruction where AVX2 takes two or three, and AVX-512's 32 vector registers
// hold the sums of eight rows past a block; 512-bit registers take two blocks at once, 8-bit
// values there read as unsigned 128 above themselves, the group's input sum times 128 taken
// off after. Every path gives each group the same exact integer sum.
// Each output of a row is scaled and summed in one fixed order (group by group), whatever rows
// are beside it: a row's result does not depend on them, nor on the instructions used.
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

constexpr int64_t OUTPUTS = 8;  // outputs per block
#ifdef __AVX512VNNI__
constexpr bool VNNI = true;
constexpr int MOST_ROWS = 8;  // rows that go past a loaded block at once
#else
constexpr bool VNNI = false;
constexpr int MOST_ROWS = 4;
#endif

// Each row's inputs as 8-bit integers with a scale per group (of the weight's width), and that
// scale times the group's sum (the minimums' share of a product).
struct Inputs {
  int64_t in, groups;
  std::vector<int8_t> values;  // (rows, in)
  std::vector<float> scales, sums;  // (rows, groups)
  std::vector<int32_t> totals;  // (rows, groups): each group's values summed
};

inline float largest_of(__m256 v) {  // the largest of v's 8 lanes
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int sum_of(__m256i v) {  // the sum of v's 8 32-bit lanes
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// One group of 32 or 16 inputs (N vectors of 8) as 8-bit values (written to ``values``) with a
// scale of its largest magnitude / 127, each rounded to nearest even; returns the scale, and
// the values' sum.
template <int N>
inline float quantized_group(const float* p, int8_t* values, int& sum) {
  __m256 v[4];
  __m256 largest = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int i = 0; i < N; ++i) {
    v[i] = _mm256_loadu_ps(p + 8 * i);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  // a NaN makes the scale NaN; a scale too small to invert (or not finite) leaves the values
  // zero, and one not finite still reaches the output through the scale
  const float scale = _mm256_movemask_ps(unordered) ? NAN : largest_of(largest) / 127.f;
  if (!(std::isnormal(scale) && scale < 1e37f)) {
    std::memset(values, 0, 8 * N);
    sum = 0;
    return scale;
  }
  const __m256 inverse = _mm256_set1_ps(1.f / scale);
  __m256i r[4];  // |value| <= 127: the packs below never saturate
  for (int i = 0; i < N; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  for (int i = N; i < 4; ++i) r[i] = _mm256_setzero_si256();
  sum = sum_of(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
  // packing interleaves the vectors' halves 4 values at a time; the permute restores order (of
  // two vectors, the first 16 bytes are theirs)
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  std::memcpy(values, &packed, 8 * N);
  return scale;
}

template <int G>
Inputs quantized_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t groups = in / G;
  Inputs q{in, groups, std::vector<int8_t>(rows * in), std::vector<float>(rows * groups),
           std::vector<float>(rows * groups), std::vector<int32_t>(rows * groups)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      int sum;
      const float scale = quantized_group<G / 8>(x + r * in + g * G,
                                                 q.values.data() + r * in + g * G, sum);
      q.scales[r * groups + g] = scale;
      q.sums[r * groups + g] = scale * static_cast<float>(sum);
      q.totals[r * groups + g] = sum;
    }
  return q;
}

inline __m256i four_inputs(const int8_t* p) {  // inputs p[0..3], in every 32-bit lane
  int32_t bytes;
  std::memcpy(&bytes, p, 4);
  return _mm256_set1_epi32(bytes);
}

// sum plus, in each 32-bit lane, the four products of u's bytes (unsigned) and s's (signed);
// only where every pair of products fits 16 bits on AVX2
inline __m256i dot4(__m256i sum, __m256i u, __m256i s) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(sum, u, s);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// A block's scales and minimums, group by group: half precision (S = uint16_t), or bytes times
// a factor per 256 inputs (S = int8_t); and where the next block's are, for two at once.
template <typename S>
struct Scales {
  const S* scales;
  const S* mins;  // null: no minimums
  const float* factors;  // null: none (half precision)
  int shift;  // log2 of the groups a factor spans (8 or 16: a shift, not a division)
  int64_t groups_apart, factors_apart;

  // the 8 outputs' scales (which 0) or minimums (1) of group g
  __m256 eight(int64_t g, int which) const {
    const S* p = (which ? mins : scales) + g * OUTPUTS;
    if constexpr (std::is_same_v<S, uint16_t>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
                           _mm256_loadu_ps(factors + (g >> shift) * 2 * OUTPUTS + which * OUTPUTS));
    }
  }

#ifdef __AVX512VNNI__
  __m512 sixteen(int64_t g, int which) const {  // this block's 8, then the next one's
    const S* p = (which ? mins : scales) + g * OUTPUTS;
    if constexpr (std::is_same_v<S, uint16_t>) {
      return _mm512_cvtph_ps(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + groups_apart)), 1));
    } else {
      const __m128i bytes =
          _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + groups_apart)));
      const float* f = factors + (g >> shift) * 2 * OUTPUTS + which * OUTPUTS;
      const __m512 factor = _mm512_castpd_ps(_mm512_insertf64x4(
          _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(f))),
          _mm256_castps_pd(_mm256_loadu_ps(f + factors_apart)), 1));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), factor);
    }
  }
#endif
};

// ROWS rows (from ``r0``) past one block: its 8 outputs for each row, stored ``ldy`` apart
// (G: inputs per group, a constant, as every loop bound here: a bound read at run time cost
// steps of a few rows about a tenth, python -m lab.quantized_peak).
template <bool FOUR, bool MIN, typename S, int G, int ROWS>
void rows_past_block(const uint8_t* values, const Scales<S>& s, const Inputs& q, int64_t r0,
                     float* y, int64_t ldy) {
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    const int8_t* x = q.values.data() + r0 * q.in + g * G;
    // VNNI's products add into their sum: two sums a row halve the chain each waits on
    __m256i sum[ROWS], more[ROWS];
    for (int r = 0; r < ROWS; ++r) sum[r] = more[r] = _mm256_setzero_si256();
    if constexpr (FOUR) {
      const __m256i mask = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 1  // unrolled, gcc computes every product first and spills them
      for (int c = 0; c < G / 8; ++c) {
        const __m256i packed = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(values + (g * G / 8 + c) * 32));
        const __m256i low = _mm256_and_si256(packed, mask);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* xr = x + r * q.in + c * 8;
          if constexpr (VNNI) {
            sum[r] = dot4(sum[r], low, four_inputs(xr));
            more[r] = dot4(more[r], high, four_inputs(xr + 4));
          } else {  // 16-bit lanes, widened once a group: at most 16 * 15 * 127 < 2^15
            sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(low, four_inputs(xr)));
            sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(high, four_inputs(xr + 4)));
          }
        }
      }
      if constexpr (!VNNI)
        for (int r = 0; r < ROWS; ++r) sum[r] = _mm256_madd_epi16(sum[r], _mm256_set1_epi16(1));
    } else {
      constexpr int STEP = VNNI ? 2 : 1;  // chunks a pass: one for each sum of a row
#pragma GCC unroll 1
      for (int c = 0; c < G / 4; c += STEP) {
        __m256i w[STEP], magnitude[STEP];
        for (int i = 0; i < STEP; ++i) {
          w[i] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(values + (g * G / 4 + c + i) * 32));
          magnitude[i] = _mm256_sign_epi8(w[i], w[i]);  // -128 reads as 128, unsigned
        }
        for (int r = 0; r < ROWS; ++r) {  // a pair's sum: at most 2 * 128 * 127 < 2^15
          const int8_t* xr = x + r * q.in + c * 4;
          sum[r] = dot4(sum[r], magnitude[0], _mm256_sign_epi8(four_inputs(xr), w[0]));
          if constexpr (VNNI)
            more[r] = dot4(more[r], magnitude[1], _mm256_sign_epi8(four_inputs(xr + 4), w[1]));
        }
      }
    }
    if constexpr (VNNI)
      for (int r = 0; r < ROWS; ++r) sum[r] = _mm256_add_epi32(sum[r], more[r]);
    const __m256 scale = s.eight(g, 0);
    const __m256 minimum = MIN ? s.eight(g, 1) : _mm256_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (r0 + r) * q.groups + g;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]),
                               _mm256_mul_ps(scale, _mm256_set1_ps(q.scales[at])), acc[r]);
      if constexpr (MIN) acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(q.sums[at]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

template <typename S>
using Rows = void (*)(const uint8_t*, const Scales<S>&, const Inputs&, int64_t, float*, int64_t);

template <bool FOUR, bool MIN, typename S, int G, size_t... N>
constexpr std::array<Rows<S>, sizeof...(N)> rows_table(std::index_sequence<N...>) {
  return {&rows_past_block<FOUR, MIN, S, G, static_cast<int>(N) + 1>...};
}

#ifdef __AVX512VNNI__
// Two adjacent blocks' 16 outputs at once in 512-bit registers: half the
// instructions of one block at a time, where VNNI multiplies 512 bits at once or nearly (on
// Zen 4 a 512-bit vpdpbusd outruns two 256-bit ones: python -m lab.quantized_peak). Lane by
// lane the operations are rows_past_block's, so are the bits. Only for steps of many rows,
// whose arithmetic outweighs reading the weights: reading two blocks side by side splits one
// stream of weights in two, which the hardware's prefetching follows worse, and a step of a
// few rows waits on that reading (python -m lab.one_b_shape).
inline __m512i two(const uint8_t* p, int64_t apart) {  // 32 bytes from each block
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + apart)), 1);
}

inline __m512i four_inputs_512(const int8_t* p) {
  int32_t bytes;
  std::memcpy(&bytes, p, 4);
  return _mm512_set1_epi32(bytes);
}

template <bool FOUR, bool MIN, typename S, int G, int ROWS>
void rows_past_two_blocks(const uint8_t* values, int64_t block_bytes, const Scales<S>& s,
                          const Inputs& q, int64_t r0, float* y, int64_t ldy) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    const int8_t* x = q.values.data() + r0 * q.in + g * G;
    __m512i sum[ROWS], more[ROWS];
    for (int r = 0; r < ROWS; ++r) sum[r] = more[r] = _mm512_setzero_si512();
    if constexpr (FOUR) {
      const __m512i mask = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 1
      for (int c = 0; c < G / 8; ++c) {
        const __m512i packed = two(values + (g * G / 8 + c) * 32, block_bytes);
        const __m512i low = _mm512_and_si512(packed, mask);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* xr = x + r * q.in + c * 8;
          sum[r] = _mm512_dpbusd_epi32(sum[r], low, four_inputs_512(xr));
          more[r] = _mm512_dpbusd_epi32(more[r], high, four_inputs_512(xr + 4));
        }
      }
    } else {  // weights read unsigned, 128 above themselves: 128 times the inputs' sum less
#pragma GCC unroll 1
      for (int c = 0; c < G / 4; c += 2) {
        const __m512i flip = _mm512_set1_epi8(-128);  // w ^ 0x80 is w + 128, unsigned
        const uint8_t* chunk = values + (g * G / 4 + c) * 32;
        const __m512i above[2] = {_mm512_xor_si512(two(chunk, block_bytes), flip),
                                  _mm512_xor_si512(two(chunk + 32, block_bytes), flip)};
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* xr = x + r * q.in + c * 4;
          sum[r] = _mm512_dpbusd_epi32(sum[r], above[0], four_inputs_512(xr));
          more[r] = _mm512_dpbusd_epi32(more[r], above[1], four_inputs_512(xr + 4));
        }
      }
      for (int r = 0; r < ROWS; ++r)
        more[r] = _mm512_sub_epi32(more[r],
                                   _mm512_set1_epi32(128 * q.totals[(r0 + r) * q.groups + g]));
    }
    const __m512 scale = s.sixteen(g, 0);
    const __m512 minimum = MIN ? s.sixteen(g, 1) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (r0 + r) * q.groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sum[r], more[r])),
                               _mm512_mul_ps(scale, _mm512_set1_ps(q.scales[at])), acc[r]);
      if constexpr (MIN) acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(q.sums[at]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);  // both blocks' outputs
}

template <typename S>
using TwoRows = void (*)(const uint8_t*, int64_t, const Scales<S>&, const Inputs&, int64_t,
                         float*, int64_t);

template <bool FOUR, bool MIN, typename S, int G, size_t... N>
constexpr std::array<TwoRows<S>, sizeof...(N)> two_rows_table(std::index_sequence<N...>) {
  return {&rows_past_two_blocks<FOUR, MIN, S, G, static_cast<int>(N) + 1>...};
}
#endif

template <bool FOUR, bool MIN, typename S, int G>
void product(const float* px, const uint8_t* values, const S* scales, const S* mins,
             const float* factors, float* py, int64_t rows, int64_t in, int64_t nblocks) {
  static constexpr auto ROWS =
      rows_table<FOUR, MIN, S, G>(std::make_index_sequence<MOST_ROWS>{});
  const Inputs q = quantized_rows<G>(px, rows, in);
  const int64_t block_bytes = in * (FOUR ? 4 : 8), block_groups = in / G * OUTPUTS;
  const int64_t block_factors = in / 256 * 2 * OUTPUTS, out = nblocks * OUTPUTS;
  const auto block = [&](int64_t b) {
    return Scales<S>{scales + b * block_groups, MIN ? mins + b * block_groups : nullptr,
                     factors ? factors + b * block_factors : nullptr, G == 32 ? 3 : 4,
                     block_groups, block_factors};
  };
  at::parallel_for(0, nblocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {  // the block stays in the core's cache for its rows
#ifdef __AVX512VNNI__
      {
        static constexpr auto TWO =
            two_rows_table<FOUR, MIN, S, G>(std::make_index_sequence<MOST_ROWS>{});
        if (rows >= MOST_ROWS && b + 1 < last) {
          for (int64_t r0 = 0; r0 < rows; r0 += MOST_ROWS)
            TWO[std::min<int64_t>(MOST_ROWS, rows - r0) - 1](
                values + b * block_bytes, block_bytes, block(b), q, r0,
                py + r0 * out + b * OUTPUTS, out);
          ++b;
          continue;
        }
      }
#endif
      for (int64_t r0 = 0; r0 < rows; r0 += MOST_ROWS)
        ROWS[std::min<int64_t>(MOST_ROWS, rows - r0) - 1](values + b * block_bytes, block(b), q,
                                                          r0, py + r0 * out + b * OUTPUTS, out);
    }
  });
}

}  // namespace

// x: (rows, in) float32; values: (blocks, in / 8, 32) uint8 (4-bit pairs) or (blocks, in / 4,
// 32) int8; scales and mins: (blocks, in / group, 8) float16, or int8 with factors (blocks, in /
// 256, 16) float32, a group of 32 or 16 inputs, mins possibly empty (no minimum), factors empty
// for float16 scales. Returns (rows, blocks * 8) float32.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values,
                               const at::Tensor& scales, const at::Tensor& mins,
                               const at::Tensor& factors) {
  const bool four = values.scalar_type() == at::kByte, minimum = mins.numel() > 0;
  const bool bytes = scales.scalar_type() == at::kChar;
  const int64_t in = x.dim() == 2 ? x.size(1) : 0;
  const int64_t group = scales.dim() == 3 && scales.size(1) ? in / scales.size(1) : 0;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  (group == 32 || group == 16) && in % group == 0 && values.dim() == 3 &&
                  values.is_contiguous() && (four || values.scalar_type() == at::kChar) &&
                  values.size(2) == 32 && values.size(1) == in / (four ? 8 : 4) &&
                  (bytes || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.size(0) == values.size(0) && scales.size(1) * group == in &&
                  scales.size(2) == OUTPUTS &&
                  (!minimum || (mins.sizes() == scales.sizes() &&
                                mins.scalar_type() == scales.scalar_type() &&
                                mins.is_contiguous())) &&
                  (!bytes || (in % 256 == 0 && factors.scalar_type() == at::kFloat &&
                              factors.is_contiguous() && factors.dim() == 3 &&
                              factors.size(0) == values.size(0) &&
                              factors.size(1) == in / 256 && factors.size(2) == 2 * OUTPUTS)),
              "quantized_linear: contiguous float32 (rows, in) input, (blocks, in / 8, 32) "
              "uint8 or (blocks, in / 4, 32) int8 values, (blocks, in / group, 8) float16 "
              "scales and minimums (or none), or int8 ones with (blocks, in / 256, 16) float32 "
              "factors, a group of 32 or 16 inputs");
  const int64_t rows = x.size(0), nblocks = values.size(0);
  auto y = at::empty({rows, nblocks * OUTPUTS}, x.options());
  if (rows == 0 || in == 0) return y.zero_();
  const float* px = x.data_ptr<float>();
  const auto* v = reinterpret_cast<const uint8_t*>(values.data_ptr());
  float* py = y.data_ptr<float>();
  auto run = [&](const auto* s, const auto* m, const float* f) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    auto grouped = [&](auto width) {
      constexpr int G = decltype(width)::value;
      if (four && minimum)
        product<true, true, S, G>(px, v, s, m, f, py, rows, in, nblocks);
      else if (four)
        product<true, false, S, G>(px, v, s, m, f, py, rows, in, nblocks);
      else if (minimum)
        product<false, true, S, G>(px, v, s, m, f, py, rows, in, nblocks);
      else
        product<false, false, S, G>(px, v, s, m, f, py, rows, in, nblocks);
    };
    if (group == 16)
      grouped(std::integral_constant<int, 16>{});
    else
      grouped(std::integral_constant<int, 32>{});
  };
  if (bytes)
    run(scales.data_ptr<int8_t>(), minimum ? mins.data_ptr<int8_t>() : nullptr,
        factors.data_ptr<float>());
  else
    run(reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
        minimum ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr,
        nullptr);
  return y;
}
