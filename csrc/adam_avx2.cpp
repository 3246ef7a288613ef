// AVX2 + FMA + F16C Adam/AdamW: 8 fp32 lanes per step, scalar reference for the tail.
// Compiled with -mavx2 -mfma -mf16c (setup.py); only called after dispatch.cpp has checked
// that the CPU and the OS support those instructions. Math: [Note: Adam math] in adam_scalar.h.
#include <immintrin.h>

#include "adam_common.h"
#include "adam_q8.h"
#include "adam_scalar.h"

namespace oz {
namespace {

constexpr int64_t kLanes = 8;

// 8 bf16 values widened to fp32 (exact).
inline __m256 bf16_to_f32_8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <DType G>
inline __m256 load_grad8(const void* grad, int64_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == DType::kBF16) {
    return bf16_to_f32_8(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i)));
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_cvtph_ps(h);
  }
}

// fp32 -> bf16, round to nearest even; NaN -> 0xFFFF (torch's vectorized conversion).
inline __m128i f32_to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_or_si256(rounded, _mm256_and_si256(is_nan, _mm256_set1_epi32(0xffff)));
  // Values are <= 0xFFFF, so unsigned saturation packs them unchanged.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// fp32 -> bf16 with stochastic rounding by r16 (each lane < 65536); NaN -> 0xFFFF. Same bits as
// f32_to_bf16_sr in adam_scalar.h.
inline __m128i f32_to_bf16_sr_8(__m256 x, __m256i r16) {
  const __m256i sum = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r16), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_or_si256(sum, _mm256_and_si256(is_nan, _mm256_set1_epi32(0xffff)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// fmix32 of adam_scalar.h, per lane.
inline __m256i fmix32_8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// sr_bits of adam_scalar.h for the 8 elements i..i+7 of the call under `key` (i % 8 == 0 and
// sr_offset % 64 == 0, so the upper index bits are one value for the whole vector).
inline __m256i sr_bits8(uint32_t key, const AdamHyper& h, int64_t i) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t gi = i + h.sr_offset;
  const uint32_t base = static_cast<uint32_t>(gi) + sr_key_hi(key, gi);
  return fmix32_8(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)), lane));
}

template <DType S>
inline __m256 load_state8(const void* state, int64_t i) {
  if constexpr (S == DType::kBF16) return load_grad8<DType::kBF16>(state, i);
  else return _mm256_loadu_ps(static_cast<const float*>(state) + i);
}

// Stores m and v; bf16 moments with the random bits of elements i..i+7 (sr_bits8). (Always
// inlined, as store_param8: GCC otherwise calls it once per vector from the update loops.)
template <DType S>
[[gnu::always_inline]] inline void store_moments8(const AdamBuffers& b, const AdamHyper& h,
                                                  int64_t i, __m256 m, __m256 v) {
  if constexpr (S == DType::kBF16) {
    const __m256i r = sr_bits8(h.sr_key, h, i);
    const __m128i m16 = f32_to_bf16_sr_8(m, _mm256_and_si256(r, _mm256_set1_epi32(0xffff)));
    const __m128i v16 = f32_to_bf16_sr_8(v, _mm256_srli_epi32(r, 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.exp_avg) + i), m16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.exp_avg_sq) + i), v16);
  } else {
    _mm256_storeu_ps(static_cast<float*>(b.exp_avg) + i, m);
    _mm256_storeu_ps(static_cast<float*>(b.exp_avg_sq) + i, v);
  }
}

template <bool kStream>
inline void store_ps(float* dst, __m256 x) {
  if constexpr (kStream) _mm256_stream_ps(dst, x); else _mm256_storeu_ps(dst, x);
}

template <DType O, bool kStream>
inline void store_out8(void* out, int64_t i, __m256 p) {
  if constexpr (O == DType::kF32) {
    store_ps<kStream>(static_cast<float*>(out) + i, p);
  } else if constexpr (O == DType::kBF16 || O == DType::kF16) {
    __m128i h;
    if constexpr (O == DType::kBF16) h = f32_to_bf16_8(p);
    else h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (kStream) _mm_stream_si128(dst, h); else _mm_storeu_si128(dst, h);
  }
}

template <DType P>
inline __m256 load_param8(const void* param, int64_t i) {
  if constexpr (P == DType::kBF16) return load_grad8<DType::kBF16>(param, i);
  else return _mm256_loadu_ps(static_cast<const float*>(param) + i);
}

// Stores the new weights of elements i..i+7 in param and out: bf16 weights rounded
// stochastically ([Note: bf16 master weights]), out then the stored value (a bf16 out the
// same 16 bits).
template <DType P, DType O, bool kStream>
[[gnu::always_inline]] inline void store_param8(const AdamBuffers& b, const AdamHyper& h,
                                                int64_t i, __m256 p) {
  if constexpr (P == DType::kBF16) {
    const __m256i r = sr_bits8(h.sr_key_param, h, i);
    const __m128i p16 = f32_to_bf16_sr_8(p, _mm256_and_si256(r, _mm256_set1_epi32(0xffff)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.param) + i), p16);
    if constexpr (O == DType::kBF16) {
      auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.out) + i);
      if constexpr (kStream) _mm_stream_si128(dst, p16); else _mm_storeu_si128(dst, p16);
    } else {
      store_out8<O, kStream>(b.out, i, bf16_to_f32_8(p16));
    }
  } else {
    _mm256_storeu_ps(static_cast<float*>(b.param) + i, p);
    store_out8<O, kStream>(b.out, i, p);
  }
}

// kStreams interleaved sub-ranges per loop: one core keeps several sequential read streams in
// flight (the hardware prefetcher follows each), which reads DRAM ~2x faster than one stream.
constexpr int64_t kStreams = 4;

// |g| as uint32 bits; the max over a range exceeds 0x7f7fffff iff some element is inf or nan.
template <DType G>
inline __m256i abs_bits(const AdamBuffers& b, const AdamHyper& h, int64_t i) {
  __m256 g = load_grad8<G>(b.grad, i);
  if (h.scale_grad) g = _mm256_mul_ps(g, _mm256_set1_ps(h.grad_scale));
  return _mm256_and_si256(_mm256_castps_si256(g), _mm256_set1_epi32(0x7fffffff));
}

template <DType G>
bool nonfinite_impl(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  const int64_t part = (end - begin) / (kStreams * kLanes) * kLanes;  // elements per stream
  for (int64_t j = 0; j < part; j += kLanes) {
    const int64_t i = begin + j;
    acc0 = _mm256_max_epu32(acc0, abs_bits<G>(b, h, i));
    acc1 = _mm256_max_epu32(acc1, abs_bits<G>(b, h, i + part));
    acc2 = _mm256_max_epu32(acc2, abs_bits<G>(b, h, i + 2 * part));
    acc3 = _mm256_max_epu32(acc3, abs_bits<G>(b, h, i + 3 * part));
  }
  int64_t i = begin + kStreams * part;
  __m256i acc = _mm256_max_epu32(_mm256_max_epu32(acc0, acc1), _mm256_max_epu32(acc2, acc3));
  for (; i + kLanes <= end; i += kLanes) acc = _mm256_max_epu32(acc, abs_bits<G>(b, h, i));
  const __m256i bad = _mm256_cmpgt_epi32(acc, _mm256_set1_epi32(0x7f7fffff));
  bool any = _mm256_movemask_epi8(bad) != 0;
  for (; i < end; ++i) any |= element_nonfinite(b, h, i);
  return any;
}

template <DType G, DType S, DType P, DType O, bool kStream>
bool update_impl(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const __m256 scale = _mm256_set1_ps(h.grad_scale);
  const __m256 l2_decay = _mm256_set1_ps(h.l2_decay);
  const __m256 decay_factor = _mm256_set1_ps(h.decay_factor);
  const __m256 lerp_coeff = _mm256_set1_ps(h.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(h.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(h.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(h.eps);
  const __m256 neg_step_size = _mm256_set1_ps(h.neg_step_size);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i seen = _mm256_setzero_si256();  // max |g| bits: > 0x7f7fffff iff some g is inf or nan
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m256 g = load_grad8<G>(b.grad, i);
    __m256 p = load_param8<P>(b.param, i);
    __m256 m = load_state8<S>(b.exp_avg, i);
    __m256 v = load_state8<S>(b.exp_avg_sq, i);
    if (h.scale_grad) g = _mm256_mul_ps(g, scale);
    seen = _mm256_max_epu32(seen, _mm256_and_si256(_mm256_castps_si256(g), abs_mask));
    if (h.l2) g = _mm256_fmadd_ps(p, l2_decay, g);
    if (h.decoupled) p = _mm256_mul_ps(p, decay_factor);
    m = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, m), h.lerp_small ? m : g);
    v = _mm256_mul_ps(v, beta2);
    v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, v);
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    store_param8<P, O, kStream>(b, h, i, p);
    store_moments8<S>(b, h, i, m, v);
  }
  bool bad = _mm256_movemask_epi8(_mm256_cmpgt_epi32(seen, _mm256_set1_epi32(0x7f7fffff))) != 0;
  for (; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);
    adam_element(b, h, i);
  }
  if constexpr (kStream) _mm_sfence();
  return bad;
}

// -- blockwise 8-bit moments ([Note: int8 moments] in adam_q8.h) ----------------------------

// The per-map constants of q8_encode (the 8 per-decade entries permuted by decade).
struct Q8Vec {
  __m256 thresh[7], a, b;
  __m256i base, lo, hi;
  explicit Q8Vec(const Q8Map& q)
      : a(_mm256_loadu_ps(q.a)), b(_mm256_loadu_ps(q.b)),
        base(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.base))),
        lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.lo))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.hi))) {
    for (int j = 0; j + 1 < q.bits; ++j) thresh[j] = _mm256_set1_ps(q.thresh[j]);
  }
};

inline __m256 abs8(__m256 x) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)));
}

// q8_encode of 8 lanes (u: the dither per lane); the codes as int32 lanes.
template <int kBits>
inline __m256i q8_encode8(const Q8Vec& c, int32_t top, __m256 x, float absmax, float inv,
                          __m256 u) {
  const __m256 ax = abs8(x);
  const __m256 r0 = _mm256_mul_ps(ax, _mm256_set1_ps(inv));
  const __m256 r = _mm256_min_ps(r0, _mm256_set1_ps(1.0f));  // (NaN -> 1, as std::fmin)
  __m256i z = _mm256_setzero_si256();
  for (int j = 0; j + 1 < kBits; ++j) {  // (a true compare is -1: subtracting counts it)
    z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(r, c.thresh[j], _CMP_LT_OQ)));
  }
  __m256 t = _mm256_fmadd_ps(r, _mm256_permutevar8x32_ps(c.a, z), _mm256_permutevar8x32_ps(c.b, z));
  t = _mm256_round_ps(_mm256_add_ps(t, u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-2.0f)), _mm256_set1_ps(256.0f));
  __m256i code = _mm256_add_epi32(_mm256_permutevar8x32_epi32(c.base, z), _mm256_cvttps_epi32(t));
  code = _mm256_max_epi32(code, _mm256_permutevar8x32_epi32(c.lo, z));
  code = _mm256_min_epi32(code, _mm256_permutevar8x32_epi32(c.hi, z));
  if (absmax > 0.0f) {
    const __m256i is_max = _mm256_castps_si256(_mm256_cmp_ps(ax, _mm256_set1_ps(absmax), _CMP_EQ_OQ));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(top), is_max);
  }
  if constexpr (kBits == 8) {
    const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(r0, _mm256_setzero_ps(), _CMP_GT_OQ));
    return _mm256_and_si256(code, pos);
  } else {
    const __m256i neg = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ)),
        _mm256_cmpgt_epi32(code, _mm256_setzero_si256()));
    return _mm256_or_si256(code, _mm256_and_si256(neg, _mm256_set1_epi32(0x80)));
  }
}

// The low byte of each of 8 int32 lanes, as 8 bytes.
inline void store_bytes8(uint8_t* dst, __m256i c) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i s = _mm256_shuffle_epi8(c, pick);
  const __m128i both = _mm_unpacklo_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), both);
}

inline __m256i load_codes8(const uint8_t* src) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline __m256 dither8(__m256i bits16) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(bits16), _mm256_set1_ps(1.0f / 65536.0f));
}

// One block [begin, end) (begin % kQ8Block == 0): q8_block of adam_q8.h, 8 lanes at a time.
// Returns the max |g| bits seen of the vector part (see update_impl).
template <DType G, DType P, DType O, bool kStream>
inline __m256i q8_block8(const AdamBuffers& b, const AdamHyper& h, const Q8Vec& qm,
                         const Q8Vec& qv, int64_t begin, int64_t end, __m256i seen) {
  const Q8Tables& t = q8_tables();
  const int64_t blk = begin / kQ8Block;
  uint8_t* mc = static_cast<uint8_t*>(b.exp_avg);
  uint8_t* vc = static_cast<uint8_t*>(b.exp_avg_sq);
  const float am = b.exp_avg_absmax[blk], av = b.exp_avg_sq_absmax[blk];
  alignas(32) float mnew[kQ8Block];
  alignas(32) float vnew[kQ8Block];
  const __m256 vam = _mm256_set1_ps(am), vav = _mm256_set1_ps(av);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256 maxm = _mm256_setzero_ps(), maxv = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m256 g = load_grad8<G>(b.grad, i);
    __m256 p = load_param8<P>(b.param, i);
    __m256 m = _mm256_mul_ps(vam, _mm256_i32gather_ps(t.m.value, load_codes8(mc + i), 4));
    __m256 v = _mm256_mul_ps(vav, _mm256_i32gather_ps(t.v.value, load_codes8(vc + i), 4));
    if (h.scale_grad) g = _mm256_mul_ps(g, _mm256_set1_ps(h.grad_scale));
    seen = _mm256_max_epu32(seen, _mm256_and_si256(_mm256_castps_si256(g), abs_mask));
    if (h.l2) g = _mm256_fmadd_ps(p, _mm256_set1_ps(h.l2_decay), g);
    if (h.decoupled) p = _mm256_mul_ps(p, _mm256_set1_ps(h.decay_factor));
    m = _mm256_fmadd_ps(_mm256_set1_ps(h.lerp_coeff), _mm256_sub_ps(g, m), h.lerp_small ? m : g);
    v = _mm256_mul_ps(v, _mm256_set1_ps(h.beta2));
    v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(h.one_minus_beta2), g), g, v);
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(h.eps));
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(h.neg_step_size), m), denom));
    store_param8<P, O, kStream>(b, h, i, p);
    _mm256_store_ps(mnew + (i - begin), m);
    _mm256_store_ps(vnew + (i - begin), v);
    maxm = _mm256_max_ps(maxm, abs8(m));
    maxv = _mm256_max_ps(maxv, abs8(v));
  }
  float mx_m = hmax8(maxm), mx_v = hmax8(maxv);
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
    const __m256i r = sr_bits8(h.sr_key, h, i);
    store_bytes8(mc + i, q8_encode8<7>(qm, t.m.top, _mm256_load_ps(mnew + (i - begin)), mx_m, im,
                                       dither8(_mm256_and_si256(r, _mm256_set1_epi32(0xffff)))));
    store_bytes8(vc + i, q8_encode8<8>(qv, t.v.top, _mm256_load_ps(vnew + (i - begin)), mx_v, iv,
                                       dither8(_mm256_srli_epi32(r, 16))));
  }
  for (; i < end; ++i) {
    const uint32_t r = sr_bits(h.sr_key, i + h.sr_offset);
    mc[i] = q8_encode(t.m, mnew[i - begin], mx_m, im, q8_dither(r & 0xffffu, true));
    vc[i] = q8_encode(t.v, vnew[i - begin], mx_v, iv, q8_dither(r >> 16, true));
  }
  return seen;
}

template <DType G, DType P, DType O, bool kStream>
bool q8_update_impl(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const Q8Tables& t = q8_tables();
  const Q8Vec qm(t.m), qv(t.v);
  __m256i seen = _mm256_setzero_si256();
  for (int64_t i = begin; i < end; i += kQ8Block) {
    const int64_t e = i + kQ8Block < end ? i + kQ8Block : end;
    seen = q8_block8<G, P, O, kStream>(b, h, qm, qv, i, e, seen);
  }
  bool bad = _mm256_movemask_epi8(_mm256_cmpgt_epi32(seen, _mm256_set1_epi32(0x7f7fffff))) != 0;
  for (int64_t i = begin + (end - begin) / kLanes * kLanes; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);  // (the lanes the vector loops left to the tail)
  }
  if constexpr (kStream) _mm_sfence();
  return bad;
}

template <DType G, DType P>
bool q8_update_out(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool streaming) {
  const bool s = streaming;
  switch (b.out_dtype) {
    case DType::kF32:
      return s ? q8_update_impl<G, P, DType::kF32, true>(b, h, begin, end)
               : q8_update_impl<G, P, DType::kF32, false>(b, h, begin, end);
    case DType::kBF16:
      return s ? q8_update_impl<G, P, DType::kBF16, true>(b, h, begin, end)
               : q8_update_impl<G, P, DType::kBF16, false>(b, h, begin, end);
    case DType::kF16:
      return s ? q8_update_impl<G, P, DType::kF16, true>(b, h, begin, end)
               : q8_update_impl<G, P, DType::kF16, false>(b, h, begin, end);
    default: return q8_update_impl<G, P, DType::kNone, false>(b, h, begin, end);
  }
}

template <DType G, DType S, DType P, DType O>
bool update_stream(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool streaming) {
  if (streaming) return update_impl<G, S, P, O, true>(b, h, begin, end);
  return update_impl<G, S, P, O, false>(b, h, begin, end);
}

template <DType G, DType S, DType P>
bool update_out(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                bool streaming) {
  switch (b.out_dtype) {
    case DType::kF32: return update_stream<G, S, P, DType::kF32>(b, h, begin, end, streaming);
    case DType::kBF16: return update_stream<G, S, P, DType::kBF16>(b, h, begin, end, streaming);
    case DType::kF16: return update_stream<G, S, P, DType::kF16>(b, h, begin, end, streaming);
    default: return update_stream<G, S, P, DType::kNone>(b, h, begin, end, streaming);
  }
}

template <DType G, DType P>
bool update_state(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                  bool streaming) {
  if (b.state_dtype == DType::kBF16) {
    return update_out<G, DType::kBF16, P>(b, h, begin, end, streaming);
  }
  if (b.state_dtype == DType::kQ8) return q8_update_out<G, P>(b, h, begin, end, streaming);
  return update_out<G, DType::kF32, P>(b, h, begin, end, streaming);
}

template <DType G>
bool update_param(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                  bool streaming) {
  if (b.param_dtype == DType::kBF16) {
    return update_state<G, DType::kBF16>(b, h, begin, end, streaming);
  }
  return update_state<G, DType::kF32>(b, h, begin, end, streaming);
}

bool avx2_update(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                 bool streaming) {
  switch (b.grad_dtype) {
    case DType::kBF16: return update_param<DType::kBF16>(b, h, begin, end, streaming);
    case DType::kF16: return update_param<DType::kF16>(b, h, begin, end, streaming);
    default: return update_param<DType::kF32>(b, h, begin, end, streaming);
  }
}

bool avx2_has_nonfinite(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case DType::kBF16: return nonfinite_impl<DType::kBF16>(b, h, begin, end);
    case DType::kF16: return nonfinite_impl<DType::kF16>(b, h, begin, end);
    default: return nonfinite_impl<DType::kF32>(b, h, begin, end);
  }
}

}  // namespace

const AdamKernels& avx2_kernels() {
  static const AdamKernels k{"avx2", &avx2_has_nonfinite, &avx2_update};
  return k;
}

}  // namespace oz
