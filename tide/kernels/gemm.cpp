// y = x @ W.T for bf16 weights, and for int8 weights with a scale per output feature, on CPUs with
// AVX512_BF16 (Zen 4, Sapphire Rapids and later) or AVX2 + FMA (the second path, below): the
// engine's projections and lm_head (tide.layers.Linear, tide.quant.Int8Linear).
//
// Why: a decode step streams every weight once. oneDNN's pre-packed GEMM read the reference
// model's 576-wide projections at ~16 GB/s on the 2-vCPU Zen 4 guest, where a plain sum reads
// 31 GB/s: its per-call set-up and blocking are made for big GEMMs, not for 1-16 rows of a 0.7 MB
// matrix (docs/results/engine-step).
//
// Layout (`bf16_pack`, `int8_pack`): W [N, K] becomes [N/16, K/2, 16, 2]: for each block of 16
// output features, K/2 pair-rows, each holding the pair (k, k+1) of all 16 features: one VDPBF16PS
// operand (64 bytes in bf16; 32 in int8, widened to bf16 in registers, exactly: |q| <= 127 fits
// bf16's 8-bit significand). int8 weights are y = (x @ q.T) * scale + bias, one scale per feature;
// with AVX512_VBMI each two int8 pair-rows are regrouped for the byte-table widening (int8_pack).
//
// Row invariance by construction: every output element is one float32 accumulator that starts at
// zero and takes the pairs k = 0, 2, 4, ... in order, one VDPBF16PS each (a fixed-rounding
// instruction: round to nearest even, denormals flushed), then (int8) multiplies by the scale, adds
// the bias and rounds to bf16 once. Neither the number of rows, nor the row tiling, nor the thread
// split changes that sequence, so a token's outputs are the same bits in a lone decode row, in a
// verification of several, or in a prompt.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t PACK_COLS = 16;  // output features per packed block, on every path

// W [N, K] -> [N/16, K/2, 16, 2]: for each block of 16 features, K/2 pair-rows, each holding the
// pair (k, k+1) of all 16 features (see each path's notes for how it reads them).
torch::Tensor pack(const torch::Tensor& w, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype, name, ": a 2-D ", c10::toString(dtype), " weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % PACK_COLS == 0 && K % 2 == 0, name, ": N a multiple of 16 and K even");
  // Moved as whole pairs (one 2- or 4-byte element each): torch's permute copies a 2-byte int8
  // pair or 4-byte bf16 pair several times faster as one element than as two.
  const auto pair = w.element_size() == 1 ? at::kShort : at::kInt;
  return w.contiguous().view(pair).view({N / PACK_COLS, PACK_COLS, K / 2}).permute({0, 2, 1}).contiguous()
      .view(dtype).view({N / PACK_COLS, K / 2, PACK_COLS, 2});
}

// One block of 16 rows (s: 16 x K int8, row-major) into its 16 * K packed bytes d, laid out by
// `at(c, j, kp)`: the offset of row c's value k = 2 kp + j. Writes in order; reads 16 rows' streams.
template <typename At>
inline void pack_block(const int8_t* s, int8_t* d, int64_t K, At at) {
  if (at(0, 1, 0) == at(0, 0, 0) + 1 && at(1, 1, 0) == at(1, 0, 0) + 1) {
    // The layouts that keep a pair's two bytes together (pair_major, lane_major; at(c, 0, kp)
    // even): moved as one int16 each, half the operations.
    for (int64_t kp = 0; kp < K / 2; ++kp)
      for (int64_t c = 0; c < PACK_COLS; ++c) {
        int16_t pair;
        std::memcpy(&pair, s + c * K + 2 * kp, 2);
        std::memcpy(d + at(c, 0, kp), &pair, 2);
      }
    return;
  }
  for (int64_t kp = 0; kp < K / 2; ++kp)
    for (int64_t c = 0; c < PACK_COLS; ++c) {
      d[at(c, 0, kp)] = s[c * K + 2 * kp];
      d[at(c, 1, kp)] = s[c * K + 2 * kp + 1];
    }
}

// q [N, K] int8 -> [N/16, K/2, 16, 2] in shape, each block of 16 rows by pack_block. In loops:
// torch's permutes of these small elements took 15 s of an 8B model's 45 s start.
template <typename At>
torch::Tensor pack_int8(const torch::Tensor& q_in, At at, const char* name) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kChar, name, ": a 2-D int8 weight");
  const auto q = q_in.contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % PACK_COLS == 0 && K % 2 == 0, name, ": N a multiple of 16 and K even");
  auto out = torch::empty({N / PACK_COLS, K / 2, PACK_COLS, 2}, at::kChar);
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, N / PACK_COLS, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) pack_block(src + nb * PACK_COLS * K, dst + nb * PACK_COLS * K, K, at);
  });
  return out;
}

}  // namespace

void q8_0_quantize_row(const uint8_t* row, int64_t B, int8_t* out, float* scale);  // cpu_ops.cpp

namespace {

// GGUF Q8_0 rows of `parts` (uint8 [rows_i, B * 34] each, stacked in order) -> (packed as pack_int8
// packs, float32 scale [rows]): each 16-row block quantized into a buffer (cpu_ops.cpp's
// q8_0_quantize_row: Int8Linear's values) and packed from it, so neither the stacked raw rows nor
// the row-major int8 matrix is ever made.
template <typename At>
std::tuple<torch::Tensor, torch::Tensor> pack_q8_0(const std::vector<torch::Tensor>& parts, At at) {
  TORCH_CHECK(!parts.empty(), "int8_pack_q8_0: no parts");
  std::vector<torch::Tensor> held;
  std::vector<const uint8_t*> rows;
  const int64_t width = parts[0].size(1);
  for (const auto& p : parts) {
    TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kByte && p.size(1) == width && width % 34 == 0,
                "int8_pack_q8_0: uint8 [rows, blocks * 34] parts of one width");
    held.push_back(p.contiguous());
    for (int64_t r = 0; r < p.size(0); ++r) rows.push_back(held.back().data_ptr<uint8_t>() + r * width);
  }
  const int64_t N = static_cast<int64_t>(rows.size()), B = width / 34, K = B * 32;
  TORCH_CHECK(N % PACK_COLS == 0, "int8_pack_q8_0: rows a multiple of 16");
  auto out = torch::empty({N / PACK_COLS, K / 2, PACK_COLS, 2}, at::kChar);
  auto scale = torch::empty({N}, at::kFloat);
  int8_t* dst = out.data_ptr<int8_t>();
  float* sc = scale.data_ptr<float>();
  at::parallel_for(0, N / PACK_COLS, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> block(PACK_COLS * K);
    for (int64_t nb = b0; nb < b1; ++nb) {
      for (int64_t c = 0; c < PACK_COLS; ++c)
        q8_0_quantize_row(rows[nb * PACK_COLS + c], B, block.data() + c * K, sc + nb * PACK_COLS + c);
      pack_block(block.data(), dst + nb * PACK_COLS * K, K, at);
    }
  });
  return {out, scale};
}

// What every path's linear() checks first: bf16 rows, and a weight of type `wtype` from pack().
void check_linear(const torch::Tensor& x, const torch::Tensor& packed, at::ScalarType wtype, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == wtype, name, ": bf16 input and ",
              c10::toString(wtype), " weight");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(-1) && packed.is_contiguous(), name,
              ": packed [N/16, K/2, 16, 2] matching x's last dim");
}

c10::optional<torch::Tensor> floats(const c10::optional<torch::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value() || !t->defined()) return c10::nullopt;
  auto f = t->to(at::kFloat).contiguous();
  TORCH_CHECK(f.numel() == n, what, " must have one value per output feature (", n, ")");
  return f;
}

}  // namespace

#if defined(__AVX512BF16__) && defined(__AVX512F__)

namespace {

constexpr int64_t COLS = 16;  // output features per block: one float32 register
constexpr int MAX_ROWS = 6;   // rows per register tile (6 x 4 accumulators + 4 weights + 1 row value)
constexpr int MAX_BLOCKS = 4; // blocks per register tile

// One pair-row of a block (32 weights) as bf16.
inline __m512bh load_pairs(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
}

inline __m512bh load_pairs(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

#if defined(__AVX512VBMI__)
// Two pair-rows of int8 weights (64 bytes, in int8_pack's lane order) as two bf16 operands, by
// table: bf16(|q|)'s low and high bytes looked up for |q| in 0..127 (VPERMI2B), the sign put back,
// the bytes interleaved. Exact, and ~1.5x fewer instructions than widening through float32.
struct Int8Tables {
  __m512i lo0, lo1, hi0, hi1;
  Int8Tables() {
    alignas(64) uint8_t lo[128], hi[128];
    for (int v = 0; v < 128; ++v) {
      const float f = static_cast<float>(v);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      const uint16_t b = static_cast<uint16_t>(bits >> 16);  // exact: v has at most 7 significant bits
      lo[v] = static_cast<uint8_t>(b & 0xff);
      hi[v] = static_cast<uint8_t>(b >> 8);
    }
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
  }
};

inline void load_two_pair_rows(const int8_t* p, const Int8Tables& t, __m512bh& first, __m512bh& second) {
  const __m512i q = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
  const __m512i a = _mm512_abs_epi8(q);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, a, t.lo1);
  const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(t.hi0, a, t.hi1),
                                     _mm512_and_si512(q, _mm512_set1_epi8(static_cast<char>(0x80))));
  first = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(lo, hi));
  second = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(lo, hi));
}
constexpr bool kInt8ByTable = true;
#else
constexpr bool kInt8ByTable = false;
#endif

inline __m512bh pair_of(const uint16_t* p) {  // x[k], x[k+1] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}

// RT rows x CB blocks of 16 features: y[r, 16 c + j] for r < RT, c < CB. `w` is block 0's first
// pair-row, `block` the weights (elements) from one block to the next; `scale` (int8) and `bias`
// start at the tile's first feature, or are null.
template <int RT, int CB, typename W>
void tile(const uint16_t* x, int64_t ldx, const W* w, int64_t block, int64_t pairs, uint16_t* y, int64_t ldy,
          const float* scale, const float* bias) {
  __m512 acc[RT][CB];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
#if defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<W, int8_t>) {  // two pair-rows at a time (int8_pack: pairs is even)
    static const Int8Tables tables;
    for (int64_t p = 0; p < pairs; p += 2) {
      __m512bh w0[CB], w1[CB];
      for (int c = 0; c < CB; ++c) load_two_pair_rows(w + c * block + p * 2 * COLS, tables, w0[c], w1[c]);
      for (int r = 0; r < RT; ++r) {
        const __m512bh x0 = pair_of(x + r * ldx + 2 * p), x1 = pair_of(x + r * ldx + 2 * p + 2);
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][c], w0[c], x0), w1[c], x1);
      }
    }
  } else
#endif
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[CB];
    for (int c = 0; c < CB; ++c) wv[c] = load_pairs(w + c * block + p * 2 * COLS);
    for (int r = 0; r < RT; ++r) {
      const __m512bh xv = pair_of(x + r * ldx + 2 * p);
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) {
      __m512 v = acc[r][c];
      if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + c * COLS));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c * COLS));
      const __m256bh out = _mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * COLS), reinterpret_cast<__m256i>(out));
    }
}

// Blocks [0, cb) of an int8 packed weight (`block` elements apart) widened to bf16 pair-rows in
// bf16_pack's layout at `out`: the values `tile` widens in registers, stored once. A prompt's
// rows then take the bf16 tiles over them: one widening per weight tile instead of one per 6 rows,
// the same accumulation order (one VDPBF16PS per pair, in order), so the same bits.
void widen_int8_blocks(const int8_t* w, int64_t block, int cb, int64_t pairs, uint16_t* out) {
  for (int c = 0; c < cb; ++c) {
    const int8_t* src = w + c * block;
    uint16_t* dst = out + c * block;
#if defined(__AVX512VBMI__)
    static const Int8Tables tables;
    for (int64_t p = 0; p < pairs; p += 2) {
      __m512bh first, second;
      load_two_pair_rows(src + p * 2 * COLS, tables, first, second);
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + p * 2 * COLS), reinterpret_cast<__m512i>(first));
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + (p + 1) * 2 * COLS), reinterpret_cast<__m512i>(second));
    }
#else
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + p * 2 * COLS),
                          reinterpret_cast<__m512i>(load_pairs(src + p * 2 * COLS)));
#endif
  }
}

template <typename W>
using TileFn = void (*)(const uint16_t*, int64_t, const W*, int64_t, int64_t, uint16_t*, int64_t, const float*,
                        const float*);

template <int RT, typename W>
TileFn<W> tile_for(int cb) {
  switch (cb) {
    case 1: return &tile<RT, 1, W>;
    case 2: return &tile<RT, 2, W>;
    case 3: return &tile<RT, 3, W>;
    default: return &tile<RT, 4, W>;
  }
}

template <typename W>
TileFn<W> tile_for(int rt, int cb) {
  switch (rt) {
    case 1: return tile_for<1, W>(cb);
    case 2: return tile_for<2, W>(cb);
    case 3: return tile_for<3, W>(cb);
    case 4: return tile_for<4, W>(cb);
    case 5: return tile_for<5, W>(cb);
    default: return tile_for<6, W>(cb);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512VBMI__)
#define TIDE_AMX_BUILT 1
}  // namespace
#include "gemm_amx.h"
namespace {
#endif

// Whether a weight of K inputs takes AMX's tiles (gemm_amx.h): whole k-tiles only, so that the
// choice depends on the weight alone and never on the number of rows (see the rounding note there).
bool takes_amx(int64_t K) {
#ifdef TIDE_AMX_BUILT
  return K % amx::TILE_K == 0 && amx::enabled().load(std::memory_order_relaxed);
#else
  (void)K;
  return false;
#endif
}

// x [..., K] bf16 -> [..., N] bf16 over a packed weight of element type W.
template <typename W>
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& scale_in,
                     const c10::optional<torch::Tensor>& bias_in, at::ScalarType wtype, const char* name) {
  check_linear(x_in, packed, wtype, name);
  const int64_t K = x_in.size(-1), blocks = packed.size(0), N = blocks * COLS, pairs = K / 2;
  const auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  const auto scale = floats(scale_in, N, "scale");
  const auto bias = floats(bias_in, N, "bias");
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x_in.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const W*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* sp = scale ? scale->data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t block = K * COLS;
  // Chunks of output features, ~64 KB of weights each (a few microseconds at the guest's ~30 GB/s):
  // small enough that a thread the OS takes away leaves little for the others to redo, large enough
  // that taking one (an atomic on a shared line) costs a few percent of it. See pool.h.
  // At least MAX_BLOCKS blocks a chunk: a tile of fewer blocks has fewer independent accumulators,
  // and one row's single VDPBF16PS chain is latency-bound (K >= 2048 gave one-block chunks: a 3B
  // model's int8 step ran at 0.88x OpenMP's static split, docs/results/model-sizes).
  int64_t per = std::max<int64_t>(MAX_BLOCKS, (int64_t{1} << 16) / (block * static_cast<int64_t>(sizeof(W))));
  const bool on_amx = takes_amx(K);
  if (on_amx) per = (per + MAX_BLOCKS - 1) / MAX_BLOCKS * MAX_BLOCKS;  // whole groups of 4 C tiles
  tide_pool::parallel(
      (blocks + per - 1) / per,
      [=](int64_t chunk) {
        const int64_t b0 = chunk * per, b1 = std::min(blocks, b0 + per);
#ifdef TIDE_AMX_BUILT
        if (on_amx) {
          for (int64_t b = b0; b < b1; b += MAX_BLOCKS)
            amx::group<W>(xp, M, K, wp + b * block, block, static_cast<int>(std::min<int64_t>(MAX_BLOCKS, b1 - b)),
                          yp + b * COLS, N, sp ? sp + b * COLS : nullptr, bp ? bp + b * COLS : nullptr);
          return;
        }
#endif
        if constexpr (std::is_same_v<W, int8_t>) {
          if (M > MAX_ROWS) {  // several row tiles (a prompt): widen each weight tile once
            thread_local std::vector<uint16_t> wide;
            wide.resize(static_cast<size_t>(MAX_BLOCKS * block));
            for (int64_t b = b0; b < b1; b += MAX_BLOCKS) {
              const int cb = static_cast<int>(std::min<int64_t>(MAX_BLOCKS, b1 - b));
              widen_int8_blocks(wp + b * block, block, cb, pairs, wide.data());
              for (int64_t r = 0; r < M; r += MAX_ROWS) {
                const int rt = static_cast<int>(std::min<int64_t>(MAX_ROWS, M - r));
                tile_for<uint16_t>(rt, cb)(xp + r * K, K, wide.data(), block, pairs, yp + r * N + b * COLS, N,
                                           sp ? sp + b * COLS : nullptr, bp ? bp + b * COLS : nullptr);
              }
            }
            return;
          }
        }
        for (int64_t b = b0; b < b1; b += MAX_BLOCKS) {
          const int cb = static_cast<int>(std::min<int64_t>(MAX_BLOCKS, b1 - b));
          for (int64_t r = 0; r < M; r += MAX_ROWS) {
            const int rt = static_cast<int>(std::min<int64_t>(MAX_ROWS, M - r));
            tile_for<W>(rt, cb)(xp + r * K, K, wp + b * block, block, pairs, yp + r * N + b * COLS, N,
                                sp ? sp + b * COLS : nullptr, bp ? bp + b * COLS : nullptr);
          }
        }
      },
      {x, packed, y, scale ? *scale : at::Tensor(), bias ? *bias : at::Tensor()});
  return y;
}

}  // namespace

constexpr bool kHasBf16Gemm = true;
constexpr bool kHasInt8Gemm = true;
constexpr bool kInt8PromptsWidened = true;  // widen_int8_blocks: prompts at ~bf16 speed

// W [N, K] bf16 (N a multiple of 16, K even) -> [N/16, K/2, 16, 2] (see the layout above).
torch::Tensor bf16_pack(const torch::Tensor& w) { return pack(w, at::kBFloat16, "bf16_pack"); }

// q [N, K] int8 -> [N/16, K/2, 16, 2]; with the byte tables (AVX512_VBMI; K a multiple of 4) each
// two pair-rows regrouped as [4 lanes][2 pair-rows][8 bytes], the order the bytes' interleave reads.
// pair-row kp: 32 bytes, row c's pair at 2c.
inline int64_t pair_major(int64_t c, int64_t j, int64_t kp) { return kp * 32 + c * 2 + j; }
// Two pair-rows (2 kq, 2 kq + 1) of 32 bytes, as 4 lanes of 8 bytes each, regrouped lane-major:
// byte o = 2c + j of pair-row 2 kq + r lies at 16 (o / 8) + 8 r + o % 8 of their 64.
inline int64_t lane_major(int64_t c, int64_t j, int64_t kp) {
  const int64_t o = c * 2 + j;
  return (kp / 2) * 64 + (o / 8) * 16 + (kp % 2) * 8 + o % 8;
}

torch::Tensor int8_pack(const torch::Tensor& q) {
  if (!kInt8ByTable) return pack_int8(q, pair_major, "int8_pack");
  TORCH_CHECK(q.size(1) % 4 == 0, "int8_pack: K a multiple of 4");
  return pack_int8(q, lane_major, "int8_pack");
}

std::tuple<torch::Tensor, torch::Tensor> int8_pack_q8_0(const std::vector<torch::Tensor>& parts) {
  return kInt8ByTable ? pack_q8_0(parts, lane_major) : pack_q8_0(parts, pair_major);  // K = 32 B: a multiple of 4
}

// x [..., K] bf16, packed from bf16_pack, bias [N] or None -> [..., N] bf16.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  return linear<uint16_t>(x, packed, c10::nullopt, bias, at::kBFloat16, "bf16_linear");
}

// x [..., K] bf16, packed from int8_pack, scale [N], bias [N] or None -> (x @ q.T) * scale + bias, bf16.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias) {
  return linear<int8_t>(x, packed, scale, bias, at::kChar, "int8_linear");
}

#elif defined(__AVX2__) && defined(__FMA__)

// AVX2 + FMA (Zen 2/3, Haswell to Alder Lake; with AVX-512F tiles where it exists without AVX512_BF16,
// Skylake-SP to Ice Lake): bf16 or int8 weights, products and sums in float32.
// bf16: bf16_pack's layout. A bf16 value widens to float32 exactly (its bits are the float's high
// half), so each 32-bit lane of a pair-row, the pair (w[k], w[k+1]) of one feature, gives w[k] by a
// shift and w[k+1] by a mask. int8: int8_pack regroups each pair-row of a block as [2 (k, k+1)][16
// features], so 8 bytes widen (VPMOVSXBD, VCVTDQ2PS: exact) to one k of 8 features, three
// instructions for 8 weights. Every output element is one float32 accumulator taking k = 0, 1, 2,
// ... in order, one FMA each, then (int8) the scale, then the bias, then one round to nearest even:
// the same bits whatever the number of rows, the tiling or the threads (row invariance, as above).
// The bits differ from the AVX512_BF16 path's (VDPBF16PS rounds its inputs and pairs differently):
// a machine uses one.
// Why: torch's bf16 GEMM on these CPUs has no native bf16 and ran the reference model's step at
// ~60 ms (float32 weights: ~55 ms, twice the bytes); this streams half of float32's bytes, int8 a
// quarter. torch's int8 kernel (`_weight_int8pack_mm`) took 2-3.5x this one's time at one row here.

namespace {

constexpr int64_t COLS = 16;  // output features per block: two float32 registers
// Register tiles. AVX2 has 16 ymm registers; a tile that needs more spills its accumulators to
// the stack every step (a first version with 3 rows x 2 blocks ran ~1 FMA a cycle, half of Zen 3's
// two). Each accumulator is one chain of FMAs that waits on itself (~4 cycles an FMA), so a tile
// needs ~8 of them to keep both FMA units busy: 1 row x 4 blocks, 2 rows x 2 blocks, 4 rows x 1
// block (3 rows x 1 block: 6). Budget: 2 x rows x blocks accumulators, plus either every row's two
// broadcasts and one widened half-block (the order for 1-3 rows), or one row's broadcasts and the
// block's four widened halves (4 rows), plus the bf16 mask: at most 15.
constexpr int MAX_ROWS = 4;
constexpr int LONE_ROW_BLOCKS = 4;  // the most blocks a tile takes (a lone row's)

inline __m256 even_of_pairs(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_of_pairs(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Features 8 h .. 8 h + 7 of one block's pair-row `row` as float32: w0 at k, w1 at k + 1.
inline void widen(const uint16_t* row, int h, __m256& w0, __m256& w1) {  // bf16_pack: [16 features][2]
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + h * 2 * 8));
  w0 = even_of_pairs(v);
  w1 = odd_of_pairs(v);
}
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void widen(const int8_t* row, int h, __m256& w0, __m256& w1) {  // int8_pack: [2][16 features]
  w0 = widen8(row + h * 8);
  w1 = widen8(row + COLS + h * 8);
}

// 8 floats -> 8 bf16, round to nearest even, NaN -> quiet NaN: torch's float -> bfloat16 conversion.
inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// RT rows (float32, `ldx` apart) x CB blocks of 16 features; `w` is block 0's first pair-row,
// `block` the elements from one block to the next; `scale` (int8) and `bias` start at the tile's
// first feature, or are null. Each accumulator takes x[k] w[k] then x[k+1] w[k+1] per pair-row,
// whatever RT and CB: the two loop orders below only interleave independent chains.
template <int RT, int CB, typename W>
void tile(const float* x, int64_t ldx, const W* w, int64_t block, int64_t pairs, uint16_t* y, int64_t ldy,
          const float* scale, const float* bias) {
  constexpr bool rows_held = 2 * RT + 2 + 2 * RT * CB <= 15;  // every row's broadcasts stay in registers
  static_assert(rows_held || CB == 1, "a tile of many rows takes one block (see the budget above)");
  __m256 acc[RT][2 * CB];
  // (GCC keeps the arrays in registers only when it unrolls every loop over them.)
  #pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < 2 * CB; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (rows_held) {  // broadcast each row once, widen each half where it is used
      __m256 x0[RT], x1[RT];
      #pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        x0[r] = _mm256_broadcast_ss(x + r * ldx + 2 * p);
        x1[r] = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
      }
      #pragma GCC unroll 8
      for (int c = 0; c < 2 * CB; ++c) {  // half c % 2 of block c / 2: features 8 (c % 2) .. + 7
        __m256 w0, w1;
        widen(w + (c / 2) * block + p * 2 * COLS, c % 2, w0, w1);
        #pragma GCC unroll 8
        for (int r = 0; r < RT; ++r) acc[r][c] = _mm256_fmadd_ps(x1[r], w1, _mm256_fmadd_ps(x0[r], w0, acc[r][c]));
      }
    } else {  // widen the block's two halves once, then broadcast each row in turn
      __m256 w0[2], w1[2];
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) widen(w + p * 2 * COLS, h, w0[h], w1[h]);
      #pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const __m256 x0 = _mm256_broadcast_ss(x + r * ldx + 2 * p), x1 = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
        #pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(x1, w1[h], _mm256_fmadd_ps(x0, w0[h], acc[r][h]));
      }
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < 2 * CB; ++c) {
      __m256 v = acc[r][c];
      if (scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + c * 8));
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c * 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * ldy + c * 8), to_bf16(v));
    }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, uint16_t*, int64_t, const float*,
                        const float*);

#if defined(__AVX512F__)
// AVX-512F without AVX512_BF16 (Skylake-SP, Cascade Lake, Ice Lake servers): the arithmetic above on
// 16 features a register, one block, instead of 8. Each output element's accumulator still takes
// x[k] w[k] then x[k + 1] w[k + 1] per pair-row, one FMA each, then the scale, the bias and one
// rounding: the same bits as the AVX2 tile's, twice the work an instruction. Why: on a 2-vCPU Ice
// Lake guest the AVX2 tiles made each extra verified token cost ~30 % of a decode step (T(1, 2) =
// 19.6 ms against T(1, 1) = 15.3 ms): widening and FMAs, not the weights' bytes, bound a few rows.
constexpr int TILE_BLOCKS = 8;  // a lone row's blocks: 8 independent FMA chains hide the latency

inline void widen16(const uint16_t* row, __m512& w0, __m512& w1) {  // bf16_pack: [16 features][2]
  const __m512i v = _mm512_loadu_si512(row);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void widen16(const int8_t* row, __m512& w0, __m512& w1) {  // int8_pack: [2][16 features]
  w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
  w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + COLS))));
}

// to_bf16 on 16 floats.
inline __m256i to_bf16_16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

template <int RT, int CB, typename W>
void tile16(const float* x, int64_t ldx, const W* w, int64_t block, int64_t pairs, uint16_t* y, int64_t ldy,
            const float* scale, const float* bias) {
  __m512 acc[RT][CB];
  #pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    #pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) {
      __m512 w0, w1;
      widen16(w + c * block + p * 2 * COLS, w0, w1);
      // Broadcast where used: the FMA takes x[k] from memory ({1to16}), no register held a row.
      #pragma GCC unroll 8
      for (int r = 0; r < RT; ++r)
        acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p + 1]), w1,
                                    _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p]), w0, acc[r][c]));
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) {
      __m512 v = acc[r][c];
      if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + c * COLS));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c * COLS));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * COLS), to_bf16_16(v));
    }
}

// Up to 8 rows a tile (a verification of up to 7 drafts reads each weight once), as many blocks as
// the registers allow: RT x CB accumulators + 2 widened <= 18.
constexpr int TILE_ROWS = 8;
inline int blocks_for(int rt) { return rt == 1 ? TILE_BLOCKS : rt <= 4 ? 4 : 2; }

template <int RT, int CB, typename W>
TileFn<W> pick16(int cb) {  // the tile of CB blocks, or the widest narrower one that cb fills
  if constexpr (CB == 1) {
    return &tile16<RT, 1, W>;
  } else {
    return cb >= CB ? &tile16<RT, CB, W> : pick16<RT, CB - 1, W>(cb);
  }
}

template <typename W>
TileFn<W> tile_for(int rt, int cb) {
  switch (rt) {
    case 1: return pick16<1, 8, W>(cb);
    case 2: return pick16<2, 4, W>(cb);
    case 3: return pick16<3, 4, W>(cb);
    case 4: return pick16<4, 4, W>(cb);
    case 5: return pick16<5, 2, W>(cb);
    case 6: return pick16<6, 2, W>(cb);
    case 7: return pick16<7, 2, W>(cb);
    default: return pick16<8, 2, W>(cb);
  }
}
#else
constexpr int TILE_BLOCKS = LONE_ROW_BLOCKS;
constexpr int TILE_ROWS = MAX_ROWS;

inline int blocks_for(int rt) { return rt == 1 ? LONE_ROW_BLOCKS : rt == 2 ? 2 : 1; }

template <typename W>
TileFn<W> tile_for(int rt, int cb) {
  switch (rt) {
    case 1: return cb == 1 ? &tile<1, 1, W> : cb == 2 ? &tile<1, 2, W> : cb == 3 ? &tile<1, 3, W> : &tile<1, 4, W>;
    case 2: return cb == 1 ? &tile<2, 1, W> : &tile<2, 2, W>;
    case 3: return &tile<3, 1, W>;
    default: return &tile<4, 1, W>;
  }
}
#endif

// x [..., K] bf16 -> [..., N] bf16 over a packed weight of element type W.
template <typename W>
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& scale_in,
                     const c10::optional<torch::Tensor>& bias_in, at::ScalarType wtype, const char* name) {
  check_linear(x_in, packed, wtype, name);
  const int64_t K = x_in.size(-1), blocks = packed.size(0), N = blocks * COLS, pairs = K / 2;
  const auto x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();  // exact: bf16 widens to float32
  const int64_t M = x.size(0);
  const auto scale = floats(scale_in, N, "scale");
  const auto bias = floats(bias_in, N, "bias");
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x_in.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const W*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* sp = scale ? scale->data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t block = K * COLS;
  // Chunks of ~64 KB of weights, as in the AVX512_BF16 path (see there and pool.h), and at least
  // the blocks a lone row's tile takes (blocks_for).
  const int64_t per = std::max<int64_t>(TILE_BLOCKS, (int64_t{1} << 16) / (block * static_cast<int64_t>(sizeof(W))));
  tide_pool::parallel(
      (blocks + per - 1) / per,
      [=](int64_t chunk) {
        const int64_t b0 = chunk * per, b1 = std::min(blocks, b0 + per);
        // Rows in tiles of as equal a size as TILE_ROWS allows (5 rows on AVX2: 3 + 2, not 4 + 1).
        const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
        for (int64_t b = b0; b < b1; b += TILE_BLOCKS) {
          const int64_t nb = std::min<int64_t>(TILE_BLOCKS, b1 - b);
          for (int64_t t = 0, r = 0; t < tiles; ++t) {
            const int rt = static_cast<int>((M - r + (tiles - t) - 1) / (tiles - t));
            for (int64_t c = 0; c < nb; c += blocks_for(rt)) {
              const int cb = static_cast<int>(std::min<int64_t>(blocks_for(rt), nb - c));
              const int64_t f = (b + c) * COLS;  // the tile's first feature
              tile_for<W>(rt, cb)(xp + r * K, K, wp + (b + c) * block, block, pairs, yp + r * N + f, N,
                                  sp ? sp + f : nullptr, bp ? bp + f : nullptr);
            }
            r += rt;
          }
        }
      },
      {x, packed, y, scale ? *scale : at::Tensor(), bias ? *bias : at::Tensor()});
  return y;
}

}  // namespace

constexpr bool kHasBf16Gemm = true;
constexpr bool kHasInt8Gemm = true;
constexpr bool kInt8PromptsWidened = false;

// W [N, K] bf16 (N a multiple of 16, K even) -> [N/16, K/2, 16, 2], the AVX512_BF16 path's layout.
torch::Tensor bf16_pack(const torch::Tensor& w) { return pack(w, at::kBFloat16, "bf16_pack"); }

// q [N, K] int8 -> [N/16, K/2, 16, 2] in shape; each pair-row's 32 bytes regrouped as [2 (k, k+1)][16 features].
// pair-row kp: k = 2 kp of the 16 rows, then k + 1.
inline int64_t k_major(int64_t c, int64_t j, int64_t kp) { return kp * 32 + j * 16 + c; }

torch::Tensor int8_pack(const torch::Tensor& q) { return pack_int8(q, k_major, "int8_pack"); }

std::tuple<torch::Tensor, torch::Tensor> int8_pack_q8_0(const std::vector<torch::Tensor>& parts) {
  return pack_q8_0(parts, k_major);
}

// x [..., K] bf16, packed from bf16_pack, bias [N] or None -> [..., N] bf16.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  return linear<uint16_t>(x, packed, c10::nullopt, bias, at::kBFloat16, "bf16_linear");
}

// x [..., K] bf16, packed from int8_pack, scale [N], bias [N] or None -> (x @ q.T) * scale + bias, bf16.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& bias) {
  return linear<int8_t>(x, packed, scale, bias, at::kChar, "int8_linear");
}

#else
constexpr bool kHasBf16Gemm = false;
constexpr bool kHasInt8Gemm = false;
constexpr bool kInt8PromptsWidened = false;
torch::Tensor bf16_pack(const torch::Tensor&) { TORCH_CHECK(false, "bf16_pack needs AVX512_BF16 or AVX2"); }
torch::Tensor int8_pack(const torch::Tensor&) { TORCH_CHECK(false, "int8_pack needs AVX512_BF16 or AVX2"); }
std::tuple<torch::Tensor, torch::Tensor> int8_pack_q8_0(const std::vector<torch::Tensor>&) {
  TORCH_CHECK(false, "int8_pack_q8_0 needs AVX512_BF16 or AVX2");
}
torch::Tensor bf16_linear(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "bf16_linear needs AVX512_BF16 or AVX2");
}
torch::Tensor int8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "int8_linear needs AVX512_BF16 or AVX2");
}
#endif

bool has_bf16_gemm() { return kHasBf16Gemm; }
bool has_int8_gemm() { return kHasInt8Gemm; }
bool int8_prompts_widened() { return kInt8PromptsWidened; }

// AMX (gemm_amx.h): built for this CPU and granted by the OS; and whether GEMMs take it now.
bool amx_available() {
#ifdef TIDE_AMX_BUILT
  return amx::available();
#else
  return false;
#endif
}
bool amx_enabled() {
#ifdef TIDE_AMX_BUILT
  return amx::enabled().load();
#else
  return false;
#endif
}
// For side-by-side benchmarks only: a row's bits differ between the two paths.
void set_amx(bool on) {
#ifdef TIDE_AMX_BUILT
  amx::enabled().store(on && amx::available());
#else
  (void)on;
#endif
}
