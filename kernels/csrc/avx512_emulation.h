// The AVX-512 intrinsics the kernels' "avx512" variants call, written in
// plain GCC vector code, for a test build that runs those variants on a CPU
// without AVX-512 (-DSLIPSTREAM_EMULATE_AVX512; SLIPSTREAM_CPU=avx512-emulated,
// see kernels/cpu_answer.py). The variant's logic -- 16 float lanes, bf16 pair
// dot products, masks, lane shuffles -- is then the logic the tests check on
// any x86-64 CPU with AVX2; only these primitives stand in for the hardware.
//
// Included inside the namespace of the code that calls them, so that an
// unqualified call finds these before <immintrin.h>'s (which need the
// avx512 target). An intrinsic missing here resolves to <immintrin.h>'s and
// fails to compile: never silently native. Each follows Intel's pseudo-code,
// including the rounding of VDPBF16PS (each product exact in fp32, then two
// rounded adds, the odd pair first) and VCVTNE(2)PS2BF16 (round to nearest
// even, denormals to signed zero, NaN quietened). Not emulated: MXCSR's
// DAZ/FTZ for the dot products' denormal inputs and outputs.
//
// No include guard: each including namespace gets its own copy.

#define SLIP_EMU inline

typedef float slip_emu_v16f __attribute__((vector_size(64)));
typedef int32_t slip_emu_v16i __attribute__((vector_size(64)));
typedef uint32_t slip_emu_v16u __attribute__((vector_size(64)));
typedef uint16_t slip_emu_v32h __attribute__((vector_size(64)));
typedef double slip_emu_v8d __attribute__((vector_size(64)));
typedef int64_t slip_emu_v8l __attribute__((vector_size(64)));
typedef uint16_t slip_emu_v16h __attribute__((vector_size(32)));
typedef int8_t slip_emu_v16c __attribute__((vector_size(16)));

template <typename To, typename From>
SLIP_EMU To slip_emu_bits(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast between equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

SLIP_EMU float slip_emu_bf16_to_float(uint16_t h) { return slip_emu_bits<float>(uint32_t(h) << 16); }

SLIP_EMU uint16_t slip_emu_float_to_bf16(float f) {
  const uint32_t w = slip_emu_bits<uint32_t>(f);
  const uint32_t exponent = w & 0x7F800000u;
  if (exponent == 0) return uint16_t((w >> 16) & 0x8000u);  // zero or denormal: signed zero
  if (exponent == 0x7F800000u) {
    if (w & 0x007FFFFFu) return uint16_t((w >> 16) | 0x0040u);  // NaN, quietened
    return uint16_t(w >> 16);                                    // infinity
  }
  return uint16_t((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

SLIP_EMU __m512 _mm512_setzero_ps() { return __m512{}; }
SLIP_EMU __m512i _mm512_setzero_si512() { return __m512i{}; }

SLIP_EMU __m512 _mm512_set1_ps(float x) {
  slip_emu_v16f v;
  for (int i = 0; i < 16; ++i) v[i] = x;
  return (__m512)v;
}

SLIP_EMU __m512i _mm512_set1_epi32(int x) {
  slip_emu_v16i v;
  for (int i = 0; i < 16; ++i) v[i] = x;
  return (__m512i)v;
}

SLIP_EMU __m512 _mm512_loadu_ps(const void* p) {
  __m512 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

SLIP_EMU __m512i _mm512_loadu_si512(const void* p) {
  __m512i v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

SLIP_EMU void _mm512_storeu_ps(void* p, __m512 v) { std::memcpy(p, &v, sizeof(v)); }
SLIP_EMU void _mm512_storeu_si512(void* p, __m512i v) { std::memcpy(p, &v, sizeof(v)); }

SLIP_EMU __m512 _mm512_add_ps(__m512 a, __m512 b) { return (__m512)((slip_emu_v16f)a + (slip_emu_v16f)b); }
SLIP_EMU __m512 _mm512_sub_ps(__m512 a, __m512 b) { return (__m512)((slip_emu_v16f)a - (slip_emu_v16f)b); }
SLIP_EMU __m512 _mm512_mul_ps(__m512 a, __m512 b) { return (__m512)((slip_emu_v16f)a * (slip_emu_v16f)b); }

// VMAXPS: the second operand where either is NaN or both are zeros.
SLIP_EMU __m512 _mm512_max_ps(__m512 a, __m512 b) {
  const slip_emu_v16f x = (slip_emu_v16f)a, y = (slip_emu_v16f)b;
  return (__m512)(x > y ? x : y);
}

SLIP_EMU __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  const slip_emu_v16f x = (slip_emu_v16f)a, y = (slip_emu_v16f)b, z = (slip_emu_v16f)c;
  slip_emu_v16f r;
  for (int i = 0; i < 16; ++i) r[i] = __builtin_fmaf(x[i], y[i], z[i]);
  return (__m512)r;
}

// Lane i: a * b where bit i of k is set, else src.
SLIP_EMU __m512 _mm512_mask_mul_ps(__m512 src, __mmask16 k, __m512 a, __m512 b) {
  const slip_emu_v16f s = (slip_emu_v16f)src, x = (slip_emu_v16f)a, y = (slip_emu_v16f)b;
  slip_emu_v16f r;
  for (int i = 0; i < 16; ++i) r[i] = (k >> i) & 1 ? x[i] * y[i] : s[i];
  return (__m512)r;
}

// The order of GCC's _mm512_reduce_*_ps: halves, then quarters, then pairs.
SLIP_EMU float _mm512_reduce_add_ps(__m512 a) {
  const slip_emu_v16f v = (slip_emu_v16f)a;
  float r8[8], r4[4];
  for (int i = 0; i < 8; ++i) r8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) r4[i] = r8[i] + r8[i + 4];
  return (r4[0] + r4[2]) + (r4[1] + r4[3]);
}

SLIP_EMU float _mm512_reduce_max_ps(__m512 a) {
  const slip_emu_v16f v = (slip_emu_v16f)a;
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

SLIP_EMU __m512d _mm512_castps_pd(__m512 a) { return (__m512d)a; }
SLIP_EMU __m512 _mm512_castpd_ps(__m512d a) { return (__m512)a; }
SLIP_EMU __m512 _mm512_castsi512_ps(__m512i a) { return (__m512)a; }

// Within each 128-bit lane: the low (high) two floats of a and b, interleaved.
SLIP_EMU __m512 _mm512_unpacklo_ps(__m512 a, __m512 b) {
  return (__m512)__builtin_shuffle((slip_emu_v16f)a, (slip_emu_v16f)b,
                                   slip_emu_v16i{0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12,
                                                 28, 13, 29});
}

SLIP_EMU __m512 _mm512_unpackhi_ps(__m512 a, __m512 b) {
  return (__m512)__builtin_shuffle((slip_emu_v16f)a, (slip_emu_v16f)b,
                                   slip_emu_v16i{2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14,
                                                 30, 15, 31});
}

SLIP_EMU __m512d _mm512_unpacklo_pd(__m512d a, __m512d b) {
  return (__m512d)__builtin_shuffle((slip_emu_v8d)a, (slip_emu_v8d)b,
                                    slip_emu_v8l{0, 8, 2, 10, 4, 12, 6, 14});
}

SLIP_EMU __m512d _mm512_unpackhi_pd(__m512d a, __m512d b) {
  return (__m512d)__builtin_shuffle((slip_emu_v8d)a, (slip_emu_v8d)b,
                                    slip_emu_v8l{1, 9, 3, 11, 5, 13, 7, 15});
}

// Within each 128-bit lane: the low (high) four 16-bit words of a and b, interleaved.
SLIP_EMU __m512i _mm512_unpacklo_epi16(__m512i a, __m512i b) {
  const slip_emu_v32h x = (slip_emu_v32h)a, y = (slip_emu_v32h)b;
  slip_emu_v32h r;
  for (int lane = 0; lane < 4; ++lane)
    for (int j = 0; j < 4; ++j) {
      r[8 * lane + 2 * j] = x[8 * lane + j];
      r[8 * lane + 2 * j + 1] = y[8 * lane + j];
    }
  return (__m512i)r;
}

SLIP_EMU __m512i _mm512_unpackhi_epi16(__m512i a, __m512i b) {
  const slip_emu_v32h x = (slip_emu_v32h)a, y = (slip_emu_v32h)b;
  slip_emu_v32h r;
  for (int lane = 0; lane < 4; ++lane)
    for (int j = 0; j < 4; ++j) {
      r[8 * lane + 2 * j] = x[8 * lane + 4 + j];
      r[8 * lane + 2 * j + 1] = y[8 * lane + 4 + j];
    }
  return (__m512i)r;
}

// 128-bit lanes: two of a (imm bits 0-1, 2-3), then two of b (bits 4-5, 6-7).
SLIP_EMU __m512 _mm512_shuffle_f32x4(__m512 a, __m512 b, const int imm) {
  const slip_emu_v16f x = (slip_emu_v16f)a, y = (slip_emu_v16f)b;
  slip_emu_v16f r;
  for (int lane = 0; lane < 4; ++lane) {
    const slip_emu_v16f& from = lane < 2 ? x : y;
    const int pick = (imm >> (2 * lane)) & 3;
    for (int j = 0; j < 4; ++j) r[4 * lane + j] = from[4 * pick + j];
  }
  return (__m512)r;
}

SLIP_EMU __m512i _mm512_slli_epi32(__m512i a, unsigned int count) {
  if (count > 31) return __m512i{};
  return (__m512i)((slip_emu_v16u)a << count);
}

SLIP_EMU __m512i _mm512_cvtepu16_epi32(__m256i a) {
  return (__m512i)__builtin_convertvector((slip_emu_v16h)a, slip_emu_v16u);
}

SLIP_EMU __m512i _mm512_cvtepi8_epi32(__m128i a) {
  return (__m512i)__builtin_convertvector((slip_emu_v16c)a, slip_emu_v16i);
}

SLIP_EMU __m512 _mm512_cvtepi32_ps(__m512i a) {
  return (__m512)__builtin_convertvector((slip_emu_v16i)a, slip_emu_v16f);
}

// VDPBF16PS: lane i += a[2i+1] * b[2i+1], then += a[2i] * b[2i] (each product
// of two bf16 values is exact in fp32; each add rounds).
SLIP_EMU __m512 _mm512_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  const slip_emu_v32h x = slip_emu_bits<slip_emu_v32h>(a), y = slip_emu_bits<slip_emu_v32h>(b);
  slip_emu_v16f r = (slip_emu_v16f)src;
  for (int i = 0; i < 16; ++i) {
    r[i] += slip_emu_bf16_to_float(x[2 * i + 1]) * slip_emu_bf16_to_float(y[2 * i + 1]);
    r[i] += slip_emu_bf16_to_float(x[2 * i]) * slip_emu_bf16_to_float(y[2 * i]);
  }
  return (__m512)r;
}

// Words 0-15 from b, 16-31 from a.
SLIP_EMU __m512bh _mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
  const slip_emu_v16f x = (slip_emu_v16f)a, y = (slip_emu_v16f)b;
  slip_emu_v32h r;
  for (int i = 0; i < 16; ++i) {
    r[i] = slip_emu_float_to_bf16(y[i]);
    r[16 + i] = slip_emu_float_to_bf16(x[i]);
  }
  return slip_emu_bits<__m512bh>(r);
}

SLIP_EMU __m256bh _mm512_cvtneps_pbh(__m512 a) {
  const slip_emu_v16f x = (slip_emu_v16f)a;
  slip_emu_v16h r;
  for (int i = 0; i < 16; ++i) r[i] = slip_emu_float_to_bf16(x[i]);
  return slip_emu_bits<__m256bh>(r);
}

// Masked 16-bit loads and stores touch the selected words only (as the
// hardware, which does not fault on the others).
SLIP_EMU __m256i _mm256_maskz_loadu_epi16(__mmask16 k, const void* p) {
  slip_emu_v16h r{};
  const uint16_t* src = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) r[i] = src[i];
  return (__m256i)r;
}

SLIP_EMU void _mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
  const slip_emu_v16h v = (slip_emu_v16h)a;
  uint16_t* dst = static_cast<uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) dst[i] = v[i];
}

SLIP_EMU void _mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
  const slip_emu_v16f v = (slip_emu_v16f)a;
  float* dst = static_cast<float*>(p);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) dst[i] = v[i];
}

#undef SLIP_EMU
