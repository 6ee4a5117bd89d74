// Fused paged attention on the CPU: decodes and prefill chunks of a ragged
// batch in one call, reading K/V straight from the paged pool.
//
// Semantics (those of kernels/attention.py): token i of sequence b, whose
// query length is n = qsl[b+1] - qsl[b], sits at position seq_len[b] - n + i
// and attends keys 0..position inclusive.
//
// Memory walk of one task (sequence b, kv head h, a tile of query tokens, a
// range of keys). The cache is head-major, so the keys of one block of one kv
// head are a contiguous [block_size, head_dim] slab:
//
//   k_storage [kv_heads, num_blocks, block_size, head_dim]
//              h ----> block_tables[b] = [7, 2, 9]
//                      |  slab(h,7) |  slab(h,2) |  slab(h,9)  | ...
//   keys                  0..15       16..31       32..seq_len-1
//
//   for each key tile (<= 32 keys, never crossing a block):
//     K, V tile read in place (bf16 decodes: as even/odd lanes, see Bf16Rows),
//       or converted to fp32 scratch once for the rows of a prefill tile
//       (int8 rows, each with its scale after its values: always converted)
//     for each row r = (query token, head of the GQA group):
//       s = (q_r . K^T) * scale * log2(e)         8 keys per reduction
//       causal: row r sees keys <= its position
//       online softmax in base 2: m_r, l_r, O_r (fp32) rescaled by 2^(m_old - m_new)
//       O_r += p . V
//     meanwhile, a few lines at a time: prefetch the next tile's K and V
//       (another block, another page; the last tile: the thread's next task's first)
//
// Tasks of many rows (a prefill chunk's tokens x the group) take each tile
// as two small matrix products instead, with the rows' softmax state in
// vectors across rows (see run_task_tiles). With AVX512-BF16 (Bf16DotRows)
// a bf16 tile is taken in two passes instead:
// the scores of every row, then p . V for all rows at once, each
// interleaved pair of V rows shared by the rows (see attend_tile_dot).
//
// All G query heads of a kv head are rows of the same task, so each K/V tile
// is read from memory once per task. Long key ranges are split over several
// tasks ("split-K"); each split leaves (O, m, l) per row in a scratch buffer
// and a second pass merges them. Tasks run on OpenMP threads, largest first,
// each thread claiming its next task one ahead (run_plan).
//
// Instruction sets: the part below "per-variant code" is compiled three
// times, by including this file into itself (the pattern of Google's
// Highway): for the baseline, under `#pragma GCC target("avx2,fma")`, and
// under AVX-512 (F/BW/VL/DQ + BF16). The logic is one source; macros set
// what differs: SLIPSTREAM_LANES, the float lanes of the head_dim vectors
// (8: ymm or pairs of xmm; 16: zmm), SLIPSTREAM_BF16_DOT, which lets a
// bf16 task take its dot products on vdpbf16ps (Bf16DotRows below), and
// SLIPSTREAM_AVX2, where int8 widening, broadcasts and the KV write's
// rounding use AVX2 (or AVX-512) instructions (generic code in the
// baseline). The variant is picked at run time (CPUID, capped by
// set_max_isa, which the Python side calls with what cpu_features.detect()
// allows), so the binary does not depend on the build machine's CPU. A test
// build (-DSLIPSTREAM_EMULATE_AVX512) compiles the AVX-512 variant for AVX2
// with its intrinsics emulated (avx512_emulation.h) and runs it on any
// AVX2 CPU, so its logic is tested where no AVX-512 CPU is at hand.

#ifndef SLIPSTREAM_VARIANT  // ============================== shared code, first pass

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace slipstream {
namespace {

// GCC vector extensions, 8 float lanes: ymm registers in the AVX2 variant,
// pairs of xmm registers in the baseline one.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

using bf16_bits = uint16_t;  // element type of bfloat16 tensors

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// An int8 K/V row: head_dim values, then the row's fp32 scale in 4 bytes.
constexpr int64_t kInt8ScaleBytes = 4;
constexpr int kKeyTile = 32;  // keys per tile; a multiple of 8

// A unit of work: rows (token, head of the group) of one sequence and kv head
// against keys [key_begin, key_end). partial < 0: the task covers all keys
// and writes the output; else it writes its (O, m, l) record at partials + partial.
struct Task {
  int64_t seq;
  int64_t token0;  // row of q of the first query token
  int64_t pos0;    // its position in the sequence
  int64_t key_begin;
  int64_t key_end;
  int64_t partial;
  int64_t cost;
  int32_t kv_head;
  int32_t num_tokens;
};

// The split tasks of one (sequence, kv head, token tile): num_splits
// consecutive records of rows * (head_dim + 2) floats, O [rows, head_dim]
// then m [rows] then l [rows].
struct Merge {
  int64_t token0;
  int64_t partial;
  int32_t kv_head;
  int32_t num_tokens;
  int32_t num_splits;
};

// T: q and the output (float or bf16_bits); KV: the cache, T or int8_t
// rows, each head_dim values and the row's fp32 scale after them
// (kv_layout.py: value = int8 * scale).
template <typename T, typename KV = T>
struct Problem {
  const T* q;
  int64_t q_stride;  // elements between tokens of q; heads are packed
  const KV* k;       // [kv_heads, num_blocks, block_size, row_stride]
  const KV* v;
  T* out;            // [tokens, num_heads, head_dim] contiguous
  const int64_t* block_tables;
  int64_t max_blocks;
  int64_t num_heads;
  int64_t group;     // query heads per kv head
  int64_t head_dim;
  int64_t row_stride;  // elements between K/V rows: head_dim, + 4 for int8 rows
  int64_t block_size;
  int64_t num_blocks;
  float qk_scale;    // scale * log2(e): scores in base 2
  float* partials;
  int bf16_prefill;  // Bf16Prefill: how this call's bf16 tasks of many rows run
};

// A KV write (write_kv): rows (token, kv head) of k and v into their slots.
template <typename T, typename KV>
struct KvWrite {
  const T* src[2];        // k, v [tokens, kv_heads, head_dim], heads packed
  int64_t src_stride[2];  // elements between tokens
  KV* dst[2];             // head-major storage
  const int64_t* slots;
  int64_t num_kv_heads;
  int64_t num_slots;      // num_blocks * block_size
  int64_t head_dim;
  int64_t width;          // elements of a storage row
};

// Per-thread fp32 scratch, grown on demand and kept across calls.
struct Scratch {
  std::vector<float> q, o, m, l, k, v, alpha;
  std::vector<uint32_t> p_pairs;  // Bf16DotRows: p as bf16 pairs, per row
  std::vector<uint32_t> v_pairs;  // bf16 dot tiles: V's rows t, t + 1 paired, per column
  std::vector<uint32_t> v_cols;   // brgemm tiles: V transposed, a column's keys paired
  std::vector<int> visible;       // Bf16DotRows: keys of the tile each row sees
  std::vector<float> l_lanes;     // Bf16DotRows: l per row as 16 partial sums
  std::vector<float> st, pos;     // tiled tasks: scores [keys][rows], row positions
  std::vector<float> k_scales, v_scales;  // int8 tiles on vdpbf16ps: the rows' scales
  void reserve(int64_t rows, int64_t head_dim) {
    auto grow = [](auto& b, int64_t n) {
      if (int64_t(b.size()) < n) b.resize(n);
    };
    rows += 16;  // tiled tasks pad rows to a multiple of the vector lanes
    grow(st, kKeyTile * rows);
    grow(pos, rows);
    grow(q, rows * head_dim);
    grow(o, rows * head_dim);
    grow(m, rows);
    grow(l, rows);
    grow(k, kKeyTile * head_dim);
    grow(v, kKeyTile * head_dim);
    grow(alpha, rows);
    grow(visible, rows);
    grow(l_lanes, rows * 16);
    grow(p_pairs, rows * kKeyTile / 2);
    grow(v_pairs, head_dim * kKeyTile / 2);
    grow(v_cols, head_dim * kKeyTile / 2);
    grow(k_scales, kKeyTile);
    grow(v_scales, kKeyTile);
  }
};

inline float to_float(float x) { return x; }
inline float to_float(bf16_bits x) {
  const uint32_t w = uint32_t(x) << 16;  // bfloat16 is the top half of a float32
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does.
inline bf16_bits to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t w;
  std::memcpy(&w, &f, sizeof(w));
  return bf16_bits((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

// bf16 K/V tasks of many rows (prefill chunks) on AVX512-BF16: the dot
// product rows (Bf16DotRows: the default), the tiles over fp32 copies of K/V
// (run_task_tiles), the tiles on vdpbf16ps over K/V in place
// (run_task_tiles with kDotTiles), or the same tiles with both products on
// oneDNN's batch-reduce GEMM (run_task_brgemm: AMX tiles where the CPU has
// AMX-BF16). paged_attention_set_bf16_prefill switches it; the loader picks
// per CPU what was measured fastest there (cpu_attention.bf16_prefill_for).
enum Bf16Prefill : int { kDotRows, kFloatTiles, kDotTiles, kBrgemm };
constexpr const char* kBf16PrefillNames[] = {"dot", "tiles", "dot-tiles", "brgemm"};
std::atomic<int> g_bf16_prefill{kDotRows};

// Whether ATen's bf16 brgemm runs here as run_task_brgemm calls it; the
// reason when it does not ("" when it does). It needs oneDNN's ukernel
// (AVX-512) and oneDNN enabled, and throws otherwise, which must never happen
// inside the task loop; and its B must be the layout the tiles build (pairs
// of k per column, "pack32", leading dimension 16-64), which AMX's kernels
// read differently from vdpbf16ps's if at all. So: the tiles' two product
// shapes, small integers (exact in bf16 and fp32) against plain sums.
std::string brgemm_failure() {
  if (!at::globalContext().userEnabledMkldnn()) return "oneDNN is disabled (torch.backends.mkldnn)";
  struct Shape {
    int64_t m, n, k;
    bool add;
  };
  try {
    for (const Shape shape : {Shape{32, 64, 64, false}, Shape{64, 48, 32, true}, Shape{5, 16, 32, false}}) {
      const int64_t m = shape.m, n = shape.n, k = shape.k;
      std::vector<at::BFloat16> a(m * k), b(k * n);
      std::vector<float> c(m * n), want(m * n);
      auto value = [](int64_t i, int64_t j) { return float((i * 7 + j * 3) % 5) - 2.0f; };
      for (int64_t i = 0; i < m; ++i)
        for (int64_t t = 0; t < k; ++t) a[i * k + t] = at::BFloat16(value(i, t));
      for (int64_t t = 0; t < k; ++t)
        for (int64_t j = 0; j < n; ++j) b[(t / 2) * 2 * n + 2 * j + t % 2] = at::BFloat16(value(t, j + 1));
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          c[i * n + j] = shape.add ? float(i - j) : 0.0f;
          float sum = c[i * n + j];
          for (int64_t t = 0; t < k; ++t) sum += value(i, t) * value(t, j + 1);
          want[i * n + j] = sum;
        }
      at::native::cpublas::brgemm(m, n, k, k, n, n, shape.add, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release(true);
      if (c != want) return "oneDNN's bf16 brgemm did not give the tiles' products";
    }
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  } catch (const std::exception& error) {
    return error.what();
  }
  return "";
}

// Set by a task loop's thread that ran brgemm, which releases the AMX state
// (cpublas::brgemm_release) when its tasks are done.
thread_local bool t_used_brgemm = false;

// A brgemm call that threw inside the task loop (oneDNN switched off since
// set_bf16_prefill checked it, or a shape its check did not try refused):
// the task is redone on the vdpbf16ps tiles, the mode falls back to them
// process-wide, and the op warns, on the calling thread, with the reason.
std::atomic<bool> g_brgemm_threw{false};
std::mutex g_brgemm_reason_lock;
std::string g_brgemm_reason;

void note_brgemm_failure(const char* reason) {
  std::lock_guard<std::mutex> hold(g_brgemm_reason_lock);
  if (g_brgemm_reason.empty()) g_brgemm_reason = reason;
  g_bf16_prefill.store(kDotTiles);
  g_brgemm_threw.store(true);
}

inline void store_row(float* dst, const float* src, float mul, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * mul;
}
inline void store_row(bf16_bits* dst, const float* src, float mul, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i] * mul);
}

}  // namespace
}  // namespace slipstream

#define SLIPSTREAM_LANES 8
#define SLIPSTREAM_BF16_DOT 0
#define SLIPSTREAM_AVX2 0
#define SLIPSTREAM_VARIANT portable
#include __FILE__
#undef SLIPSTREAM_VARIANT

#if defined(__x86_64__)
#undef SLIPSTREAM_AVX2
#define SLIPSTREAM_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SLIPSTREAM_VARIANT avx2
#include __FILE__
#undef SLIPSTREAM_VARIANT
#pragma GCC pop_options

#undef SLIPSTREAM_LANES
#undef SLIPSTREAM_BF16_DOT
#define SLIPSTREAM_LANES 16
#define SLIPSTREAM_BF16_DOT 1
#pragma GCC push_options
#if defined(SLIPSTREAM_EMULATE_AVX512)  // a test build: see avx512_emulation.h
#pragma GCC target("avx2,fma")
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
#endif
#define SLIPSTREAM_VARIANT avx512
#include __FILE__
#undef SLIPSTREAM_VARIANT
#pragma GCC pop_options
#endif
#undef SLIPSTREAM_LANES
#undef SLIPSTREAM_BF16_DOT
#undef SLIPSTREAM_AVX2

namespace slipstream {
namespace {

// Ordered: a variant needs every instruction of those before it.
enum class Isa { kPortable, kAvx2, kAvx512 };
constexpr const char* kIsaNames[] = {"portable", "avx2", "avx512"};

// What this CPU executes (CPUID).
Isa cpu_best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return Isa::kPortable;
#if defined(SLIPSTREAM_EMULATE_AVX512)
  return Isa::kAvx512;  // its AVX-512 instructions emulated with AVX2
#endif
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16"))
    return Isa::kAvx512;
  return Isa::kAvx2;
#else
  return Isa::kPortable;
#endif
}

// The most "auto" may pick; set_max_isa lowers it (the Python side passes
// what cpu_features.detect() reports, which tests may force).
std::atomic<int> g_max_isa{int(Isa::kAvx512)};

Isa best_isa() { return Isa(std::min(int(cpu_best_isa()), g_max_isa.load())); }

Isa isa_named(c10::string_view name) {
  for (int i = 0; i < 3; ++i)
    if (name == kIsaNames[i]) return Isa(i);
  TORCH_CHECK(false, "paged_attention: isa must be auto, avx512, avx2 or portable, got ", name);
  return Isa::kPortable;  // not reached
}

// "auto": the capped best; a named variant (tests, benchmarks) must run on this CPU.
Isa parse_isa(c10::string_view name) {
  if (name == "auto") return best_isa();
  const Isa isa = isa_named(name);
  TORCH_CHECK(int(isa) <= int(cpu_best_isa()), "paged_attention: this CPU cannot run the ",
              kIsaNames[int(isa)], " variant (it runs ", kIsaNames[int(cpu_best_isa())], ")");
  return isa;
}

std::string cpu_isa() { return kIsaNames[int(best_isa())]; }

// Caps "auto" at `name`; returns the variant "auto" now picks.
std::string set_max_isa(c10::string_view name) {
  g_max_isa.store(int(isa_named(name)));
  return cpu_isa();
}

// "dot", "tiles", "dot-tiles" or "brgemm" (see g_bf16_prefill); returns the
// mode now in force. "brgemm" is refused where ATen's bf16 brgemm does not run.
std::string set_bf16_prefill(c10::string_view mode) {
  int chosen = -1;
  for (int i = 0; i < int(std::size(kBf16PrefillNames)); ++i)
    if (mode == kBf16PrefillNames[i]) chosen = i;
  TORCH_CHECK(chosen >= 0,
              "paged_attention_set_bf16_prefill: dot, tiles, dot-tiles or brgemm, got ", mode);
  if (chosen == kBrgemm) {
    const std::string why = brgemm_failure();
    TORCH_CHECK(why.empty(), "paged_attention_set_bf16_prefill: brgemm does not run here: ", why);
  }
  g_bf16_prefill.store(chosen);
  return kBf16PrefillNames[g_bf16_prefill.load()];
}

// ------------------------------------------------------------------ work split

// Work is counted in (row x key) units. Below kSerialCost a call stays on one
// thread (waking the pool costs more than it saves); a task costing more than
// both kMinSplitCost and its share of the call is split over keys, in
// block-aligned pieces of at least kMinSplitKeys keys.
constexpr int64_t kSerialCost = 16384;
constexpr int64_t kMinSplitCost = 2048;
constexpr int64_t kMinSplitKeys = 64;
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kRowsPerTask = 64;  // query rows (tokens x group) of a prefill tile

struct Plan {
  std::vector<Task> tasks;
  std::vector<Merge> merges;
  int64_t partial_floats = 0;
  int64_t max_rows = 0;
  int64_t total_cost = 0;
};

void split_over_keys(Plan& plan, int64_t group, int64_t head_dim, int64_t block_size,
                     int64_t num_threads) {
  const int64_t cap = std::max(kMinSplitCost, plan.total_cost / (num_threads * kTasksPerThread));
  const int64_t min_keys = (kMinSplitKeys + block_size - 1) / block_size * block_size;
  const size_t num_whole = plan.tasks.size();
  for (size_t i = 0; i < num_whole; ++i) {
    const Task whole = plan.tasks[i];  // a copy: push_back below may move the vector
    const int64_t keys = whole.key_end;
    const int64_t wanted = std::min((whole.cost + cap - 1) / cap, keys / min_keys);
    if (wanted < 2) continue;
    const int64_t blocks = (keys + block_size - 1) / block_size;
    const int64_t piece = (blocks + wanted - 1) / wanted * block_size;
    const int64_t splits = (keys + piece - 1) / piece;
    const int64_t record = whole.num_tokens * group * (head_dim + 2);
    plan.merges.push_back(Merge{whole.token0, plan.partial_floats, whole.kv_head,
                                whole.num_tokens, int32_t(splits)});
    for (int64_t s = 0; s < splits; ++s) {
      Task part = whole;
      part.key_begin = s * piece;
      part.key_end = std::min(keys, part.key_begin + piece);
      part.partial = plan.partial_floats + s * record;
      part.cost = whole.cost * (part.key_end - part.key_begin) / keys;
      if (s == 0)
        plan.tasks[i] = part;
      else
        plan.tasks.push_back(part);
    }
    plan.partial_floats += splits * record;
  }
}

// One task per (sequence, kv head, tile of up to kRowsPerTask / group query
// tokens), then split-K where one task would hold up the others.
Plan make_plan(const int64_t* seq_lens, const int64_t* qsl, int64_t num_seqs,
               int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
               int64_t num_threads) {
  Plan plan;
  const int64_t tile_tokens = std::max<int64_t>(1, kRowsPerTask / group);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t query_len = qsl[b + 1] - qsl[b];
    const int64_t prefix = seq_lens[b] - query_len;
    for (int64_t i = 0; i < query_len; i += tile_tokens) {
      const int32_t n = int32_t(std::min(tile_tokens, query_len - i));
      const int64_t keys = prefix + i + n;  // the tile's last token sees them all
      const int64_t cost = (n * group + 2) * (keys - (n - 1) / 2);  // + 2: K/V conversion
      for (int64_t h = 0; h < num_kv_heads; ++h)
        plan.tasks.push_back(Task{b, qsl[b] + i, prefix + i, 0, keys, -1, cost, int32_t(h), n});
      plan.total_cost += cost * num_kv_heads;
      plan.max_rows = std::max(plan.max_rows, n * group);
    }
  }
  if (num_threads > 1 && plan.total_cost >= kSerialCost)
    split_over_keys(plan, group, head_dim, block_size, num_threads);
  // Largest first, so the last tasks to start are short ones.
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return plan;
}

// Combines the split records of each row: weights 2^(m_s - max m), which is 0
// for a split holding only keys the row cannot see (m_s = -inf).
template <typename T, typename KV>
void run_merge(const Problem<T, KV>& p, const Merge& merge) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = merge.num_tokens * g;
  const int64_t stride = rows * (d + 2);
  const float* base = p.partials + merge.partial;
  std::vector<float> acc(d);
  for (int64_t r = 0; r < rows; ++r) {
    float top = kNegInf;
    for (int s = 0; s < merge.num_splits; ++s) top = std::max(top, base[s * stride + rows * d + r]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    for (int s = 0; s < merge.num_splits; ++s) {
      const float* rec = base + s * stride;
      const float w = std::exp2(rec[rows * d + r] - top);
      total += w * rec[rows * d + rows + r];
      for (int64_t c = 0; c < d; ++c) acc[c] += w * rec[r * d + c];
    }
    const int64_t token = merge.token0 + r / g, head = merge.kv_head * g + r % g;
    store_row(p.out + (token * p.num_heads + head) * d, acc.data(), 1.0f / total, d);
  }
}

template <typename T, typename KV>
void run_plan(const Problem<T, KV>& p, const Plan& plan, Isa isa, int64_t num_threads) {
  const int64_t num_tasks = int64_t(plan.tasks.size());
  const bool parallel = num_threads > 1 && num_tasks > 1 && plan.total_cost >= kSerialCost;
  // Dynamic scheduling that claims one task ahead: a thread knows its next
  // task while it runs the current one, and prefetches that task's first
  // tile during its last (a task's first tile is in another block, on
  // another page, where the hardware prefetcher does not follow).
  std::atomic<int64_t> next_task{0};
#pragma omp parallel num_threads(int(num_threads)) if (parallel)
  {
    thread_local Scratch scratch;
    scratch.reserve(plan.max_rows, p.head_dim);
    int64_t i = next_task.fetch_add(1);
    while (i < num_tasks) {
      const int64_t after = next_task.fetch_add(1);
      const Task& task = plan.tasks[i];
      const Task* upcoming = after < num_tasks ? &plan.tasks[after] : nullptr;
      i = after;
#if defined(__x86_64__)
      // fp32 K/V stay on the AVX2 code under AVX-512: its 16-lane build
      // measured 5-15 % slower (AMD EPYC Zen 5, 1 thread: fp32 decode reads
      // K/V at the core's L3/DRAM bandwidth either way). Int8 K/V too (tiles
      // are widened into fp32 scratch, as fp32 tasks read them), except those
      // of a bf16 q that take vdpbf16ps (int8_dot).
      if (isa == Isa::kAvx512 &&
          (std::is_same_v<KV, bf16_bits> || avx512::takes_int8_dot(p, task))) {
        avx512::run_task(p, task, upcoming, scratch);
        continue;
      }
      if (isa != Isa::kPortable) {
        avx2::run_task(p, task, upcoming, scratch);
        continue;
      }
#endif
      portable::run_task(p, task, upcoming, scratch);
    }
    if (t_used_brgemm) {
      try {  // nothing may leave the parallel region; a failed release only leaves the tiles set
        at::native::cpublas::brgemm_release(true);
      } catch (const std::exception&) {
      }
      t_used_brgemm = false;
    }
  }
  const int64_t num_merges = int64_t(plan.merges.size());
#pragma omp parallel for num_threads(int(num_threads)) if (parallel && num_merges > 1)
  for (int64_t i = 0; i < num_merges; ++i) run_merge(p, plan.merges[i]);
}

// ---------------------------------------------------------------------- the op

// Bounds every index the tasks will follow, so a bad table cannot read outside the pool.
void check_metadata(const int64_t* seq_lens, const int64_t* qsl, const int64_t* tables,
                    int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                    int64_t num_blocks, int64_t num_tokens) {
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == num_tokens,
              "paged_attention: query_start_loc must run from 0 to ", num_tokens);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t query_len = qsl[b + 1] - qsl[b], seq_len = seq_lens[b];
    TORCH_CHECK(1 <= query_len && query_len <= seq_len, "paged_attention: sequence ", b,
                " needs 1 <= query_len <= seq_len, got ", query_len, ", ", seq_len);
    const int64_t used = (seq_len + block_size - 1) / block_size;
    TORCH_CHECK(used <= max_blocks, "paged_attention: sequence ", b, " has ", seq_len,
                " tokens but block_tables holds ", max_blocks, " blocks");
    for (int64_t j = 0; j < used; ++j) {
      const int64_t id = tables[b * max_blocks + j];
      TORCH_CHECK(0 <= id && id < num_blocks, "paged_attention: block id ", id,
                  " out of range [0, ", num_blocks, ")");
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_storage,
                           const at::Tensor& v_storage, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, c10::string_view isa_name) {
  for (const at::Tensor* t :
       {&q, &k_storage, &v_storage, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_storage.dim() == 4,
              "paged_attention: q [T, H, D], K/V storage [kv_heads, num_blocks, block_size, D]");
  TORCH_CHECK(k_storage.sizes() == v_storage.sizes(), "paged_attention: K and V shapes differ");
  TORCH_CHECK(k_storage.is_contiguous() && v_storage.is_contiguous(),
              "paged_attention: K/V storage must be contiguous (head-major)");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_attention: q heads must be packed (strides [*, D, 1])");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_attention: float32 or bfloat16, got ", dtype);
  const auto kv_dtype = k_storage.scalar_type();
  const bool int8_kv = kv_dtype == at::kChar;
  TORCH_CHECK((kv_dtype == dtype || int8_kv) && v_storage.scalar_type() == kv_dtype,
              "paged_attention: the K/V storage must be q's dtype or int8, got ", kv_dtype);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_storage.size(0), num_blocks = k_storage.size(1);
  const int64_t block_size = k_storage.size(2);
  const int64_t row_stride = head_dim + (int8_kv ? kInt8ScaleBytes : 0);
  TORCH_CHECK(k_storage.size(3) == row_stride && head_dim > 0,
              "paged_attention: K/V rows of ", k_storage.size(3), " elements for head_dim ",
              head_dim, int8_kv ? " (int8 rows hold head_dim values and a 4-byte scale)" : "");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "paged_attention: num_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: block_tables, seq_lens, query_start_loc: contiguous int64");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == num_seqs + 1,
              "paged_attention: block_tables [B, max_blocks], seq_lens [B], "
              "query_start_loc [B + 1]");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  check_metadata(lens, qsl, tables, num_seqs, max_blocks, block_size, num_blocks, num_tokens);
  const Isa isa = parse_isa(isa_name);

  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, q.options());
  if (num_tokens == 0) return out;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_threads = at::get_num_threads();
  const Plan plan =
      make_plan(lens, qsl, num_seqs, num_kv_heads, group, head_dim, block_size, num_threads);
  std::vector<float> partials(plan.partial_floats);
  const float qk_scale = float(scale * 1.4426950408889634);  // log2(e)
  const int bf16_prefill = g_bf16_prefill.load();

  auto run = [&](auto element, auto kv_element) {
    using T = decltype(element);
    using KV = decltype(kv_element);
    const Problem<T, KV> p{static_cast<const T*>(q.data_ptr()),
                           q.stride(0),
                           static_cast<const KV*>(k_storage.data_ptr()),
                           static_cast<const KV*>(v_storage.data_ptr()),
                           static_cast<T*>(out.data_ptr()),
                           tables,
                           max_blocks,
                           num_heads,
                           group,
                           head_dim,
                           row_stride,
                           block_size,
                           num_blocks,
                           qk_scale,
                           partials.data(),
                           bf16_prefill};
    run_plan(p, plan, isa, num_threads);
  };
  if (dtype == at::kFloat)
    int8_kv ? run(float{}, int8_t{}) : run(float{}, float{});
  else
    int8_kv ? run(bf16_bits{}, int8_t{}) : run(bf16_bits{}, bf16_bits{});
  if (g_brgemm_threw.exchange(false)) {
    std::lock_guard<std::mutex> hold(g_brgemm_reason_lock);
    TORCH_WARN("paged_attention: oneDNN's brgemm failed (", g_brgemm_reason,
               "); bf16 prefill runs on the vdpbf16ps tiles from now on");
    g_brgemm_reason.clear();
  }
  return out;
}

// ------------------------------------------------------------------ KV write

// This step's keys and values ([tokens, kv_heads, head_dim], heads packed,
// any token stride) into their slots (block * block_size + offset) of
// head-major storage: copied as they are, or quantized into int8 rows.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_storage,
              at::Tensor& v_storage, const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : {&k, &v, &slot_mapping, &std::as_const(k_storage),
                              &std::as_const(v_storage)})
    TORCH_CHECK(t->device().is_cpu(), "paged_kv_write: all tensors must be on the CPU");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_storage.dim() == 4 &&
                  k_storage.sizes() == v_storage.sizes(),
              "paged_kv_write: k, v [T, kv_heads, D]; storage [kv_heads, blocks, block_size, W]");
  TORCH_CHECK(k_storage.is_contiguous() && v_storage.is_contiguous(),
              "paged_kv_write: K/V storage must be contiguous (head-major)");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "paged_kv_write: k and v heads must be packed (strides [*, D, 1])");
  const auto dtype = k.scalar_type(), kv_dtype = k_storage.scalar_type();
  const bool int8_kv = kv_dtype == at::kChar;
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && v.scalar_type() == dtype &&
                  (kv_dtype == dtype || int8_kv) && v_storage.scalar_type() == kv_dtype,
              "paged_kv_write: k, v float32 or bfloat16; storage theirs or int8");
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t width = head_dim + (int8_kv ? kInt8ScaleBytes : 0);
  TORCH_CHECK(k_storage.size(0) == num_kv_heads && k_storage.size(3) == width,
              "paged_kv_write: storage rows of ", k_storage.size(3), " elements for ",
              num_kv_heads, " kv heads of head_dim ", head_dim);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens,
              "paged_kv_write: slot_mapping: contiguous int64 [T]");
  const int64_t num_slots = k_storage.size(1) * k_storage.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(0 <= slots[t] && slots[t] < num_slots, "paged_kv_write: slot ", slots[t],
                " out of range [0, ", num_slots, ")");
  const Isa isa = best_isa();
  auto run = [&](auto element, auto kv_element) {
    using T = decltype(element);
    using KV = decltype(kv_element);
    const KvWrite<T, KV> w{{static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr())},
                           {k.stride(0), v.stride(0)},
                           {static_cast<KV*>(k_storage.data_ptr()),
                            static_cast<KV*>(v_storage.data_ptr())},
                           slots, num_kv_heads, num_slots, head_dim, width};
    // Rows are (token, kv head) pairs, K and V: a few hundred bytes each.
    at::parallel_for(0, num_tokens * num_kv_heads, 256, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
      if (isa != Isa::kPortable) return avx2::write_rows(w, begin, end);
#endif
      portable::write_rows(w, begin, end);
    });
  };
  if (dtype == at::kFloat)
    int8_kv ? run(float{}, int8_t{}) : run(float{}, float{});
  else
    int8_kv ? run(bf16_bits{}, int8_t{}) : run(bf16_bits{}, bf16_bits{});
}

// How a call would be cut into tasks, for tests: [tasks, split groups].
std::vector<int64_t> plan_summary(const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                  int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                  int64_t block_size, int64_t num_threads) {
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "paged_attention_plan: contiguous int64 tensors");
  const Plan plan = make_plan(seq_lens.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(),
                              seq_lens.size(0), num_kv_heads, group, head_dim, block_size,
                              num_threads);
  return {int64_t(plan.tasks.size()), int64_t(plan.merges.size())};
}

}  // namespace

// A fragment, so other Slipstream extensions may add ops to the namespace.
TORCH_LIBRARY_FRAGMENT(slipstream, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_storage, Tensor v_storage, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, str isa=\"auto\") -> Tensor");
  m.def(
      "paged_kv_write(Tensor k, Tensor v, Tensor(a!) k_storage, Tensor(b!) v_storage, "
      "Tensor slot_mapping) -> ()");
  m.def("paged_attention_cpu_isa() -> str", &cpu_isa);
  m.def("paged_attention_set_max_isa(str isa) -> str", &set_max_isa);
  m.def("paged_attention_set_bf16_prefill(str mode) -> str", &set_bf16_prefill);
  m.def(
      "paged_attention_plan(Tensor seq_lens, Tensor query_start_loc, int num_kv_heads, "
      "int group, int head_dim, int block_size, int num_threads) -> int[]",
      &plan_summary);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_kv_write", &write_kv);
}

}  // namespace slipstream

#else  // ==================================== per-variant code, once per instruction set

namespace slipstream {
namespace {
namespace SLIPSTREAM_VARIANT {

#define SLIP_INLINE inline __attribute__((always_inline))
#define SLIP_INLINE_LAMBDA __attribute__((always_inline))

#if SLIPSTREAM_LANES == 16 && defined(SLIPSTREAM_EMULATE_AVX512)
#include "avx512_emulation.h"
#endif

// The brgemm tiles (run_task_brgemm): the AVX-512 variant, not its emulated
// test build (ATen's bf16 brgemm needs AVX-512 itself).
#if SLIPSTREAM_BF16_DOT && !defined(SLIPSTREAM_EMULATE_AVX512)
#define SLIPSTREAM_BRGEMM 1
#else
#define SLIPSTREAM_BRGEMM 0
#endif

// Scores are handled 8 keys at a time (v8f) in every variant; head_dim is
// walked kLanes floats at a time (vf): 8 in the baseline and AVX2 variants,
// 16 (one zmm) in the AVX-512 one.
constexpr int kLanes = SLIPSTREAM_LANES;
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

SLIP_INLINE v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
// One broadcast load where the variant has one. `vf{} + x` compiles to a
// scalar add from memory (x + 0.0f is not x for x = -0.0f, so the add stays)
// and a register broadcast; a lane-by-lane build, to a lane-by-lane insert.
SLIP_INLINE vf splatv(float x) {
#if SLIPSTREAM_AVX2 && SLIPSTREAM_LANES == 16
  return (vf)_mm512_set1_ps(x);
#elif SLIPSTREAM_AVX2
  return (vf)_mm256_set1_ps(x);
#else
  return vf{} + x;
#endif
}

SLIP_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Eight bf16 values widened to fp32: each is the top half of its float.
SLIP_INLINE v8f load8(const bf16_bits* p) {
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

// Eight int8 values widened to fp32: vpmovsxbd + vcvtdq2ps where the
// variant has AVX2 (GCC turns a generic int8 -> float vector conversion into
// scalar code); element by element in the baseline.
SLIP_INLINE v8f load8(const int8_t* p) {
#if SLIPSTREAM_AVX2
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  return v8f{float(p[0]), float(p[1]), float(p[2]), float(p[3]),
             float(p[4]), float(p[5]), float(p[6]), float(p[7])};
#endif
}

SLIP_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

SLIP_INLINE vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

SLIP_INLINE void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// The kLanes lanes of v summed down to 8 (lane i + lane i + 8 + ...).
SLIP_INLINE v8f fold8(vf v) {
  v8f r;
  std::memcpy(&r, &v, sizeof(r));
  for (int h = 1; h < kLanes / 8; ++h) {
    v8f x;
    std::memcpy(&x, reinterpret_cast<const char*>(&v) + 32 * h, sizeof(x));
    r += x;
  }
  return r;
}

SLIP_INLINE v8f vmax(v8f a, v8f b) { return a > b ? a : b; }

SLIP_INLINE float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

SLIP_INLINE float hsum(v8f v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// Pairwise sums within 128-bit halves, as x86's haddps.
SLIP_INLINE v8f hadd(v8f a, v8f b) {
  return __builtin_shuffle(a, b, v8i{0, 2, 8, 10, 4, 6, 12, 14}) +
         __builtin_shuffle(a, b, v8i{1, 3, 9, 11, 5, 7, 13, 15});
}

// Lane i of the result is the sum of the lanes of a_i.
SLIP_INLINE v8f reduce8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
  const v8f lo = hadd(hadd(a0, a1), hadd(a2, a3));  // [a0..a3 low halves | a0..a3 high halves]
  const v8f hi = hadd(hadd(a4, a5), hadd(a6, a7));
  return __builtin_shuffle(lo, hi, v8i{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(lo, hi, v8i{4, 5, 6, 7, 12, 13, 14, 15});
}

#define SLIP_REDUCE8(a)                                                                 \
  reduce8(fold8(a[0]), fold8(a[1]), fold8(a[2]), fold8(a[3]), fold8(a[4]), fold8(a[5]), \
          fold8(a[6]), fold8(a[7]))

// 2^x for x <= 0; 0 below -125 (weights that small cannot move an fp32 sum).
// Round-to-nearest splits x = n + f, |f| <= 1/2; 2^f by its degree-6 Taylor
// polynomial (relative error < 2e-7); 2^n is added to the exponent bits.
template <typename V>
SLIP_INLINE V exp2_neg(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: x + magic rounds x to an integer
  const V xc = x > V{} - 125.0f ? x : V{} - 125.0f;
  const V t = xc + magic;
  const V f = xc - (t - magic);
  const VI n = (VI)t - (VI)magic;
  V p = V{} + 1.5403530393381608e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const V r = (V)((VI)p + (n << 23));
  return x < V{} - 125.0f ? V{} : r;
}

// Software prefetch of the next tile's K and V rows, spread over the work
// on the current one: a few lines per step of the inner loops. Each tile is
// in another block, likely another page, where the hardware prefetcher
// stops, so every line is asked for. Spread, not issued at once: a burst of
// the whole tile (128 lines for head_dim 64, block 32) queued behind the
// core's few outstanding misses and stalled the loads of the tile being
// worked on (AMD EPYC Zen 5, bf16 decode 64 x 300, 2 threads: 0.70 -> 0.55
// ms per layer); aiming two tiles ahead measured slower. Non-temporal
// (prefetchnta): the rows are used by this task only, so they need not
// displace L2 and L3 (256 x 300: 2.09 -> 1.98 ms per layer).
struct LinePrefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0;  // of K, and as many of V
  int64_t done = 0;   // bytes asked for, K first, then V

  SLIP_INLINE void aim(const void* k_rows, const void* v_rows, int64_t num_bytes) {
    k = static_cast<const char*>(k_rows);
    v = static_cast<const char*>(v_rows);
    bytes = num_bytes;
    done = 0;
  }
  SLIP_INLINE void step(int lines) {
    for (int i = 0; i < lines && done < 2 * bytes; ++i, done += 64)
      __builtin_prefetch(done < bytes ? k + done : v + (done - bytes), 0, 0);
  }
  SLIP_INLINE void finish() {
    while (done < 2 * bytes) step(16);
  }
};

// Lines asked for per step: per 16 keys of a row's scores, per key pair of p . V,
// per row of the other paths.
constexpr int kScoreLines = 8;
constexpr int kPairLines = 4;
constexpr int kRowLines = 16;

// How the inner loops read K/V rows: kStep elements at a time, as kStep /
// kLanes float vectors. Float rows (fp32 storage, or a bf16 tile converted
// into scratch) are read in order. Bf16 rows are read straight from the
// storage, 2 kLanes elements per load, as two vectors: the even elements
// (shifted up) and the odd ones (masked). Their q and O rows are kept
// "paired" in that same order, [even kLanes | odd kLanes] per 2 kLanes
// elements, so the pairing costs nothing in the loops; rows are unpaired
// once, when a task writes its result. Bf16DotRows (AVX-512 BF16 only) keep
// q in bf16 and take both products on vdpbf16ps; see below.
struct FloatRows {
  using E = float;
  using Q = float;
  static constexpr int kVecs = 1;
  static constexpr int kPairWidth = 1;  // head_dim multiple for the layout
  static SLIP_INLINE void load(const float* p, vf* x) { x[0] = loadv(p); }
};

struct Bf16Rows {
  using E = bf16_bits;
  using Q = float;
  static constexpr int kVecs = 2;
  static constexpr int kPairWidth = 2 * kLanes;
  static SLIP_INLINE void load(const bf16_bits* p, vf* x) {
    vu w;
    std::memcpy(&w, p, sizeof(w));
    x[0] = (vf)(w << 16);           // elements 0, 2, .., 2 kLanes - 2
    x[1] = (vf)(w & 0xFFFF0000u);   // elements 1, 3, .., 2 kLanes - 1
  }
};

struct Bf16DotRows {
  using E = bf16_bits;
  using Q = bf16_bits;
  static constexpr int kPairWidth = 32;  // one zmm of bf16
};

// Int8 K/V under a bf16 q (AVX512-BF16): each tile's int8 values become bf16
// in scratch -- exactly, |x| <= 127 needs 7 bits of a bf16's 8 -- and the
// Bf16DotRows loops run on them, the rows' scales applied to the scores (K)
// and to p before its rounding (V). Half the bytes of a bf16 cache read, at
// the cost of one widening per tile shared by the task's rows.
struct Int8DotRows {
  using E = int8_t;
  using Q = bf16_bits;
  static constexpr int kPairWidth = 32;
};

template <typename R>
constexpr bool kPaired = std::is_same_v<R, Bf16Rows>;
template <typename R>
constexpr bool kDot = std::is_same_v<R, Bf16DotRows> || std::is_same_v<R, Int8DotRows>;

// Scores of one row against 8 consecutive keys (rows of k, stride d).
template <typename R>
SLIP_INLINE v8f dot8(const float* q, const typename R::E* k, int64_t d) {
  constexpr int kStep = kLanes * R::kVecs;
  vf a[8] = {};
  int64_t c = 0;
  for (; c + kStep <= d; c += kStep) {
    vf x[R::kVecs];
    for (int v = 0; v < R::kVecs; ++v) x[v] = loadv(q + c + kLanes * v);
    for (int i = 0; i < 8; ++i) {
      vf y[R::kVecs];
      R::load(k + i * d + c, y);
      for (int v = 0; v < R::kVecs; ++v) a[i] += x[v] * y[v];
    }
  }
  v8f s = SLIP_REDUCE8(a);
  if constexpr (std::is_same_v<R, FloatRows>) {  // paired rows have no tail
    for (; c < d; ++c)
      for (int i = 0; i < 8; ++i) s[i] += q[c] * k[i * d + c];
  }
  return s;
}

// Vector registers: 16 ymm (AVX2; the baseline's xmm pairs alike), 32 zmm.
constexpr int kNumRegs = kLanes == 16 ? 32 : 16;

// o[0, kLanes * NV) = o * alpha + sum_t p[t] * v[t, 0 .. kLanes * NV).
// Each accumulator is a chain of dependent multiply-adds, one per key; when
// there are fewer than about 8 (the FMA latency times the FMAs per cycle)
// and the registers allow, even and odd keys go to two sets, added at the end.
template <typename R, int NV>
SLIP_INLINE void accumulate_pv(float* o, const typename R::E* v, int64_t d, const float* p,
                               int n, float alpha) {
  static_assert(NV % R::kVecs == 0, "a load fills kVecs accumulators");
  constexpr int kSets = NV < 8 && 2 * NV + 2 * R::kVecs + 1 <= kNumRegs ? 2 : 1;
  vf acc[kSets][NV];
  for (int i = 0; i < NV; ++i) acc[0][i] = loadv(o + kLanes * i) * alpha;
  if constexpr (kSets == 2)
    for (int i = 0; i < NV; ++i) acc[1][i] = vf{};
  int t = 0;
  for (; t + kSets <= n; t += kSets) {
    for (int u = 0; u < kSets; ++u) {
      const vf w = splatv(p[t + u]);
      for (int i = 0; i < NV; i += R::kVecs) {
        vf y[R::kVecs];
        R::load(v + (t + u) * d + kLanes * i, y);
        for (int j = 0; j < R::kVecs; ++j) acc[u][i + j] += w * y[j];
      }
    }
  }
  if constexpr (kSets == 2) {
    if (t < n) {
      const vf w = splatv(p[t]);
      for (int i = 0; i < NV; i += R::kVecs) {
        vf y[R::kVecs];
        R::load(v + t * d + kLanes * i, y);
        for (int j = 0; j < R::kVecs; ++j) acc[0][i + j] += w * y[j];
      }
    }
    for (int i = 0; i < NV; ++i) acc[0][i] += acc[1][i];
  }
  for (int i = 0; i < NV; ++i) storev(o + kLanes * i, acc[0][i]);
}

template <typename R, int NV>
SLIP_INLINE void accumulate_pv_if(float* o, const typename R::E* v, int64_t d, const float* p,
                                  int n, float alpha) {
  if constexpr (NV % R::kVecs == 0) accumulate_pv<R, NV>(o, v, d, p, n, alpha);
}

// Up to 8 vectors of accumulators stay in registers; head_dim is walked in
// such chunks, then (float rows) the d % kLanes tail one lane at a time.
template <typename R>
SLIP_INLINE void accumulate_row(float* o, const typename R::E* v, int64_t d, const float* p,
                                int n, float alpha) {
  constexpr int64_t kChunk = 8 * kLanes;
  int64_t c = 0;
  for (; c + kChunk <= d; c += kChunk) accumulate_pv<R, 8>(o + c, v + c, d, p, n, alpha);
  switch ((d - c) / kLanes) {
    case 7: accumulate_pv_if<R, 7>(o + c, v + c, d, p, n, alpha); break;
    case 6: accumulate_pv_if<R, 6>(o + c, v + c, d, p, n, alpha); break;
    case 5: accumulate_pv_if<R, 5>(o + c, v + c, d, p, n, alpha); break;
    case 4: accumulate_pv_if<R, 4>(o + c, v + c, d, p, n, alpha); break;
    case 3: accumulate_pv_if<R, 3>(o + c, v + c, d, p, n, alpha); break;
    case 2: accumulate_pv_if<R, 2>(o + c, v + c, d, p, n, alpha); break;
    case 1: accumulate_pv_if<R, 1>(o + c, v + c, d, p, n, alpha); break;
    default: break;
  }
  if constexpr (std::is_same_v<R, FloatRows>) {
    for (c += (d - c) / kLanes * kLanes; c < d; ++c) {
      float acc = o[c] * alpha;
      for (int t = 0; t < n; ++t) acc += p[t] * v[t * d + c];
      o[c] = acc;
    }
  }
}

#if SLIPSTREAM_BF16_DOT
// Bf16DotRows: q . k and p . V on vdpbf16ps, which multiplies 32 bf16 pairs
// and adds each pair's two products into one fp32 lane (products exact,
// sums in fp32). q stays in bf16 as given (the scale multiplies the scores,
// not q). A task takes one tile in two passes, both over rows of K and V
// that stay in L1 while the task's rows (the query heads of a GQA group,
// and a prefill tile's tokens) go over them:
//
//   1. scores: per row, 16 keys at a time: 16 fp32 partial-sum vectors
//      (NC vdpbf16ps each), summed by one transpose-and-add tree (reduce16);
//      then the online softmax over the tile, p rounded to bf16 pairs
//      (p_t, p_t+1), as FlashAttention rounds P on tensor cores; l sums the
//      unrounded p.
//   2. p . V: the pairs must run along the keys, so rows t and t + 1 of V
//      are interleaved (vpunpck{l,h}wd) once per key pair and used by every
//      row of the chunk against its broadcast pair.
//
// The interleave leaves each 32 columns of O in the order of DotOrder
// below, undone once per row when the task writes it. NC = head_dim / 32 is
// fixed at compile time, so the loops unroll and the accumulators stay in
// registers (a run-time head_dim loop kept them on the stack: measured 1.3x
// slower).

// Lane i of the result is the sum of the 16 lanes of a[i]: 45 shuffles and
// adds for 16 keys, where a horizontal sum per key would take ~8 each.
SLIP_INLINE __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lane: [a_2i, a_2i+1, a_2i, a_2i+1], part sums
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane: [a_4i .. a_4i+3]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [a_8i..8i+3 twice, a_8i+4..8i+7 twice]
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                       _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

// Unscaled scores of one row against the first `readable` (a multiple of 8,
// at most kKeyTile) rows of k, 16 keys per vector; lanes past them are 0.
template <int NC>
SLIP_INLINE void scores_row(__m512* s, const bf16_bits* q, const bf16_bits* k, int64_t d,
                            int readable, LinePrefetcher& ahead) {
  __m512bh x[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) x[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int g = 0; g < kKeyTile / 16; ++g) {
    if (16 * g >= readable) {
      s[g] = _mm512_setzero_ps();
      continue;
    }
    ahead.step(kScoreLines);
    const bf16_bits* kg = k + 16 * g * d;
    const bool full = readable - 16 * g >= 16;
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      a[i] = _mm512_setzero_ps();
      if (i < 8 || full) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c)
          a[i] = _mm512_dpbf16_ps(a[i], x[c], (__m512bh)_mm512_loadu_si512(kg + i * d + 32 * c));
      }
    }
    s[g] = reduce16(a);
  }
}

// Rows of the p . V pass kept in registers at once, for NC column chunks:
// 2 NC accumulators per row, at most 12 in all.
template <int NC>
constexpr int kPvRows = NC >= 4 ? 1 : 6 / NC;

// R rows of O, 32 NC columns (row stride d): o = o * alpha + sum_t p_t v_t
// over the first n rows of v, with p as bf16 pairs (row stride kKeyTile / 2).
// With few accumulators (<= 8) key pairs alternate between two sets, so the
// vdpbf16ps are not one dependent chain each; an odd last key pairs with
// zeros (its partner's weight is 0, and rows past n are never read).
template <int NC, int R>
SLIP_INLINE void pv_rows(float* o, int64_t d, const bf16_bits* v, const uint32_t* pairs,
                         const float* alpha, int n, LinePrefetcher& ahead) {
  constexpr int kAcc = 2 * NC;
  constexpr int kSets = R * kAcc <= 8 ? 2 : 1;
  __m512 acc[kSets][R][kAcc];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) {
      acc[0][r][i] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + 16 * i), a);
      if constexpr (kSets == 2) acc[1][r][i] = _mm512_setzero_ps();
    }
  }
  auto pair = [&](int set, int t, bool has_second) SLIP_INLINE_LAMBDA {
    ahead.step(kPairLines);
    __m512i u[kAcc];
    const bf16_bits* row0 = v + t * d;
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) {
      const __m512i x0 = _mm512_loadu_si512(row0 + 32 * j);
      const __m512i x1 =
          has_second ? _mm512_loadu_si512(row0 + d + 32 * j) : _mm512_setzero_si512();
      u[2 * j] = _mm512_unpacklo_epi16(x0, x1);
      u[2 * j + 1] = _mm512_unpackhi_epi16(x0, x1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pairs[r * (kKeyTile / 2) + t / 2]));
#pragma GCC unroll 16
      for (int i = 0; i < kAcc; ++i)
        acc[set][r][i] = _mm512_dpbf16_ps(acc[set][r][i], (__m512bh)u[i], w);
    }
  };
  int t = 0;
  if constexpr (kSets == 2) {
    for (; t + 4 <= n; t += 4) {
      pair(0, t, true);
      pair(1, t + 2, true);
    }
  }
  for (; t + 2 <= n; t += 2) pair(0, t, true);
  if (t < n) pair(kSets - 1, t, false);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) {
      __m512 sum = acc[0][r][i];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, acc[1][r][i]);
      _mm512_storeu_ps(o + r * d + 16 * i, sum);
    }
}

// `rows` (< kPvRows<NC> + 1) rows: R picked at compile time.
template <int NC, int R = kPvRows<NC>>
SLIP_INLINE void pv_rows_upto(int rows, float* o, int64_t d, const bf16_bits* v,
                              const uint32_t* pairs, const float* alpha, int n,
                              LinePrefetcher& ahead) {
  if constexpr (R > 0) {
    if (rows == R) return pv_rows<NC, R>(o, d, v, pairs, alpha, n, ahead);
    pv_rows_upto<NC, R - 1>(rows, o, d, v, pairs, alpha, n, ahead);
  }
}

// p . V for every row of the task, 32 NC columns from column 0 of o and v.
template <int NC>
SLIP_INLINE void pv_all_rows(float* o, int64_t d, const bf16_bits* v, const uint32_t* pairs,
                             const float* alpha, int64_t rows, int n, LinePrefetcher& ahead) {
  constexpr int kRows = kPvRows<NC>;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    pv_rows<NC, kRows>(o + r * d, d, v, pairs + r * (kKeyTile / 2), alpha + r, n, ahead);
  if (r < rows)
    pv_rows_upto<NC>(int(rows - r), o + r * d, d, v, pairs + r * (kKeyTile / 2), alpha + r, n,
                     ahead);
}

// One tile of n keys (k readable to a multiple of 8 rows) against all rows
// of a task: scores and softmax per row, then p . V in column chunks of at
// most 128 (4 NC; 8 accumulators a row). k_scales and v_scales (kKeyTile
// each, or null): the keys' and values' row scales of an int8 tile, which
// multiply each key's score and each value's weight p (after l has summed p).
template <int NC>
SLIP_INLINE void attend_tile_dot(const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,
                                 int64_t d, int64_t rows, const int* visible, int n,
                                 float scale, const float* k_scales, const float* v_scales,
                                 float* m, float* l_lanes, float* o, uint32_t* pairs,
                                 float* alpha, LinePrefetcher& ahead) {
  const int readable = (n + 7) / 8 * 8;
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* row_pairs = pairs + r * (kKeyTile / 2);
    const int seen = visible[r];
    if (seen <= 0) {  // causal: the row sees none of the tile
      std::memset(row_pairs, 0, kKeyTile / 2 * sizeof(uint32_t));
      alpha[r] = 1.0f;
      continue;
    }
    __m512 s[kKeyTile / 16];
    scores_row<NC>(s, q + r * d, k, d, readable, ahead);
    __m512 top = neg_inf;
    for (int g = 0; g < kKeyTile / 16; ++g) {  // keys past `seen` are -inf
      const int in = std::clamp(seen - 16 * g, 0, 16);
      const __mmask16 keep = __mmask16((1u << in) - 1);
      __m512 key_scale = _mm512_set1_ps(scale);
      if (k_scales != nullptr)
        key_scale = _mm512_mul_ps(key_scale, _mm512_loadu_ps(k_scales + 16 * g));
      s[g] = _mm512_mask_mul_ps(neg_inf, keep, s[g], key_scale);
      top = _mm512_max_ps(top, s[g]);
    }
    const float m_new = std::max(m[r], _mm512_reduce_max_ps(top));
    // 0 on the row's first tile (m = -inf); in a vector: no libm call here.
    const float a = exp2_neg(vf{} + (m[r] - m_new))[0];
    __m512 sum = _mm512_setzero_ps();
    for (int g = 0; g < kKeyTile / 16; ++g) {
      s[g] = (__m512)exp2_neg((vf)_mm512_sub_ps(s[g], _mm512_set1_ps(m_new)));
      sum = _mm512_add_ps(sum, s[g]);
    }
    static_assert(kKeyTile == 32, "one vector of bf16 pairs per row");
    if (v_scales != nullptr)
      for (int g = 0; g < kKeyTile / 16; ++g)
        s[g] = _mm512_mul_ps(s[g], _mm512_loadu_ps(v_scales + 16 * g));
    _mm512_storeu_si512(row_pairs, (__m512i)_mm512_cvtne2ps_pbh(s[1], s[0]));
    float* lanes = l_lanes + 16 * r;  // summed once, at the end of the task
    _mm512_storeu_ps(lanes, _mm512_fmadd_ps(_mm512_loadu_ps(lanes), _mm512_set1_ps(a), sum));
    m[r] = m_new;
    alpha[r] = a;
  }
  int c = 0;
  for (; c + 4 <= NC; c += 4)
    pv_all_rows<4>(o + 32 * c, d, v + 32 * c, pairs, alpha, rows, n, ahead);
  if constexpr (NC % 4 != 0)
    pv_all_rows<NC % 4>(o + 32 * c, d, v + 32 * c, pairs, alpha, rows, n, ahead);
}

SLIP_INLINE void attend_tile_dot_any(const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,
                                     int64_t d, int64_t rows, const int* visible, int n,
                                     float scale, const float* k_scales, const float* v_scales,
                                     float* m, float* l_lanes, float* o, uint32_t* pairs,
                                     float* alpha, LinePrefetcher& ahead) {
  switch (d / 32) {  // run_task admits head_dim 32, 64, .., 256 here
#define SLIP_CASE(NC)                                                                  \
  case NC:                                                                             \
    return attend_tile_dot<NC>(q, k, v, d, rows, visible, n, scale, k_scales, v_scales, m, \
                               l_lanes, o, pairs, alpha, ahead);
    SLIP_CASE(1) SLIP_CASE(2) SLIP_CASE(3) SLIP_CASE(4)
    SLIP_CASE(5) SLIP_CASE(6) SLIP_CASE(7)
    default: SLIP_CASE(8)
#undef SLIP_CASE
  }
}

// The first n int8 rows at src (stride d + 4: values, then the row's fp32
// scale) as bf16 rows [rows][d] holding the same integers, and their scales;
// rows n .. rows are zeros with scale 0. d is a multiple of 32.
SLIP_INLINE void int8_tile_bf16(const int8_t* src, int64_t n, int64_t rows, int64_t d,
                                bf16_bits* out, float* scales) {
  const int64_t stride = d + kInt8ScaleBytes;
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = src + r * stride;
    std::memcpy(scales + r, row + d, sizeof(float));
    for (int64_t c = 0; c < d; c += 32) {
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c + 16))));
      _mm512_storeu_si512(out + r * d + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  std::fill(out + n * d, out + rows * d, bf16_bits{0});
  std::fill(scales + n, scales + rows, 0.0f);
}

// A tile's K and V rows for the vdpbf16ps loops, and their row scales (null
// for bf16, which is read in place: run_task checked block_size % 8 == 0).
struct DotTile {
  const bf16_bits* k;
  const bf16_bits* v;
  const float* k_scales;
  const float* v_scales;
};

// An int8 tile's integers as bf16 in scratch: K to a multiple of 8 rows
// (the loops read keys 8 at a time), V its n rows.
template <typename T, typename KV>
SLIP_INLINE DotTile dot_tile(const Problem<T, KV>& p, int64_t offset, int64_t n, Scratch& sc) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    bf16_bits* k = reinterpret_cast<bf16_bits*>(sc.k.data());
    bf16_bits* v = reinterpret_cast<bf16_bits*>(sc.v.data());
    int8_tile_bf16(p.k + offset, n, (n + 7) / 8 * 8, p.head_dim, k, sc.k_scales.data());
    int8_tile_bf16(p.v + offset, n, n, p.head_dim, v, sc.v_scales.data());
    return {k, v, sc.k_scales.data(), sc.v_scales.data()};
  } else {
    return {p.k + offset, p.v + offset, nullptr, nullptr};
  }
}
#endif

// One row against the first n keys of a tile whose k rows are readable up to
// a multiple of 8: the online-softmax update of (m, l, o).
template <typename R>
SLIP_INLINE void attend_row(const typename R::Q* q, const typename R::E* k,
                            const typename R::E* v, int64_t d, int n, float& m, float& l,
                            float* o) {
  const int groups = (n + 7) / 8;
  v8f s[kKeyTile / 8];
  for (int g = 0; g < groups; ++g) s[g] = dot8<R>(q, k + g * 8 * d, d);
  const int tail = n - (groups - 1) * 8;
  if (tail < 8) {  // keys past n: beyond the row's position or the task's range
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    s[groups - 1] = lane < tail ? s[groups - 1] : splat(kNegInf);
  }
  v8f top = s[0];
  for (int g = 1; g < groups; ++g) top = vmax(top, s[g]);
  const float m_new = std::max(m, hmax(top));
  const float alpha = std::exp2(m - m_new);  // 0 on the row's first tile (m = -inf)
  alignas(64) float p[kKeyTile];
  v8f sum = {};
  for (int g = 0; g < groups; ++g) {
    const v8f e = exp2_neg(s[g] - splat(m_new));
    sum += e;
    store8(p + 8 * g, e);
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  accumulate_row<R>(o, v, d, p, n, alpha);
}

// `rows` rows of a tile as fp32 [rows, d], of which `readable` exist in the
// block: in place when already fp32 and all readable, else converted into
// buf (rows past the block are zeros). Int8 rows (stride d + 4) are
// multiplied by the scale each row carries after its values.
template <typename T>
SLIP_INLINE const float* tile_f32(const T* src, int64_t rows, int64_t readable, int64_t d,
                                  float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (rows <= readable) return src;
  }
  const int64_t filled = std::min(rows, readable);
  if constexpr (std::is_same_v<T, int8_t>) {
    const int64_t stride = d + kInt8ScaleBytes;
    for (int64_t r = 0; r < filled; ++r) {
      const int8_t* row = src + r * stride;
      float* out = buf + r * d;
      float scale;
      std::memcpy(&scale, row + d, sizeof(scale));
      const v8f s = splat(scale);
      int64_t c = 0;
      for (; c + 8 <= d; c += 8) store8(out + c, load8(row + c) * s);
      for (; c < d; ++c) out[c] = float(row[c]) * scale;
    }
  } else {
    const int64_t n = filled * d;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(buf + i, load8(src + i));
    for (; i < n; ++i) buf[i] = to_float(src[i]);
  }
  std::fill(buf + filled * d, buf + rows * d, 0.0f);
  return buf;
}

// Where a task's tiles lie in the K/V storage (head-major: the rows of one
// block of one kv head are a contiguous [block_size, head_dim] slab).
template <typename T, typename KV>
struct TileWalk {
  const Problem<T, KV>& p;
  const int64_t* table;
  int64_t head_base;
  int64_t key_end;
  TileWalk(const Problem<T, KV>& problem, const Task& task)
      : p(problem),
        table(problem.block_tables + task.seq * problem.max_blocks),
        head_base(task.kv_head * problem.num_blocks),
        key_end(task.key_end) {}
  SLIP_INLINE int64_t offset(int64_t key) const {  // element offset of key's row
    return ((head_base + table[key / p.block_size]) * p.block_size + key % p.block_size) *
           p.row_stride;
  }
  SLIP_INLINE int64_t length(int64_t key) const {  // keys from `key` to the end of its tile
    return std::min<int64_t>({kKeyTile, p.block_size - key % p.block_size, key_end - key});
  }
  SLIP_INLINE void aim(LinePrefetcher& ahead, int64_t key) const {  // at the tile at `key`
    const int64_t at = offset(key);
    ahead.aim(p.k + at, p.v + at, length(key) * p.row_stride * int64_t(sizeof(KV)));
  }
};

// Each tile of a task's key range in order: f(key, n, offset) for the n keys
// from `key`, whose rows start at element `offset` of K and V. Meanwhile the
// lines of the tile after next (near the end: the thread's next task's first
// tile) are asked for, a few per step of f's loops (ahead.step); the task's
// second tile at once, with its first. One tile ahead left decode waiting on
// K/V: a bf16 tile of a 64-wide head is a 4 KB page of K and one of V, which the
// hardware prefetchers do not cross (two ahead: the bf16 decode call 6-7 %
// faster on a Zen 5, int8 6-11 %; three ahead, slower).
template <typename T, typename KV, typename F>
SLIP_INLINE void for_each_tile(const Problem<T, KV>& p, const Task& task, const Task* upcoming,
                               LinePrefetcher& ahead, F&& f) {
  const TileWalk<T, KV> walk(p, task);
  int64_t key = task.key_begin;
  int64_t n = key < task.key_end ? walk.length(key) : 0;
  while (key < task.key_end) {
    const int64_t next = key + n, next_n = next < task.key_end ? walk.length(next) : 0;
    ahead.finish();  // what the last tile's steps left of the one aimed at
    if (key == task.key_begin && next_n > 0) {
      walk.aim(ahead, next);
      ahead.finish();
    }
    const int64_t after = next + next_n;
    if (after < task.key_end)
      walk.aim(ahead, after);
    else if (upcoming != nullptr)
      TileWalk<T, KV>(p, *upcoming).aim(ahead, upcoming->key_begin);
    f(key, n, walk.offset(key));
    key = next;
    n = next_n;
  }
}

// A tile's K (readable to a multiple of 8 rows) and V rows as fp32 (tile_f32).
template <typename T, typename KV>
SLIP_INLINE std::pair<const float*, const float*> float_tile(const Problem<T, KV>& p,
                                                             int64_t key, int64_t n,
                                                             int64_t offset, Scratch& scratch) {
  const int64_t readable = p.block_size - key % p.block_size;  // rows left in the block
  return {tile_f32(p.k + offset, (n + 7) / 8 * 8, readable, p.head_dim, scratch.k.data()),
          tile_f32(p.v + offset, n, readable, p.head_dim, scratch.v.data())};
}

// A task's result: row_at(r, tmp) gives row r's O in element order (tmp: d
// floats it may use), divided by l[r] into the output; or, for a split task,
// O, m and l into its record for run_merge.
template <typename T, typename KV, typename RowAt>
SLIP_INLINE void write_result(const Problem<T, KV>& p, const Task& task, RowAt row_at,
                              const float* m, const float* l, float* tmp) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = task.num_tokens * g;
  float* record = task.partial < 0 ? nullptr : p.partials + task.partial;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = row_at(r, tmp);
    if (record == nullptr) {
      const int64_t token = task.token0 + r / g, head = task.kv_head * g + r % g;
      store_row(p.out + (token * p.num_heads + head) * d, row, 1.0f / l[r], d);
    } else {
      std::copy(row, row + d, record + r * d);
    }
  }
  if (record != nullptr) {
    std::copy(m, m + rows, record + rows * d);
    std::copy(l, l + rows, record + rows * d + rows);
  }
}

// Row of q into the order and type R's loops expect (scaled unless R keeps bf16).
template <typename R, typename T>
SLIP_INLINE void load_q_row(typename R::Q* dst, const T* src, float scale, int64_t d) {
  if constexpr (kDot<R>) {
    std::memcpy(dst, src, d * sizeof(T));
  } else if constexpr (kPaired<R>) {
    for (int64_t c = 0; c < d; c += 2 * kLanes)
      for (int j = 0; j < kLanes; ++j) {
        dst[c + j] = to_float(src[c + 2 * j]) * scale;
        dst[c + kLanes + j] = to_float(src[c + 2 * j + 1]) * scale;
      }
  } else {
    for (int64_t c = 0; c < d; ++c) dst[c] = to_float(src[c]) * scale;
  }
}

// A row of O back in element order (in place for rows kept in order).
template <typename R>
SLIP_INLINE const float* natural_row(const float* o, int64_t d, float* tmp) {
  if constexpr (kPaired<R>) {
    for (int64_t c = 0; c < d; c += 2 * kLanes)
      for (int j = 0; j < kLanes; ++j) {
        tmp[c + 2 * j] = o[c + j];
        tmp[c + 2 * j + 1] = o[c + kLanes + j];
      }
    return tmp;
  } else if constexpr (kDot<R>) {
    // DotOrder: per 32 columns, lane 4 L + j of the first 16 holds column
    // 8 L + j, of the second 16 column 8 L + 4 + j (L: 128-bit lane, j < 4).
    for (int64_t c = 0; c < d; c += 32)
      for (int lane = 0; lane < 4; ++lane)
        for (int j = 0; j < 4; ++j) {
          tmp[c + 8 * lane + j] = o[c + 4 * lane + j];
          tmp[c + 8 * lane + 4 + j] = o[c + 16 + 4 * lane + j];
        }
    return tmp;
  } else {
    return o;
  }
}

template <typename T, typename KV, typename R>
SLIP_INLINE void run_task_rows(const Problem<T, KV>& p, const Task& task, const Task* upcoming,
                               Scratch& scratch) {
  using Q = typename R::Q;
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = task.num_tokens * g;
  Q* q = reinterpret_cast<Q*>(scratch.q.data());
  float* o = scratch.o.data();
  float* m = scratch.m.data();
  float* l = scratch.l.data();
  const float q_scale = kDot<R> ? 1.0f : p.qk_scale;  // folded into q, or into the scores
  // Rows are (token, head of the group), token-major.
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = p.q + (task.token0 + r / g) * p.q_stride + (task.kv_head * g + r % g) * d;
    load_q_row<R>(q + r * d, src, q_scale, d);
  }
  std::fill(o, o + rows * d, 0.0f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  if constexpr (kDot<R>) std::fill_n(scratch.l_lanes.data(), rows * 16, 0.0f);

  LinePrefetcher ahead;
  for_each_tile(p, task, upcoming, ahead, [&](int64_t key, int64_t n, int64_t offset) {
#if SLIPSTREAM_BF16_DOT
    if constexpr (kDot<R>) {
      const DotTile tile = dot_tile(p, offset, n, scratch);
      int* visible = scratch.visible.data();
      for (int64_t r = 0; r < rows; ++r)  // causal
        visible[r] = int(std::min(n, task.pos0 + r / g + 1 - key));
      attend_tile_dot_any(q, tile.k, tile.v, d, rows, visible, int(n), p.qk_scale,
                          tile.k_scales, tile.v_scales, m, scratch.l_lanes.data(), o,
                          scratch.p_pairs.data(), scratch.alpha.data(), ahead);
    }
#endif
    if constexpr (!kDot<R>) {
      const typename R::E* kt;
      const typename R::E* vt;
      if constexpr (kPaired<R>) {  // in place: run_task checked block_size % 8 == 0
        kt = p.k + offset;
        vt = p.v + offset;
      } else {
        std::tie(kt, vt) = float_tile(p, key, n, offset, scratch);
      }
      for (int64_t r = 0; r < rows; ++r) {
        ahead.step(kRowLines);
        const int64_t visible_keys = std::min(n, task.pos0 + r / g + 1 - key);  // causal
        if (visible_keys > 0)
          attend_row<R>(q + r * d, kt, vt, d, int(visible_keys), m[r], l[r], o + r * d);
      }
    }
  });

#if SLIPSTREAM_BF16_DOT
  if constexpr (kDot<R>)
    for (int64_t r = 0; r < rows; ++r)
      l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(scratch.l_lanes.data() + 16 * r));
#endif
  auto row_at = [&](int64_t r, float* tmp) { return natural_row<R>(o + r * d, d, tmp); };
  write_result(p, task, row_at, m, l, scratch.k.data());  // k: free by now
}

// ---- Tiled tasks: many rows (a prefill chunk's tokens x the GQA group).
// Each tile becomes two small matrix products, with the rows' state held in
// vectors across rows (rows padded to a multiple of kLanes):
//
//   qt [d][rows]     q, scaled and transposed once per task
//   st [keys][rows]  scores: st[t] = sum_c k[t][c] * qt[c], k broadcast
//   online softmax down the keys, per lane: m, l and alpha are vectors of
//     rows; the causal mask compares each row's position with the key's
//   ot [d][rows]     ot[c] = ot[c] * alpha + sum_t v[t][c] * p[t], v broadcast
//
// so the tile loop has no horizontal reduction and no per-row scalar work
// (the row-at-a-time path spends a reduction tree per 8 keys and an exp2
// per row). Each K or V element is broadcast once per kTileRowVecs row
// vectors; each row vector of qt or p is loaded once per 4 keys or columns.
// ot is transposed back once, when the task writes its rows.
constexpr int kTileRowVecs = kNumRegs == 32 ? 4 : 2;  // 16 accumulators, or 8
constexpr int kTileCols = 4;                          // keys, or columns, per block

// Scores of the row vectors at qt (RV of them, row stride rs) against the
// first `keys` rows of k (a multiple of 4, all readable), into st.
template <int RV>
SLIP_INLINE void tile_scores(const float* qt, int64_t rs, const float* k, int64_t d, int keys,
                             float* st) {
  for (int t = 0; t < keys; t += kTileCols) {
    vf acc[kTileCols][RV] = {};
    const float* kb = k + t * d;
    for (int64_t c = 0; c < d; ++c) {
      vf x[RV];
      for (int j = 0; j < RV; ++j) x[j] = loadv(qt + c * rs + kLanes * j);
      for (int u = 0; u < kTileCols; ++u) {
        const vf b = splatv(kb[u * d + c]);
        for (int j = 0; j < RV; ++j) acc[u][j] += b * x[j];
      }
    }
    for (int u = 0; u < kTileCols; ++u)
      for (int j = 0; j < RV; ++j) storev(st + (t + u) * rs + kLanes * j, acc[u][j]);
  }
}

// Online softmax of one row vector over the tile's first n keys (key0 is
// the first one's position): st's scores become p in place; m, l updated,
// alpha = 2^(m_old - m_new). Rows that have seen no key keep m = -inf and
// p = 0 (their alpha only ever scales zeros). scale: what the scores are
// multiplied by first (the brgemm tiles' products are unscaled).
SLIP_INLINE void tile_softmax(float* st, int64_t rs, int n, float key0, vf row_pos, float* m,
                              float* l, float* alpha, float scale = 1.0f) {
  const vf neg_inf = splatv(kNegInf);
  vf top = neg_inf;
  for (int t = 0; t < n; ++t) {
    const vf s = loadv(st + t * rs) * scale;
    const vf masked = splatv(key0 + float(t)) <= row_pos ? s : neg_inf;  // causal
    storev(st + t * rs, masked);
    top = top > masked ? top : masked;
  }
  const vf m_old = loadv(m);
  const vf m_new = m_old > top ? m_old : top;
  const vf base = m_new == neg_inf ? vf{} : m_new;
  const vf a = exp2_neg(m_old - base);
  vf sum = {};
  for (int t = 0; t < n; ++t) {
    const vf e = exp2_neg(loadv(st + t * rs) - base);
    storev(st + t * rs, e);
    sum += e;
  }
  storev(l, loadv(l) * a + sum);
  storev(m, m_new);
  storev(alpha, a);
}

// Columns c0 .. c0 + C of ot for RV row vectors: ot = ot * alpha + v^T p
// over the first n keys (rows of v, stride d; p rows of stride rs).
template <int RV, int C>
SLIP_INLINE void tile_pv(float* ot, int64_t rs, const float* v, int64_t d, int64_t c0,
                         const float* p, int n, const float* alpha) {
  vf acc[C][RV];
  for (int j = 0; j < RV; ++j) {
    const vf a = loadv(alpha + kLanes * j);
    for (int u = 0; u < C; ++u) acc[u][j] = loadv(ot + (c0 + u) * rs + kLanes * j) * a;
  }
  for (int t = 0; t < n; ++t) {
    vf x[RV];
    for (int j = 0; j < RV; ++j) x[j] = loadv(p + t * rs + kLanes * j);
    for (int u = 0; u < C; ++u) {
      const vf b = splatv(v[t * d + c0 + u]);
      for (int j = 0; j < RV; ++j) acc[u][j] += b * x[j];
    }
  }
  for (int u = 0; u < C; ++u)
    for (int j = 0; j < RV; ++j) storev(ot + (c0 + u) * rs + kLanes * j, acc[u][j]);
}

// One tile of n keys at position key0 (k readable to a multiple of 8 rows)
// against RV row vectors starting at row vector jb, whose last real row sits
// at last_pos.
template <int RV>
SLIP_INLINE void tile_block(Scratch& sc, int64_t rs, int64_t jb, int64_t last_pos,
                            const float* k, const float* v, int64_t d, int n, int64_t key0) {
  const int seen = int(std::min<int64_t>(n, last_pos - key0 + 1));  // the block's most
  if (seen <= 0) return;  // no row of the block sees the tile: nothing changes
  const int64_t at = kLanes * jb;
  float* st = sc.st.data() + at;
  tile_scores<RV>(sc.q.data() + at, rs, k, d, (seen + kTileCols - 1) / kTileCols * kTileCols,
                  st);
  for (int j = 0; j < RV; ++j) {
    const int64_t r = at + kLanes * j;
    tile_softmax(st + kLanes * j, rs, seen, float(key0), loadv(sc.pos.data() + r),
                 sc.m.data() + r, sc.l.data() + r, sc.alpha.data() + r);
  }
  const float* alpha = sc.alpha.data() + at;
  float* ot = sc.o.data() + at;
  int64_t c = 0;
  for (; c + kTileCols <= d; c += kTileCols)
    tile_pv<RV, kTileCols>(ot, rs, v, d, c, st, seen, alpha);
  for (; c < d; ++c) tile_pv<RV, 1>(ot, rs, v, d, c, st, seen, alpha);
}

// Two adjacent bf16 values as one 32-bit pair (the first in the low half).
SLIP_INLINE uint32_t load_pair(const bf16_bits* at) {
  uint32_t pair;
  std::memcpy(&pair, at, sizeof(pair));
  return pair;
}

#if SLIPSTREAM_BF16_DOT
// ---- Tiles on vdpbf16ps (bf16 q and K/V, AVX512-BF16): the same two
// products with channel pairs, K read in place and q kept in bf16:
//
//   q2 [d/2][rows]   (q[r][2i], q[r][2i+1]) as one 32-bit pair per row, unscaled
//   st[t] = scale * sum_i q2[i] . (k[t][2i], k[t][2i+1])     (k pair broadcast)
//   p2 [n/2][rows]   (p[2u][r], p[2u+1][r]) rounded to bf16 (l sums p unrounded)
//   ot[c] = ot[c] * alpha + sum_u p2[u] . (v[2u][c], v[2u+1][c])
//
// V's pairs are interleaved once per tile (v_pairs [kKeyTile/2][d], each
// row's columns in pair_slot order), shared by every row of the task. The
// products of bf16 pairs are exact in fp32.

// k_scales (or null): an int8 tile's key scales, which multiply the scores.
template <int RV>
SLIP_INLINE void tile_scores_dot(const uint32_t* q2, int64_t rs, const bf16_bits* k, int64_t d,
                                 int keys, float scale, const float* k_scales, float* st) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int t = 0; t < keys; t += kTileCols) {
    __m512 acc[kTileCols][RV];
    for (int u = 0; u < kTileCols; ++u)
      for (int j = 0; j < RV; ++j) acc[u][j] = _mm512_setzero_ps();
    const bf16_bits* kb = k + t * d;
    for (int64_t i = 0; i < d / 2; ++i) {
      __m512bh x[RV];
      for (int j = 0; j < RV; ++j) x[j] = (__m512bh)_mm512_loadu_si512(q2 + i * rs + 16 * j);
      for (int u = 0; u < kTileCols; ++u) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(int(load_pair(kb + u * d + 2 * i)));
        for (int j = 0; j < RV; ++j) acc[u][j] = _mm512_dpbf16_ps(acc[u][j], x[j], b);
      }
    }
    for (int u = 0; u < kTileCols; ++u) {
      const __m512 su = k_scales == nullptr ? s : _mm512_set1_ps(scale * k_scales[t + u]);
      for (int j = 0; j < RV; ++j)
        _mm512_storeu_ps(st + (t + u) * rs + 16 * j, _mm512_mul_ps(acc[u][j], su));
    }
  }
}

// Where column c's pair sits in a row of v_pairs: within each whole 32
// columns, in the order vpunpck{l,h}wd leave them (that of natural_row's
// DotOrder: lane 4 L + j of the first 16 holds column 8 L + j, of the
// second 16 column 8 L + 4 + j); columns past the last whole 32 in order.
SLIP_INLINE int64_t pair_slot(int64_t c, int64_t d) {
  if (c >= d / 32 * 32) return c;
  const int64_t base = c / 32 * 32, lane = c % 32 / 8, j = c % 8;
  return base + (j < 4 ? 4 * lane + j : 16 + 4 * lane + j - 4);
}

// Columns c0 .. c0 + C of ot for RV row vectors: ot = ot * alpha + V^T p over
// n2 key pairs (p2: pairs of p, row stride rs; vp: V's pairs, d a key pair).
template <int RV, int C>
SLIP_INLINE void tile_pv_dot(float* ot, int64_t rs, const uint32_t* vp, int64_t d, int64_t c0,
                             const uint32_t* p2, int n2, const float* alpha) {
  int64_t slot[C];
  for (int u = 0; u < C; ++u) slot[u] = pair_slot(c0 + u, d);
  __m512 acc[C][RV];
  for (int j = 0; j < RV; ++j) {
    const __m512 a = _mm512_loadu_ps(alpha + 16 * j);
    for (int u = 0; u < C; ++u)
      acc[u][j] = _mm512_mul_ps(_mm512_loadu_ps(ot + (c0 + u) * rs + 16 * j), a);
  }
  for (int t2 = 0; t2 < n2; ++t2) {
    __m512bh x[RV];
    for (int j = 0; j < RV; ++j) x[j] = (__m512bh)_mm512_loadu_si512(p2 + t2 * rs + 16 * j);
    for (int u = 0; u < C; ++u) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(int(vp[t2 * d + slot[u]]));
      for (int j = 0; j < RV; ++j) acc[u][j] = _mm512_dpbf16_ps(acc[u][j], x[j], b);
    }
  }
  for (int u = 0; u < C; ++u)
    for (int j = 0; j < RV; ++j) _mm512_storeu_ps(ot + (c0 + u) * rs + 16 * j, acc[u][j]);
}

// V's first n rows (stride d) as pairs of rows: row t2 of vp holds
// (v[2 t2][c], v[2 t2 + 1][c]) at pair_slot(c), interleaved 32 columns per
// vpunpck{l,h}wd pair (a column at a time, it took a quarter of a prefill's
// attention: AMD EPYC Zen 5). An odd last row pairs with zero (p's pair
// there is zero too, and 0 * a NaN would not be).
SLIP_INLINE void pair_v_rows(const bf16_bits* v, int64_t d, int n, uint32_t* vp) {
  const int64_t whole = d / 32 * 32;
  for (int t = 0; t < n; t += 2) {
    const bool second = t + 1 < n;
    const bf16_bits* row0 = v + t * d;
    const bf16_bits* row1 = row0 + d;
    uint32_t* out = vp + (t / 2) * d;
    for (int64_t c = 0; c < whole; c += 32) {
      const __m512i x0 = _mm512_loadu_si512(row0 + c);
      const __m512i x1 = second ? _mm512_loadu_si512(row1 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + c, _mm512_unpacklo_epi16(x0, x1));
      _mm512_storeu_si512(out + c + 16, _mm512_unpackhi_epi16(x0, x1));
    }
    for (int64_t c = whole; c < d; ++c)
      out[c] = uint32_t(row0[c]) | (second ? uint32_t(row1[c]) << 16 : 0u);
  }
}

// tile_block on vdpbf16ps: k (bf16) in place or an int8 tile's integers,
// V's pairs in sc.v_pairs, q2 in sc.q's memory. k_scales, v_scales: an
// int8 tile's row scales (or null), applied to the scores and to p.
template <int RV>
SLIP_INLINE void tile_block_dot(Scratch& sc, int64_t rs, int64_t jb, int64_t last_pos,
                                const bf16_bits* k, int64_t d, int n, int64_t key0, float scale,
                                const float* k_scales, const float* v_scales) {
  const int seen = int(std::min<int64_t>(n, last_pos - key0 + 1));
  if (seen <= 0) return;
  const int64_t at = 16 * jb;
  float* st = sc.st.data() + at;
  const uint32_t* q2 = reinterpret_cast<const uint32_t*>(sc.q.data()) + at;
  tile_scores_dot<RV>(q2, rs, k, d, (seen + kTileCols - 1) / kTileCols * kTileCols, scale,
                      k_scales, st);
  for (int j = 0; j < RV; ++j) {
    const int64_t r = at + 16 * j;
    tile_softmax(st + 16 * j, rs, seen, float(key0), loadv(sc.pos.data() + r),
                 sc.m.data() + r, sc.l.data() + r, sc.alpha.data() + r);
  }
  // p as bf16 pairs of keys, per row (times V's scales: l has summed p);
  // an odd last key pairs with zero
  uint32_t* p2 = sc.p_pairs.data() + at;
  const int n2 = (seen + 1) / 2;
  for (int t2 = 0; t2 < n2; ++t2) {
    const float w0 = v_scales == nullptr ? 1.0f : v_scales[2 * t2];
    const float w1 = v_scales == nullptr ? 1.0f : v_scales[2 * t2 + 1];
    for (int64_t r = 0; r < 16 * RV; ++r) {
      const uint32_t lo = to_bf16(st[2 * t2 * rs + r] * w0);
      const uint32_t hi = 2 * t2 + 1 < seen ? to_bf16(st[(2 * t2 + 1) * rs + r] * w1) : 0u;
      p2[t2 * rs + r] = lo | (hi << 16);
    }
  }
  const float* alpha = sc.alpha.data() + at;
  float* ot = sc.o.data() + at;
  int64_t c = 0;
  for (; c + kTileCols <= d; c += kTileCols)
    tile_pv_dot<RV, kTileCols>(ot, rs, sc.v_pairs.data(), d, c, p2, n2, alpha);
  for (; c < d; ++c) tile_pv_dot<RV, 1>(ot, rs, sc.v_pairs.data(), d, c, p2, n2, alpha);
}
#endif  // SLIPSTREAM_BF16_DOT

// kDotTiles (AVX512-BF16, bf16 q, bf16 or int8 K/V): the products on vdpbf16ps, above.
template <typename T, typename KV, bool kDotTiles = false>
SLIP_INLINE void run_task_tiles(const Problem<T, KV>& p, const Task& task, const Task* upcoming,
                                Scratch& sc) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = task.num_tokens * g;
  const int64_t vecs = (rows + kLanes - 1) / kLanes, rs = vecs * kLanes;
  float* qt = sc.q.data();
  float* ot = sc.o.data();
  // Rows are (token, head of the group), token-major; padding rows see nothing.
  for (int64_t r = 0; r < rs; ++r) {
    const T* src = r < rows ? p.q + (task.token0 + r / g) * p.q_stride +
                                  (task.kv_head * g + r % g) * d
                            : nullptr;
    sc.pos[r] = src != nullptr ? float(task.pos0 + r / g) : -1.0f;
    if constexpr (kDotTiles) {  // pairs of channels, unscaled, in qt's memory
      uint32_t* q2 = reinterpret_cast<uint32_t*>(qt);
      for (int64_t i = 0; i < d / 2; ++i)
        q2[i * rs + r] = src == nullptr ? 0u : load_pair(src + 2 * i);
    } else {
      for (int64_t c = 0; c < d; ++c)
        qt[c * rs + r] = src == nullptr ? 0.0f : to_float(src[c]) * p.qk_scale;
    }
  }
  std::fill(ot, ot + d * rs, 0.0f);
  std::fill(sc.m.data(), sc.m.data() + rs, kNegInf);
  std::fill(sc.l.data(), sc.l.data() + rs, 0.0f);

  LinePrefetcher ahead;
  for_each_tile(p, task, upcoming, ahead, [&](int64_t key, int64_t n, int64_t offset) {
    int64_t jb = 0;
    auto last_pos = [&](int64_t vectors) {  // of the last real row of `vectors` from jb
      return task.pos0 + (std::min(rows, kLanes * (jb + vectors)) - 1) / g;
    };
#if SLIPSTREAM_BF16_DOT
    if constexpr (kDotTiles) {
      const DotTile tile = dot_tile(p, offset, n, sc);
      pair_v_rows(tile.v, d, int(n), sc.v_pairs.data());
      for (; jb + kTileRowVecs <= vecs; jb += kTileRowVecs) {
        ahead.step(kRowLines);
        tile_block_dot<kTileRowVecs>(sc, rs, jb, last_pos(kTileRowVecs), tile.k, d, int(n), key,
                                     p.qk_scale, tile.k_scales, tile.v_scales);
      }
      for (; jb < vecs; ++jb) {
        ahead.step(kRowLines);
        tile_block_dot<1>(sc, rs, jb, last_pos(1), tile.k, d, int(n), key, p.qk_scale,
                          tile.k_scales, tile.v_scales);
      }
      return;
    }
#endif
    const auto [kt, vt] = float_tile(p, key, n, offset, sc);
    for (; jb + kTileRowVecs <= vecs; jb += kTileRowVecs) {
      ahead.step(kRowLines);
      tile_block<kTileRowVecs>(sc, rs, jb, last_pos(kTileRowVecs), kt, vt, d, int(n), key);
    }
    for (; jb < vecs; ++jb) {
      ahead.step(kRowLines);
      tile_block<1>(sc, rs, jb, last_pos(1), kt, vt, d, int(n), key);
    }
  });

  auto row_at = [&](int64_t r, float* tmp) {  // column r of ot
    for (int64_t c = 0; c < d; ++c) tmp[c] = ot[c * rs + r];
    return static_cast<const float*>(tmp);
  };
  write_result(p, task, row_at, sc.m.data(), sc.l.data(), sc.k.data());  // k: free by now
}

#if SLIPSTREAM_BRGEMM
// ---- Tiles on oneDNN's batch-reduce GEMM (ATen's cpublas::brgemm), kBrgemm:
// the dot tiles' layouts, each of a tile's two products one call, which
// oneDNN runs on AMX tiles where the CPU has AMX-BF16 and on vdpbf16ps
// where it has AVX512-BF16 only:
//
//   st [n][rs]   = K [n][d] . q2               A: K in place; B: q2 [d/2][rs] pairs
//   online softmax down the keys, as the other tiles (scale applied there)
//   p2 [16][rs]  pairs of p as the dot tiles', zero past the tile's pairs
//   ot [d][rs]   = ot * alpha + Vt [d][32] . p2   A: V transposed; B: p2
//
// B's leading dimension is rs, a multiple of 16 up to kMaxBrgemmRows: AMX's
// kernels take packed B ("pack32": pairs of k per column) at 16, 32, 48 or
// 64 only. Vt's rows are V's columns in pair_slot order (transposed from
// v_pairs), so ot's are too; the task unpermutes them when it writes.
constexpr int64_t kMaxBrgemmRows = 64;

// 16 x 16 32-bit words: rows r[i] become columns.
SLIP_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // rows 4 g .. 4 g + 3, word j of each 128-bit lane L: b[4 g + j] holds
  // column 4 L + j of those rows in lane L
  __m512i b[16];
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88);
    const __m512i y = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
    const __m512i z = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
    const __m512i w = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(x, z, 0x88);       // column j
    r[4 + j] = _mm512_shuffle_i32x4(y, w, 0x88);   // column 4 + j
    r[8 + j] = _mm512_shuffle_i32x4(x, z, 0xDD);   // column 8 + j
    r[12 + j] = _mm512_shuffle_i32x4(y, w, 0xDD);  // column 12 + j
  }
}

// V's first n rows (stride d) as Vt [d][kKeyTile] bf16, row pair_slot(c)
// holding column c's keys in order, zero past n; vp: scratch for the pairs.
SLIP_INLINE void transpose_v(const bf16_bits* v, int64_t d, int n, uint32_t* vp, uint32_t* vt) {
  const int n2 = (n + 1) / 2;
  pair_v_rows(v, d, n, vp);
  std::fill(vp + n2 * d, vp + (kKeyTile / 2) * d, 0u);
  for (int64_t c = 0; c < d; c += 16) {
    __m512i r[16];
    for (int t2 = 0; t2 < 16; ++t2) r[t2] = _mm512_loadu_si512(vp + t2 * d + c);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(vt + (c + i) * (kKeyTile / 2), r[i]);
  }
}

// p (st, n keys, rs rows) as bf16 pairs of keys per row, zero up to 16 pairs.
SLIP_INLINE void pair_p(const float* st, int64_t rs, int n, uint32_t* p2) {
  for (int t2 = 0; t2 < kKeyTile / 2; ++t2)
    for (int64_t r = 0; r < rs; r += 16) {
      __m512i pair = _mm512_setzero_si512();
      if (2 * t2 < n) {
        pair = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * t2 * rs + r)));
        if (2 * t2 + 1 < n) {
          const __m512i hi = _mm512_cvtepu16_epi32(
              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * t2 + 1) * rs + r)));
          pair = _mm512_or_si512(pair, _mm512_slli_epi32(hi, 16));
        }
      }
      _mm512_storeu_si512(p2 + t2 * rs + r, pair);
    }
}

// ot [d][rs] *= alpha [rs], each row; nothing where every alpha is 1 (no
// row's maximum moved: most tiles after a row's first few).
template <int NV>
SLIP_INLINE void rescale_columns_of(float* __restrict ot, int64_t d, const float* alpha) {
  __m512 a[NV];
  __mmask16 moved = 0;
  for (int j = 0; j < NV; ++j) {
    a[j] = _mm512_loadu_ps(alpha + 16 * j);
    moved |= _mm512_cmp_ps_mask(a[j], _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
  }
  if (moved == 0) return;
  for (int64_t c = 0; c < d; ++c, ot += 16 * NV)
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(ot + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(ot + 16 * j), a[j]));
}

SLIP_INLINE void rescale_columns(float* ot, int64_t rs, int64_t d, const float* alpha) {
  switch (rs / 16) {
    case 1: return rescale_columns_of<1>(ot, d, alpha);
    case 2: return rescale_columns_of<2>(ot, d, alpha);
    case 3: return rescale_columns_of<3>(ot, d, alpha);
    default: return rescale_columns_of<4>(ot, d, alpha);
  }
}

template <typename T, typename KV>
SLIP_INLINE void run_task_brgemm(const Problem<T, KV>& p, const Task& task, const Task* upcoming,
                                 Scratch& sc) {
  static_assert(std::is_same_v<T, bf16_bits> && std::is_same_v<KV, bf16_bits>);
  using at::native::cpublas::brgemm;
  const auto as_bf16 = [](const void* x) { return static_cast<const at::BFloat16*>(x); };
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = task.num_tokens * g;
  const int64_t rs = (rows + 15) / 16 * 16;
  uint32_t* q2 = reinterpret_cast<uint32_t*>(sc.q.data());
  for (int64_t r = 0; r < rs; ++r) {  // rows (token, head of the group), token-major
    const T* src = r < rows ? p.q + (task.token0 + r / g) * p.q_stride +
                                  (task.kv_head * g + r % g) * d
                            : nullptr;
    sc.pos[r] = src != nullptr ? float(task.pos0 + r / g) : -1.0f;
    for (int64_t i = 0; i < d / 2; ++i) q2[i * rs + r] = src == nullptr ? 0u : load_pair(src + 2 * i);
  }
  float* ot = sc.o.data();
  float* st = sc.st.data();
  uint32_t* p2 = sc.p_pairs.data();
  std::fill(ot, ot + d * rs, 0.0f);
  std::fill(sc.m.data(), sc.m.data() + rs, kNegInf);
  std::fill(sc.l.data(), sc.l.data() + rs, 0.0f);
  const int64_t last_pos = task.pos0 + (rows - 1) / g;
  t_used_brgemm = true;

  LinePrefetcher ahead;
  for_each_tile(p, task, upcoming, ahead, [&](int64_t key, int64_t n, int64_t offset) {
    const int seen = int(std::min<int64_t>(n, last_pos - key + 1));  // keys any row sees
    if (seen <= 0) return;
    brgemm(seen, rs, d, p.row_stride, rs, rs, false, as_bf16(p.k + offset), as_bf16(q2), st, true);
    ahead.step(kRowLines);
    for (int64_t j = 0; j < rs; j += 16)
      tile_softmax(st + j, rs, seen, float(key), loadv(sc.pos.data() + j), sc.m.data() + j,
                   sc.l.data() + j, sc.alpha.data() + j, p.qk_scale);
    ahead.step(kRowLines);
    pair_p(st, rs, seen, p2);
    transpose_v(p.v + offset, d, seen, sc.v_pairs.data(), sc.v_cols.data());
    ahead.step(kRowLines);
    rescale_columns(ot, rs, d, sc.alpha.data());
    brgemm(d, rs, kKeyTile, kKeyTile, rs, rs, true, as_bf16(sc.v_cols.data()), as_bf16(p2), ot,
           true);
  });

  auto row_at = [&](int64_t r, float* tmp) {  // column r of ot, its rows unpermuted
    for (int64_t c = 0; c < d; ++c) tmp[c] = ot[pair_slot(c, d) * rs + r];
    return static_cast<const float*>(tmp);
  };
  write_result(p, task, row_at, sc.m.data(), sc.l.data(), sc.k.data());  // k: free
}

// run_task_brgemm, or false when oneDNN threw (noted; the task wrote nothing,
// its result is written last): the caller runs it another way.
template <typename T, typename KV>
__attribute__((noinline)) bool run_task_brgemm_or_note(const Problem<T, KV>& p, const Task& task,
                                                       const Task* upcoming, Scratch& sc) {
  try {
    run_task_brgemm(p, task, upcoming, sc);
    return true;
  } catch (const c10::Error& error) {
    note_brgemm_failure(error.what_without_backtrace());
  } catch (const std::exception& error) {
    note_brgemm_failure(error.what());
  }
  return false;
}
#endif  // SLIPSTREAM_BRGEMM

// Bf16 rows are read in place when every tile is readable to a multiple of 8
// rows and head_dim is a multiple of the layout's width. With AVX512-BF16
// (Bf16DotRows) that is every task: no widening at all. Otherwise, as lane
// pairs for tasks of few rows (decodes): the pairing costs an ALU op per
// vector per row, cheaper than a conversion pass shared by a few rows. Tasks
// of many rows (prefill tiles) convert each tile into fp32 scratch once and
// share it (measured, AVX2, one core, a 256-token chunk: 5.2 -> 4.5 ms).
// fp32 storage is read in place whenever the tile is readable (tile_f32).
constexpr int64_t kMaxPairedRows = 16;
// Tasks of at least this many rows take the tiled path (run_task_tiles).
constexpr int64_t kMinTiledRows = 16;

// One int8 storage row from head_dim values: each rounded to x * ((1 /
// amax) * 127), half to even (vcvtps2dq under the default rounding mode; nearbyint
// in the baseline), then the fp32 scale = amax / 127 in the row's last 4
// bytes; amax = max |x|, at least 1e-30. The arithmetic of
// kv_layout.quantize_rows, operation for operation in fp32: both writers
// store the same bytes.
template <typename T>
SLIP_INLINE void quantize_row(const T* src, int8_t* dst, int64_t d) {
  float amax = 0.0f;
  int64_t c = 0;
#if SLIPSTREAM_AVX2
  __m256 top = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (; c + 8 <= d; c += 8) top = _mm256_max_ps(top, _mm256_and_ps((__m256)load8(src + c), abs_mask));
  amax = hmax((v8f)top);
#endif
  for (; c < d; ++c) amax = std::max(amax, std::fabs(to_float(src[c])));
  amax = std::max(amax, 1e-30f);
  const float inv = (1.0f / amax) * 127.0f, scale = amax / 127.0f;
  c = 0;
#if SLIPSTREAM_AVX2
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (; c + 8 <= d; c += 8) {
    const __m256 x = _mm256_mul_ps((__m256)load8(src + c), _mm256_set1_ps(inv));
    const __m256i n = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + c), _mm_packs_epi16(words, words));
  }
#endif
  for (; c < d; ++c)
    dst[c] = int8_t(std::nearbyint(std::clamp(to_float(src[c]) * inv, -127.0f, 127.0f)));
  std::memcpy(dst + d, &scale, sizeof(scale));
}

template <typename T, typename KV>
__attribute__((noinline)) void write_rows(const KvWrite<T, KV>& w, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = i / w.num_kv_heads, h = i % w.num_kv_heads;
    for (int s = 0; s < 2; ++s) {
      const T* src = w.src[s] + t * w.src_stride[s] + h * w.head_dim;
      KV* dst = w.dst[s] + (h * w.num_slots + w.slots[t]) * w.width;
      if constexpr (std::is_same_v<KV, int8_t>)
        quantize_row(src, dst, w.head_dim);
      else
        std::memcpy(dst, src, w.head_dim * sizeof(T));
    }
  }
}

// How a task of int8 K/V under a bf16 q runs on vdpbf16ps, its tiles'
// integers as bf16 (head_dim a multiple of 32): decode-sized tasks on
// Int8DotRows, tasks of many rows on the dot tiles where bf16 prefill takes
// them (set_bf16_prefill); else none (fp32 tiles or rows, widened).
enum class Int8Dot { kNone, kRows, kTiles };

template <typename T, typename KV>
SLIP_INLINE Int8Dot int8_dot(const Problem<T, KV>& p, const Task& task) {
#if SLIPSTREAM_BF16_DOT
  if constexpr (std::is_same_v<T, bf16_bits> && std::is_same_v<KV, int8_t>) {
    if (p.head_dim % Int8DotRows::kPairWidth != 0) return Int8Dot::kNone;
    if (task.num_tokens * p.group < kMinTiledRows)
      return p.head_dim <= 256 ? Int8Dot::kRows : Int8Dot::kNone;
    return p.bf16_prefill == kDotTiles ? Int8Dot::kTiles : Int8Dot::kNone;
  }
#endif
  return Int8Dot::kNone;
}

// Whether int8_dot has a way: run_plan, outside the variant's target, asks
// (so not inlined).
template <typename T, typename KV>
__attribute__((noinline)) bool takes_int8_dot(const Problem<T, KV>& p, const Task& task) {
  return int8_dot(p, task) != Int8Dot::kNone;
}

template <typename T, typename KV>
__attribute__((noinline)) void run_task(const Problem<T, KV>& p, const Task& task,
                                        const Task* upcoming, Scratch& scratch) {
#if SLIPSTREAM_BF16_DOT
  if constexpr (std::is_same_v<T, bf16_bits> && std::is_same_v<KV, int8_t>) {
    switch (int8_dot(p, task)) {
      case Int8Dot::kRows: return run_task_rows<T, KV, Int8DotRows>(p, task, upcoming, scratch);
      case Int8Dot::kTiles: return run_task_tiles<T, KV, true>(p, task, upcoming, scratch);
      case Int8Dot::kNone: break;
    }
  }
#endif
  if constexpr (std::is_same_v<KV, bf16_bits>) {
    const bool readable = p.block_size % 8 == 0;
#if SLIPSTREAM_BF16_DOT
    const int mode = task.num_tokens * p.group >= kMinTiledRows ? p.bf16_prefill : int(kDotRows);
    if constexpr (std::is_same_v<T, bf16_bits>) {
#if SLIPSTREAM_BRGEMM
      // (and not since fallen back: a brgemm call of this op threw)
      if (mode == kBrgemm && g_bf16_prefill.load(std::memory_order_relaxed) == kBrgemm &&
          readable && p.head_dim % 16 == 0 && task.num_tokens * p.group <= kMaxBrgemmRows)
        if (run_task_brgemm_or_note(p, task, upcoming, scratch)) return;
#endif
      if ((mode == kDotTiles || mode == kBrgemm) && readable && p.head_dim % 2 == 0)
        return run_task_tiles<T, KV, true>(p, task, upcoming, scratch);
    }
    if (mode == kDotRows && readable && p.head_dim % Bf16DotRows::kPairWidth == 0 &&
        p.head_dim <= 256)
      return run_task_rows<T, KV, Bf16DotRows>(p, task, upcoming, scratch);
#endif
    if (readable && p.head_dim % Bf16Rows::kPairWidth == 0 &&
        task.num_tokens * p.group < kMaxPairedRows)
      return run_task_rows<T, KV, Bf16Rows>(p, task, upcoming, scratch);
  }
  if (task.num_tokens * p.group >= kMinTiledRows)
    return run_task_tiles<T, KV>(p, task, upcoming, scratch);
  run_task_rows<T, KV, FloatRows>(p, task, upcoming, scratch);
}

#undef SLIP_INLINE
#undef SLIP_INLINE_LAMBDA
#undef SLIPSTREAM_BRGEMM
#undef SLIP_REDUCE8

}  // namespace SLIPSTREAM_VARIANT
}  // namespace
}  // namespace slipstream

#endif  // SLIPSTREAM_VARIANT
