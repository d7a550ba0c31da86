// Random layers and a plain read of their streams, for the bench tools (chain_bench,
// layers_bench, width_bench): tools only.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernel.h"
#include "kernels/repack.h"

// st.build of a K x N layer of `bits`-bit random codes, group 32, with scales of scale_type:
// float16 near 2^-7 (0x2000 + 10 random mantissa bits), int8 1 .. 127 under such float16
// super-scales, or float32 near 2^-7. Returns build's problem ("" when built).
inline std::string random_layer(cim::PackedStorage& st, int64_t K, int64_t N, int bits, int scale_type,
                                std::mt19937& rng) {
  const int64_t groups = K / 32;
  std::vector<uint8_t> packed(static_cast<size_t>(N * K * bits / 8));
  for (auto& b : packed) b = static_cast<uint8_t>(rng());
  auto half = [&] { return static_cast<uint16_t>(0x2000 + (rng() & 0x3ff)); };
  if (scale_type == cim::kScaleI8) {
    std::vector<uint16_t> supers(static_cast<size_t>(N * cim::supers_of(groups)));
    for (auto& x : supers) x = half();
    std::vector<int8_t> steps(static_cast<size_t>(N * groups));
    for (auto& x : steps) x = static_cast<int8_t>(1 + rng() % 127);
    return st.build(K, N, 32, bits, packed.data(), steps.data(), cim::kScaleI8, supers.data(), nullptr);
  }
  if (scale_type == cim::kScaleF16) {
    std::vector<uint16_t> scales(static_cast<size_t>(N * groups));
    for (auto& x : scales) x = half();
    return st.build(K, N, 32, bits, packed.data(), scales.data(), cim::kScaleF16, nullptr, nullptr);
  }
  std::vector<float> scales(static_cast<size_t>(N * groups));
  for (auto& x : scales) x = 0.0078125f * (1.0f + static_cast<float>(rng() % 100) / 100.0f);
  return st.build(K, N, 32, bits, packed.data(), scales.data(), cim::kScaleF32, nullptr, nullptr);
}

// One byte of each 64-byte line of st's stream, summed (the caller keeps the sum, so the
// loads stay): a read of the stream's lines in order, the speed the kernels are held against.
inline uint64_t touch_stream(const cim::PackedStorage& st) {
  const uint8_t* p = st.weights().stream;
  uint64_t sum = 0;
  for (int64_t i = 0; i < st.bytes(); i += 64) sum += p[i];
  return sum;
}
