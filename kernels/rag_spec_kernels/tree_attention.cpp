// Attention of a step's query tokens over a KV cache under a compact tree mask (AVX-512,
// float32): the CPU twin of the Triton kernel, with the same contract as reference_attention.
// Built only where the extension is compiled for AVX-512 (an AVX2 build leaves it out).
//
// A decoding step at long context reads the whole cache for a few queries; SDPA's CPU flash
// kernel takes two to three times as long as that read. Here each KV head's keys pass once,
// KEYS at a time, for all its query rows (the query heads sharing it, times the step's
// tokens): a row's scores are dot products summed lane-wise, 16 to a vector, its softmax is
// online (flash-decoding style), and its values are added from the rows just read, while they
// are in the core's cache. Blocks that no row sees (holes, padding) are skipped.
//
// Work items are (batch row, KV head, slice of SPLIT_KEYS committed slots), merged per query
// row in slice order. Where those are fewer than twice the cores, a step of several tokens makes
// each query head of a KV head an item of its own: one row's 3 KV heads (the default model) on
// two cores left one core idle for a third of a tree step's attention. Every row's sums run in
// the same order whichever rows share its item, so a row's result depends on its own keys and
// mask only, never on the other rows of the batch or the number of query tokens beside it.
#if defined(__AVX512F__)
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t KEYS = 32;  // keys per block: two vectors of scores per query row
constexpr int64_t SPLIT_KEYS = 512;
constexpr int MAX_CHUNKS = 8;  // head dimension up to 8 * 16 = 128
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0: 2^n * exp(r), r = x - n ln 2 in [-ln2/2, ln2/2], exp(r) by its Taylor
// series to r^7 (relative error < 1e-7), 2^n applied by scalef (0 below float's range).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result: the sum of v[j]'s 16 lanes (pairs combined in four levels).
inline __m512 lane_sums(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: its sums of 4 consecutive vectors
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 halves[2];
  for (int i = 0; i < 2; ++i)  // 128-bit lanes added in pairs
    halves[i] = _mm512_add_ps(
        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of ROWS (1 or 2) consecutive query rows against a block's keys, into ``weights``
// (KEYS per row). Two rows share each key's loads: 8 keys of each per vector of sums.
template <int CHUNKS, int ROWS>
inline void score_rows(const float* queries, const float* const* keys, float* weights) {
  constexpr int DIM = 16 * CHUNKS, STEP = 16 / ROWS;
  __m512 query[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) query[r][c] = _mm512_loadu_ps(queries + r * DIM + 16 * c);
  for (int start = 0; start < KEYS; start += STEP) {
    __m512 products[16];  // [row * STEP + key]
    for (int j = 0; j < STEP; ++j) {
      const float* key = keys[start + j];
      for (int c = 0; c < CHUNKS; ++c) {
        const __m512 part = _mm512_loadu_ps(key + 16 * c);
        for (int r = 0; r < ROWS; ++r)
          products[r * STEP + j] = c ? _mm512_fmadd_ps(query[r][c], part, products[r * STEP + j])
                                     : _mm512_mul_ps(query[r][0], part);
      }
    }
    const __m512 sums = lane_sums(products);
    if (ROWS == 1) {
      _mm512_storeu_ps(weights + start, sums);
    } else {
      _mm256_storeu_ps(weights + start, _mm512_castps512_ps256(sums));
      _mm256_storeu_ps(weights + KEYS + start, _mm512_extractf32x8_ps(sums, 1));
    }
  }
}

// The values of a block's first ``count`` keys, weighted, added to ROWS consecutive rows'
// outputs (``stride`` floats apart); two sums per output (even, odd keys) for shorter chains,
// and two rows share each value's loads.
template <int CHUNKS, int ROWS>
inline void add_values(const float* const* values, const float* weights, float* out,
                       int64_t stride, int count) {
  __m512 even[ROWS][CHUNKS], odd[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) {
      even[r][c] = _mm512_loadu_ps(out + r * stride + 16 * c);
      odd[r][c] = _mm512_setzero_ps();
    }
  int j = 0;
  for (; j + 1 < count; j += 2)
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512 first = _mm512_loadu_ps(values[j] + 16 * c);
      const __m512 second = _mm512_loadu_ps(values[j + 1] + 16 * c);
      for (int r = 0; r < ROWS; ++r) {
        even[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[r * KEYS + j]), first, even[r][c]);
        odd[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[r * KEYS + j + 1]), second,
                                    odd[r][c]);
      }
    }
  if (j < count)
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512 last = _mm512_loadu_ps(values[j] + 16 * c);
      for (int r = 0; r < ROWS; ++r)
        even[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[r * KEYS + j]), last, even[r][c]);
    }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c)
      _mm512_storeu_ps(out + r * stride + 16 * c, _mm512_add_ps(even[r][c], odd[r][c]));
}

// A block of up to KEYS keys against every query row, in three passes over the rows (scores,
// softmax, values): a row's work in a pass does not wait on the row before it, so the core
// overlaps rows; where two neighbouring rows both attend, they go together (heads up to 64).
// ``seen[r]``: the keys row r attends to (unseen lanes point at a seen key). ``state``: per
// row max, sum, then ``16 * CHUNKS`` unnormalised outputs; ``weights``: scratch.
template <int CHUNKS>
void attend_block(const float* queries, int64_t rows, const float* const* keys,
                  const float* const* values, const uint32_t* seen, float* state,
                  float* weights) {
  constexpr int DIM = 16 * CHUNKS, WIDTH = DIM + 2, HALVES = KEYS / 16;
  constexpr bool PAIRS = CHUNKS <= 4;  // registers for two rows' sums
  auto paired = [&](int64_t r) { return PAIRS && r + 1 < rows && seen[r] && seen[r + 1]; };
  for (int64_t r = 0; r < rows; ++r) {  // scores
    if (paired(r)) {
      score_rows<CHUNKS, 2>(queries + r * DIM, keys, weights + r * KEYS);
      ++r;
    } else if (seen[r]) {
      score_rows<CHUNKS, 1>(queries + r * DIM, keys, weights + r * KEYS);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // online softmax: scores become weights
    if (!seen[r]) continue;
    float* row = state + r * WIDTH;
    __m512 scores[HALVES];
    __m512 top = _mm512_set1_ps(NEG_INF);
    for (int h = 0; h < HALVES; ++h) {
      scores[h] = _mm512_loadu_ps(weights + r * KEYS + 16 * h);
      top = _mm512_mask_max_ps(top, static_cast<__mmask16>(seen[r] >> (16 * h)), top, scores[h]);
    }
    const float block_max = _mm512_reduce_max_ps(top);
    if (block_max > row[0]) {
      const float rescale = std::exp(row[0] - block_max);  // 0 for the first keys seen
      row[1] *= rescale;
      for (int c = 0; c < CHUNKS; ++c)
        _mm512_storeu_ps(row + 2 + 16 * c,
                         _mm512_mul_ps(_mm512_loadu_ps(row + 2 + 16 * c),
                                       _mm512_set1_ps(rescale)));
      row[0] = block_max;
    }
    __m512 total = _mm512_setzero_ps();
    for (int h = 0; h < HALVES; ++h) {
      const __m512 weight = _mm512_maskz_mov_ps(
          static_cast<__mmask16>(seen[r] >> (16 * h)),
          exp_nonpositive(_mm512_sub_ps(scores[h], _mm512_set1_ps(row[0]))));
      total = _mm512_add_ps(total, weight);
      _mm512_storeu_ps(weights + r * KEYS + 16 * h, weight);
    }
    row[1] += _mm512_reduce_add_ps(total);
  }
  // keys past the last any row sees add nothing
  const int count = 32 - __builtin_clz(*std::max_element(seen, seen + rows) | 1);
  for (int64_t r = 0; r < rows; ++r) {  // values
    if (paired(r)) {
      add_values<CHUNKS, 2>(values, weights + r * KEYS, state + r * WIDTH + 2, WIDTH, count);
      ++r;
    } else if (seen[r]) {
      add_values<CHUNKS, 1>(values, weights + r * KEYS, state + r * WIDTH + 2, WIDTH, count);
    }
  }
}

struct Step {
  const float *query, *key, *value;
  int64_t q_b, q_h, q_t, k_b, k_h, k_s, v_b, v_h, v_s;  // strides (the last dimension's is 1)
  const uint8_t* committed;  // [batch, n_committed]: which (selected) committed slots hold tokens
  const uint8_t* recent;     // [batch, q_len, n_round]: which round slots each query token sees
  const int64_t* select;     // [batch, n_committed] slots read, or null for slots 0..n_committed
  int64_t n_committed, round_start, n_round, q_len, groups, dim;
  float scale;
};

// The 32 bits of ``n`` (<= 32) mask bytes: which are not zero.
inline uint32_t nonzero_bits(const uint8_t* bytes, int64_t n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (n == KEYS) {  // a whole block: its 32 bytes in one compare
    const __m256i loaded = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    return _mm256_cmpneq_epi8_mask(loaded, _mm256_setzero_si256());
  }
#endif
  uint32_t bits = 0;
  for (int64_t j = 0; j < n; ++j) bits |= static_cast<uint32_t>(bytes[j] != 0) << j;
  return bits;
}

// Query rows of (b, kv head)'s query heads [g0, g1) against committed slots [first, last) and,
// with ``round``, the round's slots; state: per row max, sum, then ``dim`` outputs, at ``state``
// (rows * (dim + 2)).
template <int CHUNKS>
void attend_slice(const Step& s, int64_t b, int64_t kv_head, int64_t g0, int64_t g1,
                  int64_t first, int64_t last, bool round, float* state) {
  const int64_t rows = (g1 - g0) * s.q_len, dim = s.dim, width = dim + 2;
  std::vector<float> queries(rows * dim);  // scaled, row = (group - g0) * q_len + token
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t t = 0; t < s.q_len; ++t) {
      const float* q = s.query + b * s.q_b + (kv_head * s.groups + g) * s.q_h + t * s.q_t;
      float* to = queries.data() + ((g - g0) * s.q_len + t) * dim;
      for (int64_t d = 0; d < dim; ++d) to[d] = q[d] * s.scale;
    }
  for (int64_t r = 0; r < rows; ++r) {
    state[r * width] = NEG_INF;
    std::fill(state + r * width + 1, state + (r + 1) * width, 0.0f);
  }
  std::vector<float> weights(rows * KEYS);
  std::vector<uint32_t> seen(rows);
  const float* key = s.key + b * s.k_b + kv_head * s.k_h;
  const float* value = s.value + b * s.v_b + kv_head * s.v_h;
  const float* keys[KEYS];
  const float* values[KEYS];
  auto point = [&](int64_t j, int64_t slot) {
    keys[j] = key + slot * s.k_s;
    values[j] = value + slot * s.v_s;
  };
  const uint8_t* committed = s.committed + b * s.n_committed;
  const int64_t* select = s.select ? s.select + b * s.n_committed : nullptr;
  for (int64_t start = first; start < last; start += KEYS) {
    const int64_t n = std::min(KEYS, last - start);
    const uint32_t bits = nonzero_bits(committed + start, n);
    if (!bits) continue;
    const int64_t spare = start + __builtin_ctz(bits);  // lanes not seen read a seen key
    for (int64_t j = 0; j < KEYS; ++j) {
      const int64_t at = (j < n && (bits >> j & 1)) ? start + j : spare;
      point(j, select ? select[at] : at);
    }
    std::fill(seen.begin(), seen.end(), bits);
    attend_block<CHUNKS>(queries.data(), rows, keys, values, seen.data(), state, weights.data());
  }
  if (!round) return;
  const uint8_t* recent = s.recent + b * s.q_len * s.n_round;
  for (int64_t start = 0; start < s.n_round; start += KEYS) {
    const int64_t n = std::min(KEYS, s.n_round - start);
    uint32_t any = 0;  // a compiled step's round spans every slot: most blocks no row sees
    for (int64_t r = 0; r < rows; ++r) {
      seen[r] = nonzero_bits(recent + (r % s.q_len) * s.n_round + start, n);
      any |= seen[r];
    }
    if (!any) continue;
    for (int64_t j = 0; j < KEYS; ++j) point(j, s.round_start + start + std::min(j, n - 1));
    attend_block<CHUNKS>(queries.data(), rows, keys, values, seen.data(), state, weights.data());
  }
}

using Slice = void (*)(const Step&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                       float*);

template <int... C>
constexpr std::array<Slice, sizeof...(C)> slices(std::integer_sequence<int, C...>) {
  return {&attend_slice<C + 1>...};
}

constexpr auto SLICES = slices(std::make_integer_sequence<int, MAX_CHUNKS>());

}  // namespace

// query: [B, heads, q, D]; key, value: [B, kv_heads, S + R, D] (last dimension contiguous);
// committed: uint8 [B, K]; recent: uint8 [B, q, R]; select: int64 [B, K] or an empty tensor.
// Returns [B, q, heads, D], the layout attention modules hand on.
at::Tensor tree_attention_cpu(const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& committed,
                                 const at::Tensor& recent, const at::Tensor& select,
                                 double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && query.dim() == 4 && key.dim() == 4 &&
                  value.dim() == 4,
              "tree_attention_cpu: float32 [B, heads, q, D] query and [B, kv_heads, slots, D] "
              "keys and values");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "tree_attention_cpu: the head dimension must have stride 1");
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2),
                dim = query.size(3), kv_heads = key.size(1);
  TORCH_CHECK(dim % 16 == 0 && dim / 16 <= MAX_CHUNKS && heads % kv_heads == 0,
              "tree_attention_cpu: head dimension a multiple of 16 up to 128");
  TORCH_CHECK(committed.scalar_type() == at::kByte && committed.is_contiguous() &&
                  recent.scalar_type() == at::kByte && recent.is_contiguous() &&
                  recent.size(1) == q_len,
              "tree_attention_cpu: contiguous uint8 committed [B, K] and recent [B, q, R] bits");
  const bool selected = select.numel() > 0;
  TORCH_CHECK(!selected || (select.scalar_type() == at::kLong && select.is_contiguous() &&
                            select.sizes() == committed.sizes()),
              "tree_attention_cpu: select is int64 [B, K] like committed");
  const int64_t n_round = recent.size(2);
  const Step step{query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(),
                  query.stride(0), query.stride(1), query.stride(2),
                  key.stride(0), key.stride(1), key.stride(2),
                  value.stride(0), value.stride(1), value.stride(2),
                  committed.data_ptr<uint8_t>(), recent.data_ptr<uint8_t>(),
                  selected ? select.data_ptr<int64_t>() : nullptr,
                  committed.size(1), key.size(2) - n_round, n_round, q_len,
                  heads / kv_heads, dim, static_cast<float>(scale)};
  const int64_t groups = step.groups, rows = groups * q_len, width = dim + 2;
  const int64_t splits = std::max<int64_t>(1, (step.n_committed + SPLIT_KEYS - 1) / SPLIT_KEYS);
  // a KV head's query heads share an item (two rows read each key once), unless that leaves
  // cores idle in a step of several tokens; items of one slice run one after another (its keys
  // stay in the core's cache)
  const bool few = batch * kv_heads * splits < 2 * at::get_num_threads();
  const int64_t per_item = q_len > 1 && few ? 1 : groups, item_rows = per_item * q_len;
  auto state = at::empty({batch * kv_heads, splits, rows, width}, query.options());
  float* states = state.data_ptr<float>();
  const Slice slice = SLICES[dim / 16 - 1];
  const int64_t parts = groups / per_item;
  at::parallel_for(0, batch * kv_heads * splits * parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t pair = item / (splits * parts), split = item / parts % splits,
                    part = item % parts;
      slice(step, pair / kv_heads, pair % kv_heads, part * per_item, (part + 1) * per_item,
            split * SPLIT_KEYS, std::min(step.n_committed, (split + 1) * SPLIT_KEYS),
            split == splits - 1,
            states + ((pair * splits + split) * rows + part * item_rows) * width);
    }
  });
  auto out = at::empty({batch, q_len, heads, dim}, query.options());
  float* outs = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / kv_heads, kv_head = pair % kv_heads;
      const float* parts = states + pair * splits * rows * width;
      for (int64_t r = 0; r < rows; ++r) {
        float top = NEG_INF;
        for (int64_t p = 0; p < splits; ++p) top = std::max(top, parts[(p * rows + r) * width]);
        float* to = outs + ((b * q_len + r % q_len) * heads + kv_head * groups + r / q_len) * dim;
        std::fill(to, to + dim, 0.0f);
        float sum = 0.0f;
        for (int64_t p = 0; p < splits; ++p) {
          const float* part = parts + (p * rows + r) * width;
          if (part[0] == NEG_INF) continue;  // this slice showed the row no key
          const float weight = std::exp(part[0] - top);
          sum += part[1] * weight;
          for (int64_t d = 0; d < dim; ++d) to[d] += part[2 + d] * weight;
        }
        if (sum > 0.0f)
          for (int64_t d = 0; d < dim; ++d) to[d] /= sum;
      }
    }
  });
  return out;
}
#endif  // __AVX512F__
