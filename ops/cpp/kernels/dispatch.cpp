// Picks the kernel table once per op instance. CPUID-based choice of SIMD tables
// goes here; the portable table is always available.
#include <cstring>

#include "kernels/kernel.h"

namespace cim {

const KernelTable* select_kernels(const char* name, const char** available) {
  static const char* const kAvailable = "portable";
  if (available != nullptr) *available = kAvailable;
  const KernelTable& portable = portable_kernels();
  if (name == nullptr || name[0] == '\0' || std::strcmp(name, "auto") == 0) return &portable;
  if (std::strcmp(name, portable.name) == 0) return &portable;
  return nullptr;
}

}  // namespace cim
