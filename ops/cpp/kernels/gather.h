// Row gather from an int4 table in the exporter's codes/scales format: plain structs, no ORT.
//
// The table is the same codes/scales pair a CimInt4MatMul reads (repack.h documents it):
// `packed` uint8 [rows, K_padded / 2], element k of row r in byte k / 2, even k in the low
// nibble, code = q + 8; `scales` float32 [rows, groups]. Row r dequantizes to
//   y[k] = scales[r, k / group_size] * float(code(r, k) - 8)    (one float32 product, k < K)
// which is exact to the last bit against the NumPy reference.
#pragma once

#include <cstdint>

namespace cim {

struct Int4Table {
  const uint8_t* packed = nullptr;  // [rows, groups * group_size / 2]
  const float* scales = nullptr;    // [rows, groups]
  int64_t rows = 0;
  int64_t K = 0;  // row width after dequantization
  int64_t group_size = 0;
  int64_t groups = 0;  // ceil(K / group_size)
};

// Writes the rows rows[i] (already checked to lie in [0, table.rows)) for i in [begin, end)
// to Y + i * K. Reads only those rows of the table.
void gather_rows(const Int4Table& table, const int64_t* rows, int64_t begin, int64_t end, float* Y);

}  // namespace cim
