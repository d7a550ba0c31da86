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

  // Builds the library layout from the attribute layout:
  //   packed: uint8 [N, K_padded / 2], element k of row n in byte k / 2, even k in the
  //           low nibble, code = q + 8;  scales: float32 [N, groups];  bias: [N] or null.
  // Returns an empty string on success, else what is wrong (the caller names the node).
  std::string build(int64_t K, int64_t N, int64_t group_size, const uint8_t* packed,
                    const float* scales, const float* bias);

 private:
  struct FreeDeleter {
    void operator()(void* p) const;
  };
  std::unique_ptr<uint8_t, FreeDeleter> nibbles_;
  std::unique_ptr<float, FreeDeleter> scales_;
  std::unique_ptr<float, FreeDeleter> bias_;
  PackedWeights w_;
};

// True for the group sizes the op accepts: 16, 32, 64, 128, 256.
bool is_supported_group_size(int64_t group_size);

}  // namespace cim
