#include "kernels/repack.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <new>
#include <sstream>

#include "cim_int4_contract.h"

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

std::string check_attributes(int64_t K, int64_t N, int64_t group_size, const uint8_t* packed, const float* scales,
                             const float* bias) {
  const int64_t groups = (K + group_size - 1) / group_size;
  const int64_t k_padded = groups * group_size;
  const int64_t in_row_bytes = k_padded / 2;
  // The contract pads K with q = 0 (code 8); anything else means the packer
  // disagrees with us about the layout, which would otherwise go unnoticed.
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = packed + n * in_row_bytes;
    for (int64_t k = K; k < k_padded; ++k) {
      if (code_at(row, k) != 8) {
        std::ostringstream msg;
        msg << "attribute 'packed': padding code at row " << n << ", k=" << k << " is " << int(code_at(row, k))
            << ", expected 8 (q = 0) for every k >= K=" << K;
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
      msg << "attribute 'scales': value " << scales[i] << " at row " << i / groups << ", group " << i % groups
          << " is not a finite number with 8*|scale| finite (|scale| <= 4.25e37)";
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
  return {};
}

}  // namespace

// The weight stream: decode reads it once per call, front to back, at DRAM speed. On 4 KiB
// pages that is a TLB miss every 64 cache lines, and hardware prefetchers stop at each
// page; a stream of several MiB starts on a 2 MiB boundary and asks for transparent huge
// pages (only whole 2 MiB pages inside it become huge: no memory is added).
constexpr int64_t kHugePage = int64_t(1) << 21;

void* allocate_stream(int64_t bytes) {
  if (bytes < 2 * kHugePage) return aligned_bytes(bytes);
  // aligned_alloc wants a size that is a multiple of the alignment (ASan enforces it).
  void* p = std::aligned_alloc(kHugePage, static_cast<size_t>(round_up(bytes, kHugePage)));
  if (p == nullptr) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  madvise(p, static_cast<size_t>(bytes / kHugePage * kHugePage), MADV_HUGEPAGE);  // advice only: ignore failure
#endif
  return p;
}

void PackedStorage::FreeDeleter::operator()(void* p) const { std::free(p); }

bool is_supported_group_size(int64_t g) {
  return std::find(std::begin(contract::kGroupSizes), std::end(contract::kGroupSizes), g) != std::end(contract::kGroupSizes);
}

std::string PackedStorage::build(int64_t K, int64_t N, int64_t group_size, const uint8_t* packed,
                                 const float* scales, const float* bias) {
  std::string problem = check_attributes(K, N, group_size, packed, scales, bias);
  if (!problem.empty()) return problem;

  const int64_t groups = (K + group_size - 1) / group_size;
  const int64_t in_row_bytes = groups * group_size / 2;
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  const int64_t rows_per_group = group_size / 8;
  const int64_t block_bytes = rows_per_group * kCodeRowBytes + kTileN * int64_t(sizeof(float));
  stream_bytes_ = tiles * groups * block_bytes;
  stream_.reset(static_cast<uint8_t*>(allocate_stream(stream_bytes_)));

  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t strip0 = t / kStripTiles * kStripTiles;
      const int64_t width = tiles - strip0 < kStripTiles ? tiles - strip0 : kStripTiles;
      uint8_t* block = stream_.get() + (strip0 * groups + g * width + (t - strip0)) * block_bytes;
      float* block_scales = reinterpret_cast<float*>(block + rows_per_group * kCodeRowBytes);
      for (int64_t c = 0; c < kTileN; ++c) {
        const int64_t n = t * kTileN + c;
        const uint8_t* src = packed + n * in_row_bytes;
        block_scales[c] = n < N ? scales[n * groups + g] : 0.0f;
        for (int64_t v = 0; v < rows_per_group; ++v) {
          uint8_t* lane = block + v * kCodeRowBytes + 4 * c;
          if (n >= N) {
            std::memset(lane, 0x88, 4);
            continue;
          }
          // Codes k0..k0+7 (k0 even) are the nibbles of source bytes s[0..3], low first:
          // lane byte b takes code k0+b (low) and k0+4+b (high).
          const uint8_t* s = src + (g * group_size + 8 * v) / 2;
          lane[0] = static_cast<uint8_t>((s[0] & 0x0F) | (s[2] << 4));
          lane[1] = static_cast<uint8_t>((s[0] >> 4) | (s[2] & 0xF0));
          lane[2] = static_cast<uint8_t>((s[1] & 0x0F) | (s[3] << 4));
          lane[3] = static_cast<uint8_t>((s[1] >> 4) | (s[3] & 0xF0));
        }
      }
    }
  }
  if (bias != nullptr) {
    bias_bytes_ = tiles * kTileN * int64_t(sizeof(float));
    bias_.reset(static_cast<float*>(aligned_bytes(bias_bytes_)));
    std::memset(bias_.get(), 0, static_cast<size_t>(bias_bytes_));
    std::memcpy(bias_.get(), bias, static_cast<size_t>(N) * sizeof(float));
  }

  w_ = PackedWeights{};
  w_.K = K;
  w_.N = N;
  w_.group_size = group_size;
  w_.groups = groups;
  w_.tiles = tiles;
  w_.block_bytes = block_bytes;
  w_.stream = stream_.get();
  w_.bias = bias_.get();
  return {};
}

}  // namespace cim
