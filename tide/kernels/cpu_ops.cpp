// Fused CPU kernels for the engine's per-token elementwise work (tide.kernels loads this file).
//
// Why: at batch 1 a decode step of the reference model is ~60 % weight streaming (the GEMMs) and
// ~40 % small ops, each a separate ATen dispatch whose code and data the GEMMs evict from the
// caches between calls. F.rms_norm on bf16 is itself ~8 ATen ops on CPU. One kernel per fused op
// removes most of that (docs/results/engine-step).
//
// Every kernel treats rows independently and computes each row with the same instruction sequence
// whatever the number of rows or the row's address, so a token's values do not depend on what
// shares its forward (batched verification must equal plain decoding, bit for bit). Reductions
// accumulate in LANES float32 partial sums in a fixed order: vectorizable without -ffast-math, and
// independent of alignment.
#include <torch/extension.h>

#include "pool.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The float32 vector operations the exp polynomial and decode attention take, per ISA: 16 lanes
// (AVX-512) or 8 (AVX2 + FMA: Zen 2/3, Haswell to Alder Lake). The same algorithm either way; the
// bits differ between the two (other lane sums), and a machine runs one.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int64_t W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {  // exact: a bf16 is a float32's upper half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for integral n in [-126, 127], by the exponent bits
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V x, float t, V y) {  // y where x >= t, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GE_OQ), y);
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using V = __m256;
  static constexpr int64_t W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V x, float t, V y) { return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_GE_OQ), y); }
  static float sum(V v) {  // a fixed order: halves, then pairs, then the last two
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
using L = Lanes;

// exp(x) for x in [-87, 88] (the same polynomial; callers clamp).
inline L::V exp_core(L::V x) {
  const L::V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  L::V r = L::sub(x, L::mul(n, L::set1(0.693359375f)));
  r = L::sub(r, L::mul(n, L::set1(-2.12194440e-4f)));
  L::V p = L::set1(1.9875691500e-4f);
  p = L::fma(p, r, L::set1(1.3981999507e-3f));
  p = L::fma(p, r, L::set1(8.3334519073e-3f));
  p = L::fma(p, r, L::set1(4.1665795894e-2f));
  p = L::fma(p, r, L::set1(1.6666665459e-1f));
  p = L::fma(p, r, L::set1(5.0000001201e-1f));
  const L::V y = L::add(L::fma(L::mul(p, r), r, r), L::set1(1.0f));
  return L::mul(y, L::pow2(n));
}

// exp(x) for x <= 0, lane-wise (softmax of scores shifted by their max): Cephes' expf polynomial,
// within 2 float32 ulps of exp. Lane-wise, so a score's bits do not depend on its lane or chunk.
// Below -87 (and -inf: masked or padded keys) exactly 0, so a padded key adds nothing anywhere.
inline L::V exp_nonpositive(L::V x) { return L::zero_below(x, -87.0f, exp_core(L::max(x, L::set1(-87.0f)))); }
#endif

#if defined(__AVX512F__)
// float32 -> bf16 bits, round to nearest even (c10::BFloat16's rounding; NaNs stay NaNs).
inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 from_bf16_bits(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 from_bf16(const void* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// One row of silu(gate) * up in bf16, 16 lanes at a time (a masked tail takes the same instructions):
// silu(v) = v / (1 + exp(-v)) with exp's argument clamped to [-87, 88] (past it silu is v or 0
// to well within a bf16 ulp), rounded to bf16, then the product, rounded.
inline void silu_mul_row_bf16(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = from_bf16(g + i, m);
    const __m512 e = exp_core(_mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), v), lo), hi));
    const __m512 s = from_bf16_bits(to_bf16(_mm512_div_ps(v, _mm512_add_ps(one, e))));
    _mm256_mask_storeu_epi16(o + i, m, to_bf16(_mm512_mul_ps(s, from_bf16(u + i, m))));
  }
}
#endif

constexpr int64_t LANES = 16;       // float32 partial sums per row (one AVX-512 register)
constexpr int64_t ROW_GRAIN = 32;   // rows per chunk: decode's few rows run inline, prompts split

// fn(a, b) over rows [a, b) in chunks of `grain` rows on tide_pool (pool.h): `fn` captures by value,
// `keep` holds the tensors it reads and writes.
template <typename F>
void for_rows(int64_t R, int64_t grain, F fn, std::vector<at::Tensor> keep) {
  tide_pool::parallel((R + grain - 1) / grain, [=](int64_t c) { fn(c * grain, std::min(R, (c + 1) * grain)); },
                      std::move(keep));
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t j = 0; j < LANES; ++j) {
      const float v = static_cast<float>(x[i + j]);
      acc[j] += v * v;
    }
  for (int64_t j = 0; i + j < n; ++j) {
    const float v = static_cast<float>(x[i + j]);
    acc[j] += v * v;
  }
  float total = 0.f;
  for (int64_t j = 0; j < LANES; ++j) total += acc[j];
  return total;
}

template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  // As F.rms_norm's fused CPU kernel: x * rsqrt(mean(x^2) + eps) * w in float32, rounded once.
  const float scale = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(x[i]) * scale * static_cast<float>(w[i]));
}

void check(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "tide kernels run on CPU tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "weight must be [hidden]");
}

}  // namespace

// rms_norm(x [..., H], w [H], eps) -> [..., H]
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  check(x_in, w_in);
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "tide_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float e = static_cast<float>(eps);
    for_rows(R, ROW_GRAIN, [=](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) norm_row(xp + r * H, wp, op + r * H, H, e);
    }, {x, w, out});
  });
  return out;
}

// add_rms_norm(x, delta, w, eps) -> (x + delta, rms_norm(x + delta)): the residual add and the next
// norm in one pass. The sum is rounded to the dtype before the norm reads it, as `x = x + delta`.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x_in, const torch::Tensor& d_in,
                                                      const torch::Tensor& w_in, double eps) {
  check(x_in, w_in);
  TORCH_CHECK(x_in.sizes() == d_in.sizes() && x_in.scalar_type() == d_in.scalar_type(),
              "x and delta must match in shape and dtype");
  const auto x = x_in.contiguous();
  const auto d = d_in.contiguous();
  const auto w = w_in.contiguous();
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "tide_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float e = static_cast<float>(eps);
    for_rows(R, ROW_GRAIN, [=](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        const int64_t o = r * H;
        for (int64_t i = 0; i < H; ++i)
          sp[o + i] = static_cast<scalar_t>(static_cast<float>(xp[o + i]) + static_cast<float>(dp[o + i]));
        norm_row(sp + o, wp, op + o, H, e);
      }
    }, {x, d, w, sum, out});
  });
  return {sum, out};
}

// silu_mul(gate_up [..., 2I]) -> silu(gate) * up [..., I], gate = the first half; each product
// rounded as F.silu(gate) * up rounds it (silu to the dtype, then the product).
torch::Tensor silu_mul(const torch::Tensor& gu_in) {
  TORCH_CHECK(gu_in.device().is_cpu() && gu_in.size(-1) % 2 == 0, "silu_mul takes a CPU [..., 2I] tensor");
  const auto gu = gu_in.contiguous();
  const int64_t I = gu.size(-1) / 2, R = I ? gu.numel() / (2 * I) : 0;
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "tide_silu_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(R, ROW_GRAIN, [=](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        const scalar_t* g = gp + r * 2 * I;
        const scalar_t* u = g + I;
        scalar_t* o = op + r * I;
#if defined(__AVX512F__)
        if (std::is_same_v<scalar_t, c10::BFloat16>) {  // (the lambda is no template: both branches compile)
          silu_mul_row_bf16(reinterpret_cast<const c10::BFloat16*>(g), reinterpret_cast<const c10::BFloat16*>(u),
                            reinterpret_cast<c10::BFloat16*>(o), I);
          continue;
        }
#endif
        for (int64_t i = 0; i < I; ++i) {
          const float v = static_cast<float>(g[i]);
          const scalar_t s = static_cast<scalar_t>(v / (1.f + std::exp(-v)));
          o[i] = static_cast<scalar_t>(static_cast<float>(s) * static_cast<float>(u[i]));
        }
      }
    }, {gu, out});
  });
  return out;
}

// rope_kv_cache(qkv [B, q, (Hq + 2 Hkv) D], cos/sin [B, q, D], k_cache/v_cache [S, Hkv, L, D], slots [B],
// positions [B, q], Hq, Hkv) -> q [B, Hq, q, D]: RoPE on the query and key heads of a fused q|k|v
// projection (tide.layers.apply_rope: x * cos + roll(x, D/2) * sin, each product and the sum
// rounded to the dtype as the torch ops round them: the same bits), the keys and values written
// into the cache at (slot, position), the rotated queries returned. One pass instead of ~10 ops.
torch::Tensor rope_kv_cache(const torch::Tensor& qkv_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots_in,
                            const torch::Tensor& pos_in, int64_t hq, int64_t hkv) {
  const auto qkv = qkv_in.contiguous();
  const auto cosr = cos_in.contiguous();
  const auto sinr = sin_in.contiguous();
  const auto slots = slots_in.to(at::kLong).contiguous();
  const auto pos = pos_in.to(at::kLong).contiguous();
  TORCH_CHECK(qkv.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rope_kv_cache: qkv [B, q, W], contiguous caches [S, Hkv, L, D]");
  const bool bf16_cache = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_cache || k_cache.scalar_type() == at::kFloat) && v_cache.scalar_type() == k_cache.scalar_type(),
              "rope_kv_cache: float32 or bfloat16 caches, both the same (the CPU engine's)");
  TORCH_CHECK(!bf16_cache || qkv.scalar_type() == at::kBFloat16, "rope_kv_cache: a bfloat16 cache takes bfloat16 "
              "keys and values only (it holds them exactly; wider ones would be rounded)");
  const int64_t B = qkv.size(0), Q = qkv.size(1), D = k_cache.size(3), L = k_cache.size(2);
  TORCH_CHECK(qkv.size(2) == (hq + 2 * hkv) * D && k_cache.size(1) == hkv && D % 2 == 0, "rope_kv_cache: shapes");
  TORCH_CHECK(cosr.size(0) == B && cosr.size(1) == Q && cosr.size(2) == D && slots.numel() == B
              && pos.size(0) == B && pos.size(1) == Q, "rope_kv_cache: cos/sin [B, q, D], slots [B], positions [B, q]");
  auto q_out = torch::empty({B, hq, Q, D}, qkv.options());
  const int64_t W = qkv.size(2), half = D / 2;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "tide_rope_kv_cache", [&] {
    using T = scalar_t;
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cosr.data_ptr<T>();
    const T* sp = sinr.data_ptr<T>();
    const int64_t* slot_p = slots.data_ptr<int64_t>();
    const int64_t* pos_p = pos.data_ptr<int64_t>();
    T* qo = q_out.data_ptr<T>();
    auto rotate = [&](const T* x, const T* c, const T* s, int64_t j) -> T {
      const T xr = j < half ? x[j + half] : x[j - half];
      const T a = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j]));
      const T b = static_cast<T>(static_cast<float>(xr) * static_cast<float>(s[j]));
      return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
    };
    auto write = [&](auto* kc, auto* vc) {  // the cache's element type: float, or bf16 for bf16 values (exact)
    using CT = std::remove_pointer_t<decltype(kc)>;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = slot_p[b];
      TORCH_CHECK(slot >= 0 && slot < k_cache.size(0), "rope_kv_cache: slot out of range");
      for (int64_t t = 0; t < Q; ++t) {
        const int64_t p = pos_p[b * Q + t];
        TORCH_CHECK(p >= 0 && p < L, "rope_kv_cache: position out of range");
        const T* row = xp + (b * Q + t) * W;
        const T* c = cp + (b * Q + t) * D;
        const T* s = sp + (b * Q + t) * D;
        for (int64_t h = 0; h < hq; ++h) {
          T* dst = qo + ((b * hq + h) * Q + t) * D;
          for (int64_t j = 0; j < D; ++j) dst[j] = rotate(row + h * D, c, s, j);
        }
        for (int64_t h = 0; h < hkv; ++h) {
          CT* kd = kc + ((slot * hkv + h) * L + p) * D;
          CT* vd = vc + ((slot * hkv + h) * L + p) * D;
          const T* kx = row + (hq + h) * D;
          const T* vx = row + (hq + hkv + h) * D;
          for (int64_t j = 0; j < D; ++j) {
            kd[j] = static_cast<CT>(rotate(kx, c, s, j));
            vd[j] = static_cast<CT>(vx[j]);
          }
        }
      }
    }
    };
    if (bf16_cache)
      write(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
    else
      write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  });
  return q_out;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

// Query rows' scores against keys [0, L) (rows of D floats, `ks` floats apart; D % 16 == 0, D <= 256):
// R rows share each key's loads, and each row's score is computed by the same instructions in the
// same order whatever R is (one accumulator over D's chunks in order, then Lanes::sum, then the
// bias), so a row's bits never depend on its neighbours. Trailing masked keys (a prompt row's later
// positions, the padding) score -inf whatever they hold: they are not read, which changes no bit
// and halves a causal prompt chunk's work. Returns each row's max score and visible length.
template <int R, int ND, typename KT>  // ND: D / Lanes::W when known at compile time (accumulators in registers), else 0
inline void qk_rows(const float* const* q, const KT* kb, int64_t ks, const float* const* bias, int64_t L,
                    int64_t D, float* const* scores, float* mx, int64_t* Lv) {
  using V = Lanes::V;
  constexpr int64_t W = Lanes::W;
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const int64_t nd = ND ? ND : D / W;
  int64_t Lmax = 0;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    Lv[r] = L;
    if (bias[r])
      while (Lv[r] > 0 && bias[r][Lv[r] - 1] == kMasked) --Lv[r];
    Lmax = std::max(Lmax, Lv[r]);
    mx[r] = kMasked;
  }
  for (int64_t l = 0; l < Lmax; ++l) {
    const KT* k = kb + l * ks;
    V acc[R];
    const V k0 = Lanes::load(k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = Lanes::mul(Lanes::load(q[r]), k0);
    #pragma GCC unroll 16
    for (int64_t c = 1; c < nd; ++c) {
      const V kc = Lanes::load(k + W * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = Lanes::fma(Lanes::load(q[r] + W * c), kc, acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float sc = l < Lv[r] ? Lanes::sum(acc[r]) + (bias[r] ? bias[r][l] : 0.f) : kMasked;
      scores[r][l] = sc;
      mx[r] = sc > mx[r] ? sc : mx[r];
    }
  }
}

// One row's softmax over its scores and the weighted sum of the values (rows of D floats, `vs`
// apart) into `out`; `scores` holds L rounded up to 16 floats, the first Lv of them set.
// `idx` (or nullptr: key l is row l) maps score l to its value row: a compacted row's (compact_visible).
template <int ND, typename VT>
inline void softmax_pv(float* scores, float mx, int64_t Lv, int64_t L, const VT* vb, int64_t vs, int64_t D,
                       float* out, const int64_t* idx) {
  using V = Lanes::V;
  constexpr int64_t W = Lanes::W;
  const int64_t nd = ND ? ND : D / W;
  const int64_t Lr = (L + 15) / 16 * 16;
  for (int64_t l = Lv; l < Lr; ++l) scores[l] = -std::numeric_limits<float>::infinity();
  const V mxv = Lanes::set1(mx);
  V sum = Lanes::zero();
  for (int64_t l = 0; l < Lr; l += W) {
    const V e = exp_nonpositive(Lanes::sub(Lanes::load(scores + l), mxv));
    Lanes::store(scores + l, e);
    sum = Lanes::add(sum, e);
  }
  const float inv = 1.f / Lanes::sum(sum);
  V acc[256 / W];
  #pragma GCC unroll 16
  for (int64_t c = 0; c < nd; ++c) acc[c] = Lanes::zero();
  for (int64_t l = 0; l < Lv; ++l) {
    const float p = scores[l] * inv;
    if (p == 0.f) continue;  // masked and padded keys: adding 0 * v would change no bit
    const V pv = Lanes::set1(p);
    const VT* v = vb + (idx ? idx[l] : l) * vs;
    #pragma GCC unroll 16
    for (int64_t c = 0; c < nd; ++c) acc[c] = Lanes::fma(pv, Lanes::load(v + W * c), acc[c]);
  }
  #pragma GCC unroll 16
  for (int64_t c = 0; c < nd; ++c) Lanes::store(out + W * c, acc[c]);
}

// A row whose bias hides keys inside its visible length (a draft tree's node, tide.engine.tree: it
// sees the cached tokens and its own ancestors, not its siblings' branches) gets its visible scores
// moved to the front, in key order, and `idx` their keys: softmax_pv then sums them in the lanes
// plain decoding of the node's path uses, where exactly those keys are contiguous, so the node's
// result is plain decoding's bits. Returns the visible count; a row without holes (every decode,
// verify and prompt row) is left as it is and returns Lv.
inline int64_t compact_visible(float* scores, int64_t Lv, int64_t* idx) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  int64_t n = 0;
  while (n < Lv && scores[n] != kMasked) ++n;
  if (n == Lv) return Lv;
  for (int64_t l = 0; l < n; ++l) idx[l] = l;
  for (int64_t l = n + 1; l < Lv; ++l) {
    if (scores[l] == kMasked) continue;
    scores[n] = scores[l];
    idx[n++] = l;
  }
  return n;
}

}  // namespace
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kHasDecodeAttention = true;

// decode_attention(q [B, Hq, t, D], k/v [B, Hkv, L, D] float32 or bfloat16, both the same (a contiguous
// last dim; other strides free: the cache's [slots, :, :L] slices; a bf16 key or value is widened to
// float32 in registers, exactly, so either cache of the same values gives the same bits), bias [B, t, L] float32 additive or None) -> [B, Hq, t, D]
// in q's dtype: tide.layers.grouped_attention's contract (query head h reads KV head h / (Hq/Hkv), q
// scaled by D^-1/2 in float32). Each (sequence, head, position) is computed on its own by one
// instruction sequence, so its result depends on its own inputs only, and padding the keys with
// masked ones changes nothing.
torch::Tensor decode_attention(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& bias_in) {
  const bool bf16_kv = k.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_kv || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type(),
              "decode_attention: float32 or bfloat16 keys and values, both the same");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: k/v [B, Hkv, L, D] with a contiguous last dim");
  const auto q = q_in.contiguous();
  const int64_t B = q.size(0), hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && hq % hkv == 0 && D % 16 == 0 && D <= 256,
              "decode_attention: shapes (D a multiple of 16, at most 256)");
  const int64_t g = hq / hkv;
  torch::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 3 && bias.size(0) == B && bias.size(1) == T && bias.size(2) == L,
                "decode_attention: bias [B, t, L]");
  }
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  auto out = torch::empty({B, hq, T, D}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // Work units are (sequence, head, block of up to kRowBlock query rows); chunks of units worth ~64K
  // multiply-adds: taking a chunk costs an atomic, and at batch 1 with 320 cached keys one layer's
  // 9 heads took 45 us on one thread. A prompt chunk's rows split across threads this way (9 heads
  // alone left one of two threads a fifth idle).
  constexpr int64_t kRowBlock = 16;
  const int64_t blocks = (T + kRowBlock - 1) / kRowBlock;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, std::min(T, kRowBlock) * L * D * 2));
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t units = B * hq * blocks;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "tide_decode_attention", [&] {
    using T_ = scalar_t;
    const T_* qp = q.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    auto run = [&](auto kv_type) {  // KT: the cache's element type
    using KT = decltype(kv_type);
    const KT* kp = k.data_ptr<KT>();
    const KT* vp = v.data_ptr<KT>();
    tide_pool::parallel(
        (units + grain - 1) / grain,
        [=](int64_t chunk) {
          constexpr int R = 4;  // query rows sharing each key's loads
          const int64_t Lr = (L + 15) / 16 * 16;
          std::vector<float> scores(R * Lr), qs(R * D), o(D);
          std::vector<int64_t> idx(Lr);
          for (int64_t unit = chunk * grain; unit < std::min(units, (chunk + 1) * grain); ++unit) {
            const int64_t bh = unit / blocks, t0 = unit % blocks * kRowBlock;
            const int64_t b = bh / hq, h = bh % hq, kh = h / g;
            const KT* kb = kp + b * ks0 + kh * ks1;
            const KT* vb = vp + b * vs0 + kh * vs1;
            const int64_t t1 = std::min(T, t0 + kRowBlock);
            for (int64_t t = t0; t < t1;) {
              const int n = t1 - t >= R ? R : 1;
              const float* qrows[R];
              const float* brows[R];
              float* srows[R];
              float mx[R];
              int64_t Lv[R];
              for (int r = 0; r < n; ++r) {
                const T_* qrow = qp + ((b * hq + h) * T + t + r) * D;
                float* qd = qs.data() + r * D;
                for (int64_t d = 0; d < D; ++d) qd[d] = static_cast<float>(qrow[d]) * scale;
                qrows[r] = qd;
                brows[r] = bp ? bp + (b * T + t + r) * L : nullptr;
                srows[r] = scores.data() + r * Lr;
              }
              constexpr int kND64 = 64 / Lanes::W;  // head_dim 64 (the reference model, Llama 3.2 1B)
              if (n == R && D == 64)
                qk_rows<R, kND64>(qrows, kb, ks2, brows, L, D, srows, mx, Lv);
              else if (n == R)
                qk_rows<R, 0>(qrows, kb, ks2, brows, L, D, srows, mx, Lv);
              else if (D == 64)
                qk_rows<1, kND64>(qrows, kb, ks2, brows, L, D, srows, mx, Lv);
              else
                qk_rows<1, 0>(qrows, kb, ks2, brows, L, D, srows, mx, Lv);
              for (int r = 0; r < n; ++r) {
                const int64_t visible = brows[r] ? compact_visible(srows[r], Lv[r], idx.data()) : Lv[r];
                const int64_t* keys = visible < Lv[r] ? idx.data() : nullptr;
                if (D == 64)
                  softmax_pv<kND64>(srows[r], mx[r], visible, L, vb, vs2, D, o.data(), keys);
                else
                  softmax_pv<0>(srows[r], mx[r], visible, L, vb, vs2, D, o.data(), keys);
                T_* orow = op + ((b * hq + h) * T + t + r) * D;
                for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T_>(o[d]);
              }
              t += n;
            }
          }
        },
        {q, k, v, out, bias});
    };
    if (bf16_kv)
      run(c10::BFloat16{});
    else
      run(float{});
  });
  return out;
}
#else
constexpr bool kHasDecodeAttention = false;
#endif

// GGUF Q8_0 rows -> int8 rows with one scale per row, as tide.quant's `_int8_rows` computes it from
// the dequantized values (the same bits: its test checks it). A Q8_0 block is 34 bytes, a float16
// scale d then 32 int8 values; w = d * q is exact in float32 (11 x 7 significant bits). The row's
// scale is max |w| / 127, at least FLT_MIN, rounded to bf16 (nearest even); each value is then
// round-half-even(w / scale), within -127..127. One pass over the blocks for the max, one to write:
// an 8B model's 7 GB convert in seconds where torch's elementwise ops took a minute.
namespace {
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline float round_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
}  // namespace

// One Q8_0 row of B blocks -> K = 32 B int8 values and the row's scale (see above).
void q8_0_quantize_row(const uint8_t* row, int64_t B, int8_t* out, float* scale) {
  float amax = 0.f;
  for (int64_t b = 0; b < B; ++b) {
    uint16_t h;
    std::memcpy(&h, row + b * 34, 2);
    const float d = std::fabs(half_to_float(h));
    const int8_t* v = reinterpret_cast<const int8_t*>(row + b * 34 + 2);
    int m = 0;
    for (int i = 0; i < 32; ++i) m = std::max(m, std::abs(static_cast<int>(v[i])));
    amax = std::max(amax, d * static_cast<float>(m));
  }
  const float s = round_to_bf16(std::max(amax / 127.f, std::numeric_limits<float>::min()));
  *scale = s;
  for (int64_t b = 0; b < B; ++b) {
    uint16_t h;
    std::memcpy(&h, row + b * 34, 2);
    const float d = half_to_float(h);
    const int8_t* v = reinterpret_cast<const int8_t*>(row + b * 34 + 2);
#if defined(__AVX512F__)
    // The scalar loop's operations, 16 lanes at a time: (v * d) / s, rounded to nearest even
    // without raising exceptions, clamped, narrowed with saturation (in range already).
    const __m512 vd = _mm512_set1_ps(d), vs = _mm512_set1_ps(s);
    const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * half));
      __m512 x = _mm512_div_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), vd), vs);
      x = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      x = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * 32 + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
    }
#else
    for (int i = 0; i < 32; ++i) {
      const float x = std::nearbyint(static_cast<float>(v[i]) * d / s);
      out[b * 32 + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, x)));
    }
#endif
  }
}

// raw uint8 [rows, blocks * 34] -> (q int8 [rows, 32 blocks], scale float32 [rows]), row-major: for
// torch's int8 kernel where tide.kernels' int8 GEMM is not built (gemm.cpp's int8_pack_q8_0 packs).
std::tuple<torch::Tensor, torch::Tensor> q8_0_rows(const torch::Tensor& raw_in) {
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte && raw_in.size(1) % 34 == 0,
              "q8_0_rows: uint8 [rows, blocks * 34]");
  const auto raw = raw_in.contiguous();
  const int64_t R = raw.size(0), B = raw.size(1) / 34;
  auto q = torch::empty({R, B * 32}, at::kChar);
  auto scale = torch::empty({R}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* dst = q.data_ptr<int8_t>();
  float* sc = scale.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) q8_0_quantize_row(src + r * B * 34, B, dst + r * B * 32, sc + r);
  });
  return {q, scale};
}

// gemm.cpp
torch::Tensor bf16_pack(const torch::Tensor& w);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_pack(const torch::Tensor& q);
std::tuple<torch::Tensor, torch::Tensor> int8_pack_q8_0(const std::vector<torch::Tensor>& parts);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias);
bool has_bf16_gemm();
bool has_int8_gemm();
bool int8_prompts_widened();
bool amx_available();
// argmax.cpp
torch::Tensor argmax_rows(const torch::Tensor& logits);
bool has_argmax();
bool amx_enabled();
void set_amx(bool on);
// layer.cpp
std::tuple<torch::Tensor, torch::Tensor> decode_layer(
    const torch::Tensor& x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& ln1,
    const torch::Tensor& ln2, double eps,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& qkv,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& o,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& gate_up,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& down,
    torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& cos, const torch::Tensor& sin,
    const torch::Tensor& slots, const torch::Tensor& positions, int64_t slot_lo, int64_t slot_hi, int64_t kv_len,
    const c10::optional<torch::Tensor>& bias, int64_t hq, int64_t hkv);

torch::Tensor draft_layer(
    const torch::Tensor& ids, const torch::Tensor& embed, const torch::Tensor& hidden, const torch::Tensor& ln_in,
    const torch::Tensor& ln_hidden, const torch::Tensor& ln_post, double eps,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& qkv,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& o,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& gate_up,
    const std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>& down,
    torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& cos, const torch::Tensor& sin,
    const torch::Tensor& slots, const torch::Tensor& write_at, int64_t kv_len, const torch::Tensor& bias, int64_t hq,
    int64_t hkv);

// Every op releases the GIL while it runs, as torch's own ops do: the worker's gRPC and exporter
// threads then run beside a forward instead of between its calls (a decode_layer call is ~0.3 ms).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (rows independent)", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta))", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up from a fused gate|up projection", nogil);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  m.def("decode_attention", &decode_attention, "grouped-query attention for few query tokens (AVX-512 or AVX2)", nogil);
#endif
  m.attr("has_decode_attention") = kHasDecodeAttention;
  m.def("rope_kv_cache", &rope_kv_cache, "RoPE on q and k, k and v into the cache, rotated q out", nogil);
  m.attr("has_bf16_gemm") = has_bf16_gemm();
  m.attr("has_int8_gemm") = has_int8_gemm();
  m.attr("int8_prompts_widened") = int8_prompts_widened();  // prompts on int8 weights at ~bf16 speed
  m.attr("has_amx") = amx_available();
  m.attr("has_argmax") = has_argmax();
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, -1) for bf16 / float32 [R, V] (AVX-512)", nogil);
  m.def("amx_enabled", &amx_enabled, "whether the GEMMs take AMX tiles now (gemm_amx.h)");
  m.def("set_amx", &set_amx, "AMX tiles on or off, for side-by-side benchmarks (the bits differ)", nogil);
  m.def("q8_0_rows", &q8_0_rows, "GGUF Q8_0 rows -> (int8 rows, float32 bf16-rounded scale per row)", nogil);
  m.def("int8_pack_q8_0", &int8_pack_q8_0, "GGUF Q8_0 row blocks (parts stacked) -> (int8_pack's layout, scale)",
        nogil);
  m.def("bf16_pack", &bf16_pack, "W [N, K] bf16 -> the layout bf16_linear reads", nogil);
  m.def("bf16_linear", &bf16_linear, "x @ W.T, bf16, row-invariant (AVX512_BF16 or AVX2)", nogil);
  m.def("int8_pack", &int8_pack, "q [N, K] int8 -> the layout int8_linear reads", nogil);
  m.def("int8_linear", &int8_linear, "(x @ q.T) * scale + bias, bf16 x, int8 q, row-invariant (AVX512_BF16)",
        nogil);
  m.def("decode_layer", &decode_layer, "one decoder layer for few query tokens a sequence (layer.cpp)", nogil);
  m.def("draft_layer", &draft_layer, "one EAGLE-3 draft layer pass for few query tokens a sequence (layer.cpp)",
        nogil);
  m.def("set_pool", [](bool on) { tide_pool::Pool::get().set_enabled(on); },
        "on: the kernels' threads are tide_pool's (pool.h); off: OpenMP's static split");
  m.def("set_pool_threads", [](int n) { tide_pool::Pool::get().set_threads(n); },
        "threads a pool job runs on, the caller included (0: no pool; at::parallel_for)");
  m.def("pool_enabled", [] { return tide_pool::Pool::get().enabled(); });
  m.def("pool_chunks_redone", [] { return tide_pool::Pool::get().chunks_redone(); },
        "chunks the calling thread ran again because a helper held them too long");
  m.def("_set_pool_helper_delay_us", [](int64_t us) { tide_pool::Pool::get().set_helper_delay_us(us); },
        "tests only: helpers sleep this long in every chunk they take (a stand-in for a preemption)");
}
