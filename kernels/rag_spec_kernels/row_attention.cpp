// Attention whose every query row is computed from its own visible keys alone, in their order
// (float32, AVX2; AVX-512 builds run the same instructions): a token of a verified tree gets
// bit for bit the output it gets in a one-token step once its ancestors are committed, because
// both see the same keys in the same order (the committed slots, then its ancestors) and
// nothing here depends on where those keys sit in the cache or on the rows beside it.
//
// Per row: the visible slots listed in slot order; each key's score a dot product over the head
// dimension in one fixed order (8 lanes, then a fixed tree of additions); the maximum (exact in
// any order); each exponential by one vector routine whatever its lane (a tail is padded with
// -inf, never computed another way); the denominator summed 8 lanes by the key's place in the
// list; the values added key after key. Masked keys are skipped, not added as zeros. Four keys'
// scores are reduced together (``lane_sums``), adding the same pairs as one key's reduction;
// the query heads that share a KV head run together, a tile of keys at a time, so that keys
// and values come from L2 once for the group (``attend_group``).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t MOST_CHUNKS = 16;  // head dimension up to 16 * 8 = 128
constexpr int64_t MOST_GROUP = 64;  // query heads per KV head

// exp(x) for x <= 0 (or -inf): 2^n * exp(r), r = x - n ln 2 in [-ln2/2, ln2/2], exp(r) by its
// Taylor series to r^7 (relative error < 1e-7); 2^n built in the exponent bits, 0 below -126.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i bits = _mm256_slli_epi32(_mm256_max_epi32(biased, _mm256_setzero_si256()), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));  // 2^n: zero where n < -126
}

inline float lane_sum(__m256 v) {  // ((0+4) + (2+6)) + ((1+5) + (3+7))
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

struct Tensor4 {  // a [B, heads, tokens, D] tensor's data and strides (last dimension dense)
  const float* data;
  int64_t batch, head, token;
  const float* at(int64_t b, int64_t h, int64_t t) const {
    return data + b * batch + h * head + t * token;
  }
};

// lane_sum of four vectors at once, each summed in lane_sum's own order (the same pairs
// added, so the same results), for four keys' scores a step: one reduction for four
inline __m128 lane_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),   // lo + hi of a | b
                                  _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20),
                                  _mm256_permute2f128_ps(c, d, 0x31));
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
  // sums: [a, c, a, c | b, d, b, d]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// The slots a row's mask allows, in order, 32 mask bytes a test.
inline void visible(const uint8_t* allowed, int64_t slots, std::vector<int64_t>& seen) {
  seen.clear();
  int64_t s = 0;
  for (; s + 32 <= slots; s += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(allowed + s));
    uint32_t bits = ~static_cast<uint32_t>(
        _mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256())));
    while (bits) {
      seen.push_back(s + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; s < slots; ++s)
    if (allowed[s]) seen.push_back(s);
}

inline __m256 score_sum(const __m256* query, const float* k, int64_t chunks) {
  __m256 acc = _mm256_mul_ps(query[0], _mm256_loadu_ps(k));
  for (int64_t c = 1; c < chunks; ++c)
    acc = _mm256_fmadd_ps(query[c], _mm256_loadu_ps(k + c * 8), acc);
  return acc;
}

constexpr int64_t TILE = 32;  // keys whose keys and values (16 KB at D = 128) stay in L1

// The query heads of one KV head (they see the same keys) for one query row; CHUNKS: the head
// dimension over 8 where the build knows it (0: ``runtime_chunks``). Keys and values are read
// a tile at a time for every head of the group, so the group's heads after the first read
// them from L1; each head's arithmetic is a lone row's, in the same order.
template <int64_t CHUNKS>
void attend_group(const Tensor4& q, const Tensor4& key, const Tensor4& value, int64_t b,
                  int64_t i, int64_t kv_head, int64_t group, const uint8_t* allowed,
                  int64_t slots, int64_t runtime_chunks, float scale, float* out,
                  int64_t head_stride, std::vector<int64_t>& seen, std::vector<float>& p,
                  std::vector<float>& accs) {
  const int64_t chunks = CHUNKS ? CHUNKS : runtime_chunks;
  visible(allowed, slots, seen);
  const int64_t n = static_cast<int64_t>(seen.size());
  if (n == 0) {  // no key: zeros, as the reference's empty softmax is taken to be
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c)
        _mm256_storeu_ps(out + g * head_stride + c * 8, _mm256_setzero_ps());
    return;
  }
  const int64_t padded = (n + 7) / 8 * 8;
  p.assign(group * padded, -std::numeric_limits<float>::infinity());
  accs.assign(group * chunks * 8, 0.0f);
  const __m128 scales = _mm_set1_ps(scale);
  for (int64_t start = 0; start < n; start += TILE) {  // scores
    const int64_t end = std::min(n, start + TILE);
    for (int64_t g = 0; g < group; ++g) {
      const float* row = q.at(b, kv_head * group + g, i);
      float* scores = p.data() + g * padded;
      __m256 query[MOST_CHUNKS];
      for (int64_t c = 0; c < chunks; ++c) query[c] = _mm256_loadu_ps(row + c * 8);
      int64_t j = start;
      for (; j + 4 <= end; j += 4)  // four keys' dot products side by side, one reduction
        _mm_storeu_ps(scores + j, _mm_mul_ps(lane_sums(
            score_sum(query, key.at(b, kv_head, seen[j]), chunks),
            score_sum(query, key.at(b, kv_head, seen[j + 1]), chunks),
            score_sum(query, key.at(b, kv_head, seen[j + 2]), chunks),
            score_sum(query, key.at(b, kv_head, seen[j + 3]), chunks)), scales));
      for (; j < end; ++j)
        scores[j] = lane_sum(score_sum(query, key.at(b, kv_head, seen[j]), chunks)) * scale;
    }
  }
  float inverse[MOST_GROUP];
  for (int64_t g = 0; g < group; ++g) {  // exponentials, each head's own
    float* scores = p.data() + g * padded;
    float largest = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) largest = std::max(largest, scores[j]);
    const __m256 top = _mm256_set1_ps(largest);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top));
      _mm256_storeu_ps(scores + j, e);
      total = _mm256_add_ps(total, e);
    }
    inverse[g] = 1.0f / lane_sum(total);
  }
  for (int64_t start = 0; start < n; start += TILE) {  // values, key after key per head
    const int64_t end = std::min(n, start + TILE);
    for (int64_t g = 0; g < group; ++g) {
      const float* weights = p.data() + g * padded;
      float* kept = accs.data() + g * chunks * 8;
      __m256 acc[MOST_CHUNKS];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_loadu_ps(kept + c * 8);
      for (int64_t j = start; j < end; ++j) {
        const float* v = value.at(b, kv_head, seen[j]);
        const __m256 weight = _mm256_set1_ps(weights[j]);
        for (int64_t c = 0; c < chunks; ++c)
          acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + c * 8), acc[c]);
      }
      for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(kept + c * 8, acc[c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m256 scaled = _mm256_set1_ps(inverse[g]);
    for (int64_t c = 0; c < chunks; ++c)
      _mm256_storeu_ps(out + g * head_stride + c * 8,
                       _mm256_mul_ps(_mm256_loadu_ps(accs.data() + (g * chunks + c) * 8), scaled));
  }
}

}  // namespace

// query [B, heads, q, D], key and value [B, kv_heads, slots, D] (last dimension dense, D a
// multiple of 8 up to 128), allowed [B, q, slots] uint8: which keys each query sees. Returns
// [B, q, heads, D].
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& allowed,
                            double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes() &&
                  query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && query.stride(3) == 1 &&
                  key.stride(3) == 1 && value.stride(3) == 1 && query.size(3) == key.size(3) &&
                  query.size(3) % 8 == 0 && query.size(3) <= 8 * MOST_CHUNKS &&
                  key.size(1) > 0 && query.size(1) % key.size(1) == 0 &&
                  query.size(1) / key.size(1) <= MOST_GROUP &&
                  allowed.scalar_type() == at::kByte && allowed.is_contiguous() &&
                  allowed.dim() == 3 && allowed.size(0) == query.size(0) &&
                  allowed.size(1) == query.size(2) && allowed.size(2) == key.size(2),
              "row_attention: float32 [B, heads, q, D] queries, [B, kv_heads, slots, D] keys "
              "and values (heads a multiple of kv_heads, at most 64 times; D a multiple of 8 up "
              "to 128; last dimension dense), a [B, q, slots] uint8 mask");
  const int64_t batch = query.size(0), heads = query.size(1), queries = query.size(2);
  const int64_t dim = query.size(3), slots = key.size(2), group = heads / key.size(1);
  auto out = at::empty({batch, queries, heads, dim}, query.options());
  const Tensor4 q{query.data_ptr<float>(), query.stride(0), query.stride(1), query.stride(2)};
  const Tensor4 k{key.data_ptr<float>(), key.stride(0), key.stride(1), key.stride(2)};
  const Tensor4 v{value.data_ptr<float>(), value.stride(0), value.stride(1), value.stride(2)};
  const uint8_t* mask = allowed.data_ptr<uint8_t>();
  float* po = out.data_ptr<float>();
  const int64_t kv_heads = key.size(1);
  const auto rows = dim == 64 ? &attend_group<8> : dim == 128 ? &attend_group<16>
                                                              : &attend_group<0>;
  at::parallel_for(0, batch * kv_heads * queries, 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> seen;
    std::vector<float> p, accs;
    for (int64_t item = first; item < last; ++item) {
      const int64_t i = item % queries, h = item / queries % kv_heads;
      const int64_t b = item / queries / kv_heads;
      rows(q, k, v, b, i, h, group, mask + (b * queries + i) * slots, slots, dim / 8,
           static_cast<float>(scale), po + ((b * queries + i) * heads + h * group) * dim, dim,
           seen, p, accs);
    }
  });
  return out;
}
