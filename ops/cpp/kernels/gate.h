// The epilogue of a gated node (attribute 'gated'): y = act(gate) * up, element by element.
// Kernels know nothing of ORT; the op calls one GateFn per range of output channels.
#pragma once

#include <cstdint>

#include "kernels/kernel.h"

namespace cim {

// The activations of the contract's GATED_ACTIVATIONS, both of the form
// act(g) = g / (1 + exp(-t(g))):
//   silu:      t = g                                    (g * sigmoid(g))
//   gelu_tanh: t = 2 * sqrt(2/pi) * (g + 0.044715 g^3)  (0.5 g (1 + tanh(sqrt(2/pi)(g + 0.044715 g^3))))
enum class Gate : int { kSilu = 0, kGeluTanh = 1 };

// gate[i] = act(gate[i]) * up[i] for i in [0, n), in place.
using GateFn = void (*)(Gate kind, float* gate, const float* up, int64_t n);

// Scalar float32 with std::exp: the reference beside the SIMD version.
void gate_portable(Gate kind, float* gate, const float* up, int64_t n);
#if defined(CIM_INT4_X86_KERNELS)
// AVX2 + FMA: exp by range reduction and a degree-6 polynomial (within 2 ulp of expf on the
// range it is used; the tail runs gate_portable).
void gate_avx2(Gate kind, float* gate, const float* up, int64_t n);
#endif

// The epilogue matching a kernel table: the portable one for the portable table, else AVX2
// (every x86 table runs on a CPU with AVX2 and FMA).
GateFn gate_for(const KernelTable& table);

}  // namespace cim
