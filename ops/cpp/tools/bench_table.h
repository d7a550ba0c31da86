// The kernel table a bench tool runs: the one CIM_INT4_KERNEL names (as the op's override
// does), the avx2 one by default; nullptr after saying why on stderr. Tools only.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "kernels/kernel.h"

inline const cim::KernelTable* bench_table(const char** name_out = nullptr) {
  const char* env = std::getenv("CIM_INT4_KERNEL");
  const char* name = env != nullptr ? env : "avx2";
  const char* available = nullptr;
  const cim::KernelTable* table = cim::select_kernels(name, &available);
  if (table == nullptr) std::fprintf(stderr, "this CPU does not run the %s table (available: %s)\n", name, available);
  if (name_out != nullptr) *name_out = name;
  return table;
}
