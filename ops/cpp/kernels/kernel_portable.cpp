// The portable kernels: plain C++, every CPU. They are the oracle that each SIMD path
// is tested against, so they favour clarity over speed, and they perform exactly the
// arithmetic of ops/reference.py's `emulate` for both compute modes and every code width
// (per output: groups in order; fp32 mode sums a * (c - o) by fma within a group, o =
// 2^(bits-1), and adds sum * scale by fma; int8 mode adds the exact integer group dot
// product times a_scale * w_scale). They also hold the layout's one definition in code
// (code_spot), which repack() writes by.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/kernel.h"

namespace cim {

CodeSpot code_spot(int bits, int64_t group_size, int64_t c, int64_t j) {
  const Planes p = planes_of(bits);
  const int64_t per_chunk = chunk_codes(group_size);
  const int64_t chunk = j / per_chunk, quad = j % per_chunk / 4, byte = j % 4;
  const int64_t base = chunk * chunk_bytes(bits, group_size) + 4 * c + byte;
  CodeSpot s{};
  s.lo_byte = base + quad * p.lo / 8 * kCodeRowBytes;
  s.lo_shift = p.lo * int(quad % (8 / p.lo));
  if (p.hi > 0) {
    s.hi_byte = base + (low_rows(bits, group_size) + quad * p.hi / 8) * kCodeRowBytes;
    s.hi_shift = p.hi * int(quad % (8 / p.hi));
  }
  return s;
}

int code_in_block(const PackedWeights& w, const uint8_t* block, int64_t c, int64_t j) {
  const Planes p = planes_of(w.bits);
  const CodeSpot s = code_spot(w.bits, w.group_size, c, j);
  int code = (block[s.lo_byte] >> s.lo_shift) & ((1 << p.lo) - 1);
  if (p.hi > 0) code |= ((block[s.hi_byte] >> s.hi_shift) & ((1 << p.hi) - 1)) << p.lo;
  return code;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf or NaN (payload kept)
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal: mantissa * 2^-24, normalised (a float32 normal number).
    int e = 113;  // 127 - 14
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --e;
    }
    bits = sign | (uint32_t(e) << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float scale_of(const PackedWeights& w, int64_t tile, int64_t group, int64_t c) {
  const uint8_t* p = w.scales(tile, group);
  if (w.scale_type == kScaleI8) {
    uint16_t h;
    std::memcpy(&h, w.super_of(tile, group) + 2 * c, sizeof h);
    return static_cast<float>(static_cast<int8_t>(p[c])) * (half_to_float(h) / kInt8ScaleOne);  // both exact
  }
  if (w.scale_type == kScaleF16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * c, sizeof h);
    return half_to_float(h);
  }
  float s;
  std::memcpy(&s, p + 4 * c, sizeof s);
  return s;
}

namespace {

float read_float(const float* p) {
  float x;
  std::memcpy(&x, p, sizeof x);  // A may come from a caller's buffer at any address
  return x;
}

// Calls out(m, n, value) for every output of the tiles, after adding the bias.
template <typename Acc>
void for_each_output(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end, Acc&& acc_of) {
  const PackedWeights& w = *args.W;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    for (int64_t c = 0; c < kTileN && t * kTileN + c < w.N; ++c) {
      const int64_t n = t * kTileN + c;
      for (int64_t m = 0; m < args.M; ++m) {
        float y = acc_of(t, c, m);
        if (w.bias != nullptr) y += w.bias[n];
        args.Y[m * args.ldy + n] = y;
      }
    }
  }
}

void matmul_fp32_portable(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
  const PackedWeights& w = *args.W;
  for_each_output(args, tile_begin, tile_end, [&](int64_t t, int64_t c, int64_t m) {
    const float* a = args.A + m * args.lda;
    float acc = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* block = w.block(t, g);
      const int64_t k0 = g * w.group_size;
      float sum = 0.0f;
      for (int64_t j = 0; j < w.group_size && k0 + j < w.K; ++j) {
        sum = std::fma(read_float(a + k0 + j), static_cast<float>(q_of(w, code_in_block(w, block, c, j))), sum);
      }
      acc = std::fma(sum, scale_of(w, t, g, c), acc);
    }
    return acc;
  });
}

void matmul_int8_portable(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
  const PackedWeights& w = *args.W;
  const QuantizedA& qa = *args.QA;
  const int64_t k_padded = w.groups * w.group_size;
  for_each_output(args, tile_begin, tile_end, [&](int64_t t, int64_t c, int64_t m) {
    float acc = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* block = w.block(t, g);
      const int8_t* q = qa.q + m * k_padded + g * w.group_size;
      int32_t dot = -w.levels.zero * qa.qsum[m * w.groups + g];
      for (int64_t j = 0; j < w.group_size; ++j) dot += int32_t(q[j]) * u_of(w, code_in_block(w, block, c, j));
      const float scale = qa.scale[m * w.groups + g] * scale_of(w, t, g, c);
      acc = std::fma(static_cast<float>(dot), scale, acc);
    }
    return acc;
  });
}

}  // namespace

void quantize_group_portable(const float* a, int64_t len, int64_t group_size, int8_t* q, float* scale,
                             int32_t* qsum) {
  float amax = 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    const float x = std::fabs(read_float(a + j));
    if (std::isnan(x) || x > amax) amax = x;  // NaN wins: the group's output must not look finite
    if (std::isnan(x)) break;
  }
  const float inv = 127.0f / amax;
  int32_t sum = 0;
  std::memset(q, 0, static_cast<size_t>(group_size));
  if (!std::isfinite(amax)) {
    *scale = amax;  // inf or NaN: the output is recomputed exactly
  } else if (amax == 0.0f || !std::isfinite(inv)) {
    *scale = 0.0f;  // zero, or below 127 / FLT_MAX: counts as zero
  } else {
    for (int64_t j = 0; j < len; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(read_float(a + j) * inv));
      sum += q[j];
    }
    *scale = amax / 127.0f;
  }
  *qsum = sum;
}

void quantize_a_portable(const float* A, int64_t M, int64_t lda, int64_t K, int64_t group_size, int8_t* q,
                         float* scale, int32_t* qsum) {
  const int64_t groups = (K + group_size - 1) / group_size;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * group_size;
      const int64_t len = k0 + group_size <= K ? group_size : K - k0;
      quantize_group_portable(A + m * lda + k0, len, group_size, q + (m * groups + g) * group_size,
                              scale + m * groups + g, qsum + m * groups + g);
    }
  }
}

void recompute_nonfinite(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
  const PackedWeights& w = *args.W;
  const int64_t n_end = tile_end * kTileN < w.N ? tile_end * kTileN : w.N;
  for (int64_t m = 0; m < args.M; ++m) {
    float* y = args.Y + m * args.ldy;
    const float* a = args.A + m * args.lda;
    int has_nan = -1;  // unknown until an output of the row needs it
    for (int64_t n = tile_begin * kTileN; n < n_end; ++n) {
      if (std::isfinite(y[n])) continue;
      if (has_nan < 0) {
        has_nan = 0;
        for (int64_t k = 0; k < w.K && !has_nan; ++k) has_nan = std::isnan(read_float(a + k));
      }
      if (has_nan) continue;  // every output of the row is NaN in exact arithmetic too
      const int64_t t = n / kTileN, c = n % kTileN;
      double sum = 0.0;
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* block = w.block(t, g);
        const double scale = scale_of(w, t, g, c);
        const int64_t k0 = g * w.group_size;
        for (int64_t j = 0; j < w.group_size && k0 + j < w.K; ++j) {
          sum += double(read_float(a + k0 + j)) * (double(q_of(w, code_in_block(w, block, c, j))) * scale);
        }
      }
      if (w.bias != nullptr) sum += w.bias[n];
      y[n] = static_cast<float>(sum);
    }
  }
}

const KernelTable& portable_kernels() {
  static const KernelVariant variants[] = {{"portable", {matmul_fp32_portable, matmul_int8_portable}}};
  // One kernel reads every width.
  static const KernelVariant widths[kMaxBits + 1] = {
      {}, {}, variants[0], variants[0], variants[0], variants[0], variants[0], {}, variants[0]};
  static const KernelTable table{"portable", variants, 1, {0, 0}, quantize_a_portable, widths, widths};
  return table;
}

}  // namespace cim
