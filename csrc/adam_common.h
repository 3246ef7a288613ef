// Shared declarations for the host-side Adam/AdamW kernels.
//
// Every instruction set (scalar, AVX2, AVX-512) is its own translation unit and exposes the
// same two entry points through an `AdamKernels` table; dispatch.cpp picks one table at run
// time from cpuid and splits the work over threads. Nothing in this header depends on the
// instruction set it is compiled for.
#pragma once

#include <cstdint>

namespace oz {

// Element type of the weights, of a gradient input, of the moments, or of the optional weight
// output.
enum class DType : int {
  kNone = 0,  // no tensor (only legal for the output)
  kF32 = 1,
  kBF16 = 2,
  kF16 = 3,
  kQ8 = 4,   // moments only: blockwise 8-bit codes + an fp32 absmax per block ([Note: int8
             // moments] in adam_q8.h)
};

// Per-call scalars, already reduced to float the way torch.optim.Adam reduces its Python
// doubles (see [Note: Adam math] in adam_scalar.h). Built once on the host by dispatch.cpp.
struct AdamHyper {
  bool scale_grad;       // multiply the gradient by grad_scale first
  float grad_scale;      // 1/loss_scale times a clip coefficient
  bool l2;               // Adam: grad += weight_decay * param
  float l2_decay;        // weight_decay
  bool decoupled;        // AdamW: param *= 1 - lr * weight_decay
  float decay_factor;    // (float)(1 - lr * weight_decay), computed in double
  bool lerp_small;       // torch's lerp branch: |1 - beta1| < 0.5
  float lerp_coeff;      // (1 - beta1) if lerp_small else (1 - beta1) - 1
  float beta2;           // beta2
  float one_minus_beta2; // (float)(1 - beta2)
  float eps;             // (float)(eps * sqrt(bc2)), bc2 = 1 - beta2**step (1 without bias
                         // correction)
  float neg_step_size;   // (float)(-(lr / bc1) * sqrt(bc2)), bc1 = 1 - beta1**step (1 without)
  uint32_t sr_key;       // stochastic-rounding key of this (seed, step); see [Note: bf16 moments]
  uint32_t sr_key_param; // the key of bf16 weights, fmix32(sr_key ^ 0x2545f491): bits
                         // independent of the moments'; [Note: bf16 master weights]
  int64_t sr_offset;     // counter index of element 0 (a multiple of 64); [Note: bf16 moments]
};

// The buffers of one call; all hold `numel` elements. param is param_dtype (kF32, or kBF16:
// read widened to fp32, updated in fp32, stored with stochastic rounding: [Note: bf16 master
// weights]); exp_avg/exp_avg_sq are both state_dtype (kF32, kBF16 with stochastic rounding:
// [Note: bf16 moments], or kQ8: one uint8 code per element and one fp32 absmax per block of
// kQ8Block elements, counted from element 0 of the call: [Note: int8 moments]). out receives
// the weight as stored in param (for kBF16 the rounded value), converted to out_dtype.
struct AdamBuffers {
  void* param;
  DType param_dtype;  // kF32 or kBF16
  const void* grad;
  DType grad_dtype;
  void* exp_avg;
  void* exp_avg_sq;
  DType state_dtype;  // kF32, kBF16 or kQ8
  float* exp_avg_absmax;     // kQ8 only: ceil(numel / kQ8Block) block scales of exp_avg
  float* exp_avg_sq_absmax;  // kQ8 only: the same for exp_avg_sq
  void* out;          // may be null when out_dtype == kNone
  DType out_dtype;
};

// One instruction set's kernels. Both work on the half-open element range [begin, end).
struct AdamKernels {
  const char* name;
  // True when any grad[i] * grad_scale (scaled only if h.scale_grad) is inf or nan.
  bool (*has_nonfinite)(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end);
  // One Adam/AdamW step in place. `streaming` asks for non-temporal stores; the caller only
  // sets it when every pointer at `begin` is 64-byte aligned. Returns has_nonfinite over the
  // same range (found in registers while updating, at no extra memory traffic).
  bool (*update)(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                 bool streaming);
};

// Elements per absmax block of kQ8 moments ([Note: int8 moments] in adam_q8.h).
constexpr int64_t kQ8Block = 256;

// One 8-bit dynamic map ([Note: int8 moments]): the decoded value of each code (times the
// block's absmax) and, per decade z, the constants of the encoder.
struct Q8Map {
  int bits;              // magnitude bits N: 7 (signed, exp_avg) or 8 (unsigned, exp_avg_sq)
  float value[256];      // value[code], |value| <= 1; value[top code] == 1 exactly
  float thresh[8];       // thresh[j] = 10^-(j+1), j < N-1: decade z = #{j : r < thresh[j]}
  float a[8], b[8];      // per decade: fraction index t = floor(fma(r, a[z], b[z]) + u)
  int32_t base[8], lo[8], hi[8];  // magnitude code = clamp(base[z] + t, lo[z], hi[z])
  int32_t top;           // the magnitude code of value 1
};

struct Q8Tables {
  Q8Map m;  // signed map of exp_avg
  Q8Map v;  // unsigned map of exp_avg_sq
};

// The one copy of the tables (built once in adam_scalar.cpp, in double, without any
// instruction-set flags), shared by every instruction set.
const Q8Tables& q8_tables();

// Defined in adam_scalar.cpp / adam_avx2.cpp / adam_avx512.cpp.
const AdamKernels& scalar_kernels();
const AdamKernels& avx2_kernels();
// has_bf16_insn selects the variant that converts to bf16 with AVX512-BF16 vcvtneps2bf16.
const AdamKernels& avx512_kernels(bool has_bf16_insn);

}  // namespace oz
