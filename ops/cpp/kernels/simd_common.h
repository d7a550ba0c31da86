// The prefill driver shared by the SIMD kernels (kernel_avx2.cpp, kernel_avx512.cpp):
// blocking, prefetching and scratch, with the instruction-set parts passed in.
//
// Everything here has internal linkage (an unnamed namespace): each translation unit is
// compiled with its own -m flags, and an inline function or template with external
// linkage would be merged by the linker into one copy, possibly the AVX-512 one, then
// called on a CPU without AVX-512.
//
// Prefill (M from a threshold per instruction set up): in a kernel that unpacks in
// registers each weight is unpacked once per few rows of A, which costs about a third
// of the issue slots (measured on Sapphire Rapids). Here each panel of kPanelRows
// weight rows is dequantized once per chunk of kTileK codes into a small thread-local
// buffer, and an FP32 tile kernel runs the rows of A against it, so all rows of A (up
// to 72 at a time) share one unpacking. Loops, outer to inner:
//   m-block   up to kTilesPerBlock tiles of rows of A (up to 72 rows)
//   panel     kPanelRows weight rows: each panel of the call reuses the m-block's rows
//             of A from L2
//   chunk     kTileK codes, dequantized into 16 x 512 floats (32 KB) that stay in L1
//             while every tile of the m-block passes over them
//   tile      up to kTileA rows of A x a few panel rows, all accumulators in registers
// Each call reads all of A; when A outgrows L2 it comes from L3, so a thread's calls
// alternate the direction of their m-blocks: a call starts on the rows of A the
// previous one ended with, still in L2.
//
// Between chunks a tile's partial sums (whole vectors) wait in the scratch, stored and
// reloaded exactly, so each output sees the operations of a single pass over K. Which
// operations is up to the instruction set; neither the tile nor the m-block an output
// falls in, nor the N range of a call, changes them.
#pragma once

#include <xmmintrin.h>  // _mm_prefetch (SSE, in every x86-64 baseline)

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels/kernel.h"

namespace cim {
namespace {

constexpr int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// A per-thread buffer for the dequantized panel and the partial sums. ORT's intra-op
// pool keeps its threads, so it is allocated once per thread and reused by every call;
// tasks on different threads never share one. (Not a std::vector: its member functions
// are shared between translation units, and one built with AVX-512 flags could be the
// copy the AVX2 kernels call.)
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { std::free(data_); }

  // `floats` floats, 64-byte aligned; zeros when new, else what the last call left.
  float* get(size_t floats) {
    if (floats > capacity_) {
      const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
      std::free(data_);
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (data_ == nullptr) {
        capacity_ = 0;
        throw std::bad_alloc();
      }
      capacity_ = bytes / sizeof(float);
      std::memset(data_, 0, bytes);
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  size_t capacity_ = 0;
};

inline float* thread_scratch(size_t floats) {
  thread_local ScratchBuffer buffer;
  return buffer.get(floats);
}

constexpr int64_t kPanelRows = 16;
// Codes per chunk, a multiple of 32; the last may have up to 15 more, rather than leave
// a chunk of less than a vector (see chunk_end).
constexpr int64_t kTileK = 512;
constexpr int64_t kMaxTileK = kTileK + 15;
constexpr int kTileA = 6;  // most rows of A per tile
// Up to 72 rows of A per m-block: fewer dequantize each panel chunk more often, more
// leave less of A in L2 for the next call (measured best from 8 to 12, M = 128).
constexpr int64_t kTilesPerBlock = 12;
// Panel rows: a chunk need not start on a unit (see the shift below), so a row holds
// the whole units around it, up to kPanelMargin floats either side; then 64 bytes more
// so that the rows a tile reads fall on different L1 sets.
constexpr int64_t kPanelMargin = 32;
constexpr int64_t kPanelLd = (kPanelMargin + kMaxTileK + kPanelMargin + 15) / 16 * 16 + 16;
static_assert(kTileK % 32 == 0, "chunks must not split a unit");

// The end of the chunk that starts at kc.
constexpr int64_t chunk_end(int64_t kc, int64_t K) { return K - (kc + kTileK) < 16 ? K : kc + kTileK; }

// Weight rows [n0, n0 + rows) over codes [k_begin, k_end): what the panel holds. k_begin
// may be negative (the first chunk, shifted): there are no codes before 0.
struct PanelChunk {
  int64_t n0, rows, k_begin, k_end;
};

// The cache lines of the codes and scales of the next chunk, requested a few at a time
// between the tile kernels of this chunk, where the out-of-order core runs the requests
// alongside their FMAs. Dequantization reads each code once, and the rows of a panel
// are short runs far apart that the hardware prefetchers follow poorly; requesting a
// whole chunk at once stalls on the line fill buffers (measured).
class ChunkPrefetch {
 public:
  void plan(const PackedWeights& w, const PanelChunk& c) {
    count_ = next_ = 0;
    for (int64_t r = 0; r < c.rows; ++r) {
      const uint8_t* codes = w.nibbles + (c.n0 + r) * w.row_bytes;
      const float* scales = w.scales + (c.n0 + r) * w.groups;
      const int64_t k_begin = c.k_begin > 0 ? c.k_begin : 0;
      add_lines(codes + k_begin / 2, codes + (c.k_end + 1) / 2);
      add_lines(scales + k_begin / w.group_size, scales + (c.k_end - 1) / w.group_size + 1);
    }
  }
  // Spreads the requests over `calls` calls of step().
  void pace(int64_t calls) { pace_ = calls > 0 ? (count_ + calls - 1) / calls : count_; }
  void step() {
    for (int64_t i = 0; i < pace_ && next_ < count_; ++i) _mm_prefetch(lines_[next_++], _MM_HINT_T1);
  }
  void finish() {
    while (next_ < count_) _mm_prefetch(lines_[next_++], _MM_HINT_T1);
  }

 private:
  // Per row: the codes' lines and the scales' (group 16 at most), each plus one where
  // they straddle lines.
  static constexpr int64_t kMaxLines = kPanelRows * ((kMaxTileK / 2 + 63) / 64 + 1 + (kMaxTileK / 4 + 63) / 64 + 1);
  void add_lines(const void* begin, const void* end) {
    const uintptr_t last = reinterpret_cast<uintptr_t>(end);
    for (uintptr_t p = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63}; p < last && count_ < kMaxLines;
         p += 64) {
      lines_[count_++] = reinterpret_cast<const char*>(p);
    }
  }
  const char* lines_[kMaxLines];
  int64_t count_ = 0, next_ = 0, pace_ = 0;
};

// One tile: some rows of A against some panel rows over one chunk.
struct Tile {
  const float* a;      // A[m0, k]: the tile's first row at the chunk's first code
  int64_t lda;
  const float* panel;  // the first panel row at the chunk's first code
  int64_t len;         // codes in this chunk, with those before 0 in the first
  int64_t head;        // codes before 0: lanes of the chunk's first vector not in A
  float* partial;      // the sums of row i, panel row r: lanes floats at (i * kPanelRows + r) * lanes
  bool first, last;    // first chunk: start from 0; last: store Y instead of partial
  float* y;            // Y[m0, n0 + r0]
  int64_t ldy;
  const float* bias;   // bias + n0 + r0, or nullptr
};

// The M rows of A in ceil(M / kTileA) tiles as even as possible, so that no tile is left
// with few rows when avoidable (8 rows: 4 + 4, not 6 + 2). For M >= 4 a tile has 3 to 6
// rows (3 only for M = 7).
struct TilePlan {
  int64_t count, base, extra;  // tile i has base + (i < extra) rows
  int64_t begin(int64_t i) const { return i * base + (i < extra ? i : extra); }
  int64_t rows(int64_t i) const { return base + (i < extra ? 1 : 0); }
};

inline TilePlan plan_tiles(int64_t M) {
  const int64_t count = (M + kTileA - 1) / kTileA;
  return {count, M / count, M % count};
}

// A thread's calls alternate the direction of their m-blocks. Only the order of
// independent tiles changes, never an output's arithmetic.
inline bool next_call_runs_backward() {
  thread_local bool backward = false;
  backward = !backward;
  return backward;
}

// How many floats past a 64-byte line A's rows start, when all start alike (lda a
// multiple of 16 floats); else 0.
inline int64_t rows_misalignment(const MatMulArgs& args) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(args.A);
  if (address % sizeof(float) != 0 || args.lda % 16 != 0) return 0;
  return static_cast<int64_t>(address % 64 / sizeof(float));
}

// Y[:, n_begin, n_end) = A W^T (+ bias), for M of at least 4 (see plan_tiles).
//
// Chunks start at multiples of kTileK, less `shift` floats: with Isa::kShiftsChunks,
// shift is A's misalignment, so that the tiles' loads of A start on cache lines. (A
// from NumPy is often 16 or 32 bytes off, and loads split across lines cost about a
// fifth of the tile throughput, measured.) The first chunk then begins `shift` codes
// before 0, which its tiles mask out, and lane l of a vector holds the codes k with
// k = l - shift (mod lanes) instead of k = l: the same classes of k, each summed in the
// same order, in rotated lanes. The final lane sum (lanes l and l + lanes/2 first, then
// l and l + lanes/4, ...) pairs the same classes whatever the rotation, and a + b is
// b + a exactly, so it returns the decode's sum bit for bit.
//
// Isa provides, for its vectors of Isa::kLanes floats:
//   Isa::dequantize_panel<kUnit>(w, chunk, panel)
//       panel[r * kPanelLd + k - chunk.k_begin] = weight k of row chunk.n0 + r, for k
//       in the units that cover [max(chunk.k_begin, 0), chunk.k_end) (panel has
//       kPanelMargin floats to spare either side of each row)
//   Isa::run_tiles<kUnit>(rows_a, tile, panel_rows, prefetch)
//       rows_a (3..kTileA) rows of A against panel_rows panel rows over one chunk,
//       calling prefetch.step() after every Isa::kTileRows panel rows
template <class Isa, int kUnit>
void prefill_panels(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  const PackedWeights& w = *args.W;
  const int64_t K = w.K;
  const TilePlan plan = plan_tiles(args.M);
  const int64_t tiles_per_block = min_i64(plan.count, kTilesPerBlock);
  const int64_t blocks = (plan.count + tiles_per_block - 1) / tiles_per_block;
  const int64_t partial_floats = tiles_per_block * kTileA * kPanelRows * Isa::kLanes;
  float* scratch = thread_scratch(static_cast<size_t>(kPanelRows * kPanelLd + partial_floats));
  float* panel = scratch + kPanelMargin;
  float* partial = scratch + kPanelRows * kPanelLd;
  const int64_t shift = Isa::kShiftsChunks ? rows_misalignment(args) : 0;
  ChunkPrefetch prefetch;
  const bool backward = next_call_runs_backward();

  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t b = backward ? blocks - 1 - bi : bi;
    const int64_t t_begin = b * tiles_per_block;
    const int64_t t_end = min_i64(plan.count, t_begin + tiles_per_block);
    const int64_t block_m0 = plan.begin(t_begin);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kPanelRows) {
      const int64_t rows = min_i64(kPanelRows, n_end - n0);
      for (int64_t kc = -shift, kc_end = 0; kc < K; kc = kc_end) {
        kc_end = chunk_end(kc, K);
        Isa::template dequantize_panel<kUnit>(w, {n0, rows, kc, kc_end}, panel);
        // While the tiles run, prefetch the chunk after this one: further along these
        // rows, else the next panel's first chunk: in this call, else again the call's
        // first for the next m-block, else the rows after n_end (the next task likely
        // takes them, and they are in bounds).
        const int64_t first_end = chunk_end(-shift, K);
        if (kc_end < K) {
          prefetch.plan(w, {n0, rows, kc_end, chunk_end(kc_end, K)});
        } else if (n0 + rows < n_end) {
          prefetch.plan(w, {n0 + rows, min_i64(kPanelRows, n_end - n0 - rows), 0, first_end});
        } else if (bi + 1 < blocks) {
          prefetch.plan(w, {n_begin, min_i64(kPanelRows, n_end - n_begin), 0, first_end});
        } else {
          prefetch.plan(w, {n_end, min_i64(kPanelRows, w.N - n_end), 0, first_end});
        }
        prefetch.pace((t_end - t_begin) * ((rows + Isa::kTileRows - 1) / Isa::kTileRows));
        for (int64_t ti = t_begin; ti < t_end; ++ti) {
          const int64_t m0 = plan.begin(ti);
          Tile t;
          // Before A when kc < 0 (row 0): an address for masked loads only, so it is
          // made as an integer, not by pointer arithmetic past the array.
          t.a = reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(args.A + m0 * args.lda) +
                                               static_cast<uintptr_t>(kc) * sizeof(float));
          t.lda = args.lda;
          t.panel = panel;
          t.len = kc_end - kc;
          t.head = kc < 0 ? -kc : 0;
          t.partial = partial + (m0 - block_m0) * kPanelRows * Isa::kLanes;
          t.first = kc == -shift;
          t.last = kc_end == K;
          t.y = args.Y + m0 * args.ldy + n0;
          t.ldy = args.ldy;
          t.bias = w.bias != nullptr ? w.bias + n0 : nullptr;
          Isa::template run_tiles<kUnit>(plan.rows(ti), t, rows, prefetch);
        }
        prefetch.finish();
      }
    }
  }
}

}  // namespace
}  // namespace cim
