// The elementwise work between a Llama layer's matrix multiplications, fused:
// one pass over memory and one parallel region where eager torch makes three
// to five of each.
//
//   add_rms_norm_(x, delta, w, eps)   x += delta (in place); returns rms_norm(x) * w
//   rms_norm(x, w, eps)               the same without the residual add
//   silu_and_mul(gu)                  [T, 2I] -> [T, I]: silu(gu[:, :I]) * gu[:, I:]
//   rotary_neox_(qk, cos, ssin, pos)  in place, neox layout: x * cos + roll(x, D/2) * ssin
//                                     (ssin = sin with the first half negated)
//   row_argmax(x)                     [R, C] -> int64 [R]: x.argmax(-1), for the sampler
//   row_top_values(x, k)              float32 [R, C] -> [R, k]: x.topk(k).values (no NaN in x),
//                                     the sampler's top-p candidates
//
// Rounding follows the eager ops where it can: every add and product is
// rounded as torch rounds it (-ffp-contract=off: no fused multiply-adds), bf16
// values are rounded to nearest even once, where eager torch rounds between
// ops. The sum of squares and exp (glibc's vector expf) differ from torch's in
// the last bit, so fp32 results match eager to ~1e-7 relative, not bit for bit.
//
// Instruction sets: each kernel is a template inlined into an AVX-512
// (F/BW/VL/DQ, 16-lane vectors), an AVX2+FMA and a baseline entry point, one
// source compiled three times; the variant is picked at run time
// (__builtin_cpu_supports, capped by fused_ops_set_max_isa, which the Python
// side calls with what cpu_features.detect() allows), so the binary does not
// depend on the build machine's CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

// glibc's vector expf (libmvec, linked with -lmvec): with this declaration the
// compiler vectorizes the silu loop instead of calling expf once per element.
extern "C" {
#pragma omp declare simd notinbranch
float expf(float) noexcept;
}

namespace slipstream {
namespace {

using bf16_bits = uint16_t;

inline float load(float v) { return v; }
inline float load(bf16_bits v) {
  uint32_t w = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
// v as T: bf16 rounded to nearest even, a NaN as 0x7FC0. The NaN case is a
// mask, not a branch or a select, which gcc 12 kept as a branch in a bf16 loop
// that also sums what it stores (rms_rows' residual add): that loop ran
// scalar on AVX2, 8x the fp32 loop's time.
template <typename T>
inline T narrow(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    uint32_t w;
    std::memcpy(&w, &v, sizeof(w));
    const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    const uint32_t nan = 0u - uint32_t((w & 0x7FFFFFFFu) > 0x7F800000u);
    return static_cast<bf16_bits>((rounded & ~nan) | (0x7FC0u & nan));
  }
}
template <typename T>
inline void store(T* dst, float v) {
  *dst = narrow<T>(v);
}

// Rows per parallel chunk: about 16K elements, so small batches run on one thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

template <typename T>
__attribute__((always_inline)) inline void rms_rows(T* x, int64_t x_stride, const T* delta,
                                                    int64_t d_stride, const T* w, T* out,
                                                    int64_t width, float eps, int64_t begin,
                                                    int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* xr = x + r * x_stride;
    float sum = 0.f;
    if (delta != nullptr) {
      const T* dr = delta + r * d_stride;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) {
        const T v = narrow<T>(load(xr[i]) + load(dr[i]));
        xr[i] = v;
        float s = load(v);  // the rounded sum, as the next op reads it
        sum += s * s;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) {
        float s = load(xr[i]);
        sum += s * s;
      }
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
    T* orow = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) store(&orow[i], load(xr[i]) * inv * load(w[i]));
  }
}

template <typename T>
__attribute__((always_inline)) inline void silu_rows(const T* gu, int64_t stride, T* out,
                                                     int64_t inter, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = gu + r * stride;
    const T* u = g + inter;
    T* o = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      float x = load(g[i]);
      store(&o[i], x / (1.f + expf(-x)) * load(u[i]));
    }
  }
}

template <typename T>
__attribute__((always_inline)) inline void rope_rows(T* qk, int64_t tok_stride, int64_t heads,
                                                     int64_t dim, const T* cos, const T* ssin,
                                                     const int64_t* pos, int64_t begin,
                                                     int64_t end) {
  const int64_t half = dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* c = cos + pos[t] * dim;
    const T* s = ssin + pos[t] * dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = qk + t * tok_stride + h * dim;
      float lo[512], hi[512];  // dim <= 1024, checked by the caller
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        lo[i] = load(x[i]);
        hi[i] = load(x[i + half]);
      }
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        // roll(x, D/2)[i] is hi[i] for i < D/2 and lo[i - D/2] after.
        float a = lo[i] * load(c[i]);
        float b = hi[i] * load(s[i]);
        store(&x[i], a + b);
        float a2 = hi[i] * load(c[i + half]);
        float b2 = lo[i] * load(s[i + half]);
        store(&x[i + half], a2 + b2);
      }
    }
  }
}

// The index of each row's first maximum, a NaN counting as the maximum (its
// first NaN), as torch's argmax: one pass of chunk maxima (a vector max and a
// NaN test per chunk), then one chunk read again from cache for the index.
// torch's CPU argmax carries an index per element in scalar code.
constexpr int64_t kArgmaxChunk = 256;

template <typename T>
__attribute__((always_inline)) inline void argmax_rows(const T* x, int64_t cols, int64_t* out,
                                                       int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * cols;
    float best = -INFINITY;
    int64_t best_start = 0, answer = -1;
    for (int64_t start = 0; start < cols && answer < 0; start += kArgmaxChunk) {
      const int64_t n = std::min(kArgmaxChunk, cols - start);
      const T* c = row + start;
      float m = -INFINITY;
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t i = 0; i < n; ++i) {
        const float v = load(c[i]);
        m = std::max(m, v);
        nan |= v != v;
      }
      if (nan) {
        for (int64_t i = 0; i < n; ++i) {
          if (load(c[i]) != load(c[i])) {
            answer = start + i;
            break;
          }
        }
      } else if (m > best) {
        best = m;
        best_start = start;
      }
    }
    if (answer < 0) {
      const int64_t n = std::min(kArgmaxChunk, cols - best_start);
      answer = best_start;  // a row of -inf: its first
      for (int64_t i = 0; i < n; ++i) {
        if (load(row[best_start + i]) == best) {
          answer = best_start + i;
          break;
        }
      }
    }
    out[r] = answer;
  }
}

// Ordered: a variant needs every instruction of those before it.
enum Variant : int { kBase, kAvx2, kAvx512 };
constexpr const char* kVariantNames[] = {"portable", "avx2", "avx512"};

int cpu_variant() {
#if defined(__x86_64__)
  static const int best = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return int(kBase);
#if defined(SLIPSTREAM_EMULATE_AVX512)
    return int(kAvx512);  // compiled for AVX2 in this test build (avx512_emulation.h)
#endif
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return int(kAvx512);
    return int(kAvx2);
  }();
  return best;
#else
  return kBase;
#endif
}

std::atomic<int> g_max_variant{kAvx512};  // lowered by fused_ops_set_max_isa

int variant() { return std::min(cpu_variant(), g_max_variant.load(std::memory_order_relaxed)); }

#if defined(__x86_64__)
#define SLIPSTREAM_AVX2 __attribute__((target("avx2,fma")))
#if defined(SLIPSTREAM_EMULATE_AVX512)  // a test build: the same code for AVX2
#define SLIPSTREAM_AVX512 __attribute__((target("avx2,fma")))
#else
#define SLIPSTREAM_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")))
#endif
#else
#define SLIPSTREAM_AVX2
#define SLIPSTREAM_AVX512
#endif

// One baseline, one AVX2 and one AVX-512 entry point per kernel and dtype.
// fp32_on_avx2: fp32 calls keep the AVX2 entry point on AVX-512 CPUs (RoPE's
// 16-lane fp32 loop measured slower: AMD EPYC Zen 5, 1 thread, 64 tokens x
// 12 heads x 64: 11.6 vs 14.2 us).
#define SLIPSTREAM_VARIANTS(name, kernel, fp32_on_avx2, params, args) \
  template <typename T>                                          \
  void name##_base params { kernel<T> args; }                    \
  template <typename T>                                          \
  SLIPSTREAM_AVX2 void name##_avx2 params { kernel<T> args; }     \
  template <typename T>                                          \
  SLIPSTREAM_AVX512 void name##_avx512 params { kernel<T> args; } \
  template <typename T>                                          \
  void name params {                                             \
    int v = variant();                                           \
    if (fp32_on_avx2 && std::is_same_v<T, float> && v == kAvx512) \
      v = kAvx2;                                                 \
    if (v == kAvx512) {                                          \
      name##_avx512<T> args;                                     \
    } else if (v == kAvx2) {                                     \
      name##_avx2<T> args;                                       \
    } else {                                                     \
      name##_base<T> args;                                       \
    }                                                            \
  }

SLIPSTREAM_VARIANTS(run_rms, rms_rows, false,
                    (T * x, int64_t xs, const T* d, int64_t ds, const T* w, T* o, int64_t n,
                     float eps, int64_t b, int64_t e),
                    (x, xs, d, ds, w, o, n, eps, b, e))
SLIPSTREAM_VARIANTS(run_silu, silu_rows, false,
                    (const T* gu, int64_t s, T* o, int64_t n, int64_t b, int64_t e),
                    (gu, s, o, n, b, e))
SLIPSTREAM_VARIANTS(run_argmax, argmax_rows, false,
                    (const T* x, int64_t c, int64_t* o, int64_t b, int64_t e), (x, c, o, b, e))
SLIPSTREAM_VARIANTS(run_rope, rope_rows, true,
                    (T * qk, int64_t ts, int64_t h, int64_t d, const T* c, const T* s,
                     const int64_t* p, int64_t b, int64_t e),
                    (qk, ts, h, d, c, s, p, b, e))

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(bf16_bits{});
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

at::Tensor rms_impl(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                    const at::Tensor& weight, double eps) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, hidden] with packed rows");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  int64_t d_stride = 0;
  if (delta.has_value()) {
    const at::Tensor& d = *delta;
    TORCH_CHECK(d.sizes() == x.sizes() && d.stride(1) == 1 && d.scalar_type() == x.scalar_type(),
                "delta must match x");
    d_stride = d.stride(0);
  }
  at::Tensor out = at::empty({rows, width}, x.options());
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    T* xp = ptr<T>(x);
    const T* dp = delta.has_value() ? ptr<T>(*delta) : nullptr;
    const T* wp = ptr<T>(weight);
    T* op = ptr<T>(out);
    const float e = static_cast<float>(eps);
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, grain(width), [&](int64_t b, int64_t en) {
      run_rms<T>(xp, xs, dp, d_stride, wp, op, width, e, b, en);
    });
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight,
                         double eps) {
  return rms_impl(x, delta, weight, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_impl(x, c10::nullopt, weight, eps);
}

at::Tensor silu_and_mul(const at::Tensor& gu) {
  check_float(gu, "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "gate_up must be [tokens, 2 * intermediate] with packed rows");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2, stride = gu.stride(0);
  at::Tensor out = at::empty({rows, inter}, gu.options());
  by_dtype(gu, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = ptr<T>(gu);
    T* op = ptr<T>(out);
    at::parallel_for(0, rows, grain(2 * inter), [&](int64_t b, int64_t e) {
      run_silu<T>(gp, stride, op, inter, b, e);
    });
  });
  return out;
}

void rotary_neox_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& ssin,
                  const at::Tensor& positions) {
  check_float(qk, "qk");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be [tokens, heads, head_dim] with packed heads");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  TORCH_CHECK(dim % 2 == 0 && dim <= 1024, "head_dim must be even and at most 1024");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && cos.is_contiguous() && ssin.sizes() == cos.sizes() &&
                  ssin.is_contiguous() && cos.scalar_type() == qk.scalar_type() &&
                  ssin.scalar_type() == qk.scalar_type(),
              "cos and signed sin must be contiguous [positions, head_dim] tables of qk's dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong,
              "positions must be a contiguous int64 [tokens] tensor");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t table = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table, "position ", pos[t], " outside the rope table");
  }
  by_dtype(qk, [&](auto tag) {
    using T = decltype(tag);
    T* qp = ptr<T>(qk);
    const T* cp = ptr<T>(cos);
    const T* sp = ptr<T>(ssin);
    const int64_t ts = qk.stride(0);
    at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t b, int64_t e) {
      run_rope<T>(qp, ts, heads, dim, cp, sp, pos, b, e);
    });
  });
}

at::Tensor row_argmax(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous [rows, cols] tensor with cols > 0");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / cols), [&](int64_t b, int64_t e) {
      run_argmax<T>(xp, cols, op, b, e);
    });
  });
  return out;
}

// ---- The k largest values of each row, descending: x.topk(k).values for rows
// without NaN, 2.7x faster than torch's CPU topk at k = 1,024 of 49,152. One
// pass counts the row's values in 2,048 buckets of their order-preserving
// bits (sign, exponent, two mantissa bits), the bucket holding the k-th largest
// is found from the top, a second pass keeps the values from that bucket up,
// the k-th of those is selected and the k above it sorted. Scalar code: the
// same on every CPU.

inline uint32_t ordered_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

void top_values_rows(const float* x, int64_t cols, int64_t k, float* out, int64_t b, int64_t e) {
  constexpr int kShift = 21;  // 2,048 buckets
  std::vector<int64_t> count(size_t{1} << (32 - kShift));
  std::vector<float> kept;
  for (int64_t r = b; r < e; ++r) {
    const float* row = x + r * cols;
    std::fill(count.begin(), count.end(), 0);
    for (int64_t c = 0; c < cols; ++c) ++count[ordered_bits(row[c]) >> kShift];
    int64_t bucket = static_cast<int64_t>(count.size()) - 1, above = 0;
    while (above + count[bucket] < k) above += count[bucket--];
    const uint32_t lowest = static_cast<uint32_t>(bucket) << kShift;
    kept.clear();
    for (int64_t c = 0; c < cols; ++c) {
      if (ordered_bits(row[c]) >= lowest) kept.push_back(row[c]);
    }
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<float>());
    std::sort(kept.begin(), kept.begin() + k, std::greater<float>());
    std::memcpy(out + r * k, kept.data(), k * sizeof(float));
  }
}

at::Tensor row_top_values(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous float32 [rows, cols] CPU tensor");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(k >= 1 && k <= cols, "k must be in [1, cols], got ", k);
  at::Tensor out = at::empty({rows, k}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) { top_values_rows(xp, cols, k, op, b, e); });
  return out;
}

// ---- The decoder stack in one call: the same ops a Python layer loop makes,
// in the same order, without ~20 interpreter round trips per layer (5-10 us
// each on a slow core: milliseconds a step on a 30-layer model, as much as
// the weights take to read at batch 1). The projections and attention live
// in other Slipstream libraries and are reached through the dispatcher.

// One projection as kernels/linear.py's Linear runs it: the panels for calls of
// at most max_panel_rows rows, else oneDNN's packed weight or a plain linear.
struct Projection {
  const at::Tensor& weight;
  const c10::optional<at::Tensor>& panels;
  const c10::optional<at::Tensor>& bias;
  int64_t packed, out_features, max_panel_rows;
};

using PanelFn = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                           int64_t);

// Looked up on first use only: a model without panels runs where the panel
// library did not load.
const c10::TypedOperatorHandle<PanelFn>& panel_op(bool bf16) {
  static const auto f32 = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("slipstream::panel_linear", "")
                              .typed<PanelFn>();
  if (!bf16) return f32;
  static const auto b16 = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("slipstream::panel_linear_bf16", "")
                              .typed<PanelFn>();
  return b16;
}

at::Tensor project(const Projection& p, at::Tensor x) {
  if (p.panels.has_value() && x.size(0) <= p.max_panel_rows) {
    if (x.stride(-1) != 1) x = x.contiguous();
    return panel_op(x.scalar_type() != at::kFloat).call(x, *p.panels, p.bias, p.out_features);
  }
  if (p.packed) {
    static const auto pointwise = c10::Dispatcher::singleton().findSchemaOrThrow(
        "mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, p.weight, p.bias, c10::string_view("none"),
                            c10::List<c10::optional<at::Scalar>>({c10::nullopt}),
                            c10::optional<c10::string_view>(c10::string_view(""))};
    pointwise.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, p.weight, p.bias);
}

// Every layer of a Llama decoder over the residual stream x [tokens, hidden],
// updated in place; ends with x holding the last layer's output (the final
// norm is the caller's). Per layer, four projections in the order qkv, o,
// gate_up, down (info: packed, out_features, max_panel_rows for each) and two
// norms (input, post-attention).
void decoder_layers_(at::Tensor x, at::TensorList weights,
                     const c10::List<c10::optional<at::Tensor>>& panels,
                     const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef info,
                     at::TensorList norms, at::TensorList k_storages, at::TensorList v_storages,
                     const at::Tensor& cos, const at::Tensor& ssin, const at::Tensor& positions,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                     double eps, const c10::optional<at::Tensor>& part_ns) {
  const int64_t layers = int64_t(k_storages.size());
  TORCH_CHECK(int64_t(v_storages.size()) == layers && int64_t(weights.size()) == 4 * layers &&
                  int64_t(panels.size()) == 4 * layers && int64_t(biases.size()) == 4 * layers &&
                  int64_t(info.size()) == 12 * layers && int64_t(norms.size()) == 2 * layers,
              "decoder_layers_: per layer, 4 projections, 12 info values, 2 norms and a K and V "
              "storage");
  using WriteFn = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                       const at::Tensor&);
  using AttendFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              c10::string_view);
  static const auto write = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("slipstream::paged_kv_write", "")
                                .typed<WriteFn>();
  static const auto attend = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("slipstream::paged_attention", "")
                                 .typed<AttendFn>();
  const int64_t tokens = x.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // Holds c10::List elements alive: the list's operator[] yields a temporary.
  std::vector<c10::optional<at::Tensor>> panel_of(panels.begin(), panels.end());
  std::vector<c10::optional<at::Tensor>> bias_of(biases.begin(), biases.end());
  auto projection = [&](int64_t j) {
    return Projection{weights[j], panel_of[j], bias_of[j], info[3 * j], info[3 * j + 1],
                      info[3 * j + 2]};
  };
  // part_ns: where given, int64 [2] += nanoseconds in attention and in the
  // projections (bench step's split; a clock read costs tens of ns).
  int64_t* clock = nullptr;
  if (part_ns.has_value()) {
    TORCH_CHECK(part_ns->scalar_type() == at::kLong && part_ns->numel() == 2 &&
                    part_ns->is_contiguous(),
                "part_ns must be a contiguous int64 tensor of 2 elements");
    clock = part_ns->data_ptr<int64_t>();
  }
  auto timed = [clock](int part, auto&& run) {
    if (clock == nullptr) return run();
    const auto start = std::chrono::steady_clock::now();
    at::Tensor out = run();
    clock[part] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - start)
                       .count();
    return out;
  };
  auto project_timed = [&](int64_t j, const at::Tensor& in) {
    return timed(1, [&] { return project(projection(j), in); });
  };
  at::Tensor h = rms_norm(x, norms[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor qkv = project_timed(4 * i, h);
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
    rotary_neox_(qk, cos, ssin, positions);
    at::Tensor q = qk.narrow(1, 0, num_heads);
    at::Tensor k = qk.narrow(1, num_heads, num_kv_heads);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor k_storage = k_storages[i], v_storage = v_storages[i];
    write.call(k, v, k_storage, v_storage, slot_mapping);
    at::Tensor attn = timed(0, [&] {
      return attend.call(q, k_storage, v_storage, block_tables, seq_lens, query_start_loc, scale,
                         "auto");
    });
    at::Tensor o = project_timed(4 * i + 1, attn.view({tokens, q_size}));
    h = add_rms_norm_(x, o, norms[2 * i + 1], eps);
    at::Tensor mlp = project_timed(4 * i + 3, silu_and_mul(project_timed(4 * i + 2, h)));
    if (i + 1 < layers) {
      h = add_rms_norm_(x, mlp, norms[2 * i + 2], eps);
    } else {
      x.add_(mlp);
    }
  }
}

std::string fused_ops_isa() { return kVariantNames[variant()]; }

// Caps the variant at `name`; returns the one now picked.
std::string fused_ops_set_max_isa(c10::string_view name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kVariantNames[i]) {
      g_max_variant.store(i);
      return fused_ops_isa();
    }
  }
  TORCH_CHECK(false, "fused_ops_set_max_isa: avx512, avx2 or portable, got ", name);
  return "";
}

}  // namespace
}  // namespace slipstream

TORCH_LIBRARY_FRAGMENT(slipstream, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("row_top_values(Tensor x, int k) -> Tensor");
  m.def("rotary_neox_(Tensor(a!) qk, Tensor cos, Tensor signed_sin, Tensor positions) -> ()");
  m.def(
      "decoder_layers_(Tensor(a!) x, Tensor[] weights, Tensor?[] panels, Tensor?[] biases, "
      "int[] info, Tensor[] norms, Tensor[] k_storages, Tensor[] v_storages, Tensor cos, "
      "Tensor signed_sin, Tensor positions, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor slot_mapping, int num_heads, int num_kv_heads, "
      "int head_dim, float scale, float eps, Tensor(b!)? part_ns=None) -> ()");
  m.def("fused_ops_cpu_isa() -> str", &slipstream::fused_ops_isa);
  m.def("fused_ops_set_max_isa(str isa) -> str", &slipstream::fused_ops_set_max_isa);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) {
  m.impl("add_rms_norm_", &slipstream::add_rms_norm_);
  m.impl("rms_norm", &slipstream::rms_norm);
  m.impl("silu_and_mul", &slipstream::silu_and_mul);
  m.impl("row_argmax", &slipstream::row_argmax);
  m.impl("row_top_values", &slipstream::row_top_values);
  m.impl("rotary_neox_", &slipstream::rotary_neox_);
  m.impl("decoder_layers_", &slipstream::decoder_layers_);
}

// oneDNN's packed weights are MkldnnCPU tensors: a list holding one dispatches there.
TORCH_LIBRARY_IMPL(slipstream, MkldnnCPU, m) {
  m.impl("decoder_layers_", &slipstream::decoder_layers_);
}
