// Portable C++ is enough here: one row is K / 2 bytes of codes and K / group_size scales,
// so a token costs a few hundred bytes of reads; the per-group table of the 16 products
// turns each code byte into two table loads, which compilers vectorize well enough.
#include "kernels/gather.h"

namespace cim {

void gather_rows(const Int4Table& t, const int64_t* rows, int64_t begin, int64_t end, float* Y) {
  const int64_t row_bytes = t.groups * t.group_size / 2;
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* codes = t.packed + rows[i] * row_bytes;
    const float* scales = t.scales + rows[i] * t.groups;
    float* y = Y + i * t.K;
    for (int64_t g = 0; g < t.groups; ++g) {
      float level[16];
      for (int c = 0; c < 16; ++c) level[c] = scales[g] * static_cast<float>(c - 8);
      const int64_t k0 = g * t.group_size;
      const int64_t k1 = k0 + t.group_size < t.K ? k0 + t.group_size : t.K;
      int64_t k = k0;
      for (; k + 1 < k1; k += 2) {
        const uint8_t byte = codes[k / 2];
        y[k] = level[byte & 0x0F];
        y[k + 1] = level[byte >> 4];
      }
      if (k < k1) y[k] = level[codes[k / 2] & 0x0F];  // odd K: the last low nibble
    }
  }
}

}  // namespace cim
