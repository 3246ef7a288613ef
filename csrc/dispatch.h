// Run-time choice of the Adam kernel (cpuid + OS support + OFFLOAD_ZERO_ADAM_ISA) and the
// threaded driver that runs one step over a flat buffer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "adam_common.h"

namespace oz {

// Instruction sets this CPU and OS can run, best last; always starts with "scalar".
std::vector<std::string> available_isas();

// The kernels to use now. Reads OFFLOAD_ZERO_ADAM_ISA on every call (so tests can switch in
// one process). Throws std::invalid_argument for an unknown name and std::runtime_error when
// the named instruction set is not supported by this CPU/OS.
const AdamKernels& select_kernels();

// Threads used when the caller passes 0: the value of set_num_threads() if one is set, else
// OFFLOAD_ZERO_ADAM_THREADS if set (a positive integer, else std::invalid_argument), otherwise
// the CPUs this process may run on.
int default_num_threads();

// Sets the process-wide thread count default_num_threads() returns (n >= 1), or clears it
// (n == 0) so the environment variable / CPU count apply again. Thread-safe.
void set_num_threads(int n);

// The scalars of one step, as the user gives them (doubles, like Python floats).
struct AdamOptions {
  int64_t step;        // 1-based step count after the increment, >= 1
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool adamw;          // decoupled weight decay (AdamW) instead of L2 (Adam)
  bool bias_correction;
  double grad_scale;
  uint32_t sr_seed;    // stochastic-rounding seed of bf16/q8 moments and bf16 weights
                       // ([Note: bf16 moments], [Note: bf16 master weights])
  int64_t sr_offset;   // counter index of element 0 of this call, >= 0, a multiple of 64
};

// Reduces the options to the floats the kernels use, in double first like torch does.
AdamHyper make_hyper(const AdamOptions& o);

// What run_adam_step did.
enum class StepResult : int {
  kUpdated = 0,          // every scaled gradient finite; state updated
  kSkipped = 1,          // a scaled gradient is inf/nan; nothing written (check_overflow)
  kNonfiniteWritten = 2, // a scaled gradient is inf/nan and, without the check, the state
                         // has been written with it: it no longer holds valid values
};

// Blockwise 8-bit encoding of x[0, numel) ([Note: int8 moments] in adam_q8.h): codes, and
// one absmax per block of kQ8Block elements. is_signed: exp_avg's map (else exp_avg_sq's);
// stochastic: the dither of the update (the key and element index counted from sr_offset as
// there, exp_avg the low 16 bits, exp_avg_sq the high 16), else round to nearest.
void q8_quantize(const float* x, int64_t numel, uint8_t* codes, float* absmax, bool is_signed,
                 bool stochastic, uint32_t sr_key, int64_t sr_offset);

// x = absmax[i / kQ8Block] * value[codes[i]] over [0, numel).
void q8_dequantize(const uint8_t* codes, const float* absmax, int64_t numel, float* x,
                   bool is_signed);

// One step over `numel` elements with `num_threads` threads (0: default_num_threads()).
// check_overflow: read every gradient first and write nothing if one is inf or nan
// ([Note: overflow check before the update]); without it the update runs alone and only
// reports non-finite gradients afterwards.
StepResult run_adam_step(const AdamKernels& k, const AdamBuffers& b, const AdamHyper& h,
                         int64_t numel, int num_threads, bool check_overflow);

}  // namespace oz
