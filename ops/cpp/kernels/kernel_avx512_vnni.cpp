// The avx512_vnni kernel table: tile_kernels.h's variants (variants.h) over Avx512 traits
// and their ymm form (Avx2 traits with EVEX vpdpbusd). Only this file is compiled with its
// -m flags (CMakeLists.txt); dispatch.cpp calls in here only after CPUID and XCR0 say the
// CPU and OS run them.
#include "kernels/simd_avx512.h"  // first: it includes immintrin.h without GCC 12's false warnings
#include "kernels/simd_avx2.h"
#include "kernels/variants.h"

namespace cim {

const KernelTable& avx512_vnni_kernels() {
  static const KernelTable table = make_table<Avx512<true>, Avx2<Dot::kAvx512Vnni>>("avx512_vnni", "n4-pf6k");
  return table;
}

}  // namespace cim
