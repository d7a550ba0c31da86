// Times a kernel table's decode variants (kernels/variants.h) on the CPU at hand and
// picks one per compute mode. No ORT: the op (op/op.cpp) and the `cim-int4 tune` command
// (tune_api.cpp) call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernel.h"

namespace cim {

struct TuneOptions {
  // Wall-clock bound of the timing rounds (setup not included: see TuneReport::setup_seconds).
  // Rounds stop once the next would pass it, but never before kTuneMinRounds have run
  // (candidates far behind drop out after two rounds, so later rounds are shorter), and
  // while the choice is open up to kTuneExtendFactor times it (tune()).
  double budget_seconds = 0.4;
  // Bytes of the synthetic weight stream; 0: twice the last-level cache, within
  // [16 MiB, 256 MiB], so that every pass reads from DRAM as decode does.
  int64_t stream_bytes = 0;
};

// A stream larger than this is timed in equal windows (whole strips) of at most this many
// bytes, one window per pass in rotation, so that a pass takes the same time whatever the
// stream size while a window is read again only after the other windows (the rest of the
// stream: at least the last-level cache up to a 128 MiB LLC, where the 256 MiB cap sets in;
// above it, 192 MiB, as cold as the whole-stream passes before, which also re-read within
// 256 MiB) have been read since.
constexpr int64_t kTuneWindowBytes = int64_t(64) << 20;

struct TuneReport {
  std::string table;              // the kernel table's name
  int64_t stream_bytes = 0;
  int64_t window_bytes = 0;       // bytes one pass reads (stream_bytes / windows)
  int windows = 0;                // equal windows of the stream, read in rotation (1: the whole stream per pass)
  int64_t llc_bytes = 0;          // last-level cache as the OS reports it (0: unknown)
  int rounds = 0;
  bool extended = false;          // rounds ran past the budget while the choice was open
  double setup_seconds = 0;       // allocating and filling the stream
  double elapsed_seconds = 0;     // the timing rounds
  double longest_round_seconds = 0;
  // Times are of the whole stream: a pass's time over one window times `windows` (the
  // windows hold equal tile counts).
  double read_seconds = 0;        // median over rounds of the faster of two streaming reads of the same bytes
  struct Row {
    std::string name;
    double seconds[2] = {0, 0};   // median per Mode, one decode (M = 1, 1 thread) of the stream
    double vs_default[2] = {1, 1};  // median per Mode of time / the default's time in the same round
    int rounds[2] = {0, 0};       // per Mode, the rounds it was timed in (fewer: dropped as far behind)
  };
  std::vector<Row> rows;          // one per variant, in the table's order
  int chosen[2] = {0, 0};         // per Mode, an index into rows
};

// Interleaved rounds (streaming reads, then every variant in both modes in an order
// shuffled each round; each pass over the next window of the stream) over a stream larger
// than the last-level cache, at least
// kTuneMinRounds of them. From the second round on, a candidate whose median time over the
// default is more than kTuneDropFactor times the best one's is no longer timed. Per mode
// the variant with the lowest median time relative to the default in the same round, among
// those timed in every round; the default is kept unless that variant beats it by more
// than kTuneMargin in the median and in at least 3 of 4 rounds, over at least
// kTuneMinRounds rounds (so a choice is never worse than the default beyond noise, and a
// loaded machine keeps the default). While a candidate not yet steady (3 of 4 rounds) leads
// the would-be choice (the default, or the steady winner) in the median by more than the
// margin, rounds go on up to kTuneExtendFactor times the budget (a 5-round run kept a
// default 1.15x slower than a variant that won every longer run). A table with one
// variant returns at once.
constexpr double kTuneMargin = 0.03;
constexpr int kTuneMinRounds = 3;
constexpr double kTuneDropFactor = 1.2;
constexpr double kTuneExtendFactor = 2.0;
TuneReport tune(const KernelTable& table, const TuneOptions& options);

}  // namespace cim
