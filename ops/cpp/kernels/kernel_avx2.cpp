// The avx2 kernel table: tile_kernels.h instantiated with Avx2<false> traits. Only this
// file is compiled with its -m flags (CMakeLists.txt); dispatch.cpp calls in here only
// after CPUID and XCR0 say the CPU and OS run them.
#include "kernels/simd_avx2.h"
#include "kernels/tile_kernels.h"

namespace cim {

const KernelTable& avx2_kernels() {
  using K = TileKernels<Avx2<false>>;
  static const KernelTable table{"avx2", K::matmul_fp32, K::matmul_int8, K::quantize_a};
  return table;
}

}  // namespace cim
