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
// Bytes per "code row" of a tile: 16 channels x 4 bytes.
constexpr int64_t kCodeRowBytes = 64;
// Output channels come in tiles of 16, tiles in strips of kStripTiles (64 channels).
constexpr int64_t kStripTiles = 4;

// Weights in the library's own layout, made once at kernel creation by repack() (the
// why and a picture per width: docs/widths.md).
//
// Output channels come in tiles of kTileN = 16 (the last tile padded with channels of
// scale 0 and the code of q = 0), tiles in strips of kStripTiles = 4 (64 channels; the
// last strip may hold fewer). The whole matrix is one sequential stream, strip after
// strip; within a strip group after group, and within a group the strip's tiles' scales
// in order, then their codes, so decode, which runs a strip's tiles side by side, reads
// one stream front to back. A (tile, group) block is `block_bytes`: the tile's 16 scales
// (`scales`) as given, float32 (64 bytes), float16 (32 bytes) or int8 (16 bytes), converted
// in registers, so the bytes saved are bytes not read, and the group's codes (`block`,
// code_bytes of them). A full strip's scales of a group are 64, 128 or 256 bytes, so its
// codes keep the stream's 64-byte alignment whatever the scales' size (a last strip of 1-3
// tiles may not: loads are unaligned ones everywhere) (with the scales inside
// each block after its codes, int8 ones put 3 of 4 blocks' code rows off a 64-byte line and
// split vector loads in two: 5% of AVX2 int8 prefill on a Zen 4). Scales before codes, not
// after: decode reads a group's scales after its codes, from a line just behind it in the
// stream (on a Zen 4, scales after the codes cost the avx512_vnni n4 int8 decode 2.5%,
// scales before are level with the old layout; docs/benchmarks.md). An int8 scale q stands for
// float32(q) * (d / 128), d the channel's float16 super-scale of its kSuperGroups groups:
// d / 128 and its product with an int8 are exact in float32, so every path computes the
// same scale bit for bit. The super-scales stay in the one stream: within a strip, each
// run of kSuperGroups groups starts with a record of the strip's tiles' 16 float16
// super-scales each (32 bytes a tile), so decode still reads front to back.
//
// Codes of b bits (b = `bits`, code = q + 2^(b-1)) are split into a low plane of
// lo bits and a high plane of hi bits (planes_of: 2 = 2, 3 = 2 + 1, 4 = 4, 5 = 4 + 1,
// 6 = 4 + 2, 8 = 8), code = low | high << lo. A group is cut into chunks of
// C = min(group_size, 32) codes; a chunk is the low plane's C*lo/32 code rows of 64 bytes,
// then the high plane's max(1, C*hi/32) rows (none without a high plane). In a plane of
// p bits, channel c owns bytes 4c..4c+3 (32-bit lane c) of each row, and "quad" Q of the
// chunk (codes k = 4Q .. 4Q+3 of the chunk) sits in row Q*p/8, at bit p*(Q mod 8/p) of
// the lane's bytes b = 0..3, one code per byte. So one shift and one mask give four
// consecutive codes per lane, ready for vpdpbusd against four consecutive int8
// activations, and a second plane costs one more shift, mask and or. For b = 4 this is
// the original layout: code row v holds codes 8v .. 8v+7, byte b's low nibble code
// 8v + b and its high nibble code 8v + 4 + b. Only a 1-bit plane at group_size 16 holds
// padding (half its lanes' bits), so widths 3 and 5 spend one bit more per weight there.
// K is padded to groups * group_size with the code of q = 0.
constexpr int kMaxBits = 8;
struct Planes {
  int lo;  // bits of the low plane: 2, 4 or 8
  int hi;  // bits of the high plane: 0 (none), 1 or 2
};
constexpr Planes planes_of(int bits) {
  return bits == 2 ? Planes{2, 0}
         : bits == 3 ? Planes{2, 1}
         : bits == 5 ? Planes{4, 1}
         : bits == 6 ? Planes{4, 2}
         : bits == 8 ? Planes{8, 0}
                     : Planes{4, 0};
}
// Codes per chunk, and the code rows of a chunk's low and high planes.
constexpr int64_t chunk_codes(int64_t group_size) { return group_size < 32 ? group_size : 32; }
constexpr int64_t low_rows(int bits, int64_t group_size) { return chunk_codes(group_size) * planes_of(bits).lo / 32; }
constexpr int64_t high_rows(int bits, int64_t group_size) {
  const int64_t r = chunk_codes(group_size) * planes_of(bits).hi / 32;
  return planes_of(bits).hi == 0 ? 0 : (r > 0 ? r : 1);
}
constexpr int64_t chunk_bytes(int bits, int64_t group_size) {
  return (low_rows(bits, group_size) + high_rows(bits, group_size)) * kCodeRowBytes;
}
// How a block stores its scales (the `scales` attribute's element type).
enum ScaleType : int { kScaleF32 = 0, kScaleF16 = 1, kScaleI8 = 2 };
constexpr int64_t scale_size_of(int scale_type) { return scale_type == kScaleI8 ? 1 : scale_type == kScaleF16 ? 2 : 4; }
// Groups that share one int8-scale super-scale (contract.SUPER_GROUPS), and the int8
// scale that stands for the whole super-scale (contract.INT8_SCALE_ONE: a power of two).
constexpr int64_t kSuperGroups = 8;
constexpr float kInt8ScaleOne = 128.0f;
// Super-blocks of int8 scales along a row of `groups` groups.
constexpr int64_t supers_of(int64_t groups) { return (groups + kSuperGroups - 1) / kSuperGroups; }

// Bytes of one (tile, group) block.
constexpr int64_t block_bytes_of(int bits, int64_t group_size, int scale_type) {
  return group_size / chunk_codes(group_size) * chunk_bytes(bits, group_size) + kTileN * scale_size_of(scale_type);
}

// Widths whose codes go through a 16-entry level table (CodeLevels below).
constexpr int kLevelBits = 3;
// The largest u8 value int8 mode multiplies for codes of `bits` bits: 2^bits - 1, or
// 2^(bits+1) where a level table may hold a grid's levels (within +-2^bits) plus its zero.
constexpr int max_u(int bits) { return bits <= kLevelBits ? (2 << bits) : (1 << bits) - 1; }

// How many dot4 steps of codes of `bits` bits (u8 values up to max_u(bits) times s8
// activations in [-127, 127]) an int16 pair sum takes before it could pass 32767
// (vpmaddubsw without VNNI, simd_avx2.h's pair_dot): 8 for 4-bit codes; 0 for 8-bit codes,
// whose one step can already saturate.
constexpr int pair_steps(int bits) { return bits >= 8 ? 0 : 32767 / (2 * 127 * max_u(bits)); }

// What a code stands for (the `grid` attribute), for widths up to kLevelBits: fp32 mode takes
// the signed level q as a float (vpermps from q), int8 mode looks a non-uniform grid's codes up
// in u (one byte shuffle per vector), the unsigned q + zero that vpdpbusd takes, with the
// group's dot starting at -zero * sum(qa). The uniform grid's tables are q = code - 2^(b-1),
// u = code, zero = 2^(b-1) (int8 mode skips u). A grid's levels lie within +-2^b, so u <= max_u(b).
struct CodeLevels {
  alignas(16) int8_t q[16] = {};
  alignas(16) uint8_t u[16] = {};
  int32_t zero = 8;
  bool uniform = true;  // q = code - 2^(b-1): the kernels skip the table (with_planes, plane_kernels.h)
};
// The levels of grid `grid` (0 uniform, 1 normal: the contract's kGrids order) for `bits`
// bits; false for a grid that width does not have.
bool make_levels(int bits, int grid, CodeLevels* out);

struct PackedWeights {
  int64_t K = 0;
  int64_t N = 0;
  int64_t group_size = 0;
  int64_t groups = 0;       // ceil(K / group_size)
  int64_t tiles = 0;        // ceil(N / 16)
  int64_t block_bytes = 0;  // block_bytes_of(bits, group_size, scale_type)
  int bits = 4;             // code width b
  CodeLevels levels;        // what each code stands for (make_levels)
  int scale_type = kScaleF32;  // how the blocks store their scales (ScaleType)
  // Bytes of one tile's super-scale record (int8 scales: 16 float16, zero past N; else 0).
  int64_t super_bytes = 0;
  const uint8_t* stream = nullptr;
  const float* bias = nullptr;  // [tiles * 16] (zero past N) or nullptr

  // Always inlined: the SIMD translation units call it, and an out-of-line copy built
  // with their -m flags could be the one the linker keeps for everyone.
  // The codes of tile `tile`, group `group` (code_bytes of them).
  __attribute__((always_inline)) const uint8_t* block(int64_t tile, int64_t group) const {
    const int64_t strip0 = tile / kStripTiles * kStripTiles;
    const int64_t width = tiles - strip0 < kStripTiles ? tiles - strip0 : kStripTiles;
    return group_start(strip0, width, group) + width * (block_bytes - code_bytes()) + (tile - strip0) * code_bytes();
  }
  // The 16 scales of tile `tile`, group `group` (before the strip's codes of the group).
  __attribute__((always_inline)) const uint8_t* scales(int64_t tile, int64_t group) const {
    const int64_t strip0 = tile / kStripTiles * kStripTiles;
    const int64_t width = tiles - strip0 < kStripTiles ? tiles - strip0 : kStripTiles;
    return group_start(strip0, width, group) + (tile - strip0) * (block_bytes - code_bytes());
  }
  // Where group `group` of the strip from tile strip0 (width tiles) starts.
  __attribute__((always_inline)) const uint8_t* group_start(int64_t strip0, int64_t width, int64_t group) const {
    return stream + strip0 * strip_bytes_per_tile() + (group / kSuperGroups + 1) * width * super_bytes +
           group * width * block_bytes;
  }
  // The float16 super-scales of tile `tile` that group `group`'s int8 scales multiply.
  __attribute__((always_inline)) const uint8_t* super_of(int64_t tile, int64_t group) const {
    const int64_t strip0 = tile / kStripTiles * kStripTiles;
    const int64_t width = tiles - strip0 < kStripTiles ? tiles - strip0 : kStripTiles;
    const int64_t run = group / kSuperGroups;
    return stream + strip0 * strip_bytes_per_tile() + run * width * (super_bytes + kSuperGroups * block_bytes) +
           (tile - strip0) * super_bytes;
  }
  // Bytes of the stream per tile (its blocks and super-scale records); the whole stream is tiles times this.
  __attribute__((always_inline)) int64_t strip_bytes_per_tile() const {
    return groups * block_bytes + supers_of(groups) * super_bytes;
  }
  // Bytes of a block's codes.
  __attribute__((always_inline)) int64_t code_bytes() const { return block_bytes - kTileN * scale_size_of(scale_type); }
};

// Where the codes of channel c at offset j (0 .. group_size - 1) of a block lie: the code
// is ((block[lo_byte] >> lo_shift) & (2^lo - 1)) | ((block[hi_byte] >> hi_shift) & (2^hi - 1)) << lo.
struct CodeSpot {
  int64_t lo_byte, hi_byte;
  int lo_shift, hi_shift;
};
CodeSpot code_spot(int bits, int64_t group_size, int64_t c, int64_t j);
// The code (0 .. 2^bits - 1) of channel c at offset j of a block, and the scale of channel c
// in block (tile, group).
int code_in_block(const PackedWeights& w, const uint8_t* block, int64_t c, int64_t j);
float scale_of(const PackedWeights& w, int64_t tile, int64_t group, int64_t c);
// The signed q a code of `bits` bits stands for (fp32 mode), and the u8 value int8 mode
// multiplies (q + levels.zero).
inline int code_q(int bits, const CodeLevels& levels, int code) {
  return bits <= kLevelBits ? levels.q[code] : code - (1 << (bits - 1));
}
inline int q_of(const PackedWeights& w, int code) { return code_q(w.bits, w.levels, code); }
inline int u_of(const PackedWeights& w, int code) { return w.bits <= kLevelBits ? w.levels.u[code] : code; }
// float16 bits to float32, exactly (every float16 is a float32), without compiler support for _Float16.
float half_to_float(uint16_t h);

// int8 activations (compute mode "int8"): each row of A quantized per group, once per
// call, before the parallel section. For row m and group g, with amax = max |a| over
// the group: q = rint(a * (127 / amax)) (0 where amax = 0), scale = amax / 127 and
// qsum = sum(q): the group's integer dot product starts at -2^(b-1) * qsum, so that it
// subtracts the codes' offset exactly.
struct QuantizedA {
  const int8_t* q = nullptr;      // [M, groups * group_size], zero past K
  const float* scale = nullptr;   // [M, groups]
  const int32_t* qsum = nullptr;  // [M, groups]
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

// How the op splits a layer of `tiles` tiles into at most `ranges` calls (one or a few per
// pool thread, op.cpp): ranges of whole strips, all of `range_span` tiles but the last, call
// i on tiles [i * span, min(tiles, (i + 1) * span)). The tools that time a layer split so too.
constexpr int64_t range_span(int64_t tiles, int64_t ranges) {
  const int64_t strips = (tiles + kStripTiles - 1) / kStripTiles;
  const int64_t calls = ranges < strips ? ranges : strips;
  return calls < 1 ? kStripTiles : (strips + calls - 1) / calls * kStripTiles;
}

// Quantizes A [M, K] for int8 mode into q [M, groups * group_size], scale and qsum
// [M, groups] (QuantizedA).
using QuantizeAFn = void (*)(const float* A, int64_t M, int64_t lda, int64_t K, int64_t group_size, int8_t* q,
                             float* scale, int32_t* qsum);

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
  // Prefetches with the NTA hint, so its pass leaves less of the stream in the caches than
  // a plain one: the tuner times these last in a round (tune/tuner.cpp).
  bool nta = false;
  // Strips int8 mode reads at once (2: the n4x2 rows). The other code widths follow it when
  // this variant is the tuned one (KernelTable::matmul_for).
  int int8_strips = 1;
};

// One table per instruction set, filled in the translation unit compiled for it.
struct KernelTable {
  const char* name;  // "portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni"
  const KernelVariant* variants;
  int variant_count;
  int defaults[2];  // the variant each mode runs untuned, per Mode
  QuantizeAFn quantize_a;
  // The kernels of every code width, indexed by bits (entries of widths the contract
  // lacks are empty): widths other than 4 run fixed decode parameters, int8 mode one strip
  // at a time (`widths`) or two (`widths_x2`, the same kernels in fp32 mode); entry 4 is the
  // default variant (the tuner picks among `variants` for 4-bit codes).
  const KernelVariant* widths;     // [kMaxBits + 1]
  const KernelVariant* widths_x2;  // [kMaxBits + 1]

  const KernelVariant& default_variant(Mode mode) const { return variants[defaults[mode]]; }
  // The kernel of `mode` for codes of `bits` bits; `tuned` is the variant chosen for 4-bit
  // codes: another width reads as many strips at once as it does (a core whose one stream
  // holds too few lines in flight for 4-bit codes holds too few for any width).
  MatMulFn matmul_for(int bits, Mode mode, const KernelVariant& tuned) const {
    if (bits == 4) return tuned.matmul[mode];
    return (tuned.int8_strips == 2 ? widths_x2 : widths)[bits].matmul[mode];
  }
  // The variant called `name`, or nullptr.
  const KernelVariant* find_variant(const char* name) const;
};

// The portable C++ kernels: the scalar oracle beside every SIMD path.
const KernelTable& portable_kernels();
// int8 mode's quantization of A: the portable routine, and that of one group of `len`
// values (len <= group_size; q gets group_size entries, zero past len), which the SIMD
// routines fall back to for short, non-finite or tiny groups.
void quantize_group_portable(const float* a, int64_t len, int64_t group_size, int8_t* q, float* scale,
                             int32_t* qsum);
void quantize_a_portable(const float* A, int64_t M, int64_t lda, int64_t K, int64_t group_size, int8_t* q,
                         float* scale, int32_t* qsum);

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
