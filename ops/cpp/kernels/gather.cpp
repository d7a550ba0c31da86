// Portable C++ is enough here: one row is K * bits / 8 bytes of codes and K / group_size
// scales, so a token costs a few hundred bytes of reads. 4-bit codes take a per-group
// table of the 16 products (two table loads per code byte, which compilers vectorize
// well enough); other widths read each code from the bit stream and multiply.
#include "kernels/gather.h"

#include "kernels/kernel.h"
#include "kernels/repack.h"

namespace cim {
namespace {

void gather_group_4bit(const uint8_t* codes, float scale, int64_t k0, int64_t k1, float* y) {
  float level[16];
  for (int c = 0; c < 16; ++c) level[c] = scale * static_cast<float>(c - 8);
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    const uint8_t byte = codes[k / 2];
    y[k] = level[byte & 0x0F];
    y[k + 1] = level[byte >> 4];
  }
  if (k < k1) y[k] = level[codes[k / 2] & 0x0F];  // odd K: the last low nibble
}

}  // namespace

void gather_rows(const Int4Table& t, const int64_t* rows, int64_t begin, int64_t end, float* Y) {
  const int64_t row_bytes = t.groups * t.group_size * t.bits / 8;
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* codes = t.packed + rows[i] * row_bytes;
    float* y = Y + i * t.K;
    for (int64_t g = 0; g < t.groups; ++g) {
      const float scale = attribute_scale(t.scales, t.scale_type, t.super_scales, t.groups, rows[i], g);
      const int64_t k0 = g * t.group_size;
      const int64_t k1 = k0 + t.group_size < t.K ? k0 + t.group_size : t.K;
      if (t.bits == 4) {
        gather_group_4bit(codes, scale, k0, k1, y);
        continue;
      }
      for (int64_t k = k0; k < k1; ++k) {
        y[k] = scale * static_cast<float>(code_q(t.bits, t.levels, attribute_code(codes, k, t.bits)));
      }
    }
  }
}

}  // namespace cim
