// Blockwise 8-bit moments: the scalar encoder, decoder and block update that every
// instruction set uses for its tails and that the SIMD paths reproduce bit for bit.
//
// [Note: int8 moments]
// With state_dtype kQ8 each moment is one uint8 code per element plus one fp32 absmax per
// block of kQ8Block = 256 elements (counted from element 0 of the call): the value is
// absmax * value[code] with value[] a dynamic map (Dettmers et al. 2021, "8-bit Optimizers
// via Block-wise Quantization", dynamic tree quantisation), here in this exact variant:
//   A map has N magnitude bits (exp_avg: N = 7 plus a sign bit, code = sign << 7 | mag;
//   exp_avg_sq: N = 8, unsigned). A magnitude code c >= 1 has k = floor(log2 c) (its leading
//   zeros, N - 1 - k, are the decade z) and fraction f = c - 2^k:
//       value(c) = 10^-z * (0.1 + 0.9 * (f + 1) / 2^k),     value(0) = 0,
//   so the codes are in increasing order of value, the top code (2^N - 1) is 1 exactly, and
//   each decade [10^-(z+1), 10^-z] is cut into 2^k equal steps whose bottom point is the top
//   code of the decade below (code 2^k - 1): the codes form one lattice across decade edges.
//   The smallest non-zero value is 10^-(N-1): 1e-6 for exp_avg, 1e-7 for exp_avg_sq.
// Encoding x of a block with absmax A (the block's largest |x| after the update), with a
// dither u in [0, 1): r = min(|x| * inv, 1), inv = 1/A (0 when A == 0); the decade z counts
// the thresholds 10^-(j+1) (j < N-1) that r is below; t = floor(fma(r, a[z], b[z]) + u) is r's
// place on the decade's lattice (a = 2^k / (0.9 * 10^-z), b = -(0.1 * 2^k / 0.9) - 1; the
// bottom decade z = N-1 is the lattice {0, 10^-(N-1)}: a = 10^(N-1), b = 0), and
// mag = clamp(base[z] + t, lo[z], hi[z]) (base 2^k, lo 2^k - 1, hi 2^(k+1) - 1; bottom decade
// 0..1). An element equal to A gets the top code (so a block decodes to its absmax exactly),
// exp_avg's sign is kept when mag > 0, and a positive exp_avg_sq never gets code 0: a
// second moment that rounded to 0 under a non-zero first moment would make m / (sqrt(v) +
// eps) explode.
// The update rounds stochastically, u = (16 random bits) / 2^16 from the same counter-based
// hash as bf16 moments ([Note: bf16 moments]; m the low 16 bits, v the high 16, element index
// counted from sr_offset): v * beta2 moves v by 0.1%, less than half a step of the top decade
// (0.7%), so round-to-nearest would stall it as it stalls bf16 moments. Loading a state
// (checkpoints, quantise()) rounds to nearest, u = 1/2: decoding and encoding again gives the
// same codes and absmax (each decoded value sits mid-way between its decision points).
// Error: with u = 1/2, |x - A * value(code)| <= A * (s / 2 + 2^-22), s the lattice step where
// r lies (0.9 * 10^-z / 2^k in decade z, 10^-(N-1) in the bottom one; a positive
// exp_avg_sq below half of it gets the bottom code: error <= A * 10^-(N-1)); stochastic
// rounding lands on one of the two lattice points around r: error < A * (s + 2^-22).
// Every operation is a correctly rounded IEEE op (mul, fma, add, floor, compare) on the
// tables of q8_tables(), so each instruction set gives the same codes as this file. (AVX-512
// finds the decade z from r's binary exponent and one compare, the same count, and decodes by
// permutes of value[] instead of a gather: Q8Vec and Q8Values in adam_avx512.cpp.)
// Bytes: 1 per element per moment, plus 4 per block of 256 for each absmax: 2 + 8/256 =
// 2.03125 bytes per element for both moments (fp32: 8, bf16: 4).
#pragma once

#include <cmath>
#include <cstdint>

#include "adam_common.h"
#include "adam_scalar.h"

namespace oz {
namespace {

// 1/absmax for the encoder (0 for an all-zero block).
inline float q8_inverse(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

// The magnitude code of r = |x| / absmax in [0, 1] (r may be slightly over 1: clamped) with
// dither u ([Note: int8 moments]).
inline int32_t q8_magnitude(const Q8Map& q, float r, float u) {
  r = std::fmin(r, 1.0f);
  int z = 0;
  for (int j = 0; j + 1 < q.bits; ++j) z += r < q.thresh[j] ? 1 : 0;
  float t = std::floor(std::fma(r, q.a[z], q.b[z]) + u);
  t = std::fmin(std::fmax(t, -2.0f), 256.0f);  // (NaN -> -2: no undefined conversion)
  int32_t c = q.base[z] + static_cast<int32_t>(t);
  c = c < q.lo[z] ? q.lo[z] : c;
  return c > q.hi[z] ? q.hi[z] : c;
}

// The code of x in a block of absmax `absmax` (inv = q8_inverse(absmax)), dither u.
inline uint8_t q8_encode(const Q8Map& q, float x, float absmax, float inv, float u) {
  const float ax = std::fabs(x);
  const float r = ax * inv;
  int32_t c = ax == absmax && absmax > 0.0f ? q.top : q8_magnitude(q, r, u);
  if (q.bits == 8) {  // unsigned: positive -> >= 1 (lo[N-1] = 1), exact 0 -> 0
    return static_cast<uint8_t>(r > 0.0f ? c : 0);
  }
  return static_cast<uint8_t>(c > 0 && x < 0.0f ? (c | 0x80) : c);
}

inline float q8_decode(const Q8Map& q, uint8_t code, float absmax) {
  return absmax * q.value[code];
}

// The dither of element i: stochastic (low or high 16 bits of its random word) or 1/2.
inline float q8_dither(uint32_t bits16, bool stochastic) {
  return stochastic ? static_cast<float>(bits16) * (1.0f / 65536.0f) : 0.5f;
}

// The reference update of one block: elements [begin, end), begin a multiple of kQ8Block,
// end - begin <= kQ8Block. Decode, the Adam maths per element ([Note: Adam math]; a bf16
// weight stored as in [Note: bf16 master weights]), then encode with the block's new absmax
// and stochastic rounding ([Note: int8 moments]).
inline void q8_block(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const Q8Tables& t = q8_tables();
  const int64_t blk = begin / kQ8Block;
  uint8_t* mc = static_cast<uint8_t*>(b.exp_avg);
  uint8_t* vc = static_cast<uint8_t*>(b.exp_avg_sq);
  const float am = b.exp_avg_absmax[blk], av = b.exp_avg_sq_absmax[blk];
  float mnew[kQ8Block], vnew[kQ8Block];
  float maxm = 0.0f, maxv = 0.0f;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad_scalar(b.grad, b.grad_dtype, i);
    float p = load_param_scalar(b, i);
    float m = q8_decode(t.m, mc[i], am);
    float v = q8_decode(t.v, vc[i], av);
    adam_math(h, g, p, m, v);
    store_param_scalar(b, h, i, p);
    mnew[i - begin] = m;
    vnew[i - begin] = v;
    maxm = std::fmax(maxm, std::fabs(m));
    maxv = std::fmax(maxv, std::fabs(v));
  }
  b.exp_avg_absmax[blk] = maxm;
  b.exp_avg_sq_absmax[blk] = maxv;
  const float im = q8_inverse(maxm), iv = q8_inverse(maxv);
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t r = sr_bits(h.sr_key, i + h.sr_offset);
    mc[i] = q8_encode(t.m, mnew[i - begin], maxm, im, q8_dither(r & 0xffffu, true));
    vc[i] = q8_encode(t.v, vnew[i - begin], maxv, iv, q8_dither(r >> 16, true));
  }
}

}  // namespace
}  // namespace oz
