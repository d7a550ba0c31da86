// Kernel interface of cim-int4: plain structs and function pointers, no ORT.
//
// The op wrapper repacks the node's attributes once (repack.h) and calls one
// KernelTable entry per range of output channels, so ORT's thread pool can split
// the work and tests can call kernels directly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cim {

// Weights in the library's own layout, made once at kernel creation by repack().
//
// Row n (one output channel) starts at `nibbles + n * row_bytes` (64-byte aligned) and
// holds K_padded 4-bit codes in units of `unit` elements (unit = min(group_size, 32)).
// Within a unit of U codes, byte j holds code j in its low nibble and code j + U/2 in
// its high nibble, so a SIMD kernel gets the unit's first half from `byte & 0xF` and the
// second half from `byte >> 4` with no shuffles (the Q4_0 order of ggml).
// Codes are q + 8 in 0..15. Padding past K is code 8 (q = 0).
// Scales are `scales[n * groups + g]`, float32, one per group of group_size codes.
struct PackedWeights {
  int64_t K = 0;
  int64_t N = 0;
  int64_t group_size = 0;
  int64_t groups = 0;     // ceil(K / group_size)
  int64_t unit = 0;       // elements per nibble unit: min(group_size, 32)
  int64_t row_bytes = 0;  // stride between rows of `nibbles`, a multiple of 64
  const uint8_t* nibbles = nullptr;
  const float* scales = nullptr;
  const float* bias = nullptr;  // [N] or nullptr
};

// One call computes Y[m, n] = sum_k A[m, k] * W[k, n] (+ bias[n]) for all m in [0, M)
// and n in [n_begin, n_end).
struct MatMulArgs {
  const float* A = nullptr;  // [M, K], row stride lda floats
  int64_t M = 0;
  int64_t lda = 0;
  float* Y = nullptr;        // [M, N], row stride ldy floats
  int64_t ldy = 0;
  const PackedWeights* W = nullptr;
};

using MatMulFn = void (*)(const MatMulArgs& args, int64_t n_begin, int64_t n_end);

// One table per instruction set, filled in the translation unit compiled for it.
struct KernelTable {
  const char* name;  // "portable", ...
  MatMulFn matmul;
};

// The portable C++ kernel: the scalar oracle beside every SIMD path.
const KernelTable& portable_kernels();

#if defined(CIM_INT4_X86_KERNELS)
// x86-64 tables, each in its own translation unit built with its own -m flags. Call
// them only on a CPU that runs that instruction set: select_kernels() checks.
const KernelTable& avx2_kernels();    // AVX2 + FMA, FP32 activations
const KernelTable& avx512_kernels();  // AVX-512 F/BW/VL/DQ + FMA, FP32 activations
#endif

// The best table this CPU runs, or the one named by `name` ("portable", ...).
// Returns nullptr for a name that is unknown or that this CPU cannot run; `available`
// then lists the names it can.
const KernelTable* select_kernels(const char* name, const char** available);

}  // namespace cim
