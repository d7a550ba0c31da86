// Picks the kernel table once per op instance. The CPU is probed once per process; the
// portable table is always available.
#include <cstring>

#include "kernels/kernel.h"

namespace cim {
namespace {

// What this process can run, best first, and the same names as "a, b, c" for messages.
struct Candidates {
  const KernelTable* tables[5] = {};
  int count = 0;
  char names[128] = {};

  void add(const KernelTable& t) {
    tables[count++] = &t;
    if (names[0] != '\0') std::strcat(names, ", ");
    std::strcat(names, t.name);
  }
};

Candidates probe_cpu() {
  Candidates c;
#if defined(CIM_INT4_X86_KERNELS)
  // libgcc's CPUID reader also checks XCR0 (xgetbv): it reports AVX2/FMA only when the
  // OS saves the ymm state and AVX-512 only when it saves opmask and zmm state, so a
  // "yes" here means the instructions will not fault. __builtin_cpu_init makes this
  // safe even if we run before libgcc's own constructor.
  __builtin_cpu_init();
  // F16C (vcvtph2ps on ymm, float16 scales) comes with every AVX2 CPU in practice; ask anyway.
  const bool f16c = __builtin_cpu_supports("f16c");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("fma") && f16c;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (avx512 && __builtin_cpu_supports("avx512vnni")) c.add(avx512_vnni_kernels());
  if (avx512) c.add(avx512_kernels());
  if (avx2 && __builtin_cpu_supports("avxvnni")) c.add(avx2_vnni_kernels());
  if (avx2) c.add(avx2_kernels());
#endif
  c.add(portable_kernels());
  return c;
}

const Candidates& candidates() {
  static const Candidates c = probe_cpu();
  return c;
}

}  // namespace

const KernelTable* select_kernels(const char* name, const char** available) {
  const Candidates& c = candidates();
  if (available != nullptr) *available = c.names;
  if (name == nullptr || name[0] == '\0' || std::strcmp(name, "auto") == 0) return c.tables[0];
  for (int i = 0; i < c.count; ++i) {
    if (std::strcmp(name, c.tables[i]->name) == 0) return c.tables[i];
  }
  return nullptr;
}

const KernelVariant* KernelTable::find_variant(const char* wanted) const {
  for (int i = 0; i < variant_count; ++i) {
    if (std::strcmp(variants[i].name, wanted) == 0) return &variants[i];
  }
  return nullptr;
}

}  // namespace cim
