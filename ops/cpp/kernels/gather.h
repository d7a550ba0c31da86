// Row gather from a table in the exporter's codes/scales format: plain structs, no ORT.
//
// The table is the same codes/scales pair a CimInt4MatMul reads (repack.h documents it):
// `packed` uint8 [rows, K_padded * bits / 8], each row one little-endian bit stream of
// codes q + 2^(bits-1); `scales` float32, float16 or int8 [rows, groups] (int8: times the
// float16 `super_scales` [rows, ceil(groups / kSuperGroups)] / 128, an exact product). Row r
// dequantizes to
//   y[k] = scale(r, k / group_size) * float(q(code(r, k)))   (k < K)
// with q = code - 2^(bits-1) on the uniform grid, else the code's level (kernel.h's CodeLevels),
// one float32 product, so it is exact to the last bit against the NumPy reference.
#pragma once

#include <cstdint>

#include "kernels/kernel.h"

namespace cim {

struct Int4Table {
  const uint8_t* packed = nullptr;  // [rows, groups * group_size * bits / 8]
  const void* scales = nullptr;     // [rows, groups] of scale_type (kernel.h's ScaleType)
  int scale_type = 0;               // kScaleF32
  const uint16_t* super_scales = nullptr;  // int8 scales: float16 bits [rows, ceil(groups / kSuperGroups)]
  int bits = 4;
  CodeLevels levels;  // what each code stands for (make_levels)
  int64_t rows = 0;
  int64_t K = 0;  // row width after dequantization
  int64_t group_size = 0;
  int64_t groups = 0;  // ceil(K / group_size)
};

// Writes the rows rows[i] (already checked to lie in [0, table.rows)) for i in [begin, end)
// to Y + i * K. Reads only those rows of the table.
void gather_rows(const Int4Table& table, const int64_t* rows, int64_t begin, int64_t end, float* Y);

}  // namespace cim
