#include "kernels/repack.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

namespace cim {
namespace {

constexpr int64_t kAlign = 64;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void* aligned_bytes(int64_t bytes) {
  void* p = std::aligned_alloc(kAlign, static_cast<size_t>(round_up(bytes > 0 ? bytes : 1, kAlign)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

uint8_t code_at(const uint8_t* row, int64_t k) {
  const uint8_t byte = row[k / 2];
  return (k % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
}

}  // namespace

void PackedStorage::FreeDeleter::operator()(void* p) const { std::free(p); }

bool is_supported_group_size(int64_t g) {
  return g == 16 || g == 32 || g == 64 || g == 128 || g == 256;
}

std::string PackedStorage::build(int64_t K, int64_t N, int64_t group_size, const uint8_t* packed,
                                 const float* scales, const float* bias) {
  const int64_t groups = (K + group_size - 1) / group_size;
  const int64_t k_padded = groups * group_size;
  const int64_t in_row_bytes = k_padded / 2;
  const int64_t unit = group_size < 32 ? group_size : 32;
  const int64_t half = unit / 2;

  // The contract pads K with q = 0 (code 8); anything else means the packer
  // disagrees with us about the layout, which would otherwise go unnoticed.
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = packed + n * in_row_bytes;
    for (int64_t k = K; k < k_padded; ++k) {
      if (code_at(row, k) != 8) {
        std::ostringstream msg;
        msg << "attribute 'packed': padding code at row " << n << ", k=" << k << " is "
            << int(code_at(row, k)) << ", expected 8 (q = 0) for every k >= K=" << K;
        return msg.str();
      }
    }
  }
  for (int64_t i = 0; i < N * groups; ++i) {
    // Any sign (ORT's and llama.cpp's symmetric rule map the largest-magnitude weight to
    // -8, so the scale takes its sign); 8*|scale| bounds every dequantized weight, so it
    // must be finite too.
    if (!std::isfinite(scales[i]) || !std::isfinite(8.0f * scales[i])) {
      std::ostringstream msg;
      msg << "attribute 'scales': value " << scales[i] << " at row " << i / groups << ", group "
          << i % groups << " is not a finite number with 8*|scale| finite (|scale| <= 4.25e37)";
      return msg.str();
    }
  }
  if (bias != nullptr) {
    for (int64_t n = 0; n < N; ++n) {
      if (!std::isfinite(bias[n])) {
        std::ostringstream msg;
        msg << "attribute 'bias': value " << bias[n] << " at index " << n << " is not finite";
        return msg.str();
      }
    }
  }

  const int64_t row_bytes = round_up(in_row_bytes, kAlign);
  nibbles_.reset(static_cast<uint8_t*>(aligned_bytes(row_bytes * N)));
  std::memset(nibbles_.get(), 0x88, static_cast<size_t>(row_bytes * N));
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* src = packed + n * in_row_bytes;
    uint8_t* dst = nibbles_.get() + n * row_bytes;
    for (int64_t u0 = 0; u0 < k_padded; u0 += unit) {
      for (int64_t j = 0; j < half; ++j) {
        dst[u0 / 2 + j] =
            static_cast<uint8_t>(code_at(src, u0 + j) | (code_at(src, u0 + j + half) << 4));
      }
    }
  }
  scales_.reset(static_cast<float*>(aligned_bytes(N * groups * int64_t(sizeof(float)))));
  std::memcpy(scales_.get(), scales, static_cast<size_t>(N * groups) * sizeof(float));
  if (bias != nullptr) {
    bias_.reset(static_cast<float*>(aligned_bytes(N * int64_t(sizeof(float)))));
    std::memcpy(bias_.get(), bias, static_cast<size_t>(N) * sizeof(float));
  }

  w_ = PackedWeights{};
  w_.K = K;
  w_.N = N;
  w_.group_size = group_size;
  w_.groups = groups;
  w_.unit = unit;
  w_.row_bytes = row_bytes;
  w_.nibbles = nibbles_.get();
  w_.scales = scales_.get();
  w_.bias = bias_.get();
  return {};
}

}  // namespace cim
