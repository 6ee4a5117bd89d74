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
//
// Rounding: fp32 products summed in k order with fused multiply-adds, one
// accumulator per output; a different order than oneDNN's or MKL's, so
// results agree with them to ~1e-6 relative, not bit for bit.
//
// Instruction sets: an AVX2+FMA kernel (intrinsics) and a plain scalar
// baseline, picked at run time (__builtin_cpu_supports), so the binary does
// not depend on the build machine's CPU; kernels/linear.py uses it only
// where the AVX2 variant runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace slipstream {
namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int kTileRows = 6;    // rows of x per register tile: 12 accumulators

// ------------------------------------------------------------------ AVX2 + FMA

template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void tile_avx2(
    const float* x, int64_t ldx, const float* panel, int64_t k_size, float* y, int64_t ldy,
    int64_t cols, const float* bias) {
  // Every loop over R fully unrolled, so the accumulators live in registers.
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(b, w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(b, w1, acc1[r]);
    }
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
__attribute__((target("avx2,fma"), always_inline)) inline void dispatch_avx2(
    int rows, const float* x, int64_t ldx, const float* panel, int64_t k_size, float* y,
    int64_t ldy, int64_t cols, const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) {
      dispatch_avx2<R - 1>(rows, x, ldx, panel, k_size, y, ldy, cols, bias);
      return;
    }
  }
  tile_avx2<R>(x, ldx, panel, k_size, y, ldy, cols, bias);
}

__attribute__((target("avx2,fma"))) void run_panels_avx2(const float* x, int64_t ldx, int64_t m,
                                                          const float* panels, int64_t k_size,
                                                          float* y, int64_t n, const float* bias,
                                                          int64_t p_begin, int64_t p_end) {
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* panel = panels + p * k_size * kPanel;
    const int64_t col = p * kPanel;
    const int64_t cols = std::min(kPanel, n - col);
    const float* pb = bias != nullptr ? bias + col : nullptr;
    for (int64_t r = 0; r < m; r += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r));
      dispatch_avx2<kTileRows>(rows, x + r * ldx, ldx, panel, k_size, y + r * n + col, n, cols,
                               pb);
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

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear takes float32 x and panels");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, in_features] with packed rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [ceil(out / 16), in_features, 16] tensor");
  const int64_t m = x.size(0), k_size = x.size(1), n = out_features;
  TORCH_CHECK(panels.size(1) == k_size, "x has ", k_size, " features, the weight ", panels.size(1));
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == panels.size(0),
              "out_features does not match the number of panels");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous(),
                "bias must be a contiguous float32 [out_features] tensor");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
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
  return y;
}

std::string linear_isa() { return has_avx2() ? "avx2" : "portable"; }

}  // namespace
}  // namespace slipstream

TORCH_LIBRARY_FRAGMENT(slipstream, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_cpu_isa() -> str", &slipstream::linear_isa);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) { m.impl("panel_linear", &slipstream::panel_linear); }
