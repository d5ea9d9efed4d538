// The "x8" layout the packed kernels read: each format's bits and scales, unchanged in size, with
// rows interleaved in groups of 8 so that one SIMD lane holds one output row. A dot product then
// needs no horizontal sums or scale broadcasts: the 8 rows' scales are one 16-byte load.
//
// A weight [N, K] becomes ceil(N/8) groups (the last one zero-padded); a group is
//   [group head] then K/QK blocks of [block head][QK/32 chunk bodies].
// A chunk body holds 8 rows x 32 weights. Its low 4 bits (or all 8) form four 64-byte vectors
// U0..U3 of 16 int32 lanes: lane L = (g % 2) * 8 + r holds weights 4g..4g+3 of row r, with
// U0: g = 0,1  U1: g = 2,3  U2: g = 4,5  U3: g = 6,7   (U0, U1: weights 0-15; U2, U3: 16-31).
// 4-bit formats store U0 | U2 << 4 then U1 | U3 << 4 (128 bytes). The high bits follow as 32-byte
// planes. The 32-byte halves of U0..U3, in order t = 2k + half, are the ymm vectors a decode holds:
// 5-bit formats have one plane, whose byte b holds bit 4 of byte b of vector t at bit t; Q6_K has
// two, plane t / 4 holding bits 4-5 of byte b of vector t at bits 2 (t % 4) and up. So a SIMD decode
// takes vector t's high bits with one shift and one masked merge per plane (no per-bit expansion).
// 8-bit formats store U0..U3 as they are (256 bytes).
// Heads (fp16 unless said): Q4_0, Q5_0, Q8_0: d[8]; Q4_1, Q5_1, I4_G128: d[8], m[8];
// Q4_K, Q5_K: d[8], dmin[8], then per chunk k the 6-bit scale sc[k][8] and min m[k][8] as bytes;
// Q6_K: d[8], then int8 scales sc[h][8] for the 16 halves h; I8_ROW: group head of 8 float scales.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

namespace tmq {

struct X8Geom {
  int qk, group_head, block_head, body;
  int bits;        // 4, 5, 6 or 8
  int sym;         // zero point c of a symmetric format (w = d (u - c)); 0 for asymmetric or signed
  bool two_scales; // a scale per 16 weights (Q6_K)
  bool kquant;     // Q4_K / Q5_K head
};

constexpr X8Geom x8_geom(int qtype) {
  switch (qtype) {
    case Q4_0: return {32, 0, 16, 128, 4, 8, false, false};
    case Q4_1: return {32, 0, 32, 128, 4, 0, false, false};
    case Q5_0: return {32, 0, 16, 160, 5, 16, false, false};
    case Q5_1: return {32, 0, 32, 160, 5, 0, false, false};
    case Q8_0: return {32, 0, 16, 256, 8, 0, false, false};
    case I8_ROW: return {32, 32, 0, 256, 8, 0, false, false};
    case I4_G128: return {128, 0, 32, 128, 4, 0, false, false};
    case Q4_K: return {256, 0, 160, 128, 4, 0, false, true};
    case Q5_K: return {256, 0, 160, 160, 5, 0, false, true};
    case Q6_K: return {256, 0, 144, 192, 6, 32, true, false};
    default: return {0, 0, 0, 0, 0, 0, false, false};
  }
}

inline int64_t x8_group_bytes(int qtype, int64_t K) {
  const X8Geom g = x8_geom(qtype);
  return g.group_head + K / g.qk * (g.block_head + g.qk / 32 * g.body);
}

constexpr bool x8_signed(int qtype) { return qtype == Q8_0 || qtype == I8_ROW; }

// Where weight e (0..31) of row r of a chunk lives: vector k, byte index i inside it.
inline void x8_slot(int r, int e, int& k, int& i) {
  const int g = e >> 2;
  k = g >> 1;
  i = ((g & 1) * 8 + r) * 4 + (e & 3);
}

// Per-row scale data of a chunk, decoded from the heads (scalar).
struct X8Scales {
  float d[8][2];    // per row, per half
  float off[8][2];  // w = d * u + off
};

inline const uint8_t* x8_block(const uint8_t* group, const X8Geom& g, int64_t b) {
  return group + g.group_head + b * (g.block_head + g.qk / 32 * g.body);
}

inline void x8_chunk_scales(int qtype, const uint8_t* group, const X8Geom& g, int64_t c, X8Scales& s) {
  const int cpb = g.qk / 32;
  const uint8_t* h = x8_block(group, g, c / cpb);
  const int k = static_cast<int>(c % cpb);
  for (int r = 0; r < 8; ++r) {
    float d0, d1, o0, o1;
    switch (qtype) {
      case Q4_0: case Q5_0: case Q8_0: {
        d0 = d1 = ld_half(h + 2 * r);
        o0 = o1 = -static_cast<float>(g.sym) * d0;
        break;
      }
      case Q4_1: case Q5_1: case I4_G128:
        d0 = d1 = ld_half(h + 2 * r);
        o0 = o1 = ld_half(h + 16 + 2 * r);
        break;
      case I8_ROW: {
        float v;
        std::memcpy(&v, group + 4 * r, 4);
        d0 = d1 = v;
        o0 = o1 = 0.f;
        break;
      }
      case Q4_K: case Q5_K:
        d0 = d1 = ld_half(h + 2 * r) * h[32 + 8 * k + r];
        o0 = o1 = -ld_half(h + 16 + 2 * r) * h[96 + 8 * k + r];
        break;
      default: {  // Q6_K
        const float d = ld_half(h + 2 * r);
        d0 = d * static_cast<int8_t>(h[16 + 8 * (2 * k) + r]);
        d1 = d * static_cast<int8_t>(h[16 + 8 * (2 * k + 1) + r]);
        o0 = -32.f * d0;
        o1 = -32.f * d1;
      }
    }
    s.d[r][0] = d0;
    s.d[r][1] = d1;
    s.off[r][0] = o0;
    s.off[r][1] = o1;
  }
}

// The 8 x 32 quant values of a chunk (raw int8 for signed formats), scalar.
inline void x8_chunk_bytes(const uint8_t* body, const X8Geom& g, uint8_t u[8][32]) {
  for (int r = 0; r < 8; ++r) {
    for (int e = 0; e < 32; ++e) {
      int k, i;
      x8_slot(r, e, k, i);
      uint8_t v;
      if (g.bits == 8) {
        v = body[k * 64 + i];
      } else {
        v = (body[(k & 1) * 64 + i] >> ((k >> 1) * 4)) & 0xF;
        const int t = 2 * k + i / 32;  // the ymm vector that byte i of Uk is in
        if (g.bits == 5) v |= ((body[128 + i % 32] >> t) & 1) << 4;
        if (g.bits == 6) v |= ((body[128 + 32 * (t / 4) + i % 32] >> (2 * (t % 4))) & 3) << 4;
      }
      u[r][e] = v;
    }
  }
}

// A chunk's x8 body from its 8 rows' values u[r][e] (rows past N zero), each byte written once.
// Weights 4g..4g+3 of row r go to vector g / 2, lane (g % 2) * 8 + r (x8_slot); a 4-bit byte holds
// weight e and, above it, weight e + 16, as a GGUF Q4_0 byte does. High-bit plane byte 4r + j holds
// weight 4g + j's bit 4 at bit g (5 bits), or plane g / 4 its bits 4-5 at bits 2 (g % 4) (Q6_K).
// (A per-value read-modify-write of the body, row by row, held loading Qwen2.5-Coder-1.5B to
// ~0.2 GB/s: 5.6 of its 6.6 s.)
template <int BITS>
inline void x8_write_body(uint8_t* body, const uint8_t u[8][32]) {
  for (int r = 0; r < 8; ++r) {
    uint8_t p[32];
    if constexpr (BITS == 8) {
      std::memcpy(p, u[r], 32);
    } else {
      for (int e = 0; e < 16; ++e) p[e] = static_cast<uint8_t>((u[r][e] & 0xF) | (u[r][e + 16] & 0xF) << 4);
    }
    constexpr int kGroups = BITS == 8 ? 8 : 4;
    for (int g = 0; g < kGroups; ++g) std::memcpy(body + (g >> 1) * 64 + ((g & 1) * 8 + r) * 4, p + 4 * g, 4);
    if constexpr (BITS == 5 || BITS == 6) {
      for (int j = 0; j < 4; ++j) {
        uint32_t lo = 0, hi = 0;
        for (int g = 0; g < 8; ++g) {
          const uint32_t h = u[r][4 * g + j] >> 4;
          if constexpr (BITS == 5) lo |= (h & 1) << g;
          else (g < 4 ? lo : hi) |= (h & 3) << (2 * (g & 3));
        }
        body[128 + 4 * r + j] = static_cast<uint8_t>(lo);
        if constexpr (BITS == 6) body[160 + 4 * r + j] = static_cast<uint8_t>(hi);
      }
    }
  }
}

// GGUF (or tokenmill's row formats) -> x8. rows: N rows of `rb` bytes; out: ceil(N/8) groups.
template <typename F>
void x8_repack_group(const uint8_t* rows, int64_t rb, int64_t N, int64_t K, int qtype, int64_t gi, uint8_t* out) {
  const X8Geom g = x8_geom(qtype);
  const int64_t gb = x8_group_bytes(qtype, K);
  uint8_t* grp = out + gi * gb;
  std::memset(grp, 0, gb);  // the padded rows' heads (bodies are written whole)
  const int cpb = g.qk / 32;
  const int nr = static_cast<int>(std::min<int64_t>(8, N - gi * 8));
  void (*write_body)(uint8_t*, const uint8_t[8][32]) = g.bits == 8 ? x8_write_body<8>
                                                        : g.bits == 6 ? x8_write_body<6>
                                                        : g.bits == 5 ? x8_write_body<5> : x8_write_body<4>;
  for (int r = 0; r < nr; ++r) {
    const uint8_t* row = rows + (gi * 8 + r) * rb;
    if (qtype == I8_ROW) std::memcpy(grp + 4 * r, row, 4);
    for (int64_t b = 0; b < K / g.qk; ++b) {
      uint8_t* h = grp + g.group_head + b * (g.block_head + cpb * g.body);
      const uint8_t* src = row + F::HEAD + b * F::BYTES;  // the GGUF block
      switch (qtype) {
        case Q4_0: case Q5_0: case Q8_0:
          std::memcpy(h + 2 * r, src, 2);
          break;
        case Q4_1: case Q5_1: case I4_G128:
          std::memcpy(h + 2 * r, src, 2);
          std::memcpy(h + 16 + 2 * r, src + 2, 2);
          break;
        case Q4_K: case Q5_K:
          std::memcpy(h + 2 * r, src, 2);
          std::memcpy(h + 16 + 2 * r, src + 2, 2);
          for (int k = 0; k < 8; ++k) {
            int sc, m;
            scale_min_k4(k, src + 4, sc, m);
            h[32 + 8 * k + r] = static_cast<uint8_t>(sc);
            h[96 + 8 * k + r] = static_cast<uint8_t>(m);
          }
          break;
        case Q6_K:
          std::memcpy(h + 2 * r, src + 208, 2);
          for (int j = 0; j < 16; ++j) h[16 + 8 * j + r] = src[192 + j];
          break;
        default: break;
      }
    }
  }
  uint8_t u[8][32] = {};
  for (int64_t b = 0; b < K / g.qk; ++b) {
    uint8_t* h = grp + g.group_head + b * (g.block_head + cpb * g.body);
    for (int k = 0; k < cpb; ++k) {
      for (int r = 0; r < nr; ++r) F::bytes(rows + (gi * 8 + r) * rb, static_cast<int>(b * cpb + k), u[r]);
      write_body(h + g.block_head + k * g.body, u);
    }
  }
}

}  // namespace tmq
