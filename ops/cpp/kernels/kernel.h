// Kernel interface of cim-int4: plain structs and function pointers, no ORT.
//
// The op wrapper repacks the node's attributes once (repack.h) into the tile layout
// below and calls one KernelTable entry per contiguous range of channel tiles, so ORT's
// thread pool can split the work and tests can call kernels directly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cim {

// Output channels per tile: one zmm of float32 (two ymm).
constexpr int64_t kTileN = 16;
// Bytes per "code row" of a tile: 16 channels x 4 bytes (8 codes per channel).
constexpr int64_t kCodeRowBytes = 64;

// Weights in the library's own layout, made once at kernel creation by repack().
//
// Output channels come in tiles of kTileN = 16 (the last tile padded with channels of
// scale 0 and code 8), tiles in strips of kStripTiles = 4 (64 channels; the last strip
// may hold fewer). The whole matrix is one sequential stream, strip after strip; within
// a strip group after group, and within a group the strip's tiles in order, so decode,
// which runs a strip's tiles side by side, reads one stream front to back. One
// (tile, group) block is `block_bytes`:
//
//   group_size / 8 code rows of 64 bytes, then the tile's 16 float32 scales (64 bytes)
//
// Code row v of group g holds codes k = g*group_size + 8v + j (j = 0..7). In it,
// channel c owns bytes 4c..4c+3 (32-bit lane c); byte b of that lane holds
//   low nibble:  code of k = g*group_size + 8v + b      (j = b)
//   high nibble: code of k = g*group_size + 8v + 4 + b  (j = 4 + b)
// so `row & 0x0F` is four consecutive codes per lane, ready for vpdpbusd against four
// consecutive int8 activations, and `(row >> 4) & 0x0F` the next four. In FP32 mode,
// lane c's code j sits at bit 8b (j = b) or 8b + 4 (j = 4 + b).
// Codes are q + 8 in 0..15; K is padded to groups * group_size with code 8 (q = 0).
// No other padding: the stream is (tiles * groups * block_bytes) bytes.
constexpr int64_t kStripTiles = 4;

struct PackedWeights {
  int64_t K = 0;
  int64_t N = 0;
  int64_t group_size = 0;
  int64_t groups = 0;       // ceil(K / group_size)
  int64_t tiles = 0;        // ceil(N / 16)
  int64_t block_bytes = 0;  // group_size * 8 + 64
  const uint8_t* stream = nullptr;
  const float* bias = nullptr;  // [tiles * 16] (zero past N) or nullptr

  // Always inlined: the SIMD translation units call it, and an out-of-line copy built
  // with their -m flags could be the one the linker keeps for everyone.
  __attribute__((always_inline)) const uint8_t* block(int64_t tile, int64_t group) const {
    const int64_t strip0 = tile / kStripTiles * kStripTiles;
    const int64_t width = tiles - strip0 < kStripTiles ? tiles - strip0 : kStripTiles;
    return stream + (strip0 * groups + group * width + (tile - strip0)) * block_bytes;
  }
};

// int8 activations (compute mode "int8"): each row of A quantized per group, once per
// call, before the parallel section. For row m and group g, with amax = max |a| over
// the group: q = rint(a * (127 / amax)) (0 where amax = 0), scale = amax / 127 and
// zsum = -8 * sum(q), which starts the group's integer dot product so that it
// subtracts the codes' offset 8 exactly.
struct QuantizedA {
  const int8_t* q = nullptr;      // [M, groups * group_size], zero past K
  const float* scale = nullptr;   // [M, groups]
  const int32_t* zsum = nullptr;  // [M, groups]
};

// One call computes Y[m, n] = sum_k A[m, k] * W[k, n] (+ bias[n]) for all m in [0, M)
// and the channels of tiles [tile_begin, tile_end) that lie below N.
struct MatMulArgs {
  const float* A = nullptr;  // [M, K], row stride lda floats, 4-byte aligned
  int64_t M = 0;
  int64_t lda = 0;
  float* Y = nullptr;  // [M, N], row stride ldy floats
  int64_t ldy = 0;
  const PackedWeights* W = nullptr;
  const QuantizedA* QA = nullptr;  // int8 mode only
};

using MatMulFn = void (*)(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end);
// Quantizes A [M, K] for int8 mode into q [M, groups * group_size], scale and zsum
// [M, groups] (QuantizedA).
using QuantizeAFn = void (*)(const float* A, int64_t M, int64_t lda, int64_t K, int64_t group_size, int8_t* q,
                             float* scale, int32_t* zsum);

// The two compute modes, as indices into KernelVariant::matmul and KernelTable::defaults.
enum Mode : int { kFp32 = 0, kInt8 = 1 };
constexpr const char* kModeNames[2] = {"fp32", "int8"};

// One set of decode (M = 1) parameters of a table: software prefetch distance and hint,
// tiles in flight, vector width (variants.h). The best set differs by core, so each
// machine picks its own (tune/); every variant gives the same bits, and M > 1 runs the
// table's one prefill in all of them.
struct KernelVariant {
  const char* name;        // e.g. "t4-pf6k", "ymm-t4-nopf" (variants.h)
  MatMulFn matmul[2];      // [kFp32]: FP32 activations; [kInt8]: int8 activations (args.QA set)
};

// One table per instruction set, filled in the translation unit compiled for it.
struct KernelTable {
  const char* name;  // "portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni"
  const KernelVariant* variants;
  int variant_count;
  int defaults[2];  // the variant each mode runs untuned, per Mode
  QuantizeAFn quantize_a;

  const KernelVariant& default_variant(Mode mode) const { return variants[defaults[mode]]; }
  // The variant called `name`, or nullptr.
  const KernelVariant* find_variant(const char* name) const;
};

// The portable C++ kernels: the scalar oracle beside every SIMD path.
const KernelTable& portable_kernels();
// int8 mode's quantization of A: the portable routine, and that of one group of `len`
// values (len <= group_size; q gets group_size entries, zero past len), which the SIMD
// routines fall back to for short, non-finite or tiny groups.
void quantize_group_portable(const float* a, int64_t len, int64_t group_size, int8_t* q, float* scale,
                             int32_t* zsum);
void quantize_a_portable(const float* A, int64_t M, int64_t lda, int64_t K, int64_t group_size, int8_t* q,
                         float* scale, int32_t* zsum);

#if defined(CIM_INT4_X86_KERNELS)
// x86-64 tables, each in its own translation unit built with its own -m flags. Call
// them only on a CPU that runs that instruction set: select_kernels() checks.
const KernelTable& avx2_kernels();         // AVX2 + FMA; int8 dot via vpmaddubsw
const KernelTable& avx2_vnni_kernels();    // AVX2 + FMA + AVX-VNNI (vpdpbusd on ymm)
const KernelTable& avx512_kernels();       // AVX-512 F/BW/VL/DQ; int8 dot via vpmaddubsw
const KernelTable& avx512_vnni_kernels();  // AVX-512 F/BW/VL/DQ + VNNI
#endif

// The best table this CPU runs, or the one named by `name` ("portable", ...).
// Returns nullptr for a name that is unknown or that this CPU cannot run; `available`
// then lists the names it can.
const KernelTable* select_kernels(const char* name, const char** available);

// Outputs that came out NaN or infinite although every input they depend on is finite
// (the per-group partial sums can overflow where a float32 MatMul of the dequantized
// weights does not) are recomputed here in float64, term by term, and rounded once.
// Called by the op on each range after the kernel; a true overflow stays infinite.
void recompute_nonfinite(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end);

}  // namespace cim
