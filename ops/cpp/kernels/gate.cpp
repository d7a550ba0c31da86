// gate_portable and gate_for (gate.h); the AVX2 version is in gate_avx2.cpp.
#include "kernels/gate.h"

#include <cmath>
#include <cstring>

namespace cim {

void gate_portable(Gate kind, float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float t = kind == Gate::kSilu ? g : 1.5957691216f * (g + 0.044715f * g * g * g);
    gate[i] = g / (1.0f + std::exp(-t)) * up[i];
  }
}

GateFn gate_for(const KernelTable& table) {
#if defined(CIM_INT4_X86_KERNELS)
  if (std::strcmp(table.name, "portable") != 0) return gate_avx2;
#else
  (void)table;
#endif
  return gate_portable;
}

}  // namespace cim
