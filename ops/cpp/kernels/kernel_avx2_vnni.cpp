// The avx2_vnni kernel table: tile_kernels.h's variants (variants.h) over Avx2 traits. Only this
// file is compiled with its -m flags (CMakeLists.txt); dispatch.cpp calls in here only
// after CPUID and XCR0 say the CPU and OS run them.
#include "kernels/simd_avx2.h"
#include "kernels/variants.h"

namespace cim {

const KernelTable& avx2_vnni_kernels() {
  // int8 mode keeps the t4 loop by default: no AVX-VNNI core has been measured (the n4
  // rows, likely faster with 16 registers as on avx2, are the tuner's candidates).
  static const KernelTable table = make_table<Avx2<Dot::kAvxVnni>>("avx2_vnni", "t4-pf6k");
  return table;
}

}  // namespace cim
