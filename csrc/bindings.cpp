// pybind11 face of the Adam kernels: validates every pointer, size, dtype and scalar at the
// boundary, releases the GIL, and hands off to dispatch.cpp. No maths here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_common.h"
#include "dispatch.h"

namespace py = pybind11;

namespace oz {
namespace {

DType parse_dtype(const std::string& name, const char* what) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  throw py::value_error(std::string(what) + " dtype '" + name +
                        "' is not one of float32, bfloat16, float16");
}

size_t dtype_size(DType dt) { return dt == DType::kF32 ? 4 : dt == DType::kQ8 ? 1 : 2; }

void* checked_ptr(uintptr_t ptr, int64_t numel, DType dt, const char* what) {
  if (numel > 0 && ptr == 0) {
    throw py::value_error(std::string(what) + " pointer is null for numel=" +
                          std::to_string(numel));
  }
  if (ptr % dtype_size(dt) != 0) {
    throw py::value_error(std::string(what) + " pointer " + std::to_string(ptr) +
                          " is not aligned to its element size " +
                          std::to_string(dtype_size(dt)));
  }
  return reinterpret_cast<void*>(ptr);
}

void check_finite_range(double x, double lo, double hi, bool hi_open, const char* what) {
  const bool ok = std::isfinite(x) && x >= lo && (hi_open ? x < hi : x <= hi);
  if (!ok) {
    throw py::value_error(std::string(what) + "=" + std::to_string(x) + " is outside [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + (hi_open ? ")" : "]"));
  }
}

bool adam_step(uintptr_t param_ptr, uintptr_t grad_ptr, uintptr_t exp_avg_ptr,
               uintptr_t exp_avg_sq_ptr, int64_t numel, const std::string& grad_dtype,
               uintptr_t out_ptr, const py::object& out_dtype, int64_t step, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool adamw,
               bool bias_correction, double grad_scale, int num_threads,
               const std::string& state_dtype, int64_t sr_seed, bool check_overflow,
               int64_t sr_offset, uintptr_t exp_avg_absmax_ptr, uintptr_t exp_avg_sq_absmax_ptr,
               const std::string& param_dtype) {
  if (numel < 0) throw py::value_error("numel=" + std::to_string(numel) + " is negative");
  if (step < 1) throw py::value_error("step=" + std::to_string(step) + " must be >= 1");
  if (num_threads < 0) {
    throw py::value_error("num_threads=" + std::to_string(num_threads) +
                          " must be >= 0 (0: default)");
  }
  const double inf = HUGE_VAL;
  check_finite_range(lr, 0.0, inf, true, "lr");
  check_finite_range(beta1, 0.0, 1.0, true, "beta1");
  check_finite_range(beta2, 0.0, 1.0, true, "beta2");
  check_finite_range(eps, 0.0, inf, true, "eps");
  check_finite_range(weight_decay, 0.0, inf, true, "weight_decay");
  if (sr_seed < 0 || sr_seed > 0xffffffffLL) {
    throw py::value_error("sr_seed=" + std::to_string(sr_seed) + " is outside [0, 2**32)");
  }
  if (sr_offset < 0 || sr_offset % 64) {
    throw py::value_error("sr_offset=" + std::to_string(sr_offset) +
                          " must be a multiple of 64, >= 0");
  }
  if (!std::isfinite(grad_scale)) {
    throw py::value_error("grad_scale=" + std::to_string(grad_scale) + " is not finite");
  }

  AdamBuffers b{};
  b.grad_dtype = parse_dtype(grad_dtype, "grad");
  b.out_dtype = out_dtype.is_none() ? DType::kNone
                                    : parse_dtype(py::cast<std::string>(out_dtype), "out");
  if (param_dtype != "float32" && param_dtype != "bfloat16") {
    throw py::value_error("param dtype '" + param_dtype + "' is not one of float32, bfloat16");
  }
  b.param_dtype = parse_dtype(param_dtype, "param");
  b.param = checked_ptr(param_ptr, numel, b.param_dtype, "param");
  b.grad = checked_ptr(grad_ptr, numel, b.grad_dtype, "grad");
  b.state_dtype = state_dtype == "q8" ? DType::kQ8 : parse_dtype(state_dtype, "state");
  if (b.state_dtype == DType::kF16) {
    throw py::value_error("state dtype 'float16' is not supported (float32, bfloat16 or q8)");
  }
  b.exp_avg = checked_ptr(exp_avg_ptr, numel, b.state_dtype, "exp_avg");
  b.exp_avg_sq = checked_ptr(exp_avg_sq_ptr, numel, b.state_dtype, "exp_avg_sq");
  if (b.state_dtype == DType::kQ8) {
    const int64_t blocks = (numel + kQ8Block - 1) / kQ8Block;
    b.exp_avg_absmax = static_cast<float*>(
        checked_ptr(exp_avg_absmax_ptr, blocks, DType::kF32, "exp_avg_absmax"));
    b.exp_avg_sq_absmax = static_cast<float*>(
        checked_ptr(exp_avg_sq_absmax_ptr, blocks, DType::kF32, "exp_avg_sq_absmax"));
  } else if (exp_avg_absmax_ptr != 0 || exp_avg_sq_absmax_ptr != 0) {
    throw py::value_error("absmax pointers given with state dtype '" + state_dtype +
                          "' (only q8 moments have them)");
  }
  if (b.out_dtype != DType::kNone) {
    b.out = checked_ptr(out_ptr, numel, b.out_dtype, "out");
  } else if (out_ptr != 0) {
    throw py::value_error("out pointer " + std::to_string(out_ptr) +
                          " given without an out dtype");
  }

  AdamOptions o{step,  lr,    beta1,           beta2,      eps,
                weight_decay, adamw, bias_correction, grad_scale, static_cast<uint32_t>(sr_seed),
                sr_offset};
  const AdamHyper h = make_hyper(o);
  // Environment variables are read while we still hold the GIL.
  const AdamKernels& k = select_kernels();
  const int threads = num_threads > 0 ? num_threads : default_num_threads();
  StepResult result;
  {
    py::gil_scoped_release release;
    result = run_adam_step(k, b, h, numel, threads, check_overflow);
  }
  if (result == StepResult::kNonfiniteWritten) {
    throw std::runtime_error(
        "adam_step with check_overflow=False met an inf/nan gradient (times grad_scale=" +
        std::to_string(grad_scale) + ") among numel=" + std::to_string(numel) +
        ": param/exp_avg/exp_avg_sq/out now hold non-finite values");
  }
  return result == StepResult::kSkipped;
}

void q8_quantize_py(uintptr_t x_ptr, int64_t numel, uintptr_t codes_ptr, uintptr_t absmax_ptr,
                    bool is_signed, bool stochastic, int64_t sr_seed, int64_t step,
                    int64_t sr_offset) {
  if (numel < 0) throw py::value_error("numel=" + std::to_string(numel) + " is negative");
  if (sr_seed < 0 || sr_seed > 0xffffffffLL) {
    throw py::value_error("sr_seed=" + std::to_string(sr_seed) + " is outside [0, 2**32)");
  }
  if (step < 1) throw py::value_error("step=" + std::to_string(step) + " must be >= 1");
  if (sr_offset < 0 || sr_offset % 64) {
    throw py::value_error("sr_offset=" + std::to_string(sr_offset) +
                          " must be a multiple of 64, >= 0");
  }
  const int64_t blocks = (numel + kQ8Block - 1) / kQ8Block;
  const auto* x = static_cast<const float*>(checked_ptr(x_ptr, numel, DType::kF32, "x"));
  auto* codes = static_cast<uint8_t*>(checked_ptr(codes_ptr, numel, DType::kQ8, "codes"));
  auto* absmax = static_cast<float*>(checked_ptr(absmax_ptr, blocks, DType::kF32, "absmax"));
  AdamOptions o{step, 0.0, 0.0, 0.0, 0.0, 0.0, true, true, 1.0, static_cast<uint32_t>(sr_seed),
                sr_offset};
  const uint32_t key = make_hyper(o).sr_key;
  py::gil_scoped_release release;
  q8_quantize(x, numel, codes, absmax, is_signed, stochastic, key, sr_offset);
}

void q8_dequantize_py(uintptr_t codes_ptr, uintptr_t absmax_ptr, int64_t numel, uintptr_t x_ptr,
                      bool is_signed) {
  if (numel < 0) throw py::value_error("numel=" + std::to_string(numel) + " is negative");
  const int64_t blocks = (numel + kQ8Block - 1) / kQ8Block;
  const auto* codes = static_cast<const uint8_t*>(checked_ptr(codes_ptr, numel, DType::kQ8, "codes"));
  const auto* absmax = static_cast<const float*>(checked_ptr(absmax_ptr, blocks, DType::kF32, "absmax"));
  auto* x = static_cast<float*>(checked_ptr(x_ptr, numel, DType::kF32, "x"));
  py::gil_scoped_release release;
  q8_dequantize(codes, absmax, numel, x, is_signed);
}

std::vector<float> q8_values(bool is_signed) {
  const Q8Map& q = is_signed ? q8_tables().m : q8_tables().v;
  return std::vector<float>(q.value, q.value + 256);
}

std::string selected_isa() { return select_kernels().name; }

void set_threads(int n) {
  if (n < 0) throw py::value_error("num_threads=" + std::to_string(n) + " must be >= 0");
  set_num_threads(n);
}

}  // namespace
}  // namespace oz

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload-zero host kernels: Adam/AdamW over flat fp32 or bf16 buffers (raw pointers).";
  m.def("adam_step", &oz::adam_step, py::arg("param_ptr"), py::arg("grad_ptr"),
        py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"), py::arg("numel"),
        py::arg("grad_dtype"), py::arg("out_ptr"), py::arg("out_dtype"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("num_threads"), py::arg("state_dtype") = "float32",
        py::arg("sr_seed") = 0, py::arg("check_overflow") = true, py::arg("sr_offset") = 0,
        py::arg("exp_avg_absmax_ptr") = 0, py::arg("exp_avg_sq_absmax_ptr") = 0,
        py::arg("param_dtype") = "float32",
        "One Adam/AdamW step in place over raw buffers of `numel` elements.\n\n"
        "param: param_dtype ('float32'|'bfloat16', the latter updated in fp32 and stored with\n"
        "stochastic rounding, its random bits independent of the moments');\n"
        "exp_avg/exp_avg_sq: state_dtype ('float32'|'bfloat16'|'q8', the\n"
        "latter two stored with stochastic rounding keyed by (sr_seed, step) and the element\n"
        "index counted from sr_offset, a multiple of 64 >= 0; q8: uint8 codes plus one fp32\n"
        "absmax per block of 256 elements from element 0, at exp_avg[_sq]_absmax_ptr);\n"
        "grad: grad_dtype ('float32'|'bfloat16'|'float16');\n"
        "out: optional copy of the new weight as stored in param, in out_dtype (None: no\n"
        "copy, out_ptr must be 0).\n"
        "num_threads=0 uses set_num_threads(), OFFLOAD_ZERO_ADAM_THREADS or all CPUs.\n"
        "Returns True (nothing written) when any gradient times grad_scale is inf or nan.\n"
        "check_overflow=False skips that read-only pass: the caller vouches that the\n"
        "gradients are finite, and RuntimeError is raised (state already written) if not.\n"
        "Raises ValueError for bad pointers, sizes, dtypes or hyperparameters.");
  m.def("q8_quantize", &oz::q8_quantize_py, py::arg("x_ptr"), py::arg("numel"),
        py::arg("codes_ptr"), py::arg("absmax_ptr"), py::arg("is_signed"), py::arg("stochastic"),
        py::arg("sr_seed"), py::arg("step"), py::arg("sr_offset"),
        "Blockwise 8-bit encoding of fp32 x (numel) into uint8 codes (numel) and fp32 absmax\n"
        "(ceil(numel / 256)): exp_avg's signed map (is_signed) or exp_avg_sq's; stochastic\n"
        "rounding keyed as adam_step's (sr_seed, step, sr_offset), else to nearest.");
  m.def("q8_dequantize", &oz::q8_dequantize_py, py::arg("codes_ptr"), py::arg("absmax_ptr"),
        py::arg("numel"), py::arg("x_ptr"), py::arg("is_signed"),
        "x[i] = absmax[i // 256] * value[codes[i]] (fp32), the map of q8_values(is_signed).");
  m.def("q8_values", &oz::q8_values, py::arg("is_signed"),
        "The 256 decoded values of the signed (exp_avg) or unsigned (exp_avg_sq) 8-bit map.");
  m.def("q8_block_numel", []() { return oz::kQ8Block; },
        "Elements per absmax block of q8 moments (256).");
  m.def("selected_isa", &oz::selected_isa,
        "Instruction set adam_step uses now: 'scalar', 'avx2' or 'avx512' "
        "(honours OFFLOAD_ZERO_ADAM_ISA, re-read on every call).");
  m.def("set_num_threads", &oz::set_threads, py::arg("num_threads"),
        "Process-wide thread count for adam_step calls given num_threads=0 (>= 1; 0 clears it,\n"
        "so OFFLOAD_ZERO_ADAM_THREADS or the CPU count apply again).");
  m.def("get_num_threads", &oz::default_num_threads,
        "Threads an adam_step call with num_threads=0 uses now.");
  m.def("available_isas", &oz::available_isas,
        "Instruction sets this CPU and OS support, 'scalar' first.");
}
