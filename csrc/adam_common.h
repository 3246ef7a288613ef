// Shared declarations for the host-side Adam/AdamW kernels.
//
// Every instruction set (scalar, AVX2, AVX-512) is its own translation unit and exposes the
// same two entry points through an `AdamKernels` table; dispatch.cpp picks one table at run
// time from cpuid and splits the work over threads. Nothing in this header depends on the
// instruction set it is compiled for.
#pragma once

#include <cstdint>

namespace oz {

// Element type of a gradient input, of the moments, or of the optional weight output.
enum class DType : int {
  kNone = 0,  // no tensor (only legal for the output)
  kF32 = 1,
  kBF16 = 2,
  kF16 = 3,
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
  int64_t sr_offset;     // counter index of element 0 (a multiple of 64); [Note: bf16 moments]
};

// The buffers of one call; all hold `numel` elements. param is fp32; exp_avg/exp_avg_sq are
// both state_dtype (kF32, or kBF16 with stochastic rounding: [Note: bf16 moments]).
struct AdamBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  void* exp_avg;
  void* exp_avg_sq;
  DType state_dtype;  // kF32 or kBF16
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

// Defined in adam_scalar.cpp / adam_avx2.cpp / adam_avx512.cpp.
const AdamKernels& scalar_kernels();
const AdamKernels& avx2_kernels();
// has_bf16_insn selects the variant that converts to bf16 with AVX512-BF16 vcvtneps2bf16.
const AdamKernels& avx512_kernels(bool has_bf16_insn);

}  // namespace oz
