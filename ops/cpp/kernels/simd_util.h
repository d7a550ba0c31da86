// Small helpers of the SIMD kernel skeletons (tile_kernels.h, plane_kernels.h). Internal
// linkage only, for the reason tile_kernels.h gives.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

namespace cim {
namespace {

#define CIM_INLINE inline __attribute__((always_inline))
// The same for a lambda's call operator: `[&](auto j) CIM_INLINE_LAMBDA { ... }` (left to
// the inliner, GCC may call a static_for body out of line once the caller grows).
#define CIM_INLINE_LAMBDA __attribute__((always_inline))

// Calls f(std::integral_constant<int, j>) for j = 0 .. J-1, unrolled at compile time
// (shift counts and lane positions must be immediates).
template <typename Fn, int... J>
CIM_INLINE void static_for_impl(Fn&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
template <int J, typename Fn>
CIM_INLINE void static_for(Fn&& f) {
  static_for_impl(f, std::make_integer_sequence<int, J>{});
}

CIM_INLINE int32_t load_i32(const int8_t* p) {
  int32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

}  // namespace
}  // namespace cim
