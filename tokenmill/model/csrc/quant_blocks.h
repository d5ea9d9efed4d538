// Weight block formats for tokenmill's quantized kernels: GGUF's (llama.cpp's ggml layouts, read
// as they are in the file) and two of tokenmill's own for --quantization int8/int4.
//
// Every format is read in chunks of 32 weights, whatever its block size. A chunk decodes to 32
// unsigned bytes u, one scale per 16 weights and one offset per 16 weights, with
//   w[i] = scale[i / 16] * u[i] + offset[i / 16]
// (symmetric formats fold their zero point into the offset: Q4_0 is u = q + 8, offset = -8 d).
// A dot product with int8 activations x = dx * xq (one dx per 32) is then
//   sum_i w[i] x[i] = dx * sum_h scale_h * (u . xq)_h + sum_h offset_h * (dx * sum xq)_h,
// an integer u8 x s8 dot (VNNI vpdpbusd, or vpmaddubsw) plus per-half sums of the activations.
// Q8_0 and I8 are signed (u = q + 128 would overflow vpmaddubsw): `kSigned` formats give the raw
// int8 q, and the dot uses |q| . sign(xq, q) where VNNI is missing.
//
// The decoders here are scalar: the kernels read the x8 layout (quant_x8.h), which the repack
// builds from these rows at load.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tmq {

// ggml's type ids, and tokenmill's own (100+)
enum QType : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  I8_ROW = 100,   // int8 per output channel: [float scale][K x int8] per row
  I4_G128 = 101,  // int4 asymmetric, groups of 128: [fp16 d][fp16 m][64 bytes] per group (Q4_1 nibble order)
};

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float ld_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return fp16_to_float(h);
#endif
}

inline void scale_min_k4(int j, const uint8_t* q, int& d, int& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// 32 weights from 16 bytes: low nibbles are weights 0-15, high nibbles 16-31; Q5 types add bit j
// of `qh` as weight j's fifth bit.
inline void unpack_nibbles(const uint8_t* q, uint8_t* u, uint32_t qh = 0) {
  for (int j = 0; j < 16; ++j) {
    u[j] = (q[j] & 0xF) | (((qh >> j) & 1) << 4);
    u[j + 16] = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

// Scales and offsets of one chunk: [0] for weights 0-15, [1] for 16-31.
struct ChunkScale {
  float d[2];
  float off[2];
};

// Per format: block size in weights (QK) and bytes (BYTES), bytes before the first block of a row
// (HEAD), whether it is signed, and two decoders of chunk c of a row: `scales` and `bytes`
// (the scalar one; the SIMD ones follow below).
struct FQ4_0 {
  static constexpr int QK = 32, BYTES = 18, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    const float d = ld_half(row + c * BYTES);
    s.d[0] = s.d[1] = d;
    s.off[0] = s.off[1] = -8.f * d;
  }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* q = row + c * BYTES + 2;
    unpack_nibbles(q, u);
  }
};

struct FQ4_1 {
  static constexpr int QK = 32, BYTES = 20, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    const uint8_t* b = row + c * BYTES;
    s.d[0] = s.d[1] = ld_half(b);
    s.off[0] = s.off[1] = ld_half(b + 2);
  }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* q = row + c * BYTES + 4;
    unpack_nibbles(q, u);
  }
};

struct FQ5_0 {
  static constexpr int QK = 32, BYTES = 22, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    const float d = ld_half(row + c * BYTES);
    s.d[0] = s.d[1] = d;
    s.off[0] = s.off[1] = -16.f * d;
  }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* b = row + c * BYTES;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* q = b + 6;
    unpack_nibbles(q, u, qh);
  }
};

struct FQ5_1 {
  static constexpr int QK = 32, BYTES = 24, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    const uint8_t* b = row + c * BYTES;
    s.d[0] = s.d[1] = ld_half(b);
    s.off[0] = s.off[1] = ld_half(b + 2);
  }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* b = row + c * BYTES;
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const uint8_t* q = b + 8;
    unpack_nibbles(q, u, qh);
  }
};

struct FQ8_0 {
  static constexpr int QK = 32, BYTES = 34, HEAD = 0;
  static constexpr bool kSigned = true;
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    s.d[0] = s.d[1] = ld_half(row + c * BYTES);
    s.off[0] = s.off[1] = 0.f;
  }
  static const uint8_t* raw(const uint8_t* row, int c) { return row + c * BYTES + 2; }
  static void bytes(const uint8_t* row, int c, uint8_t* u) { std::memcpy(u, raw(row, c), 32); }
};

struct FI8Row {  // per-channel int8: the scale heads the row
  static constexpr int QK = 32, BYTES = 32, HEAD = 4;
  static constexpr bool kSigned = true;
  static void scales(const uint8_t* row, int, ChunkScale& s) {
    float d;
    std::memcpy(&d, row, 4);
    s.d[0] = s.d[1] = d;
    s.off[0] = s.off[1] = 0.f;
  }
  static const uint8_t* raw(const uint8_t* row, int c) { return row + HEAD + c * BYTES; }
  static void bytes(const uint8_t* row, int c, uint8_t* u) { std::memcpy(u, raw(row, c), 32); }
};

struct FI4G128 {
  static constexpr int QK = 128, BYTES = 68, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    const uint8_t* b = row + (c >> 2) * BYTES;
    s.d[0] = s.d[1] = ld_half(b);
    s.off[0] = s.off[1] = ld_half(b + 2);
  }
  static const uint8_t* nibbles(const uint8_t* row, int c) { return row + (c >> 2) * BYTES + 4 + (c & 3) * 16; }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* q = nibbles(row, c);
    unpack_nibbles(q, u);
  }
};

// Q4_K and Q5_K blocks start with fp16 d, fp16 dmin and 8 packed 6-bit (scale, min) pairs
inline void k4_scales(const uint8_t* b, int k, ChunkScale& s) {
  int sc, m;
  scale_min_k4(k, b + 4, sc, m);
  s.d[0] = s.d[1] = ld_half(b) * sc;
  s.off[0] = s.off[1] = -ld_half(b + 2) * m;
}

struct FQ4_K {
  static constexpr int QK = 256, BYTES = 144, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) { k4_scales(row + (c >> 3) * BYTES, c & 7, s); }
  // chunk k of a block: 32 bytes of qs at (k/2)*32, low nibbles for even k, high for odd
  static const uint8_t* qs(const uint8_t* row, int c) { return row + (c >> 3) * BYTES + 16 + ((c & 7) >> 1) * 32; }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* q = qs(row, c);
    const int shift = (c & 1) * 4;
    for (int l = 0; l < 32; ++l) u[l] = (q[l] >> shift) & 0xF;
  }
};

struct FQ5_K {
  static constexpr int QK = 256, BYTES = 176, HEAD = 0;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* row, int c, ChunkScale& s) { k4_scales(row + (c >> 3) * BYTES, c & 7, s); }
  static const uint8_t* qh(const uint8_t* row, int c) { return row + (c >> 3) * BYTES + 16; }
  static const uint8_t* qs(const uint8_t* row, int c) { return row + (c >> 3) * BYTES + 48 + ((c & 7) >> 1) * 32; }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* q = qs(row, c);
    const uint8_t* h = qh(row, c);
    const int shift = (c & 1) * 4, bit = c & 7;
    for (int l = 0; l < 32; ++l) u[l] = ((q[l] >> shift) & 0xF) | (((h[l] >> bit) & 1) << 4);
  }
};

struct FQ6_K {
  static constexpr int QK = 256, BYTES = 210, HEAD = 0;
  static constexpr bool kSigned = false;
  // chunk k = 4n + r of a block: ql at 64n (+32 for odd r), nibble r/2, qh at 128 + 32n, bits 2r
  static void scales(const uint8_t* row, int c, ChunkScale& s) {
    const uint8_t* b = row + (c >> 3) * BYTES;
    const float d = ld_half(b + 208);
    const int k = c & 7, n = k >> 2, r = k & 3;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * n + 2 * r;
    s.d[0] = d * sc[0];
    s.d[1] = d * sc[1];
    s.off[0] = -32.f * s.d[0];
    s.off[1] = -32.f * s.d[1];
  }
  static const uint8_t* ql(const uint8_t* row, int c) {
    const int k = c & 7;
    return row + (c >> 3) * BYTES + 64 * (k >> 2) + 32 * (k & 1);
  }
  static const uint8_t* qh(const uint8_t* row, int c) { return row + (c >> 3) * BYTES + 128 + 32 * ((c & 7) >> 2); }
  static void bytes(const uint8_t* row, int c, uint8_t* u) {
    const uint8_t* l4 = ql(row, c);
    const uint8_t* h = qh(row, c);
    const int r = c & 3, shift = (r >> 1) * 4;
    for (int l = 0; l < 32; ++l) u[l] = ((l4[l] >> shift) & 0xF) | (((h[l] >> (2 * r)) & 3) << 4);
  }
};

inline int64_t row_bytes(int qtype, int64_t K) {
  switch (qtype) {
    case Q4_0: return K / 32 * 18;
    case Q4_1: return K / 32 * 20;
    case Q5_0: return K / 32 * 22;
    case Q5_1: return K / 32 * 24;
    case Q8_0: return K / 32 * 34;
    case Q4_K: return K / 256 * 144;
    case Q5_K: return K / 256 * 176;
    case Q6_K: return K / 256 * 210;
    case I8_ROW: return 4 + K;
    case I4_G128: return K / 128 * 68;
    default: return -1;
  }
}

inline int block_size(int qtype) {
  switch (qtype) {
    case Q4_K: case Q5_K: case Q6_K: return 256;
    case I4_G128: return 128;
    default: return 32;
  }
}

// Calls f(Format{}) for a type id; false for an unknown one.
template <typename F>
bool dispatch_format(int qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(FQ4_0{}); return true;
    case Q4_1: f(FQ4_1{}); return true;
    case Q5_0: f(FQ5_0{}); return true;
    case Q5_1: f(FQ5_1{}); return true;
    case Q8_0: f(FQ8_0{}); return true;
    case Q4_K: f(FQ4_K{}); return true;
    case Q5_K: f(FQ5_K{}); return true;
    case Q6_K: f(FQ6_K{}); return true;
    case I8_ROW: f(FI8Row{}); return true;
    case I4_G128: f(FI4G128{}); return true;
    default: return false;
  }
}

}  // namespace tmq
