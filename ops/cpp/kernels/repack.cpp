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

static_assert(kSuperGroups == contract::kSuperGroups && kInt8ScaleOne == contract::kInt8ScaleOne,
              "kernel.h's int8 scales disagree with the contract");
constexpr int64_t kAlign = 64;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void* aligned_bytes(int64_t bytes) {
  void* p = std::aligned_alloc(kAlign, static_cast<size_t>(round_up(bytes > 0 ? bytes : 1, kAlign)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

std::string check_attributes(int64_t K, int64_t N, int64_t group_size, int bits, int top, const uint8_t* packed,
                             const void* scales, int scale_type, const uint16_t* super_scales, const float* bias) {
  const int64_t groups = (K + group_size - 1) / group_size;
  const int64_t k_padded = groups * group_size;
  const int64_t in_row_bytes = k_padded * bits / 8;
  const int offset = 1 << (bits - 1);
  // The contract pads K with the code 2^(bits-1) (q = 0 on the uniform grid); anything else means the packer disagrees with us
  // about the layout, which would otherwise go unnoticed.
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = packed + n * in_row_bytes;
    for (int64_t k = K; k < k_padded; ++k) {
      if (attribute_code(row, k, bits) != offset) {
        std::ostringstream msg;
        msg << "attribute 'packed': padding code at row " << n << ", k=" << k << " is "
            << attribute_code(row, k, bits) << ", expected " << offset << " for every k >= K=" << K;
        return msg.str();
      }
    }
  }
  if (scale_type == kScaleI8) {
    const int64_t supers = supers_of(groups);
    for (int64_t i = 0; i < N * supers; ++i) {
      const float d = half_to_float(super_scales[i]);
      if (!std::isfinite(d)) {
        std::ostringstream msg;
        msg << "attribute 'super_scales': value " << d << " at row " << i / supers << ", super-block " << i % supers
            << " is not finite";
        return msg.str();
      }
    }
  }
  for (int64_t i = 0; i < N * groups; ++i) {
    // Any sign (ORT's and llama.cpp's symmetric rule map the largest-magnitude weight to
    // -2^(b-1), so the scale takes its sign); top*|scale| (top: the grid's largest |q|)
    // bounds every dequantized weight, so it must be finite too (a finite float16 always is).
    const float s = attribute_scale(scales, scale_type, super_scales, groups, i / groups, i % groups);
    if (!std::isfinite(s) || !std::isfinite(float(top) * s)) {
      std::ostringstream msg;
      msg << "attribute 'scales': value " << s << " at row " << i / groups << ", group " << i % groups
          << " is not a finite number with " << top << "*|scale| finite";
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

// Codes of block (t, g) for bits != 4, written spot by spot (kernel.h's code_spot).
void write_block_codes(uint8_t* block, const uint8_t* packed, int64_t in_row_bytes, int64_t t, int64_t g,
                       int64_t N, int64_t group_size, int bits) {
  const Planes p = planes_of(bits);
  const int offset = 1 << (bits - 1);
  for (int64_t c = 0; c < kTileN; ++c) {
    const int64_t n = t * kTileN + c;
    for (int64_t j = 0; j < group_size; ++j) {
      const int code = n < N ? attribute_code(packed + n * in_row_bytes, g * group_size + j, bits) : offset;
      const CodeSpot s = code_spot(bits, group_size, c, j);
      block[s.lo_byte] = static_cast<uint8_t>(block[s.lo_byte] | ((code & ((1 << p.lo) - 1)) << s.lo_shift));
      if (p.hi > 0) block[s.hi_byte] = static_cast<uint8_t>(block[s.hi_byte] | ((code >> p.lo) << s.hi_shift));
    }
  }
}

// Codes of block (t, g) for bits = 4 (the common case, a byte at a time): codes
// k0..k0+7 (k0 even) are the nibbles of source bytes s[0..3], low first: lane byte b
// takes code k0+b (low) and k0+4+b (high).
void write_block_codes_4bit(uint8_t* block, const uint8_t* packed, int64_t in_row_bytes, int64_t t, int64_t g,
                            int64_t N, int64_t group_size) {
  for (int64_t c = 0; c < kTileN; ++c) {
    const int64_t n = t * kTileN + c;
    const uint8_t* src = packed + n * in_row_bytes;
    for (int64_t v = 0; v < group_size / 8; ++v) {
      uint8_t* lane = block + v * kCodeRowBytes + 4 * c;
      if (n >= N) {
        std::memset(lane, 0x88, 4);
        continue;
      }
      const uint8_t* s = src + (g * group_size + 8 * v) / 2;
      lane[0] = static_cast<uint8_t>((s[0] & 0x0F) | (s[2] << 4));
      lane[1] = static_cast<uint8_t>((s[0] >> 4) | (s[2] & 0xF0));
      lane[2] = static_cast<uint8_t>((s[1] & 0x0F) | (s[3] << 4));
      lane[3] = static_cast<uint8_t>((s[1] >> 4) | (s[3] & 0xF0));
    }
  }
}

}  // namespace

bool make_levels(int bits, int grid, CodeLevels* out) {
  static_assert(kLevelBits == 3 && std::size(contract::kNormalLevels2) == 4 && std::size(contract::kNormalLevels3) == 8,
                "kernel.h's level tables disagree with the contract's grids");
  for (int64_t b : contract::kGridBits) {
    if (b > kLevelBits) return false;  // a grid of a width the kernels read without a table: never run it as uniform
  }
  CodeLevels l;
  l.zero = 1 << (bits - 1);
  l.uniform = grid == 0;
  if (grid < 0 || grid >= int(std::size(contract::kGrids))) return false;
  if (grid != 0 && std::find(std::begin(contract::kGridBits), std::end(contract::kGridBits), bits) ==
                       std::end(contract::kGridBits)) {
    return false;
  }
  if (bits <= kLevelBits) {
    const int* normal = bits == 2 ? contract::kNormalLevels2 : contract::kNormalLevels3;
    const int codes = 1 << bits;
    if (grid != 0) l.zero = -normal[0];  // levels ascend: the first is the most negative
    for (int c = 0; c < codes; ++c) {
      const int q = grid == 0 ? c - (1 << (bits - 1)) : normal[c];
      if (q + l.zero < 0 || q + l.zero > max_u(bits)) return false;  // int8 mode's u8 would not fit its bound
      l.q[c] = static_cast<int8_t>(q);
      l.u[c] = static_cast<uint8_t>(q + l.zero);
    }
  }
  *out = l;
  return true;
}

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

bool is_supported_bits(int64_t bits) {
  return std::find(std::begin(contract::kBits), std::end(contract::kBits), bits) != std::end(contract::kBits);
}

std::string PackedStorage::build(int64_t K, int64_t N, int64_t group_size, int bits, const uint8_t* packed,
                                 const void* scales, int scale_type, const uint16_t* super_scales,
                                 const float* bias, int grid) {
  CodeLevels levels;
  if (!make_levels(bits, grid, &levels)) return "attribute 'grid': not a grid of codes of " + std::to_string(bits) + " bits";
  int top = 0;
  for (int c = 0; c < (1 << bits); ++c) top = std::max(top, std::abs(code_q(bits, levels, c)));
  std::string problem = check_attributes(K, N, group_size, bits, top, packed, scales, scale_type, super_scales, bias);
  if (!problem.empty()) return problem;

  const int64_t groups = (K + group_size - 1) / group_size;
  const int64_t in_row_bytes = groups * group_size * bits / 8;
  const int64_t scale_size = scale_size_of(scale_type);
  const int64_t supers = scale_type == kScaleI8 ? supers_of(groups) : 0;
  w_ = PackedWeights{};
  w_.K = K;
  w_.N = N;
  w_.group_size = group_size;
  w_.groups = groups;
  w_.tiles = (N + kTileN - 1) / kTileN;
  w_.block_bytes = block_bytes_of(bits, group_size, scale_type);
  w_.bits = bits;
  w_.levels = levels;
  w_.scale_type = scale_type;
  w_.super_bytes = supers > 0 ? kTileN * 2 : 0;
  const int64_t code_bytes = w_.code_bytes();
  stream_bytes_ = w_.tiles * w_.strip_bytes_per_tile();
  stream_.reset(static_cast<uint8_t*>(allocate_stream(stream_bytes_)));
  w_.stream = stream_.get();
  // Every byte is written below except in the super-scale records (padding channels: zero).
  if (supers > 0) std::memset(stream_.get(), 0, static_cast<size_t>(stream_bytes_));

  for (int64_t t = 0; t < w_.tiles; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      auto* block = const_cast<uint8_t*>(w_.block(t, g));
      if (bits == 4) {
        write_block_codes_4bit(block, packed, in_row_bytes, t, g, N, group_size);
      } else {
        std::memset(block, 0, static_cast<size_t>(code_bytes));
        write_block_codes(block, packed, in_row_bytes, t, g, N, group_size, bits);
      }
      // Scales as given (float16 stays float16, int8 int8); padding channels get scale 0.
      for (int64_t c = 0; c < kTileN; ++c) {
        const int64_t n = t * kTileN + c;
        uint8_t* dst = const_cast<uint8_t*>(w_.scales(t, g)) + c * scale_size;
        if (n < N) {
          std::memcpy(dst, static_cast<const uint8_t*>(scales) + (n * groups + g) * scale_size, size_t(scale_size));
        } else {
          std::memset(dst, 0, size_t(scale_size));
        }
      }
      // A run of kSuperGroups groups starts with its super-scale record (float16 as given).
      if (supers > 0 && g % kSuperGroups == 0) {
        auto* record = const_cast<uint8_t*>(w_.super_of(t, g));
        for (int64_t c = 0; c < kTileN && t * kTileN + c < N; ++c) {
          std::memcpy(record + 2 * c, super_scales + (t * kTileN + c) * supers + g / kSuperGroups, 2);
        }
      }
    }
  }
  if (bias != nullptr) {
    bias_bytes_ = w_.tiles * kTileN * int64_t(sizeof(float));
    bias_.reset(static_cast<float*>(aligned_bytes(bias_bytes_)));
    std::memset(bias_.get(), 0, static_cast<size_t>(bias_bytes_));
    std::memcpy(bias_.get(), bias, static_cast<size_t>(N) * sizeof(float));
  }
  w_.bias = bias_.get();
  return {};
}

}  // namespace cim
