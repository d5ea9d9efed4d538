// 16 floats to bf16 with AVX-512, shared by the attention kernels (paged_attention_*.h) and the
// packed products (quant_dequant.h), both compiled with AVX-512F/BW where they include it. Static:
// each library (the quant ones once per ISA variant) keeps its own copy, none resolved to another's.
#pragma once

#include <immintrin.h>

// Rounded to nearest even by integer arithmetic, as c10::BFloat16's constructor rounds (denormals
// kept, where AVX512-BF16's vcvtneps2bf16 flushes them), in the low half of each 32-bit lane.
static inline __m512i bf16_rne_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}

// As static_cast<c10::BFloat16> rounds, its NaN (0x7FC0) included: outputs that tensors hold.
static inline __m256i bf16x16_c10(__m512 x) {
  const __m512i r = _mm512_mask_mov_epi32(bf16_rne_lanes(x), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                          _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
