// AVX2 + FMA + F16C Adam/AdamW: 8 fp32 lanes per step, scalar reference for the tail.
// Compiled with -mavx2 -mfma -mf16c (setup.py); only called after dispatch.cpp has checked
// that the CPU and the OS support those instructions. Math: [Note: Adam math] in adam_scalar.h.
#include <immintrin.h>

#include "adam_common.h"
#include "adam_scalar.h"

namespace oz {
namespace {

constexpr int64_t kLanes = 8;

template <DType G>
inline __m256 load_grad8(const void* grad, int64_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == DType::kBF16) {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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

template <DType S>
inline __m256 load_state8(const void* state, int64_t i) {
  if constexpr (S == DType::kBF16) return load_grad8<DType::kBF16>(state, i);
  else return _mm256_loadu_ps(static_cast<const float*>(state) + i);
}

// Stores m and v; for bf16 moments with the random bits of elements i..i+7 (i % 8 == 0, so
// the upper index bits are one value for the whole vector).
template <DType S>
inline void store_moments8(const AdamBuffers& b, const AdamHyper& h, int64_t i, __m256 m,
                           __m256 v) {
  if constexpr (S == DType::kBF16) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t gi = i + h.sr_offset;  // (sr_offset % 64 == 0: gi % 8 == 0 too)
    const uint32_t base = static_cast<uint32_t>(gi) + sr_key_hi(h.sr_key, gi);
    const __m256i r = fmix32_8(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)), lane));
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

template <DType G, DType S, DType O, bool kStream>
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
    __m256 p = _mm256_loadu_ps(b.param + i);
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
    _mm256_storeu_ps(b.param + i, p);
    store_moments8<S>(b, h, i, m, v);
    store_out8<O, kStream>(b.out, i, p);
  }
  bool bad = _mm256_movemask_epi8(_mm256_cmpgt_epi32(seen, _mm256_set1_epi32(0x7f7fffff))) != 0;
  for (; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);
    adam_element(b, h, i);
  }
  if constexpr (kStream) _mm_sfence();
  return bad;
}

template <DType G, DType S, DType O>
bool update_stream(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool streaming) {
  if (streaming) return update_impl<G, S, O, true>(b, h, begin, end);
  return update_impl<G, S, O, false>(b, h, begin, end);
}

template <DType G, DType S>
bool update_out(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                bool streaming) {
  switch (b.out_dtype) {
    case DType::kF32: return update_stream<G, S, DType::kF32>(b, h, begin, end, streaming);
    case DType::kBF16: return update_stream<G, S, DType::kBF16>(b, h, begin, end, streaming);
    case DType::kF16: return update_stream<G, S, DType::kF16>(b, h, begin, end, streaming);
    default: return update_stream<G, S, DType::kNone>(b, h, begin, end, streaming);
  }
}

template <DType G>
bool update_state(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                  bool streaming) {
  if (b.state_dtype == DType::kBF16) {
    return update_out<G, DType::kBF16>(b, h, begin, end, streaming);
  }
  return update_out<G, DType::kF32>(b, h, begin, end, streaming);
}

bool avx2_update(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                 bool streaming) {
  switch (b.grad_dtype) {
    case DType::kBF16: return update_state<DType::kBF16>(b, h, begin, end, streaming);
    case DType::kF16: return update_state<DType::kF16>(b, h, begin, end, streaming);
    default: return update_state<DType::kF32>(b, h, begin, end, streaming);
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
