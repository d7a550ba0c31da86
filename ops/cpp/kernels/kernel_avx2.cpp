// The avx2 kernel table: tile_kernels.h's variants (variants.h) over Avx2 traits. Only this
// file is compiled with its -m flags (CMakeLists.txt); dispatch.cpp calls in here only
// after CPUID and XCR0 say the CPU and OS run them.
#include "kernels/simd_avx2.h"
#include "kernels/variants.h"

namespace cim {

const KernelTable& avx2_kernels() {
  // int8 mode: the one-vector-at-a-time loop (16 registers; measured on Zen 3: 0.83-0.86
  // of a streaming read against 0.55-0.62 for t4-pf6k, docs/tuning.md).
  static const KernelTable table = make_table<Avx2<Dot::kMaddubs>, Avx2<Dot::kMaddubs>, true>("avx2", "n4-pf12k");
  return table;
}

}  // namespace cim
