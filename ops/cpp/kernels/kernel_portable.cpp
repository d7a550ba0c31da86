// The portable kernel: plain C++, every CPU. It is the oracle that each SIMD path is
// tested against, so it favours clarity over speed.
#include <vector>

#include "kernels/kernel.h"

namespace cim {
namespace {

// Unpacks row n's codes into q[0, K_padded) as signed values -8..7.
void unpack_row(const PackedWeights& w, int64_t n, int8_t* q) {
  const uint8_t* row = w.nibbles + n * w.row_bytes;
  const int64_t half = w.unit / 2;
  for (int64_t u0 = 0; u0 < w.groups * w.group_size; u0 += w.unit) {
    for (int64_t j = 0; j < half; ++j) {
      const uint8_t byte = row[u0 / 2 + j];
      q[u0 + j] = static_cast<int8_t>((byte & 0x0F) - 8);
      q[u0 + j + half] = static_cast<int8_t>((byte >> 4) - 8);
    }
  }
}

// Summation order: a float dot product per group, scaled, accumulated over groups in
// order, then the bias. The SIMD paths round differently (they scale each weight
// first); tests hold every path to the same worst-case FP32 bound, not to this order.
void matmul_portable(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  const PackedWeights& w = *args.W;
  std::vector<int8_t> q(static_cast<size_t>(w.groups * w.group_size));
  for (int64_t n = n_begin; n < n_end; ++n) {
    unpack_row(w, n, q.data());
    const float* scales = w.scales + n * w.groups;
    for (int64_t m = 0; m < args.M; ++m) {
      const float* a = args.A + m * args.lda;
      float acc = 0.0f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int64_t k0 = g * w.group_size;
        const int64_t k1 = k0 + w.group_size < w.K ? k0 + w.group_size : w.K;
        float dot = 0.0f;
        for (int64_t k = k0; k < k1; ++k) dot += a[k] * static_cast<float>(q[k]);
        acc += dot * scales[g];
      }
      if (w.bias != nullptr) acc += w.bias[n];
      args.Y[m * args.ldy + n] = acc;
    }
  }
}

}  // namespace

const KernelTable& portable_kernels() {
  static const KernelTable table{"portable", matmul_portable};
  return table;
}

}  // namespace cim
