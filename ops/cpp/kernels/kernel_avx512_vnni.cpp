// The avx512_vnni kernel table: tile_kernels.h instantiated with Avx512<true> traits. Only this
// file is compiled with its -m flags (CMakeLists.txt); dispatch.cpp calls in here only
// after CPUID and XCR0 say the CPU and OS run them.
#include "kernels/simd_avx512.h"
#include "kernels/tile_kernels.h"

namespace cim {

const KernelTable& avx512_vnni_kernels() {
  using K = TileKernels<Avx512<true>>;
  static const KernelTable table{"avx512_vnni", K::matmul_fp32, K::matmul_int8, K::quantize_a};
  return table;
}

}  // namespace cim
