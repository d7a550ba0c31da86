// Repacking from the node-attribute format (the exporter's contract) to PackedWeights.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/kernel.h"

namespace cim {

// Owns the aligned buffers that a PackedWeights points into.
class PackedStorage {
 public:
  PackedStorage() = default;
  const PackedWeights& weights() const { return w_; }

  // Builds the tile layout (kernel.h) from the attribute layout:
  //   packed: uint8 [N, K_padded * bits / 8], row n one little-endian bit stream, element
  //           k in bits k*bits .. k*bits + bits-1 (attribute_code), code = q + 2^(bits-1)
//           (uniform grid; else q = the code's level, kernel.h's CodeLevels);
  //   scales: [N, groups] of scale_type: float32, float16 bits or int8;
  //   super_scales: int8 scales only, float16 bits [N, ceil(groups / kSuperGroups)];
  //   bias: [N] or null;
  //   grid: what a code stands for, an index into contract::kGrids (0 uniform, 1 normal).
  // Checks first (padding codes, finite scales with top|scale| finite in float32 (top: the
  // grid's largest |q|, 2^(bits-1) uniform),
  // finite super-scales and bias), so nothing is allocated for bad input. Returns an empty
  // string on success, else what is wrong (the caller names the node). The caller may free
  // its inputs afterwards.
  std::string build(int64_t K, int64_t N, int64_t group_size, int bits, const uint8_t* packed, const void* scales,
                    int scale_type, const uint16_t* super_scales, const float* bias, int grid = 0);

  // Bytes this object holds (the stream and the bias).
  int64_t bytes() const { return stream_bytes_ + bias_bytes_; }

 private:
  struct FreeDeleter {
    void operator()(void* p) const;
  };
  std::unique_ptr<uint8_t, FreeDeleter> stream_;
  std::unique_ptr<float, FreeDeleter> bias_;
  int64_t stream_bytes_ = 0;
  int64_t bias_bytes_ = 0;
  PackedWeights w_;
};

// Memory for a weight stream of `bytes` (64-byte aligned; from 4 MiB on, 2 MiB aligned
// and advised to use transparent huge pages). Free it with std::free.
void* allocate_stream(int64_t bytes);

// Code k (0 .. 2^bits - 1) of one row of the attribute format (a little-endian bit stream).
inline int attribute_code(const uint8_t* row, int64_t k, int bits) {
  const int64_t bit = k * bits;
  const int shift = int(bit % 8);
  int v = row[bit / 8] >> shift;
  if (shift + bits > 8) v |= row[bit / 8 + 1] << (8 - shift);
  return v & ((1 << bits) - 1);
}

// Scale g of row r of the attribute format ([rows, groups] of scale_type; int8 scales times
// their float16 super_scales [rows, supers_of(groups)] / 128, exact) as every kernel reads it.
inline float attribute_scale(const void* scales, int scale_type, const uint16_t* super_scales, int64_t groups,
                             int64_t r, int64_t g) {
  const int64_t i = r * groups + g;
  if (scale_type == kScaleI8) {
    const float d = half_to_float(super_scales[r * supers_of(groups) + g / kSuperGroups]) / kInt8ScaleOne;
    return static_cast<float>(static_cast<const int8_t*>(scales)[i]) * d;  // both exact
  }
  if (scale_type == kScaleF16) return half_to_float(static_cast<const uint16_t*>(scales)[i]);
  return static_cast<const float*>(scales)[i];
}

// True for the widths the op accepts (contract::kBits).
bool is_supported_bits(int64_t bits);

// True for the group sizes the op accepts (contract::kGroupSizes, from src/cim_int4/contract.py).
bool is_supported_group_size(int64_t group_size);

// Largest K and N the op accepts: every size computed from them (bytes of the stream,
// of A's int8 copy, of the attributes) then fits int64_t with room to spare.
constexpr int64_t kMaxDim = int64_t(1) << 31;

}  // namespace cim
