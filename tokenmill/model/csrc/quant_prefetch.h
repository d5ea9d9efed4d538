// The packed kernels' software prefetch of their weight streams (quant_act.h includes it): the
// distance and cache level set at load (quant_gemm_rows.cpp's set_prefetch_ahead), and one thread's
// stream through consecutive groups for the AVX2 and portable kernels (quant_zmm.h has the AVX-512
// kernels' own).
#pragma once

#include <cstdint>

namespace TM_QUANT_NS {

// Bytes each weight stream is prefetched ahead of the chunk being read (set_prefetch_ahead). Without
// it the kernels are latency-bound on DRAM (with AVX-512 the hardware prefetcher alone streamed ~9-10
// GB/s where a plain read runs ~17; the AVX2 kernel 13 against 18-20 on a Zen 3). The best distance
// depends on the CPU kind (quant_kernels.py sets it at load: 1 KiB on a Xeon, 16 KiB on an AMD EPYC;
// BENCHMARKS.md, issue 8).
inline int64_t g_prefetch_ahead = 1024;
// Into L1 (level 1) or L2 (level 2). An AMD EPYC Zen 4 streamed Qwen-1.5B's layers 1.3x faster into
// L2: prefetches into L1 wait for its few miss buffers, and evict what the kernel reads.
inline int g_prefetch_level = 1;

// One thread's weight stream through consecutive groups (the AVX2 and portable kernels): each
// chunk read calls upto(its end), which prefetches every line to g_prefetch_ahead bytes past it, on
// into the groups that follow in memory. A group that does not follow the last one restarts it.
struct StreamPrefetch {
  const uint8_t* next = nullptr;  // the first byte not yet prefetched
  const uint8_t* expect = nullptr;  // where the last group ended
  void start(const uint8_t* group, int64_t group_bytes) {
    if (group != expect) next = group;
    expect = group + group_bytes;
  }
  inline void upto(const uint8_t* read_end) {
    const uint8_t* n = next;  // a local: as the member, GCC stored it back every line
    for (const uint8_t* e = read_end + g_prefetch_ahead; n < e; n += 64) {
      if (g_prefetch_level == 2) __builtin_prefetch(n, 0, 2);
      else __builtin_prefetch(n, 0, 3);
    }
    next = n;
  }
};

}  // namespace TM_QUANT_NS
