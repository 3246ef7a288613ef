// AVX-512 Adam/AdamW: 16 fp32 lanes per step, scalar reference for the tail.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c
// (setup.py); only called after dispatch.cpp has checked CPU and OS support. The bf16 output
// uses AVX512-BF16 vcvtneps2bf16 only in the variant dispatch.cpp selects when the CPU has it;
// the other variant rounds with integer ops. Math: [Note: Adam math] in adam_scalar.h.
// GCC 12 warns about its own _mm512_undefined_* helpers when they are inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "adam_common.h"
#include "adam_q8.h"
#include "adam_scalar.h"

namespace oz {
namespace {

constexpr int64_t kLanes = 16;

// 16 bf16 values widened to fp32 (exact).
inline __m512 bf16_to_f32_16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <DType G>
inline __m512 load_grad16(const void* grad, int64_t i) {
  if constexpr (G == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == DType::kBF16) {
      return bf16_to_f32_16(h);
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// fp32 -> bf16, round to nearest even, NaN -> 0xFFFF: the bits torch's vectorized conversion
// produces. vcvtneps2bf16 rounds the same way for normal numbers but flushes denormal inputs
// and keeps NaN payloads, so lanes holding those take the integer path.
template <bool kBf16Insn>
inline __m256i f32_to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  if constexpr (kBf16Insn) {
    const __mmask16 denormal = _mm512_cmplt_epu32_mask(
        _mm512_sub_epi32(abs, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fffff));
    if ((nan | denormal) == 0) return (__m256i)_mm512_cvtneps_pbh(x);
  }
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff));
  return _mm512_cvtepi32_epi16(r);
}

// fp32 -> bf16 with stochastic rounding by r16 (each lane < 65536); NaN -> 0xFFFF. Same bits as
// f32_to_bf16_sr in adam_scalar.h.
inline __m256i f32_to_bf16_sr_16(__m512 x, __m512i r16) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, r16), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff));
  return _mm512_cvtepi32_epi16(r);
}

// fmix32 of adam_scalar.h, per lane.
inline __m512i fmix32_16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// sr_bits of adam_scalar.h for the 16 elements i..i+15 of the call under `key` (i % 16 == 0
// and sr_offset % 64 == 0, so the upper index bits are one value for the whole vector).
inline __m512i sr_bits16(uint32_t key, const AdamHyper& h, int64_t i) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t gi = i + h.sr_offset;
  const uint32_t base = static_cast<uint32_t>(gi) + sr_key_hi(key, gi);
  return fmix32_16(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base)), lane));
}

template <DType S>
inline __m512 load_state16(const void* state, int64_t i) {
  if constexpr (S == DType::kBF16) return load_grad16<DType::kBF16>(state, i);
  else return _mm512_loadu_ps(static_cast<const float*>(state) + i);
}

// Stores m and v; bf16 moments with the random bits of elements i..i+15 (sr_bits16). (Always
// inlined, as store_param16: GCC otherwise calls it once per vector from the update loops.)
template <DType S>
[[gnu::always_inline]] inline void store_moments16(const AdamBuffers& b, const AdamHyper& h,
                                                   int64_t i, __m512 m, __m512 v) {
  if constexpr (S == DType::kBF16) {
    const __m512i r = sr_bits16(h.sr_key, h, i);
    const __m256i m16 = f32_to_bf16_sr_16(m, _mm512_and_si512(r, _mm512_set1_epi32(0xffff)));
    const __m256i v16 = f32_to_bf16_sr_16(v, _mm512_srli_epi32(r, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.exp_avg) + i), m16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.exp_avg_sq) + i), v16);
  } else {
    _mm512_storeu_ps(static_cast<float*>(b.exp_avg) + i, m);
    _mm512_storeu_ps(static_cast<float*>(b.exp_avg_sq) + i, v);
  }
}

template <DType O, bool kStream, bool kBf16Insn>
inline void store_out16(void* out, int64_t i, __m512 p) {
  if constexpr (O == DType::kF32) {
    float* dst = static_cast<float*>(out) + i;
    if constexpr (kStream) _mm512_stream_ps(dst, p); else _mm512_storeu_ps(dst, p);
  } else if constexpr (O == DType::kBF16 || O == DType::kF16) {
    __m256i h;
    if constexpr (O == DType::kBF16) h = f32_to_bf16_16<kBf16Insn>(p);
    else h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (kStream) _mm256_stream_si256(dst, h); else _mm256_storeu_si256(dst, h);
  }
}

template <DType P>
inline __m512 load_param16(const void* param, int64_t i) {
  if constexpr (P == DType::kBF16) return load_grad16<DType::kBF16>(param, i);
  else return _mm512_loadu_ps(static_cast<const float*>(param) + i);
}

// Stores the new weights of elements i..i+15 in param and out: bf16 weights rounded
// stochastically ([Note: bf16 master weights]), out then the stored value (a bf16 out the
// same 16 bits).
template <DType P, DType O, bool kStream, bool kBf16Insn>
[[gnu::always_inline]] inline void store_param16(const AdamBuffers& b, const AdamHyper& h,
                                                 int64_t i, __m512 p) {
  if constexpr (P == DType::kBF16) {
    const __m512i r = sr_bits16(h.sr_key_param, h, i);
    const __m256i p16 = f32_to_bf16_sr_16(p, _mm512_and_si512(r, _mm512_set1_epi32(0xffff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.param) + i), p16);
    if constexpr (O == DType::kBF16) {
      auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.out) + i);
      if constexpr (kStream) _mm256_stream_si256(dst, p16); else _mm256_storeu_si256(dst, p16);
    } else {
      store_out16<O, kStream, kBf16Insn>(b.out, i, bf16_to_f32_16(p16));
    }
  } else {
    _mm512_storeu_ps(static_cast<float*>(b.param) + i, p);
    store_out16<O, kStream, kBf16Insn>(b.out, i, p);
  }
}

// kStreams interleaved sub-ranges per loop: one core keeps several sequential read streams in
// flight (the hardware prefetcher follows each), which reads DRAM ~2x faster than one stream.
constexpr int64_t kStreams = 4;

// |g| as uint32 bits; the max over a range exceeds 0x7f7fffff iff some element is inf or nan.
template <DType G>
inline __m512i abs_bits(const AdamBuffers& b, const AdamHyper& h, int64_t i) {
  __m512 g = load_grad16<G>(b.grad, i);
  if (h.scale_grad) g = _mm512_mul_ps(g, _mm512_set1_ps(h.grad_scale));
  return _mm512_and_si512(_mm512_castps_si512(g), _mm512_set1_epi32(0x7fffffff));
}

template <DType G>
bool nonfinite_impl(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  const int64_t part = (end - begin) / (kStreams * kLanes) * kLanes;  // elements per stream
  for (int64_t j = 0; j < part; j += kLanes) {
    const int64_t i = begin + j;
    acc0 = _mm512_max_epu32(acc0, abs_bits<G>(b, h, i));
    acc1 = _mm512_max_epu32(acc1, abs_bits<G>(b, h, i + part));
    acc2 = _mm512_max_epu32(acc2, abs_bits<G>(b, h, i + 2 * part));
    acc3 = _mm512_max_epu32(acc3, abs_bits<G>(b, h, i + 3 * part));
  }
  int64_t i = begin + kStreams * part;
  __m512i acc = _mm512_max_epu32(_mm512_max_epu32(acc0, acc1), _mm512_max_epu32(acc2, acc3));
  for (; i + kLanes <= end; i += kLanes) acc = _mm512_max_epu32(acc, abs_bits<G>(b, h, i));
  bool any = _mm512_cmpgt_epu32_mask(acc, _mm512_set1_epi32(0x7f7fffff)) != 0;
  for (; i < end; ++i) any |= element_nonfinite(b, h, i);
  return any;
}

template <DType G, DType S, DType P, DType O, bool kStream, bool kBf16Insn>
bool update_impl(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const __m512 scale = _mm512_set1_ps(h.grad_scale);
  const __m512 l2_decay = _mm512_set1_ps(h.l2_decay);
  const __m512 decay_factor = _mm512_set1_ps(h.decay_factor);
  const __m512 lerp_coeff = _mm512_set1_ps(h.lerp_coeff);
  const __m512 beta2 = _mm512_set1_ps(h.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(h.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(h.eps);
  const __m512 neg_step_size = _mm512_set1_ps(h.neg_step_size);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i seen = _mm512_setzero_si512();  // max |g| bits: > 0x7f7fffff iff some g is inf or nan
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m512 g = load_grad16<G>(b.grad, i);
    __m512 p = load_param16<P>(b.param, i);
    __m512 m = load_state16<S>(b.exp_avg, i);
    __m512 v = load_state16<S>(b.exp_avg_sq, i);
    if (h.scale_grad) g = _mm512_mul_ps(g, scale);
    seen = _mm512_max_epu32(seen, _mm512_and_si512(_mm512_castps_si512(g), abs_mask));
    if (h.l2) g = _mm512_fmadd_ps(p, l2_decay, g);
    if (h.decoupled) p = _mm512_mul_ps(p, decay_factor);
    m = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(g, m), h.lerp_small ? m : g);
    v = _mm512_mul_ps(v, beta2);
    v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, v);
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    store_param16<P, O, kStream, kBf16Insn>(b, h, i, p);
    store_moments16<S>(b, h, i, m, v);
  }
  bool bad = _mm512_cmpgt_epu32_mask(seen, _mm512_set1_epi32(0x7f7fffff)) != 0;
  for (; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);
    adam_element(b, h, i);
  }
  if constexpr (kStream) _mm_sfence();
  return bad;
}

// -- blockwise 8-bit moments ([Note: int8 moments] in adam_q8.h) ----------------------------

// The 8 per-decade entries of a table as the low half of a vector, for permutexvar by decade.
inline __m512 table8_ps(const float* t) { return _mm512_zextps256_ps512(_mm256_loadu_ps(t)); }
inline __m512i table8_epi32(const int32_t* t) {
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
}

// The per-map constants of q8_encode. The decade z = #{j : r < thresh[j]} is found from r's
// binary exponent: r in [2^-i, 2^(1-i)) (i = 0..31; i = 31 also for every smaller r) is below
// every threshold >= 2^(1-i), above every one <= 2^-i, and at most one threshold lies between
// (they are a factor 10 apart): z = below[i] + (r < between[i]), between[i] = 0 without one
// (thresholds are >= 1e-7 > 2^-30: the smallest octaves have none).
struct Q8Vec {
  __m512 a, b, between_lo, between_hi;
  __m512i base, lo, hi, below_lo, below_hi;
  explicit Q8Vec(const Q8Map& q)
      : a(table8_ps(q.a)), b(table8_ps(q.b)), base(table8_epi32(q.base)),
        lo(table8_epi32(q.lo)), hi(table8_epi32(q.hi)) {
    alignas(64) int32_t below[32];
    alignas(64) float between[32];
    for (int i = 0; i < 32; ++i) {
      const float bottom = std::ldexp(1.0f, -i), top = std::ldexp(1.0f, 1 - i);
      below[i] = 0;
      between[i] = 0.0f;
      for (int j = 0; j + 1 < q.bits; ++j) {
        if (q.thresh[j] >= top) ++below[i];
        else if (q.thresh[j] > bottom) between[i] = q.thresh[j];
      }
    }
    below_lo = _mm512_load_si512(below);
    below_hi = _mm512_load_si512(below + 16);
    between_lo = _mm512_load_ps(between);
    between_hi = _mm512_load_ps(between + 16);
  }
};

// A map's 256 decoded values (Q8Map::value) in 16 registers: value[code] of 16 lanes by
// permutes, not a gather (a gather of 16 lanes costs more than this whole lookup).
struct Q8Values {
  __m512 t[16];
  explicit Q8Values(const Q8Map& q) {
    for (int k = 0; k < 16; ++k) t[k] = _mm512_loadu_ps(q.value + 16 * k);
  }
  // value[code & 0x7f] (a code's bits 0-4 pick one of 32 values, bits 5-6 one of 4 such)
  inline __m512 low128(__m512i code) const {
    const __mmask16 b5 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(64));
    const __m512 r0 = _mm512_permutex2var_ps(t[0], code, t[1]);
    const __m512 r1 = _mm512_permutex2var_ps(t[2], code, t[3]);
    const __m512 r2 = _mm512_permutex2var_ps(t[4], code, t[5]);
    const __m512 r3 = _mm512_permutex2var_ps(t[6], code, t[7]);
    return _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r0, r1),
                                _mm512_mask_blend_ps(b5, r2, r3));
  }
  // value[code] of the signed map (exp_avg): value[sign << 7 | mag] is -value[mag], but
  // value[0x80] is +0, as value[0]
  inline __m512 signed_lookup(__m512i code) const {
    const __mmask16 neg = _mm512_test_epi32_mask(code, _mm512_set1_epi32(0x80)) &
                          _mm512_test_epi32_mask(code, _mm512_set1_epi32(0x7f));
    const __m512i mag = _mm512_castps_si512(low128(code));
    return _mm512_castsi512_ps(
        _mm512_mask_xor_epi32(mag, neg, mag, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  // value[code] for codes 0..255 (int32 lanes)
  inline __m512 lookup(__m512i code) const {
    const __mmask16 b5 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(128));
    __m512 r[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm512_permutex2var_ps(t[2 * k], code, t[2 * k + 1]);
    const __m512 s0 = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[0], r[1]),
                                           _mm512_mask_blend_ps(b5, r[2], r[3]));
    const __m512 s1 = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[4], r[5]),
                                           _mm512_mask_blend_ps(b5, r[6], r[7]));
    return _mm512_mask_blend_ps(b7, s0, s1);
  }
};

// q8_encode of 16 lanes (u: the dither per lane); the codes as int32 lanes.
template <int kBits>
inline __m512i q8_encode16(const Q8Vec& c, int32_t top, __m512 x, float absmax, float inv,
                           __m512 u) {
  const __m512 ax = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
  const __m512 r0 = _mm512_mul_ps(ax, _mm512_set1_ps(inv));
  const __m512 r = _mm512_min_ps(r0, _mm512_set1_ps(1.0f));  // (NaN -> 1, as std::fmin)
  // i = -(r's exponent), clamped to 31 (r = 0: getexp gives -inf)
  const __m512 e = _mm512_max_ps(_mm512_getexp_ps(r), _mm512_set1_ps(-31.0f));
  const __m512i i = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_setzero_ps(), e));
  __m512i z = _mm512_permutex2var_epi32(c.below_lo, i, c.below_hi);
  const __mmask16 under = _mm512_cmp_ps_mask(
      r, _mm512_permutex2var_ps(c.between_lo, i, c.between_hi), _CMP_LT_OQ);
  z = _mm512_mask_add_epi32(z, under, z, _mm512_set1_epi32(1));
  __m512 t = _mm512_fmadd_ps(r, _mm512_permutexvar_ps(z, c.a), _mm512_permutexvar_ps(z, c.b));
  t = _mm512_roundscale_ps(_mm512_add_ps(t, u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-2.0f)), _mm512_set1_ps(256.0f));
  __m512i code = _mm512_add_epi32(_mm512_permutexvar_epi32(z, c.base), _mm512_cvttps_epi32(t));
  code = _mm512_max_epi32(code, _mm512_permutexvar_epi32(z, c.lo));
  code = _mm512_min_epi32(code, _mm512_permutexvar_epi32(z, c.hi));
  if (absmax > 0.0f) {
    const __mmask16 is_max = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(absmax), _CMP_EQ_OQ);
    code = _mm512_mask_mov_epi32(code, is_max, _mm512_set1_epi32(top));
  }
  if constexpr (kBits == 8) {
    const __mmask16 pos = _mm512_cmp_ps_mask(r0, _mm512_setzero_ps(), _CMP_GT_OQ);
    return _mm512_maskz_mov_epi32(pos, code);
  } else {
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) &
                          _mm512_cmpgt_epi32_mask(code, _mm512_setzero_si512());
    return _mm512_mask_or_epi32(code, neg, code, _mm512_set1_epi32(0x80));
  }
}

inline __m512 dither16(__m512i bits16) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(bits16), _mm512_set1_ps(1.0f / 65536.0f));
}

// One block [begin, end) (begin % kQ8Block == 0): q8_block of adam_q8.h, 16 lanes at a time.
// Returns the max |g| bits seen (> 0x7f7fffff iff some g is inf or nan) of the vector part.
template <DType G, DType P, DType O, bool kStream, bool kBf16Insn>
inline __m512i q8_block16(const AdamBuffers& b, const AdamHyper& h, const Q8Vec& qm,
                          const Q8Vec& qv, const Q8Values& lm, const Q8Values& lv,
                          int64_t begin, int64_t end, __m512i seen) {
  const Q8Tables& t = q8_tables();
  const int64_t blk = begin / kQ8Block;
  uint8_t* mc = static_cast<uint8_t*>(b.exp_avg);
  uint8_t* vc = static_cast<uint8_t*>(b.exp_avg_sq);
  const float am = b.exp_avg_absmax[blk], av = b.exp_avg_sq_absmax[blk];
  alignas(64) float mnew[kQ8Block];
  alignas(64) float vnew[kQ8Block];
  const __m512 vam = _mm512_set1_ps(am), vav = _mm512_set1_ps(av);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512 maxm = _mm512_setzero_ps(), maxv = _mm512_setzero_ps();
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m512 g = load_grad16<G>(b.grad, i);
    __m512 p = load_param16<P>(b.param, i);
    const __m128i cm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mc + i));
    const __m128i cv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vc + i));
    __m512 m = _mm512_mul_ps(vam, lm.signed_lookup(_mm512_cvtepu8_epi32(cm)));
    __m512 v = _mm512_mul_ps(vav, lv.lookup(_mm512_cvtepu8_epi32(cv)));
    if (h.scale_grad) g = _mm512_mul_ps(g, _mm512_set1_ps(h.grad_scale));
    seen = _mm512_max_epu32(seen, _mm512_and_si512(_mm512_castps_si512(g), abs_mask));
    if (h.l2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(h.l2_decay), g);
    if (h.decoupled) p = _mm512_mul_ps(p, _mm512_set1_ps(h.decay_factor));
    m = _mm512_fmadd_ps(_mm512_set1_ps(h.lerp_coeff), _mm512_sub_ps(g, m), h.lerp_small ? m : g);
    v = _mm512_mul_ps(v, _mm512_set1_ps(h.beta2));
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(h.one_minus_beta2), g), g, v);
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(h.eps));
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(h.neg_step_size), m), denom));
    store_param16<P, O, kStream, kBf16Insn>(b, h, i, p);
    _mm512_store_ps(mnew + (i - begin), m);
    _mm512_store_ps(vnew + (i - begin), v);
    maxm = _mm512_max_ps(maxm, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m), abs_mask)));
    maxv = _mm512_max_ps(maxv, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask)));
  }
  float mx_m = _mm512_reduce_max_ps(maxm), mx_v = _mm512_reduce_max_ps(maxv);
  for (int64_t j = i; j < end; ++j) {  // (the last block of a call only)
    float g = load_grad_scalar(b.grad, b.grad_dtype, j);
    float p = load_param_scalar(b, j);
    float m = q8_decode(t.m, mc[j], am);
    float v = q8_decode(t.v, vc[j], av);
    adam_math(h, g, p, m, v);
    store_param_scalar(b, h, j, p);
    mnew[j - begin] = m;
    vnew[j - begin] = v;
    mx_m = std::fmax(mx_m, std::fabs(m));
    mx_v = std::fmax(mx_v, std::fabs(v));
  }
  b.exp_avg_absmax[blk] = mx_m;
  b.exp_avg_sq_absmax[blk] = mx_v;
  const float im = q8_inverse(mx_m), iv = q8_inverse(mx_v);
  for (i = begin; i + kLanes <= end; i += kLanes) {
    const __m512i r = sr_bits16(h.sr_key, h, i);
    const __m512i m8 = q8_encode16<7>(qm, t.m.top, _mm512_load_ps(mnew + (i - begin)), mx_m, im,
                                      dither16(_mm512_and_si512(r, _mm512_set1_epi32(0xffff))));
    const __m512i v8 = q8_encode16<8>(qv, t.v.top, _mm512_load_ps(vnew + (i - begin)), mx_v, iv,
                                      dither16(_mm512_srli_epi32(r, 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mc + i), _mm512_cvtepi32_epi8(m8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vc + i), _mm512_cvtepi32_epi8(v8));
  }
  for (; i < end; ++i) {
    const uint32_t r = sr_bits(h.sr_key, i + h.sr_offset);
    mc[i] = q8_encode(t.m, mnew[i - begin], mx_m, im, q8_dither(r & 0xffffu, true));
    vc[i] = q8_encode(t.v, vnew[i - begin], mx_v, iv, q8_dither(r >> 16, true));
  }
  return seen;
}

template <DType G, DType P, DType O, bool kStream, bool kBf16Insn>
bool q8_update_impl(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const Q8Tables& t = q8_tables();
  const Q8Vec qm(t.m), qv(t.v);
  const Q8Values lm(t.m), lv(t.v);
  __m512i seen = _mm512_setzero_si512();
  for (int64_t i = begin; i < end; i += kQ8Block) {
    const int64_t e = i + kQ8Block < end ? i + kQ8Block : end;
    seen = q8_block16<G, P, O, kStream, kBf16Insn>(b, h, qm, qv, lm, lv, i, e, seen);
  }
  bool bad = _mm512_cmpgt_epu32_mask(seen, _mm512_set1_epi32(0x7f7fffff)) != 0;
  for (int64_t i = begin + (end - begin) / kLanes * kLanes; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);  // (the lanes the vector loops left to the tail)
  }
  if constexpr (kStream) _mm_sfence();
  return bad;
}

template <DType G, DType P, bool kI>
bool q8_update_out(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool streaming) {
  const bool s = streaming;
  switch (b.out_dtype) {
    case DType::kF32:
      return s ? q8_update_impl<G, P, DType::kF32, true, kI>(b, h, begin, end)
               : q8_update_impl<G, P, DType::kF32, false, kI>(b, h, begin, end);
    case DType::kBF16:
      return s ? q8_update_impl<G, P, DType::kBF16, true, kI>(b, h, begin, end)
               : q8_update_impl<G, P, DType::kBF16, false, kI>(b, h, begin, end);
    case DType::kF16:
      return s ? q8_update_impl<G, P, DType::kF16, true, kI>(b, h, begin, end)
               : q8_update_impl<G, P, DType::kF16, false, kI>(b, h, begin, end);
    default: return q8_update_impl<G, P, DType::kNone, false, kI>(b, h, begin, end);
  }
}

template <DType G, DType S, DType P, DType O, bool kI>
bool update_stream(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool streaming) {
  if (streaming) return update_impl<G, S, P, O, true, kI>(b, h, begin, end);
  return update_impl<G, S, P, O, false, kI>(b, h, begin, end);
}

template <DType G, DType S, DType P, bool kI>
bool update_out(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                bool streaming) {
  switch (b.out_dtype) {
    case DType::kF32: return update_stream<G, S, P, DType::kF32, kI>(b, h, begin, end, streaming);
    case DType::kBF16: return update_stream<G, S, P, DType::kBF16, kI>(b, h, begin, end, streaming);
    case DType::kF16: return update_stream<G, S, P, DType::kF16, kI>(b, h, begin, end, streaming);
    default: return update_stream<G, S, P, DType::kNone, kI>(b, h, begin, end, streaming);
  }
}

template <DType G, DType P, bool kI>
bool update_state(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                  bool streaming) {
  if (b.state_dtype == DType::kBF16) {
    return update_out<G, DType::kBF16, P, kI>(b, h, begin, end, streaming);
  }
  if (b.state_dtype == DType::kQ8) return q8_update_out<G, P, kI>(b, h, begin, end, streaming);
  return update_out<G, DType::kF32, P, kI>(b, h, begin, end, streaming);
}

template <DType G, bool kI>
bool update_param(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                  bool streaming) {
  if (b.param_dtype == DType::kBF16) {
    return update_state<G, DType::kBF16, kI>(b, h, begin, end, streaming);
  }
  return update_state<G, DType::kF32, kI>(b, h, begin, end, streaming);
}

template <bool kBf16Insn>
bool avx512_update(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool streaming) {
  switch (b.grad_dtype) {
    case DType::kBF16: return update_param<DType::kBF16, kBf16Insn>(b, h, begin, end, streaming);
    case DType::kF16: return update_param<DType::kF16, kBf16Insn>(b, h, begin, end, streaming);
    default: return update_param<DType::kF32, kBf16Insn>(b, h, begin, end, streaming);
  }
}

bool avx512_has_nonfinite(const AdamBuffers& b, const AdamHyper& h, int64_t begin,
                          int64_t end) {
  switch (b.grad_dtype) {
    case DType::kBF16: return nonfinite_impl<DType::kBF16>(b, h, begin, end);
    case DType::kF16: return nonfinite_impl<DType::kF16>(b, h, begin, end);
    default: return nonfinite_impl<DType::kF32>(b, h, begin, end);
  }
}

}  // namespace

const AdamKernels& avx512_kernels(bool has_bf16_insn) {
  static const AdamKernels with_insn{"avx512", &avx512_has_nonfinite, &avx512_update<true>};
  static const AdamKernels without_insn{"avx512", &avx512_has_nonfinite, &avx512_update<false>};
  return has_bf16_insn ? with_insn : without_insn;
}

}  // namespace oz
