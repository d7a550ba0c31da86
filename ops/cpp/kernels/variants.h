// The decode variants each x86 table offers: one grid of parameters that plausibly differ
// by core (software prefetch distance and hint, tiles in flight, 512- or 256-bit forms),
// instantiated from tile_kernels.h in each instruction set's translation unit. tune/
// times them on the machine at hand and picks one per compute mode. Every variant
// performs the same arithmetic per output (tile_kernels.h), so all give the same bits;
// kernel_test checks each against the portable oracle.
//
// Why these: on Zen 5 (where the defaults were measured) 4 tiles side by side and 6 / 12
// KiB prefetch stream at 76-87% of the read bandwidth; on Zen 4, where AVX-512 runs on
// 256-bit units, the same loop spent ~14 cycles per 64-byte code vector against 3-5 of
// arithmetic, i.e. it waited on memory: the prefetch distance (or none, leaving it to the
// hardware prefetcher), the hint, fewer tiles in flight, and ymm forms (32 registers with
// AVX-512 VL) are the cheap knobs; which wins is measured per machine, not assumed.
#pragma once

#include <cstdlib>
#include <type_traits>

#include "kernels/kernel.h"
#include "kernels/prefill_kernels.h"
#include "kernels/tile_kernels.h"

namespace cim {
namespace {

// A variant's matmul for codes of kBits bits: decode with traits D (the table's own S, or
// its 256-bit form) and these parameters at M = 1; S's prefill otherwise (one prefill per
// table). The weights' scale type picks the instantiation (once per call).
template <class S, class D, int kBits, bool kInt8, int NT, int64_t kAhead, int kHint, bool kNarrow = false,
          int kStrips = 1>
void variant_matmul(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
  auto run = [&](auto sc) {
    constexpr int kSc = decltype(sc)::value;
    if (args.M == 1) {
      using Fm = typename TileKernels<D>::template Form<kBits, kSc, kInt8>;
      TileKernels<D>::template decode<Fm, NT, kAhead, kHint, kNarrow, kStrips>(args, tile_begin, tile_end);
    } else {
      using Fm = typename TileKernels<S>::template Form<kBits, kSc, kInt8>;
      PrefillKernels<S>::template prefill<Fm>(args, tile_begin, tile_end);
    }
  };
  switch (args.W->scale_type) {
    case kScaleF16: run(std::integral_constant<int, kScaleF16>{}); break;
    case kScaleI8: run(std::integral_constant<int, kScaleI8>{}); break;
    default: run(std::integral_constant<int, kScaleF32>{}); break;
  }
}

// kNarrow is int8 mode's alone: an n4 row's fp32 entry is the t4 row's very function (the
// tuner times it once). kStrips is fp32 mode's and, with kNarrow, int8 mode's: t4x2's int8
// entry is t4's very function.
template <class S, class D, int NT, int64_t kAhead, int kHint, bool kNarrow = false, int kStrips = 1>
constexpr KernelVariant variant(const char* name) {
  return KernelVariant{name,
                       {variant_matmul<S, D, 4, false, NT, kAhead, kHint, false, kStrips>,
                        variant_matmul<S, D, 4, true, NT, kAhead, kHint, kNarrow, kNarrow ? kStrips : 1>},
                       kAhead > 0 && kHint == _MM_HINT_NTA,
                       kNarrow ? kStrips : 1};
}

constexpr int kT0 = _MM_HINT_T0;
constexpr int kNta = _MM_HINT_NTA;

// S: the table's traits; Y: its 256-bit form (S itself when it has none: then the ymm
// rows, last, are left out).
template <class S, class Y>
struct Variants {
  static constexpr KernelVariant all[] = {
      variant<S, S, 4, 6144, kT0>("t4-pf6k"),  // int8 mode's loop as tuned on Zen 5
      variant<S, S, 4, 12288, kT0>("t4-pf12k"),  // fp32 mode's default (measured on Zen 5)
      variant<S, S, 4, 0, kT0>("t4-nopf"),
      variant<S, S, 4, 24576, kT0>("t4-pf24k"),
      variant<S, S, 4, 6144, kNta>("t4-pf6k-nta"),
      variant<S, S, 4, 12288, kNta>("t4-pf12k-nta"),
      variant<S, S, 2, 6144, kT0>("t2-pf6k"),
      // int8 mode one vector at a time, sums in L1 (tile_kernels.h's int8_narrow; fp32
      // mode: as t4). Faster than t4 on every core measured (Zen 3, Zen 4).
      variant<S, S, 4, 12288, kT0, true>("n4-pf12k"),  // the avx2 table's int8 default (measured on Zen 3)
      variant<S, S, 4, 6144, kT0, true>("n4-pf6k"),  // the avx512 tables' int8 default (measured on Zen 4)
      variant<S, S, 4, 24576, kT0, true>("n4-pf24k"),
      variant<S, S, 4, 0, kT0, true>("n4-nopf"),
      // 2 KiB ahead: on an Intel Xeon with AVX-512 and AVX-VNNI (family 6 model 167) the L2
      // streamer fetches from DRAM and a far T0 prefetch holds an L1 fill buffer for a
      // whole DRAM trip; a near one only lifts lines from L2 (docs/tuning.md).
      variant<S, S, 4, 2048, kT0>("t4-pf2k"),
      variant<S, S, 4, 2048, kT0, true>("n4-pf2k"),
      // Two strips' streams in flight, a group of each in turn (tile_kernels.h's int8_narrow
      // with kStrips = 2): on that Xeon one stream, prefetched or not, holds too few lines in
      // flight; two read at the plain read's speed (1.28-1.36x n4-pf2k kernel-only, every
      // table). The distances are each measured core's single-stream winner's. In fp32 mode
      // these rows run t4 over two strips (fp32_strips), and t4x2-pf12k at fp32 mode's
      // default distance (its int8 entry is t4-pf12k's: int8 t4 runs one strip at a time).
      variant<S, S, 4, 2048, kT0, true, 2>("n4x2-pf2k"),
      variant<S, S, 4, 0, kT0, true, 2>("n4x2-nopf"),
      variant<S, S, 4, 6144, kT0, true, 2>("n4x2-pf6k"),
      variant<S, S, 4, 12288, kT0, false, 2>("t4x2-pf12k"),
      variant<S, Y, 4, 6144, kT0>("ymm-t4-pf6k"),
      variant<S, Y, 4, 0, kT0>("ymm-t4-nopf"),
  };
  static constexpr int kYmmRows = 2;
  static constexpr int count = int(sizeof all / sizeof all[0]) - (std::is_same_v<S, Y> ? kYmmRows : 0);
};

// Per code width, the kernels at fixed decode parameters: fp32 mode 4 tiles side by side,
// 12 KiB prefetch (compute-bound at widths other than 4: two strips at once ran level on an
// Intel Xeon); int8 mode over kStrips strips at once kAhead ahead, one vector at a time
// with kNarrow (int8_narrow), else 4 tiles side by side. Entry 4 is the 4-bit default pair.
// The 4-tile int8 form of the widths other than 4 prefetches into L2 32 KiB ahead as well
// (kHintT0L2): without it its speed from DRAM on a Zen 4 hung on where its code sat
// (tile_kernels.h, docs/widths.md). Entry 4 keeps T0 alone: 4-bit codes run the tuned
// variant (KernelTable::matmul_for), not this entry.
template <class S, int64_t kAhead, int kStrips, bool kNarrow>
struct Widths {
  template <int kBits>
  static constexpr KernelVariant at(const char* name) {
    constexpr int kInt8Hint = kNarrow || kBits == 4 ? kT0 : kHintT0L2;
    return KernelVariant{name,
                         {variant_matmul<S, S, kBits, false, 4, 12288, kT0>,
                          variant_matmul<S, S, kBits, true, 4, kAhead, kInt8Hint, kNarrow, kStrips>},
                         false,
                         kStrips};
  }
  static constexpr KernelVariant all[kMaxBits + 1] = {
      {}, {}, at<2>(kStrips == 2 ? "bits2-x2" : "bits2"), at<3>(kStrips == 2 ? "bits3-x2" : "bits3"),
      at<4>(kStrips == 2 ? "bits4-x2" : "bits4"), at<5>(kStrips == 2 ? "bits5-x2" : "bits5"),
      at<6>(kStrips == 2 ? "bits6-x2" : "bits6"), {}, at<8>(kStrips == 2 ? "bits8-x2" : "bits8")};
};

// The kernel table of traits S (and its 256-bit form Y). Defaults: fp32 mode t4-pf12k;
// int8 mode `int8_default` (an n4 row: one vector at a time beat t4 by 1.4x on a Zen 3
// and 1.7-2.3x on a Zen 4, docs/tuning.md). The other code widths in int8 mode: one strip
// at a time, 4 tiles side by side 6 KiB ahead or, with kNarrowWidths, one vector at a time
// 12 KiB ahead (16-register ISAs: their t4 sums spill; one vector at a time with 32
// registers ran 2-bit decode 0.81x on an Intel Xeon); or two strips at once, one vector at
// a time 2 KiB ahead (n4x2-pf2k's parameters: on an Intel Xeon 3-bit decode went from 0.51
// to 0.78 of the read probe, docs/widths.md). A default name the grid lacks is a bug in
// this file: abort when the table is made (every test's first kernel call).
template <class S, class Y = S, bool kNarrowWidths = false>
KernelTable make_table(const char* name, const char* int8_default) {
  KernelTable table{name,
                    Variants<S, Y>::all,
                    Variants<S, Y>::count,
                    {0, 0},
                    TileKernels<S>::quantize_a,
                    Widths<S, kNarrowWidths ? 12288 : 6144, 1, kNarrowWidths>::all,
                    Widths<S, 2048, 2, true>::all};
  const KernelVariant* fp32 = table.find_variant("t4-pf12k");
  const KernelVariant* int8 = table.find_variant(int8_default);
  if (fp32 == nullptr || int8 == nullptr) std::abort();
  table.defaults[kFp32] = int(fp32 - table.variants);
  table.defaults[kInt8] = int(int8 - table.variants);
  return table;
}

}  // namespace
}  // namespace cim
