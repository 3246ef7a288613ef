// Scalar Adam/AdamW: the reference every SIMD kernel is checked against, and the fallback for
// CPUs without AVX2. Compiled without any instruction-set flags. Also the one copy of the
// 8-bit maps ([Note: int8 moments] in adam_q8.h).
#include "adam_common.h"
#include "adam_q8.h"
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
  if (b.state_dtype == DType::kQ8) {  // (begin is a multiple of kQ8Block: dispatch.cpp)
    for (int64_t i = begin; i < end; ++i) bad |= element_nonfinite(b, h, i);
    for (int64_t i = begin; i < end; i += kQ8Block) {
      q8_block(b, h, i, i + kQ8Block < end ? i + kQ8Block : end);
    }
    return bad;
  }
  for (int64_t i = begin; i < end; ++i) {
    bad |= element_nonfinite(b, h, i);
    adam_element(b, h, i);
  }
  return bad;
}

double pow10(int e) {  // 10^e for small |e|, from an exact power of ten
  double p = 1.0;
  for (int i = 0; i < (e < 0 ? -e : e); ++i) p *= 10.0;
  return e < 0 ? 1.0 / p : p;
}

// One map of [Note: int8 moments], in double, each constant rounded once to float.
Q8Map make_map(int bits) {
  Q8Map q{};
  q.bits = bits;
  const int n = 1 << bits;
  q.top = n - 1;
  for (int c = 1; c < n; ++c) {
    int k = 0;
    while ((2 << k) <= c) ++k;
    const int z = bits - 1 - k, f = c - (1 << k);
    q.value[c] = static_cast<float>(pow10(-z) * (0.1 + 0.9 * (f + 1) / (1 << k)));
  }
  q.value[0] = 0.0f;
  q.value[n - 1] = 1.0f;
  for (int j = 0; j + 1 < bits; ++j) q.thresh[j] = static_cast<float>(pow10(-(j + 1)));
  for (int z = 0; z < bits; ++z) {
    const int k = bits - 1 - z;
    if (z + 1 < bits) {
      q.a[z] = static_cast<float>((1 << k) * pow10(z) / 0.9);
      q.b[z] = static_cast<float>(-(0.1 * (1 << k) / 0.9) - 1.0);
      q.base[z] = 1 << k;
      q.lo[z] = (1 << k) - 1;
      q.hi[z] = (2 << k) - 1;
    } else {  // the bottom decade: the lattice {0, 10^-(bits-1)}
      q.a[z] = static_cast<float>(pow10(bits - 1));
      q.b[z] = 0.0f;
      q.base[z] = 0;
      q.lo[z] = bits == 8 ? 1 : 0;  // (a positive exp_avg_sq never encodes to 0)
      q.hi[z] = 1;
    }
  }
  if (bits == 7) {  // signed: the sign bit on top of every magnitude code
    for (int c = 0; c < 128; ++c) q.value[c | 0x80] = -q.value[c];
    q.value[0x80] = 0.0f;
  }
  return q;
}

}  // namespace

const Q8Tables& q8_tables() {
  static const Q8Tables t{make_map(7), make_map(8)};
  return t;
}

const AdamKernels& scalar_kernels() {
  static const AdamKernels k{"scalar", &scalar_has_nonfinite, &scalar_update};
  return k;
}

}  // namespace oz
