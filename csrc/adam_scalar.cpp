// Scalar Adam/AdamW: the reference every SIMD kernel is checked against, and the fallback for
// CPUs without AVX2. Compiled without any instruction-set flags.
#include "adam_common.h"
#include "adam_scalar.h"

namespace oz {
namespace {

bool scalar_has_nonfinite(const AdamBuffers& b, const AdamHyper& h, int64_t begin,
                          int64_t end) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) bad |= element_nonfinite(b, h, i);
  return bad;
}

bool scalar_update(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end,
                   bool /*streaming*/) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);
    adam_element(b, h, i);
  }
  return bad;
}

}  // namespace

const AdamKernels& scalar_kernels() {
  static const AdamKernels k{"scalar", &scalar_has_nonfinite, &scalar_update};
  return k;
}

}  // namespace oz
