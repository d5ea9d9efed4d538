// Compile-time loops and the x8 layout's bit-plane merges, shared by the packed kernels (included by
// quant_act.h), in each ISA variant's namespace (TM_QUANT_NS).
#pragma once

#include <utility>

namespace TM_QUANT_NS {

// Bit J of each byte of p moved to bit T, for __m256i and __m512i alike (GCC vector operations).
// Shifting whole 64-bit lanes is fine: what crosses a byte boundary lands away from bit T (and the
// bit above it), and the caller's mask drops it.
template <int T, int J, typename V>
inline V plane_bit(V p) {
  if constexpr (J <= T) return p << (T - J);
  else return p >> (J - T);
}

// u[t] |= bit T of byte b of p, for each byte b of vector t (t in J...): the 5-bit formats' plane
// of the x8 layout (quant_x8.h).
template <int T, typename V, int... J>
inline void add_plane(V* u, V p, std::integer_sequence<int, J...>) {
  const auto m = static_cast<long long>(0x0101010101010101ULL << T);
  ((u[J] |= plane_bit<T, J>(p) & m), ...);
}

// u[t] |= bits 4-5 from Q6_K's two planes (quant_x8.h): bits 2 (t % 4) and up of plane t / 4. Two
// ops a vector, against four for two one-bit planes: the 6-bit decode bound Q6_K's few-row products.
template <typename V, int... J>
inline void add_plane_pairs(V* u, V a, V b, std::integer_sequence<int, J...>) {
  const auto m = static_cast<long long>(0x3030303030303030ULL);
  ((u[J] |= plane_bit<4, 2 * (J % 4)>(J < 4 ? a : b) & m), ...);
}

// f(0), ..., f(N - 1) with compile-time indices. GCC's `#pragma GCC unroll` is a hint it dropped for
// some instances (AVX-512, 16-bit codes of 32-weight block formats: the rows' accumulators went to the
// stack, 3.5x slower; AVX2, the 8 weight vectors of a chunk); an index sequence leaves it no loop.
#define TM_INLINE __attribute__((always_inline))
template <typename F, int... I>
TM_INLINE inline void static_for_seq(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
TM_INLINE inline void static_for(F&& f) {
  static_for_seq(f, std::make_integer_sequence<int, N>{});
}

// f(integral_constant<int, mr>) for a pass of mr rows, 1 <= mr <= 8 (each kernel's row count is a
// template argument, so that its per-row arrays stay in registers)
template <typename F>
TM_INLINE inline void dispatch_rows(int mr, F&& f) {
  switch (mr) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

}  // namespace TM_QUANT_NS
