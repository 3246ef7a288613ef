// Chooses the Adam kernel for this CPU and runs it over threads. No maths here beyond turning
// the step's doubles into the kernels' floats.
#include "dispatch.h"

#include <cpuid.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "adam_q8.h"
#include "adam_scalar.h"
#include "thread_pool.h"

namespace oz {
namespace {

// Work below this many elements per thread is not worth a thread (~1.8 MB of traffic).
constexpr int64_t kMinNumelPerThread = 1 << 16;
// Chunks handed to threads, per thread (work is claimed dynamically).
constexpr int64_t kChunksPerThread = 8;
// Thread chunks start on multiples of this many elements: whole blocks of 8-bit moments
// (kQ8Block), 512 bytes of bf16, 1024 of fp32.
constexpr int64_t kChunkAlignNumel = kQ8Block;
// Non-temporal stores for the weight copy only pay off once it no longer fits in cache.
constexpr int64_t kStreamMinNumel = 1 << 18;

// Set by set_num_threads(); 0: not set.
std::atomic<int> g_num_threads{0};

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

struct CpuSupport {
  bool avx2 = false;
  bool avx512 = false;
  bool avx512_bf16 = false;
};

CpuSupport detect_cpu() {
  CpuSupport s;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return s;
  const bool osxsave = (ecx >> 27) & 1u;
  if (!osxsave) return s;  // the OS does not save vector state: only scalar is safe
  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6u) == 0x6u;             // SSE + AVX state
  const bool os_zmm = os_ymm && (xcr0 & 0xe0u) == 0xe0u;  // opmask + ZMM0-15 hi + ZMM16-31
  __builtin_cpu_init();
  s.avx2 = os_ymm && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           ((ecx >> 29) & 1u) /* F16C */;
  s.avx512 = s.avx2 && os_zmm && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
  s.avx512_bf16 = s.avx512 && __builtin_cpu_supports("avx512bf16");
  return s;
}

const CpuSupport& cpu() {
  static const CpuSupport s = detect_cpu();
  return s;
}

int cpus_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

}  // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> isas{"scalar"};
  if (cpu().avx2) isas.emplace_back("avx2");
  if (cpu().avx512) isas.emplace_back("avx512");
  return isas;
}

const AdamKernels& select_kernels() {
  const char* forced = std::getenv("OFFLOAD_ZERO_ADAM_ISA");
  const std::string name = forced ? forced : "";
  if (name.empty()) {
    if (cpu().avx512) return avx512_kernels(cpu().avx512_bf16);
    if (cpu().avx2) return avx2_kernels();
    return scalar_kernels();
  }
  std::string have;
  for (const std::string& isa : available_isas()) have += (have.empty() ? "" : ", ") + isa;
  if (name != "scalar" && name != "avx2" && name != "avx512") {
    throw std::invalid_argument("OFFLOAD_ZERO_ADAM_ISA='" + name +
                                "' is not one of scalar, avx2, avx512");
  }
  if ((name == "avx2" && !cpu().avx2) || (name == "avx512" && !cpu().avx512)) {
    throw std::runtime_error("OFFLOAD_ZERO_ADAM_ISA='" + name +
                             "' is not supported by this CPU/OS (available: " + have + ")");
  }
  if (name == "avx512") return avx512_kernels(cpu().avx512_bf16);
  if (name == "avx2") return avx2_kernels();
  return scalar_kernels();
}

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0); }

int default_num_threads() {
  const int set = g_num_threads.load();
  if (set > 0) return set;
  const char* env = std::getenv("OFFLOAD_ZERO_ADAM_THREADS");
  if (env && *env) {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(env, &end, 10);
    if (errno != 0 || end == env || *end != '\0' || n < 1 || n > 4096) {
      throw std::invalid_argument(std::string("OFFLOAD_ZERO_ADAM_THREADS='") + env +
                                  "' is not an integer in [1, 4096]");
    }
    return static_cast<int>(n);
  }
  return cpus_available();
}

AdamHyper make_hyper(const AdamOptions& o) {
  AdamHyper h{};
  h.scale_grad = o.grad_scale != 1.0;
  h.grad_scale = static_cast<float>(o.grad_scale);
  h.l2 = !o.adamw && o.weight_decay != 0.0;
  h.l2_decay = static_cast<float>(o.weight_decay);
  h.decoupled = o.adamw && o.weight_decay != 0.0;
  h.decay_factor = static_cast<float>(1.0 - o.lr * o.weight_decay);
  // torch's lerp picks its formula from the float weight: |w| < 0.5.
  const float w = static_cast<float>(1.0 - o.beta1);
  h.lerp_small = std::fabs(w) < 0.5f;
  h.lerp_coeff = h.lerp_small ? w : w - 1.0f;
  h.beta2 = static_cast<float>(o.beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  const double t = static_cast<double>(o.step);
  const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, t) : 1.0;
  const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, t) : 1.0;
  // One division less per element than torch's order: [Note: Adam math].
  h.eps = static_cast<float>(o.eps * std::sqrt(bc2));
  h.neg_step_size = static_cast<float>(-(o.lr / bc1) * std::sqrt(bc2));
  h.sr_key = fmix32(fmix32(o.sr_seed) + static_cast<uint32_t>(o.step));
  h.sr_key_param = fmix32(h.sr_key ^ 0x2545f491u);  // [Note: bf16 master weights]
  h.sr_offset = o.sr_offset;
  return h;
}

// [Note: overflow check before the update]
// "An inf/nan gradient leaves param, moments and out unchanged, bit for bit" needs every
// gradient seen before the first write. We keep a separate read-only pass over the gradients
// (4 B/param of fp32 grads, 2 for bf16/fp16) in front of the update (28 B/param). Considered
// and rejected: checking and updating one cache-sized tile at a time, so the update reads the
// gradients from cache. A nan found in a later tile (or on another thread) then finds earlier
// tiles already written, and their old values are gone: the update is not exactly
// invertible in floating point (m + c(g - m) rounds), so undoing needs a copy of the old
// param/exp_avg/exp_avg_sq of every tile written before the last tile was checked, i.e. an
// extra 12 B/param written (8 with bf16 moments) on every step, to save 4 B/param read.
// The check reads four interleaved sub-ranges per loop (several sequential streams in flight
// on one core): at 50M params on one thread ~9 ms instead of ~14 ms with one stream.
// A caller that already knows the gradients are finite (e.g. it computed their global norm
// for clipping, as torch's fused AdamW gets found_inf from outside) can pass
// check_overflow=false and save the pass: the update then notices a non-finite gradient in
// registers at no extra traffic and reports it (kNonfiniteWritten), but cannot undo it.
StepResult run_adam_step(const AdamKernels& k, const AdamBuffers& b, const AdamHyper& h,
                         int64_t numel, int num_threads, bool check_overflow) {
  if (numel <= 0) return StepResult::kUpdated;
  int64_t threads = num_threads > 0 ? num_threads : default_num_threads();
  const int64_t useful = (numel + kMinNumelPerThread - 1) / kMinNumelPerThread;
  if (threads > useful) threads = useful;
  if (threads < 1) threads = 1;
  // Several chunks per thread, handed out on demand: a thread slowed by a busy neighbour
  // takes fewer chunks instead of holding everyone up at the end of the phase.
  int64_t per = (numel + threads * kChunksPerThread - 1) / (threads * kChunksPerThread);
  if (per < kMinNumelPerThread) per = kMinNumelPerThread;
  per = (per + kChunkAlignNumel - 1) / kChunkAlignNumel * kChunkAlignNumel;
  const int64_t nchunks = (numel + per - 1) / per;
  // Chunks are handed out on demand from a persistent pool ([Note: late workers]).
  auto for_each_chunk = [&](const auto& body) {
    ChunkPool::get().run(static_cast<int>(threads), nchunks, [&](int64_t c) {
      body(c * per, std::min(numel, (c + 1) * per));
    });
  };

  // Phase 1: look at every gradient before writing anything (overflow leaves state intact).
  // See [Note: overflow check before the update].
  std::atomic<bool> overflow{false};
  if (check_overflow) {
    for_each_chunk([&](int64_t begin, int64_t end) {
      if (overflow.load(std::memory_order_relaxed)) return;
      if (k.has_nonfinite(b, h, begin, end)) overflow.store(true, std::memory_order_relaxed);
    });
    if (overflow.load()) return StepResult::kSkipped;
  }

  // Phase 2: the update.
  const bool streaming = b.out_dtype != DType::kNone && numel >= kStreamMinNumel &&
                         (reinterpret_cast<uintptr_t>(b.out) % 64) == 0;
  std::atomic<bool> written{false};
  for_each_chunk([&](int64_t begin, int64_t end) {
    if (k.update(b, h, begin, end, streaming)) written.store(true, std::memory_order_relaxed);
  });
  return written.load() ? StepResult::kNonfiniteWritten : StepResult::kUpdated;
}

// The scalar encoder / decoder of adam_q8.h over whole buffers (loading and saving states:
// not on the step's path, so one thread and no SIMD).
void q8_quantize(const float* x, int64_t numel, uint8_t* codes, float* absmax, bool is_signed,
                 bool stochastic, uint32_t sr_key, int64_t sr_offset) {
  const Q8Map& q = is_signed ? q8_tables().m : q8_tables().v;
  for (int64_t begin = 0; begin < numel; begin += kQ8Block) {
    const int64_t end = std::min(numel, begin + kQ8Block);
    float amax = 0.0f;
    for (int64_t i = begin; i < end; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    absmax[begin / kQ8Block] = amax;
    const float inv = q8_inverse(amax);
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t r = sr_bits(sr_key, i + sr_offset);
      codes[i] = q8_encode(q, x[i], amax, inv, q8_dither(is_signed ? r & 0xffffu : r >> 16,
                                                         stochastic));
    }
  }
}

void q8_dequantize(const uint8_t* codes, const float* absmax, int64_t numel, float* x,
                   bool is_signed) {
  const Q8Map& q = is_signed ? q8_tables().m : q8_tables().v;
  for (int64_t i = 0; i < numel; ++i) x[i] = q8_decode(q, codes[i], absmax[i / kQ8Block]);
}

}  // namespace oz
