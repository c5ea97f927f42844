// Greedy decoding's argmax over the vocabulary, per row of logits [R, V] (bf16 or float32), for
// tide.engine.sampling.greedy_tokens on CPUs with AVX-512.
//
// Why: torch's CPU argmax took ~36 us a row of the reference model's 49,152 logits (float32, after
// a bf16 -> float32 copy; its bf16 argmax is unvectorised, 173 us): 0.6-0.8 ms for the 17 rows of
// a 16-node tree verification, ~4 % of the step. This reads each row twice from L2 (~3 us).
//
// Same answer as torch.argmax: the first index of the largest value, where a NaN counts as larger
// than everything (the first NaN's index), and -0.0 equals 0.0. bf16 widens to float32 exactly.
#include <torch/extension.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> float32 (a bf16 is a float's high half)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}
inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const uint16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
int64_t row_argmax(const T* x, int64_t V) {
  constexpr int64_t W = 16;
  const int64_t body = V / W * W;
  // Pass 1: the largest value, and whether any NaN is present.
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < body; i += W) {
    const __m512 v = load16(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  float top = _mm512_reduce_max_ps(best);
  bool any_nan = nan != 0;
  for (int64_t i = body; i < V; ++i) {
    const float v = scalar(x, i);
    any_nan |= std::isnan(v);
    top = v > top ? v : top;
  }
  // Pass 2: the first index holding it (the first NaN where there is one).
  for (int64_t i = 0; i < body; i += W) {
    const __m512 v = load16(x + i);
    const __mmask16 hit = any_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, _mm512_set1_ps(top), _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (int64_t i = body; i < V; ++i) {
    const float v = scalar(x, i);
    if (any_nan ? std::isnan(v) : v == top) return i;
  }
  return 0;  // V == 0 is refused before; every row has its maximum somewhere
}

}  // namespace

constexpr bool kHasArgmax = true;

// logits [R, V] bf16 or float32 (rows contiguous) -> int64 [R]: torch.argmax(logits, -1).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits [R, V] with V > 0");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "argmax_rows: bf16 or float32 logits");
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  auto out = torch::empty({R}, torch::kLong);
  auto* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    const float* p = x.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) o[r] = row_argmax(p + r * ld, V);
  } else {
    const auto* p = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < R; ++r) o[r] = row_argmax(p + r * ld, V);
  }
  return out;
}

#else

constexpr bool kHasArgmax = false;
torch::Tensor argmax_rows(const torch::Tensor&) { TORCH_CHECK(false, "argmax_rows needs AVX-512"); }

#endif

bool has_argmax() { return kHasArgmax; }
