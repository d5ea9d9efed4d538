// The AVX-512 work split of a packed product (quant_gemm.cpp): work items of 16 output rows (two
// x8 groups) over the weight shards, activation rows in row tiles of up to kPairRows, tiles in
// blocks that stay in L2. The kernel per item and tile: pair_dot (quant_gemm_rows.cpp), or
// pair_dot_sb (quant_gemm_sb.cpp) when every shard is a K-quant and the codes are 8-bit.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "quant_act.h"
#include "quant_dequant.h"
#include "quant_outliers.h"

namespace TM_QUANT_NS {

struct Shard {
  const uint8_t* w;
  int qtype;
  int64_t rows, gb, first;  // rows, bytes per group of 8 rows, first output column
};

// Activation rows per block: a block's tiles stay in L2 (half of it) while every work item of a
// thread runs over them. Without blocks each item streamed all M rows' codes, from L3 once they
// outgrew L2 (Q6_K down at K = 8960: 19 KiB per row; BENCHMARKS.md, "Many rows").
constexpr int64_t kActBlockBytes = 1 << 20;

// dst[0, nr) = res[0, nr) + bias[0, nr) (bias may be null: + 0, as the scalar form added), stored
// as static_cast<TO> rounds (store16), in one vector rather than element by element (a SmolLM2
// 16-row verification's forward -1%, BENCHMARKS.md).
template <typename TO>
inline void store_item_row(TO* dst, const float* res, const float* bias, int nr) {
  const __mmask16 k = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
  store16(dst, _mm512_add_ps(_mm512_loadu_ps(res), bias ? _mm512_maskz_loadu_ps(k, bias) : _mm512_setzero_ps()), k);
}

// 16 output rows (two x8 groups) per work item, kPairRows activation rows per decoded chunk; each
// thread runs its items over one block of activation rows, then the next block.
// sb: every shard is a K-quant and the rows have one scale per 256 (quant_gemm_sb.cpp).
template <typename TO>
void qgemm_pairs(const ActRow* rows, int64_t M, int64_t K, const std::vector<Shard>& shards, TO* out, int64_t ldo,
                 const float* bias, bool fine, bool sb, const Outliers& ol) {
  std::vector<int64_t> starts{0};
  for (const Shard& s : shards) starts.push_back(starts.back() + (s.rows + 15) / 16);
  // the two groups of work item `item` (a lone last group runs twice)
  auto groups = [&](int64_t item, size_t& si, const uint8_t*& g0, const uint8_t*& g1) {
    while (item >= starts[si + 1]) ++si;
    const Shard& sh = shards[si];
    const int64_t pi = item - starts[si];
    g0 = sh.w + 2 * pi * sh.gb;
    g1 = 16 * pi + 8 < sh.rows ? g0 + sh.gb : g0;
    return pi;
  };
  const int64_t block = std::max<int64_t>(kPairRows, kActBlockBytes / tile_bytes(1, K, fine) / kPairRows * kPairRows);
  // row tiles: even tiles of at most kPairRows rows inside each block; tile t's rows lie at
  // tile_bytes(first row) in one buffer
  std::vector<std::pair<int64_t, int>> tiles;
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t mb = std::min(block, M - b0);
    const int64_t tile = (mb + (mb + kPairRows - 1) / kPairRows - 1) / ((mb + kPairRows - 1) / kPairRows);
    for (int64_t m0 = b0; m0 < b0 + mb; m0 += tile) tiles.emplace_back(m0, static_cast<int>(std::min(tile, b0 + mb - m0)));
  }
  // not zeroed: pack_tile(_sb) writes every byte of it
  std::unique_ptr<uint8_t[]> buf(new uint8_t[tile_bytes(M, K, fine) + 64]);
  uint8_t* tbase = buf.get() + (64 - reinterpret_cast<uintptr_t>(buf.get()) % 64) % 64;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      uint8_t* dst = tbase + tile_bytes(tiles[t].first, K, fine);
      if (sb) pack_tile_sb(rows + tiles[t].first, tiles[t].second, K, dst);
      else pack_tile(rows + tiles[t].first, tiles[t].second, K, fine, dst);
    }
  });
  at::parallel_for(0, starts.back(), 2, [&](int64_t b, int64_t e) {
    for (size_t t0 = 0; t0 < tiles.size();) {  // the tiles of one block
      size_t t1 = t0 + 1;
      while (t1 < tiles.size() && tiles[t1].first % block) ++t1;
      size_t si = 0;
      for (int64_t item = b; item < e; ++item) {
        const uint8_t *g0, *g1;
        const int64_t pi = groups(item, si, g0, g1);
        const Shard& sh = shards[si];
        // the first row tile streams the weights from memory: prefetch ahead, into the next item
        Ahead pf{sh.gb, nullptr, nullptr};
        if (item + 1 < e) {
          size_t sn = si;
          groups(item + 1, sn, pf.n0, pf.n1);
          if (shards[sn].gb != sh.gb) pf.n0 = pf.n1 = nullptr;
        }
        const Ahead none{0, nullptr, nullptr};
        const int nr = static_cast<int>(std::min<int64_t>(16, sh.rows - pi * 16));
        const int64_t col = sh.first + pi * 16;
        for (size_t t = t0; t < t1; ++t) {
          const auto [m0, mr] = tiles[t];
          float res[kPairRows][16];
          const uint8_t* tile = tbase + tile_bytes(m0, K, fine);
          if (sb) pair_dot_sb(sh.qtype, g0, g1, K, tile, mr, t == t0 ? pf : none, res);
          else pair_dot(sh.qtype, g0, g1, K, tile, mr, fine, t == t0 ? pf : none, res);
          for (int m = 0; m < mr; ++m) {
            if (ol.n) ol.add<16>(res[m], m0 + m, col);
            store_item_row(out + (m0 + m) * ldo + col, res[m], bias ? bias + col : nullptr, nr);
          }
        }
      }
      t0 = t1;
    }
  });
}

}  // namespace TM_QUANT_NS
