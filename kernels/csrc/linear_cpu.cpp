// A float32 projection for every batch size of a step,
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])
//
// built first for the few-token decode steps, where oneDNN's GEMM is far from
// the memory floor (at M = 1..32 rows a step reads every weight once and does
// little arithmetic on it), and measured faster than oneDNN at up to 512 rows
// too (kernels/linear.py), so it serves prefill chunks as well.
//
// Weights are packed once, at load time, into panels of 16 output features
// laid out k-major (kernels/linear.py packs them):
//
//   panels [P = ceil(N / 16), K, 16]     panels[p, k, j] = W[16 p + j, k]  (0 past N)
//
// so one panel is a contiguous stream that the hardware prefetcher follows.
// A thread takes a range of panels; for each panel it walks the rows of x in
// tiles of up to 6, keeping 6 x 16 accumulators in registers:
//
//   for k in 0..K:   w = panel[k, 0:16]               two 8-lane loads
//                    acc[r] += x[r, k] * w            one broadcast, two FMAs per row
//
// The panel (K x 64 bytes: 36 KB at K = 576) stays in L1/L2 while the row
// tiles reuse it, so every weight leaves memory once per call whatever M is.
// Calls of 2 to 128 rows walk k in blocks instead, every tile over a block in
// turn while the next one is prefetched (run_panels_avx2 says why).
//
// Rounding: fp32 products summed in k order with fused multiply-adds, one
// accumulator per output; a different order than oneDNN's or MKL's, so
// results agree with them to ~1e-6 relative, not bit for bit.
//
// Instruction sets: an AVX2+FMA kernel (intrinsics) and a plain scalar
// baseline, picked at run time (__builtin_cpu_supports, capped by
// linear_set_max_isa, which the Python side calls with what
// cpu_features.detect() allows), so the binary does not depend on the build
// machine's CPU; kernels/linear.py uses it only where the AVX2 variant runs.
//
// bf16 panels (panel_linear_bf16, the "avx512" variant: AVX-512 F/BW/VL and
// AVX512-BF16) serve the decode-sized calls of bf16 weights (kernels/linear.py
// says which), where oneDNN is short of the weights' read time or of the dot
// products' rate. Pairs of k sit side by side so
// one vdpbf16ps takes a whole 64-byte row of the panel:
//
//   panels [P = ceil(N / 16), K / 2, 16, 2]   panels[p, i, j, t] = W[16 p + j, 2 i + t]
//
//   for i in 0..K/2:  w = panel[i]                    one 64-byte load
//                     acc[s][r] += (x[r, 2i], x[r, 2i+1]) . w    broadcast + vdpbf16ps
//
// A tile is up to 8 rows against two adjacent panels, so each broadcast of
// x feeds two dot products. With one row, two accumulators would be chains
// of dependent vdpbf16ps (latency-bound), so k-pairs also rotate over S
// accumulator sets, summed at the end. More rows walk k in blocks of 64
// pairs, every row tile over a block in turn while the next block is
// prefetched (run_blocks_bf16). Products of bf16 are exact in fp32; sums are
// fp32, rounded once to bf16 (round to nearest even) after the bias, as oneDNN does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace slipstream {
namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int kTileRows = 6;    // rows of x per register tile: 12 accumulators

// ------------------------------------------------------------------ AVX2 + FMA

// As the bf16 panels below do, a call of 2 to kMaxBlockedRows rows walks k in
// blocks, every row tile over a block while it sits in L1 (sums parked
// between blocks, each accumulator still summed in k order: the same
// results), the tiles sharing out the prefetches of the next block (the last
// block's, of the next panel's first), so the weights stream in while every
// row's products run rather than before the tiles after the first: 0.7-0.9
// of the time at 4-64 rows (Zen 5, AVX2 code). Larger calls (prefill chunks)
// are bound by their arithmetic, and the walk tile by tile over the whole of
// k is ~3 % faster at 512 rows.
constexpr int64_t kBlockK = 64;  // k a block: 4 KB of a panel
constexpr int64_t kMaxBlockedRows = 128;

template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void block_tile_avx2(
    const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, int64_t prefetch_end,
    int tile, int tiles, float* partial, bool first, bool last, float* y, int64_t ldy,
    int64_t cols, const float* bias) {
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + r * kPanel);
    acc1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + r * kPanel + 8);
  }
  int turn = tile;  // this tile prefetches every tiles-th line of the next block
#pragma GCC unroll 4
  for (int64_t k = k0; k < k1; ++k) {
    if (turn == 0) {
      turn = tiles;
      if (k + kBlockK < prefetch_end)  // past k_size: the next panel's first block
        _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kBlockK) * kPanel), _MM_HINT_T0);
    }
    --turn;
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(b, w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(b, w1, acc1[r]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(partial + r * kPanel, acc0[r]);
      _mm256_storeu_ps(partial + r * kPanel + 8, acc1[r]);
    }
    return;
  }
  alignas(32) float row[kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(row, acc0[r]);
    _mm256_store_ps(row + 8, acc1[r]);
    float* yr = y + r * ldy;
    if (bias != nullptr) {
      for (int64_t j = 0; j < cols; ++j) yr[j] = row[j] + bias[j];
    } else {
      std::memcpy(yr, row, cols * sizeof(float));
    }
  }
}

template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void dispatch_block_avx2(
    int rows, const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
    int64_t prefetch_end, int tile, int tiles, float* partial, bool first, bool last, float* y,
    int64_t ldy, int64_t cols, const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) {
      dispatch_block_avx2<R - 1>(rows, x, ldx, panel, k0, k1, prefetch_end, tile, tiles, partial,
                                 first, last, y, ldy, cols, bias);
      return;
    }
  }
  block_tile_avx2<R>(x, ldx, panel, k0, k1, prefetch_end, tile, tiles, partial, first, last, y,
                     ldy, cols, bias);
}

__attribute__((target("avx2,fma"))) void run_panels_avx2(const float* x, int64_t ldx, int64_t m,
                                                          const float* panels, int64_t k_size,
                                                          float* y, int64_t n, const float* bias,
                                                          int64_t p_begin, int64_t p_end) {
  const int tiles = static_cast<int>((m + kTileRows - 1) / kTileRows);
  const bool blocked = m > 1 && m <= kMaxBlockedRows;
  std::vector<float> partial(blocked ? static_cast<size_t>(tiles) * kTileRows * kPanel : 0);
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* panel = panels + p * k_size * kPanel;
    const int64_t col = p * kPanel;
    const int64_t cols = std::min(kPanel, n - col);
    const float* pb = bias != nullptr ? bias + col : nullptr;
    if (!blocked) {  // the whole of k as one block, no prefetches: the hardware's stream
      for (int64_t r = 0; r < m; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r));
        dispatch_block_avx2<kTileRows>(rows, x + r * ldx, ldx, panel, 0, k_size, 0, 0, 1, nullptr,
                                       true, true, y + r * n + col, n, cols, pb);
      }
      continue;
    }
    // Panels lie end to end: the last block prefetches the next panel's first.
    const int64_t prefetch_end = p + 1 < p_end ? 2 * k_size : k_size;
    for (int64_t k0 = 0; k0 < k_size; k0 += kBlockK) {
      const int64_t k1 = std::min(k0 + kBlockK, k_size);
      for (int64_t r = 0; r < m; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r));
        const int tile = static_cast<int>(r / kTileRows);
        dispatch_block_avx2<kTileRows>(rows, x + r * ldx, ldx, panel, k0, k1, prefetch_end, tile,
                                       tiles, partial.data() + tile * kTileRows * kPanel, k0 == 0,
                                       k1 == k_size, y + r * n + col, n, cols, pb);
      }
    }
  }
}

// ------------------------------------------------------------------ baseline

// Correct everywhere, not fast: kernels/linear.py sends work here only on a
// CPU with AVX2 (where the variant above runs).
void run_panels_portable(const float* x, int64_t ldx, int64_t m, const float* panels,
                         int64_t k_size, float* y, int64_t n, const float* bias, int64_t p_begin,
                         int64_t p_end) {
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* panel = panels + p * k_size * kPanel;
    const int64_t col = p * kPanel;
    const int64_t cols = std::min(kPanel, n - col);
    for (int64_t r = 0; r < m; ++r) {
      float acc[kPanel] = {};
      for (int64_t k = 0; k < k_size; ++k) {
        const float xv = x[r * ldx + k];
        for (int64_t j = 0; j < kPanel; ++j) acc[j] += xv * panel[k * kPanel + j];
      }
      for (int64_t j = 0; j < cols; ++j) {
        y[r * n + col + j] = acc[j] + (bias != nullptr ? bias[col + j] : 0.f);
      }
    }
  }
}

// ------------------------------------------------------------------ AVX-512 bf16

#if defined(SLIPSTREAM_EMULATE_AVX512)  // a test build: see avx512_emulation.h
#define SLIPSTREAM_AVX512_BF16 __attribute__((target("avx2,fma")))
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "avx512_emulation.h"
#pragma GCC pop_options
#else
#define SLIPSTREAM_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
#endif

constexpr int kBf16TileRows = 8;  // rows of x per register tile
constexpr int64_t kBf16TileFloats = 2 * kBf16TileRows * kPanel;  // a tile's parked sums

// A tile is R rows against NP adjacent panels (NP <= 2): each broadcast pair
// of x feeds NP dot products. With few rows the k-pairs also rotate over S
// accumulator sets, so that at least 4 independent chains are in flight.
template <int R, int NP>
constexpr int sets_for() {
  return R * NP >= 4 ? 1 : R * NP >= 2 ? 2 : 4;
}

// acc[q][r] += (x[r, 2i], x[r, 2i + 1]) . panel_q[i] for every row and panel.
template <int R, int NP>
SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void dot_pair(
    __m512 (*acc)[R], const uint16_t* x, int64_t ldx, const uint16_t* panel,
    int64_t panel_stride, int64_t i) {
  __m512i w[NP];
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) w[q] = _mm512_loadu_si512(panel + q * panel_stride + i * 2 * kPanel);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, x + r * ldx + 2 * i, sizeof(pair));
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], xb, (__m512bh)w[q]);
  }
}

// Row r's 16 sums of one panel into y (the `keep` columns): rounded to bf16,
// or as they are where y is float32 (the logits: rounding them to bf16 ties
// tokens 1/8 apart near 20, which greedy decoding then breaks by token id).
SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void store_sums(
    uint16_t* y, __mmask16 keep, __m512 v) {
  _mm256_mask_storeu_epi16(y, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void store_sums(
    float* y, __mmask16 keep, __m512 v) {
  _mm512_mask_storeu_ps(y, keep, v);
}

// Or not stored at all: each row keeps its greatest sum and its column (a
// greedy row's token), where y would have been [m, n] at `offset`. Columns
// reach a row in increasing order within a thread's panels, so the first
// maximum wins; a NaN never does (a row of NaNs picks column 0).
struct RowMax {
  float value;
  int64_t column;
};

struct ArgmaxOut {
  RowMax* rows;
  int64_t n;
  int64_t offset;
  ArgmaxOut operator+(int64_t d) const { return {rows, n, offset + d}; }
};

SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void store_sums(
    ArgmaxOut y, __mmask16 keep, __m512 v) {
  RowMax& best = y.rows[y.offset / y.n];
  if (keep == 0xffff && !(_mm512_reduce_max_ps(v) > best.value)) return;  // the usual case
  alignas(64) float sums[kPanel];
  _mm512_storeu_ps(sums, v);
  const int64_t column = y.offset % y.n;
  for (int j = 0; j < kPanel; ++j) {
    if ((keep >> j) & 1 && sums[j] > best.value) best = {sums[j], column + j};
  }
}

// y[r, q * 16 + j] = sum[q][r][j] + bias, the columns past N masked off.
template <int R, int NP, typename Y>
SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void write_rows_bf16(
    __m512 (*sum)[R], Y y, int64_t ldy, int64_t cols, const uint16_t* bias) {
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
    const int64_t left = cols - q * kPanel;  // columns of this panel inside N
    const __mmask16 keep = static_cast<__mmask16>(left >= kPanel ? 0xffff : (1u << left) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) {  // bf16 -> fp32 is a 16-bit shift
      b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + q * kPanel)), 16));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store_sums(y + r * ldy + q * kPanel, keep, _mm512_add_ps(sum[q][r], b));
  }
}

template <int R, int NP, typename Y>
SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void tile_bf16(
    const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t k_pairs, Y y,
    int64_t ldy, int64_t cols, const uint16_t* bias) {
  constexpr int S = sets_for<R, NP>();
  __m512 acc[S][NP][R];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[s][q][r] = _mm512_setzero_ps();
    }
  }
  const int64_t stride = k_pairs * 2 * kPanel;
  int64_t i = 0;
  for (; i + S <= k_pairs; i += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) dot_pair<R, NP>(acc[s], x, ldx, panel, stride, i + s);
  }
  for (; i < k_pairs; ++i) dot_pair<R, NP>(acc[0], x, ldx, panel, stride, i);
  __m512 sum[NP][R];
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sum[q][r] = acc[0][q][r];
#pragma GCC unroll 4
      for (int s = 1; s < S; ++s) sum[q][r] = _mm512_add_ps(sum[q][r], acc[s][q][r]);
    }
  }
  write_rows_bf16<R, NP, Y>(sum, y, ldy, cols, bias);
}

// Calls of more than one row walk k in blocks, and every row tile takes its
// share of a block while the block sits in L1, its sums parked in `partial`
// between blocks. Row tile after row tile over the whole of k, the first tile
// waited on memory and the others then computed on a cached panel, the two
// never overlapping (16 rows of smollm2's projections: 1.6x the weights'
// read time). Here the tiles of a block share out the prefetches of the
// next one (the last block's, of the next panel pair's first), so the
// weights stream in while every row's dot products run.
constexpr int64_t kBf16BlockPairs = 64;  // k-pairs a block: 8 KB of a panel pair

template <int R, int NP, typename Y>
SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void block_tile_bf16(
    const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t stride, int64_t i0,
    int64_t i1, int64_t k_pairs, int next_panels, int tile, int tiles, float* partial, bool first,
    bool last, Y y, int64_t ldy, int64_t cols, const uint16_t* bias) {
  __m512 acc[NP][R];
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[q][r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + (q * R + r) * kPanel);
  }
  int turn = tile;  // this tile prefetches every tiles-th pair of the next block
  for (int64_t i = i0; i < i1; ++i) {
    if (turn == 0) {
      turn = tiles;
      const int64_t ahead = i + kBf16BlockPairs;
      if (ahead < k_pairs) {
#pragma GCC unroll 2
        for (int q = 0; q < NP; ++q)
          _mm_prefetch(reinterpret_cast<const char*>(panel + q * stride + ahead * 2 * kPanel),
                       _MM_HINT_T0);
      } else if (ahead < 2 * k_pairs) {  // the next pair's first block: 2 panels on
#pragma GCC unroll 2
        for (int q = 0; q < NP; ++q) {
          if (q < next_panels)
            _mm_prefetch(reinterpret_cast<const char*>(panel + (q + 2) * stride +
                                                       (ahead - k_pairs) * 2 * kPanel),
                         _MM_HINT_T0);
        }
      }
    }
    --turn;
    dot_pair<R, NP>(acc, x, ldx, panel, stride, i);
  }
  if (last) {
    write_rows_bf16<R, NP, Y>(acc, y, ldy, cols, bias);
    return;
  }
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(partial + (q * R + r) * kPanel, acc[q][r]);
  }
}

template <int R, int NP, typename Y>
SLIPSTREAM_AVX512_BF16 __attribute__((always_inline)) inline void dispatch_block_bf16(
    int rows, const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t stride, int64_t i0,
    int64_t i1, int64_t k_pairs, int next_panels, int tile, int tiles, float* partial, bool first,
    bool last, Y y, int64_t ldy, int64_t cols, const uint16_t* bias) {
  if constexpr (R > 1) {
    if (rows < R) {
      dispatch_block_bf16<R - 1, NP, Y>(rows, x, ldx, panel, stride, i0, i1, k_pairs, next_panels,
                                     tile, tiles, partial, first, last, y, ldy, cols, bias);
      return;
    }
  }
  block_tile_bf16<R, NP, Y>(x, ldx, panel, stride, i0, i1, k_pairs, next_panels, tile, tiles,
                         partial, first, last, y, ldy, cols, bias);
}

template <int NP, typename Y>
SLIPSTREAM_AVX512_BF16 void run_blocks_bf16(const uint16_t* x, int64_t ldx, int64_t m,
                                            const uint16_t* panel, int64_t k_pairs, Y y,
                                            int64_t ldy, int64_t cols, const uint16_t* bias,
                                            int next_panels, float* partial) {
  const int64_t stride = k_pairs * 2 * kPanel;
  const int tiles = static_cast<int>((m + kBf16TileRows - 1) / kBf16TileRows);
  for (int64_t i0 = 0; i0 < k_pairs; i0 += kBf16BlockPairs) {
    const int64_t i1 = std::min(i0 + kBf16BlockPairs, k_pairs);
    for (int64_t r = 0; r < m; r += kBf16TileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kBf16TileRows, m - r));
      const int tile = static_cast<int>(r / kBf16TileRows);
      dispatch_block_bf16<kBf16TileRows, NP, Y>(
          rows, x + r * ldx, ldx, panel, stride, i0, i1, k_pairs, next_panels, tile, tiles,
          partial + tile * kBf16TileFloats, i0 == 0, i1 == k_pairs, y + r * ldy, ldy, cols, bias);
    }
  }
}

template <typename Y>
SLIPSTREAM_AVX512_BF16 void run_panels_bf16(const uint16_t* x, int64_t ldx, int64_t m,
                                            const uint16_t* panels, int64_t k_pairs, Y y,
                                            int64_t n, const uint16_t* bias, int64_t p_begin,
                                            int64_t p_end) {
  const bool blocked = m > 1;
  std::vector<float> partial(
      blocked ? static_cast<size_t>((m + kBf16TileRows - 1) / kBf16TileRows * kBf16TileFloats)
              : 0);
  for (int64_t p = p_begin; p < p_end; p += 2) {
    const uint16_t* panel = panels + p * k_pairs * 2 * kPanel;
    const int64_t col = p * kPanel;
    const int64_t cols = std::min(2 * kPanel, n - col);
    const uint16_t* pb = bias != nullptr ? bias + col : nullptr;
    const bool pair = p + 1 < p_end;
    // The next pair's panels in this range, whose first block the last block prefetches.
    const int next = static_cast<int>(std::clamp<int64_t>(p_end - p - 2, 0, 2));
    if (blocked) {
      if (pair) {
        run_blocks_bf16<2, Y>(x, ldx, m, panel, k_pairs, y + col, n, cols, pb, next, partial.data());
      } else {
        run_blocks_bf16<1, Y>(x, ldx, m, panel, k_pairs, y + col, n, cols, pb, next, partial.data());
      }
      continue;
    }
    if (pair) {
      tile_bf16<1, 2, Y>(x, ldx, panel, k_pairs, y + col, n, cols, pb);
    } else {
      tile_bf16<1, 1, Y>(x, ldx, panel, k_pairs, y + col, n, cols, pb);
    }
  }
}

// ------------------------------------------------------------------ variants

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kIsaNames[] = {"portable", "avx2", "avx512"};

int cpu_isa() {
  static const int best = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return int(kPortable);
#if defined(SLIPSTREAM_EMULATE_AVX512)
    return int(kAvx512);  // its AVX-512 instructions emulated with AVX2
#endif
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bf16"))
      return int(kAvx512);
    return int(kAvx2);
  }();
  return best;
}

std::atomic<int> g_max_isa{kAvx512};  // lowered by linear_set_max_isa

int isa() { return std::min(cpu_isa(), g_max_isa.load(std::memory_order_relaxed)); }

bool has_avx2() { return isa() >= kAvx2; }

const float* checked_bias(const c10::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n &&
                  bias->is_contiguous(),
              "bias must be a contiguous [out_features] tensor of the weight's dtype");
  return static_cast<const float*>(bias->data_ptr());
}

// y = x @ W^T (+ bias) into y [M, out_features], float32 with packed rows.
void panel_linear_into(const at::Tensor& x, const at::Tensor& panels,
                       const c10::optional<at::Tensor>& bias, int64_t out_features,
                       const at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear takes float32 x and panels");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, in_features] with packed rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [ceil(out / 16), in_features, 16] tensor");
  const int64_t m = x.size(0), k_size = x.size(1), n = out_features;
  TORCH_CHECK(panels.size(1) == k_size, "x has ", k_size, " features, the weight ", panels.size(1));
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == panels.size(0),
              "out_features does not match the number of panels");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == m && y.size(1) == n &&
                  y.stride(1) == 1 && y.stride(0) == n,
              "out must be a contiguous float32 [tokens, out_features] tensor");
  const float* bp = checked_bias(bias, at::kFloat, n);
  if (m == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const auto run = has_avx2() ? run_panels_avx2 : run_panels_portable;
  // Split the panels over the threads; a call of a few panels stays on one.
  const int64_t num_panels = panels.size(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k_size * m, 1));
  at::parallel_for(0, num_panels, grain, [&](int64_t b, int64_t e) {
    run(xp, ldx, m, wp, k_size, yp, n, bp, b, e);
  });
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, in_features] with packed rows");
  at::Tensor y = at::empty({x.size(0), std::max<int64_t>(out_features, 0)}, x.options());
  panel_linear_into(x, panels, bias, out_features, y);
  return y;
}

// The same into a buffer the caller keeps: a large output (a big vocabulary's
// logits) allocated fresh is mapped anew and its every page faulted in.
void panel_linear_out(const at::Tensor& x, const at::Tensor& panels,
                      const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2, "out must be [tokens, out_features]");
  panel_linear_into(x, panels, bias, out.size(1), out);
}

// A bf16 panel call's operands, checked.
struct Bf16Call {
  const uint16_t* x;
  int64_t ldx, m, k_pairs, n;
  const uint16_t* panels;
  int64_t num_panels;
  const uint16_t* bias;
  int64_t grain;  // panels a thread takes at least
};

Bf16Call bf16_call(const at::Tensor& x, const at::Tensor& panels,
                   const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(isa() == kAvx512, "panel_linear_bf16 needs the avx512 variant (AVX512-BF16); ",
              "this CPU, as capped, runs ", kIsaNames[isa()]);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16,
              "panel_linear_bf16 takes bfloat16 x and panels");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, in_features] with packed rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kPanel && panels.size(3) == 2 &&
                  panels.is_contiguous(),
              "panels must be a contiguous [ceil(out / 16), in_features / 2, 16, 2] tensor");
  const int64_t m = x.size(0), k_size = x.size(1), n = out_features;
  TORCH_CHECK(k_size % 2 == 0 && panels.size(1) * 2 == k_size, "x has ", k_size,
              " features, the weight ", panels.size(1) * 2, " (an even number)");
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == panels.size(0),
              "out_features does not match the number of panels");
  const auto* bp = reinterpret_cast<const uint16_t*>(checked_bias(bias, at::kBFloat16, n));
  // Chunks of >= 64 KiB of weights per thread: below that the fork costs more
  // than the second core's reads gain.
  const int64_t per_panel = k_size * 2 * kPanel * std::max<int64_t>(m, 1);
  const int64_t grain = 2 * std::max<int64_t>(1, 32768 / per_panel);
  return {static_cast<const uint16_t*>(x.data_ptr()),
          x.stride(0),
          m,
          k_size / 2,
          n,
          static_cast<const uint16_t*>(panels.data_ptr()),
          panels.size(0),
          bp,
          grain};
}

// y = x @ W^T (+ bias) into y [M, out_features] with packed rows: bfloat16,
// or float32 (the sums as they are: a bf16 model's logits).
void panel_linear_bf16_into(const at::Tensor& x, const at::Tensor& panels,
                            const c10::optional<at::Tensor>& bias, int64_t out_features,
                            const at::Tensor& y) {
  const Bf16Call c = bf16_call(x, panels, bias, out_features);
  const bool to_float = y.scalar_type() == at::kFloat;
  TORCH_CHECK((to_float || y.scalar_type() == at::kBFloat16) && y.dim() == 2 &&
                  y.size(0) == c.m && y.size(1) == c.n && y.stride(1) == 1 && y.stride(0) == c.n,
              "out must be a contiguous bfloat16 or float32 [tokens, out_features] tensor");
  if (c.m == 0) return;
  at::parallel_for(0, c.num_panels, c.grain, [&](int64_t b, int64_t e) {
    if (to_float) {
      run_panels_bf16(c.x, c.ldx, c.m, c.panels, c.k_pairs, y.data_ptr<float>(), c.n, c.bias, b, e);
    } else {
      auto* yp = static_cast<uint16_t*>(y.data_ptr());
      run_panels_bf16(c.x, c.ldx, c.m, c.panels, c.k_pairs, yp, c.n, c.bias, b, e);
    }
  });
}

// The column of each row's greatest float32 sum (the first of equals): a bf16
// model's greedy tokens, with no [m, n] logits written and read again. Every
// range of panels a thread takes keeps its rows' maxima; they are merged in
// column order.
at::Tensor panel_linear_bf16_argmax(const at::Tensor& x, const at::Tensor& panels,
                                    const c10::optional<at::Tensor>& bias,
                                    int64_t out_features) {
  const Bf16Call c = bf16_call(x, panels, bias, out_features);
  at::Tensor ids = at::zeros({c.m}, x.options().dtype(at::kLong));
  if (c.m == 0) return ids;
  std::vector<std::vector<RowMax>> ranges(c.num_panels);  // at each range's first panel
  at::parallel_for(0, c.num_panels, c.grain, [&](int64_t b, int64_t e) {
    std::vector<RowMax> rows(c.m, RowMax{-std::numeric_limits<float>::infinity(), b * kPanel});
    run_panels_bf16(c.x, c.ldx, c.m, c.panels, c.k_pairs, ArgmaxOut{rows.data(), c.n, 0}, c.n,
                    c.bias, b, e);
    ranges[b] = std::move(rows);
  });
  std::vector<const RowMax*> taken;
  for (const auto& range : ranges) {
    if (!range.empty()) taken.push_back(range.data());
  }
  auto* out = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < c.m; ++r) {
    RowMax best = taken[0][r];
    for (size_t t = 1; t < taken.size(); ++t) {
      if (taken[t][r].value > best.value) best = taken[t][r];
    }
    out[r] = best.column;
  }
  return ids;
}

at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels,
                             const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, in_features] with packed rows");
  at::Tensor y = at::empty({x.size(0), std::max<int64_t>(out_features, 0)}, x.options());
  panel_linear_bf16_into(x, panels, bias, out_features, y);
  return y;
}

// The same into a buffer the caller keeps, bfloat16 or float32.
void panel_linear_bf16_out(const at::Tensor& x, const at::Tensor& panels,
                           const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2, "out must be [tokens, out_features]");
  panel_linear_bf16_into(x, panels, bias, out.size(1), out);
}

std::string linear_isa() { return kIsaNames[isa()]; }

// Caps the variant at `name`; returns the one now picked.
std::string linear_set_max_isa(c10::string_view name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kIsaNames[i]) {
      g_max_isa.store(i);
      return linear_isa();
    }
  }
  TORCH_CHECK(false, "linear_set_max_isa: avx512, avx2 or portable, got ", name);
  return "";
}

}  // namespace
}  // namespace slipstream

TORCH_LIBRARY_FRAGMENT(slipstream, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_linear_bf16(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_linear_out(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("panel_linear_bf16_out(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("panel_linear_bf16_argmax(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_cpu_isa() -> str", &slipstream::linear_isa);
  m.def("linear_set_max_isa(str isa) -> str", &slipstream::linear_set_max_isa);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) {
  m.impl("panel_linear", &slipstream::panel_linear);
  m.impl("panel_linear_bf16", &slipstream::panel_linear_bf16);
  m.impl("panel_linear_out", &slipstream::panel_linear_out);
  m.impl("panel_linear_bf16_out", &slipstream::panel_linear_bf16_out);
  m.impl("panel_linear_bf16_argmax", &slipstream::panel_linear_bf16_argmax);
}
