// gemm.cpp's tiles on AMX (Sapphire Rapids and later Xeons): the same y = x @ W.T over the same
// packed weights, for CPUs with AMX-BF16, included by gemm.cpp's AVX512_BF16 section.
//
// Why: a VDPBF16PS tile does 32 multiply-adds a cycle, so a verification's extra rows cost compute:
// on a 2-vCPU Sapphire Rapids guest the reference model's forward took 10.4 ms for one token and
// 31 ms for 16 (T(1, n), tide.engine.profiling), where the weights' bytes are the same. One
// TDPBF16PS multiplies a 16-row x 32 tile by a 32 x 16 tile (8192 multiply-adds): 16 rows of one
// 576 x 1536 int8 projection took 45 us against one row's 39 us (a standalone single-thread
// micro-benchmark; VDPBF16PS tiles: 301 us).
//
// Layout: bf16_pack's [N/16, K/2, 16, 2] is AMX's B-tile layout as it stands: 16 pair-rows of one
// block (32 k, 16 features) are 1 KB, contiguous, 64 bytes a row. int8 weights are widened to that
// layout (exactly, by gemm.cpp's byte tables) into a per-thread buffer before the tile loads.
// A tile: 16 rows of x (64 bytes, 32 k, each). C: 16 rows x 16 features in float32.
//
// Rounding: TDPBF16PS does not round like VDPBF16PS (measured: 42 of 256 elements equal), nor like
// any order of float32 adds tried, so a machine that takes this path takes it for every row count:
// a weight's path depends only on its K (a multiple of 32: whole tiles), and every output element
// is one accumulator tile element that takes the k-tiles 0, 32, 64, ... in order from zero, then
// (int8) the scale, then the bias, then one round to bf16. Each tile row is computed on its own,
// so the number of rows in a tile, the row chunks and the threads do not change a row's bits.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace amx {

constexpr int64_t TILE_K = 32;      // bf16 k per tile row (64 bytes)
constexpr int64_t TILE_ROWS = 16;   // rows of x per A tile, and pair-rows per B tile
constexpr int64_t B_TILE = TILE_ROWS * 2 * COLS;  // elements of one B tile (16 pair-rows x 16 x 2)
constexpr int MAX_BLOCKS = 4;       // C tiles: tmm0-3; A: tmm4; B: tmm5-7

// Linux lends AMX's 8 KB of tile state to a process only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
inline bool request_permission() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// Whether the OS granted AMX to this process (asked once).
inline bool available() {
  static const bool permitted = request_permission();
  return permitted;
}

// Whether GEMMs take AMX: available, and not turned off (TIDE_AMX=0 at start, or set_enabled(false)
// for a side-by-side benchmark: switching changes the bits, so never within one engine's life).
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("TIDE_AMX");
    return !(env && std::strcmp(env, "0") == 0) && available();
  }()};
  return on;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the tile configuration for `rows` rows of x on this thread, unless it is already loaded.
// Read back rather than remembered: other code on the thread (oneDNN's AMX kernels, in torch's
// matmuls) loads its own. STTILECFG costs ~10 ns here, LDTILECFG ~45 ns.
inline void configure(int rows) {
  TileConfig want;
  for (int t = 0; t < 8; ++t) want.colsb[t] = 64;
  for (int t = 0; t < 5; ++t) want.rows[t] = static_cast<uint8_t>(rows);
  for (int t = 5; t < 8; ++t) want.rows[t] = TILE_ROWS;
  TileConfig have;
  _tile_storeconfig(&have);
  if (std::memcmp(&have, &want, sizeof want) != 0) _tile_loadconfig(&want);
}

// Where k-tile `s` of block `c` is, as bf16 B tiles: packed bf16 weights as they lie, or int8
// weights widened (gemm.cpp's byte tables) one k-tile at a time into a small per-thread buffer.
struct Bf16Blocks {
  const uint16_t* w;
  int64_t block;  // elements from one block to the next
  void prepare(int64_t, int) {}
  const uint16_t* at(int64_t s, int c) const { return w + c * block + s * B_TILE; }
};

// One B tile of int8 weights (16 pair-rows from `src`, int8_pack's layout) widened to bf16 at `dst`.
inline void widen_tile(const int8_t* src, uint16_t* dst) {
  static const Int8Tables tables;
  for (int64_t p = 0; p < TILE_ROWS; p += 2) {
    __m512bh first, second;
    load_two_pair_rows(src + p * 2 * COLS, tables, first, second);
    _mm512_store_si512(dst + p * 2 * COLS, reinterpret_cast<__m512i>(first));
    _mm512_store_si512(dst + (p + 1) * 2 * COLS, reinterpret_cast<__m512i>(second));
  }
}

struct Int8Blocks {
  const int8_t* w;
  int64_t block;
  uint16_t* buf;  // MAX_BLOCKS B tiles, 64-byte aligned
  void prepare(int64_t s, int cb) {
    for (int c = 0; c < cb; ++c) widen_tile(w + c * block + s * B_TILE, buf + c * B_TILE);
  }
  const uint16_t* at(int64_t, int c) const { return buf + c * B_TILE; }
};

// C tiles 0..CB-1 = x[rows of the configured count] @ blocks 0..CB-1 over `steps` k-tiles.
template <int CB, typename Blocks>
inline void accumulate(const uint16_t* x, int64_t ldx, Blocks& blocks, int64_t steps) {
  _tile_zero(0);
  if constexpr (CB > 1) _tile_zero(1);
  if constexpr (CB > 2) _tile_zero(2);
  if constexpr (CB > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    blocks.prepare(s, CB);
    _tile_loadd(4, x + s * TILE_K, ldx * 2);
    _tile_loadd(5, blocks.at(s, 0), 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (CB > 1) {
      _tile_loadd(6, blocks.at(s, 1), 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (CB > 2) {
      _tile_loadd(7, blocks.at(s, 2), 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (CB > 3) {
      _tile_loadd(5, blocks.at(s, 3), 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
}

// C tile `c`, stored as float32 rows of 16 in `out`, -> y's rows: * scale, + bias, one round to
// bf16 (as gemm.cpp's tiles). (The tile intrinsics take their register as a literal.)
inline void store(const float* out, int c, int rows, uint16_t* y, int64_t ldy, const float* scale,
                  const float* bias) {
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(out + r * COLS);
    if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + c * COLS));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c * COLS));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * COLS),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

template <int CB, typename Blocks>
inline void tile(const uint16_t* x, int64_t K, int rows, Blocks& blocks, uint16_t* y, int64_t ldy,
                 const float* scale, const float* bias) {
  alignas(64) float out[MAX_BLOCKS][TILE_ROWS * COLS];
  configure(rows);
  accumulate<CB>(x, K, blocks, K / TILE_K);
  constexpr int64_t stride = COLS * sizeof(float);
  _tile_stored(0, out[0], stride);
  if constexpr (CB > 1) _tile_stored(1, out[1], stride);
  if constexpr (CB > 2) _tile_stored(2, out[2], stride);
  if constexpr (CB > 3) _tile_stored(3, out[3], stride);
  for (int c = 0; c < CB; ++c) store(out[c], c, rows, y, ldy, scale, bias);
}

template <typename Blocks>
inline void tile(int cb, const uint16_t* x, int64_t K, int rows, Blocks& blocks, uint16_t* y, int64_t ldy,
                 const float* scale, const float* bias) {
  switch (cb) {
    case 1: return tile<1>(x, K, rows, blocks, y, ldy, scale, bias);
    case 2: return tile<2>(x, K, rows, blocks, y, ldy, scale, bias);
    case 3: return tile<3>(x, K, rows, blocks, y, ldy, scale, bias);
    default: return tile<4>(x, K, rows, blocks, y, ldy, scale, bias);
  }
}

// Per-thread scratch, 64-byte aligned: int8 widening's B tiles, or a group's whole widened blocks.
inline uint16_t* scratch(int64_t elements) {
  thread_local std::vector<uint16_t> mem;
  if (static_cast<int64_t>(mem.size()) < elements + 32) mem.resize(elements + 32);
  auto addr = reinterpret_cast<uintptr_t>(mem.data());
  return reinterpret_cast<uint16_t*>((addr + 63) & ~uintptr_t{63});
}

// Blocks b .. b + cb - 1 (cb <= 4) of y [M, N] for all M rows of x [M, K], 16 rows a tile.
// int8 weights: with one row chunk, widened a k-tile at a time (stays in L1); with more, the
// group's whole K is widened once (cb x 16 x K bf16, <= 196 KB at K = 1536: L2) and read by each.
template <typename W>
void group(const uint16_t* x, int64_t M, int64_t K, const W* w, int64_t block, int cb, uint16_t* y, int64_t N,
           const float* scale, const float* bias) {
  if constexpr (std::is_same_v<W, int8_t>) {
    if (M > TILE_ROWS) {
      uint16_t* wide = scratch(cb * block);
      for (int c = 0; c < cb; ++c)
        for (int64_t s = 0; s < K / TILE_K; ++s)
          widen_tile(w + c * block + s * B_TILE, wide + c * block + s * B_TILE);
      group<uint16_t>(x, M, K, wide, block, cb, y, N, scale, bias);
      return;
    }
    Int8Blocks blocks{w, block, scratch(MAX_BLOCKS * B_TILE)};
    tile(cb, x, K, static_cast<int>(M), blocks, y, N, scale, bias);
  } else {
    Bf16Blocks blocks{w, block};
    for (int64_t r = 0; r < M; r += TILE_ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(TILE_ROWS, M - r));
      tile(cb, x + r * K, K, rows, blocks, y + r * N, N, scale, bias);
    }
  }
}

}  // namespace amx
