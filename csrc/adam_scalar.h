// Scalar reference of one Adam/AdamW element, plus the fp16/bf16 conversions.
//
// This header is included by every instruction-set translation unit: the scalar TU loops over
// it, the SIMD TUs use it for the tail that does not fill a vector. Everything here has
// internal linkage (anonymous namespace) so that each TU keeps the copy compiled with its own
// flags and the linker can never hand the AVX-512 copy to the scalar path.
//
// [Note: Adam math]
// We follow torch/optim/adam.py `_single_tensor_adam` (non-capturable) operation by operation
// up to the denominator, with each Python double reduced to float exactly as torch does when
// it passes a Python scalar into a float32 kernel:
//   g  = grad * grad_scale                          (only when grad_scale != 1)
//   g  = fma(param, wd, g)                          Adam, L2:   grad.add(param, alpha=wd)
//   p  = p * (1 - lr*wd)                            AdamW:      param.mul_(1 - lr*wd)
//   m  = fma(c, g - m, m)   (c = 1-beta1 < 0.5)     exp_avg.lerp_(grad, 1-beta1)
//      = fma(c - 1, g - m, g) otherwise
//   v  = v * beta2;  v = fma((1-beta2) * g, g, v)   exp_avg_sq.mul_(beta2).addcmul_(g, g, 1-beta2)
//   d  = sqrt(v) + eps * s2                         s2 = sqrt(1 - beta2^t), in double
//   p  = p + (-(lr / (1 - beta1^t)) * s2 * m) / d   param.addcdiv_(exp_avg, denom, -step_size)
// (Kingma & Ba 2015, "Adam"; Loshchilov & Hutter 2019, "Decoupled Weight Decay
// Regularization".) torch computes d = sqrt(v) / s2 + eps: the same number, scaled by s2
// here, which saves one division per element. Division and sqrt share one slow unit per core,
// and with torch's order they bounded the kernel (~1.5 ns/element with the data in L2;
// ~0.5 ns with this order). The weight then differs from torch's by the rounding of one
// multiply-divide (a few ulps of the step, far below the 1e-6 * max(1, |w|) the tests allow);
// m and v are torch's bits, and without bias correction s2 = 1 and every op is torch's.
// sqrt, / and fma are correctly rounded, so every instruction set produces the same bits as
// this reference. torch's own float sqrt on CPU may go through MKL VML and be off by one ulp.
//
// [Note: bf16 moments]
// With state_dtype bf16, m and v are loaded to fp32, updated exactly as above, and stored back
// to bf16 with *stochastic* rounding: r is 16 random bits and the stored value is the top half
// of (bits(x) + r), so x rounds away from zero with probability equal to the fraction of a
// bf16 ulp it has past the lower neighbour (unbiased in expectation). Round-to-nearest-even
// would stall the moments: bf16 keeps 8 significand bits, so a relative change under 2^-9 is
// lost. With beta2 = 0.999, v * beta2 moves v by 0.1% < 2^-9 = 0.2%, so under RNE v never
// decays, and every (1 - beta2) * g^2 smaller than half an ulp of v vanishes. Stochastic
// rounding keeps both effects on average.
// The random bits are a counter-based hash, so a step is deterministic and independent of the
// thread split and instruction set: for element i (64-bit) of a call with (seed, step),
// counted from the call's sr_offset (so a call on elements [lo, hi) of a buffer with
// sr_offset = lo rounds them exactly as one call on the whole buffer does),
//   key = fmix32(fmix32(seed) + step)                       (per call, in make_hyper)
//   r   = fmix32((uint32)i + (key ^ (uint32)(i >> 32) * 0x9E3779B9))
// with fmix32 the 32-bit finalizer of MurmurHash3 (a xor-shift / multiply bijection); m uses
// the low 16 bits of r, v the high 16. NaN stores 0xFFFF (as the RNE conversion below);
// +-inf stays inf; a value within a bf16 ulp of FLT_MAX may round up to inf.
//
// [Note: bf16 master weights]
// With param_dtype bf16 the weights themselves are bf16 (2 B per weight instead of 4, read and
// written: 4 B per parameter less traffic on every step): each is widened to fp32 exactly,
// updated by the fp32 maths above, and stored back with stochastic rounding as the bf16
// moments are (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"; Zamirai
// et al. 2020, "Revisiting BFloat16 Training"). Round-to-nearest would freeze them: an update
// under half a bf16 ulp of the weight is lost on every step (Adam moves a weight by about lr;
// with lr = 1e-4 a weight of 0.1, whose half ulp is 2.4e-4, never moves), while stochastic
// rounding moves it by one ulp with the probability that makes the expected stored weight
// the fp32 one. The bits are those of [Note: bf16 moments] under a key of their own,
//   key_param = fmix32(key ^ 0x2545f491)                       (per call, in make_hyper)
//   r_param   = fmix32((uint32)i + (key_param ^ (uint32)(i >> 32) * 0x9E3779B9)),
// the weight taking the low 16 bits of r_param: independent of m's and v's bits (with one
// shared r, an element's m and weight would round up together), and the same whatever the
// moments' dtype (fp32, bf16 or q8), so the weight rounds alike for every thread split,
// instruction set and call split with sr_offset. out receives the weight as stored: a bf16
// out holds param's bits, fp32 the widened value, fp16 that value rounded to nearest even.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam_common.h"

namespace oz {
namespace {

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as torch's vectorized fp32 -> bf16 conversion: every NaN becomes
// 0xFFFF, denormals are rounded (not flushed).
inline uint16_t f32_to_bf16(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> binary32, exact (same as F16C vcvtph2ps).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);                                   // +-0
  // Subnormal half: value = mant * 2^-24, exact in fp32.
  const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;    // 2^-24
  return bits_f32(sign | f32_bits(mag));
}

// IEEE binary32 -> binary16, round to nearest even (same bits as F16C vcvtps2ph with
// _MM_FROUND_TO_NEAREST_INT): NaNs are quieted keeping the sign and top payload bits.
inline uint16_t f32_to_f16(float x) {
  const uint32_t u = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;        // rounds to >= 65520: inf
  if (abs >= 0x38800000u) {                             // normal half (>= 2^-14)
    const uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u) - 0x38000000u;
    return sign | static_cast<uint16_t>(r >> 13);
  }
  if (abs < 0x33000000u) return sign;                   // < 2^-25 rounds to 0 (ties: even 0)
  // Subnormal half: shift the full significand right and round to nearest even.
  const uint32_t e = abs >> 23;                         // 102..112
  const uint32_t sig = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;                      // 14..24
  const uint32_t keep = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t rounded = keep + ((rest > half || (rest == half && (keep & 1u))) ? 1u : 0u);
  return sign | static_cast<uint16_t>(rounded);
}

// MurmurHash3's 32-bit finalizer: a bijection on uint32 with full avalanche.
inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// Per-element key of the upper 32 index bits (constant over any aligned vector).
inline uint32_t sr_key_hi(uint32_t key, int64_t i) {
  return key ^ (static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32) * 0x9e3779b9u);
}

// 32 random bits of element i ([Note: bf16 moments]).
inline uint32_t sr_bits(uint32_t key, int64_t i) {
  return fmix32(static_cast<uint32_t>(i) + sr_key_hi(key, i));
}

// fp32 -> bf16 with stochastic rounding by the 16 random bits r16 (< 65536); NaN -> 0xFFFF.
inline uint16_t f32_to_bf16_sr(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
  return static_cast<uint16_t>((u + r16) >> 16);
}

inline float load_param_scalar(const AdamBuffers& b, int64_t i) {
  if (b.param_dtype == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(b.param)[i]);
  return static_cast<const float*>(b.param)[i];
}

inline float load_state_scalar(const void* state, DType dt, int64_t i) {
  if (dt == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(state)[i]);
  return static_cast<const float*>(state)[i];
}

inline float load_grad_scalar(const void* grad, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    default: return static_cast<const float*>(grad)[i];
  }
}

inline void store_out_scalar(void* out, DType dt, int64_t i, float x) {
  switch (dt) {
    case DType::kF32: static_cast<float*>(out)[i] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(out)[i] = f32_to_bf16(x); break;
    case DType::kF16: static_cast<uint16_t*>(out)[i] = f32_to_f16(x); break;
    default: break;
  }
}

// Stores the new weight p of element i in param (bf16: rounded stochastically, [Note: bf16
// master weights]) and the weight as stored in out.
inline void store_param_scalar(const AdamBuffers& b, const AdamHyper& h, int64_t i, float p) {
  if (b.param_dtype == DType::kBF16) {
    const uint16_t w = f32_to_bf16_sr(p, sr_bits(h.sr_key_param, i + h.sr_offset) & 0xffffu);
    static_cast<uint16_t*>(b.param)[i] = w;
    p = bf16_to_f32(w);
  } else {
    static_cast<float*>(b.param)[i] = p;
  }
  store_out_scalar(b.out, b.out_dtype, i, p);
}

// The maths of one element in fp32 (see [Note: Adam math]): gradient g, weight p and moments
// m, v in, the new p, m, v out.
inline void adam_math(const AdamHyper& h, float g, float& p, float& m, float& v) {
  if (h.scale_grad) g = g * h.grad_scale;
  if (h.l2) g = std::fma(p, h.l2_decay, g);
  if (h.decoupled) p = p * h.decay_factor;
  m = std::fma(h.lerp_coeff, g - m, h.lerp_small ? m : g);
  v = v * h.beta2;
  v = std::fma(h.one_minus_beta2 * g, g, v);
  const float denom = std::sqrt(v) + h.eps;
  p = p + (h.neg_step_size * m) / denom;
}

// The reference: one element of one step with fp32 or bf16 moments and fp32 or bf16 weights
// (see [Note: Adam math]); kQ8 moments are updated a block at a time (q8_block in adam_q8.h).
inline void adam_element(const AdamBuffers& b, const AdamHyper& h, int64_t i) {
  float g = load_grad_scalar(b.grad, b.grad_dtype, i);
  float p = load_param_scalar(b, i);
  float m = load_state_scalar(b.exp_avg, b.state_dtype, i);
  float v = load_state_scalar(b.exp_avg_sq, b.state_dtype, i);
  adam_math(h, g, p, m, v);
  store_param_scalar(b, h, i, p);
  if (b.state_dtype == DType::kBF16) {
    const uint32_t r = sr_bits(h.sr_key, i + h.sr_offset);
    static_cast<uint16_t*>(b.exp_avg)[i] = f32_to_bf16_sr(m, r & 0xffffu);
    static_cast<uint16_t*>(b.exp_avg_sq)[i] = f32_to_bf16_sr(v, r >> 16);
  } else {
    static_cast<float*>(b.exp_avg)[i] = m;
    static_cast<float*>(b.exp_avg_sq)[i] = v;
  }
}

// True when grad[i] (scaled as the update will scale it) is inf or nan.
inline bool element_nonfinite(const AdamBuffers& b, const AdamHyper& h, int64_t i) {
  float g = load_grad_scalar(b.grad, b.grad_dtype, i);
  if (h.scale_grad) g = g * h.grad_scale;
  return (f32_bits(g) & 0x7fffffffu) >= 0x7f800000u;
}

}  // namespace
}  // namespace oz
