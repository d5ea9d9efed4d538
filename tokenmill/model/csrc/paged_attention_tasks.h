// How the AVX-512 bf16 path of paged decode attention (paged_attention_avx512.h, whose kernels
// this schedules) splits a batch into tasks: rows of one sequence with consecutive lengths (a
// verification, a prompt) run together, sharing each K/V load; each row's keys are split into
// 64-key chunks (flash-decoding) so that one stream keeps every thread busy, and the last task to
// finish a (row, kv head) combines its chunks. With many rows (a prompt) each (run, kv head) is
// one task over all its chunks instead. Included after paged_attention_avx512.h.
#pragma once

#include <atomic>
#include <memory>

namespace tm_paged {

// Runs of rows [start, end) that share a block table with lengths rising by one (a verification),
// cut so that there are at least `min_tasks` (run, kv head, key chunk) tasks where rows allow.
std::vector<std::pair<int64_t, int64_t>> row_runs(const int64_t* tables, const int64_t* lens, int64_t B,
                                                  int64_t max_blocks, int64_t BS, int64_t Hkv, int64_t min_tasks) {
  constexpr int64_t kMaxRun = 32;
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    while (e < B && lens[e] == lens[e - 1] + 1 &&
           std::equal(tables + e * max_blocks, tables + e * max_blocks + (lens[e] + BS - 1) / BS, tables + b * max_blocks))
      ++e;
    // runs of at most kMaxRun rows, of even sizes (33 rows: 17 + 16, not 32 + 1, which would leave
    // one thread the whole 32-row run while the other ran the single row)
    const int64_t parts = (e - b + kMaxRun - 1) / kMaxRun;
    for (int64_t i = 0; i < parts; ++i)
      runs.emplace_back(b + (e - b) * i / parts, b + (e - b) * (i + 1) / parts);
    b = e;
  }
  auto tasks = [&] {
    int64_t n = 0;
    for (auto [a, e] : runs) n += Hkv * key_chunks(lens[e - 1]);
    return n;
  };
  for (bool cut = true; cut && tasks() < min_tasks;) {
    cut = false;
    std::vector<std::pair<int64_t, int64_t>> halves;
    for (auto [a, e] : runs) {
      if (e - a > 1) {
        halves.emplace_back(a, (a + e + 1) / 2);
        halves.emplace_back((a + e + 1) / 2, e);
        cut = true;
      } else {
        halves.emplace_back(a, e);
      }
    }
    runs.swap(halves);
  }
  return runs;
}

// fn(task, scratch) for tasks [0, total), shared out by TaskShares. A 16-row verification's
// attention -3.5%, its forward -1.4% on SmolLM2; batched decode even (BENCHMARKS.md).
template <typename Scratch, typename Fn>
void for_tasks(int64_t total, Fn&& fn) {
  TaskShares shares(total, at::get_num_threads());
  at::parallel_for(0, shares.count(), 1, [&](int64_t own, int64_t) {
    Scratch s;
    int64_t cursor = 0;
    for (int64_t task; (task = shares.claim(own, cursor)) >= 0;) fn(task, s);
  });
}

// bf16 queries and outputs, head_dim = 16 * NV (64 -> 4, 128 -> 8), a cache of C.
template <int NV, typename C>
void decode_attention_avx512(at::BFloat16* out, const at::BFloat16* q, const PagedKV<C>& kv,
                             const int64_t* block_tables, const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                             int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = 16 * NV;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;
  const auto runs = row_runs(block_tables, seq_lens, B, max_blocks, BS, Hkv, 2 * at::get_num_threads());
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + key_chunks(seq_lens[b]);
  const int64_t stride = D + 2;
  // one (row run, kv head, chunk) and its partials: `part` is this run's own or the shared buffer
  auto chunk = [&](int64_t b, int64_t b_end, int64_t h, int64_t t0, Partials& part, Scratch& s) {
    const int64_t* table = block_tables + b * max_blocks;
    if (b_end - b == 1 && G <= 8) {
      s.scores.resize(G * kKeyChunk);
      auto one = [&](auto g_tag) {
        row_chunk<NV, decltype(g_tag)::value, C>(q, kv, table, seq_lens[b], b, h, H, row, BS, t0, scale, part,
                                                 s.scores.data());
      };
      switch (G) {
        case 1: one(std::integral_constant<int, 1>{}); break;
        case 2: one(std::integral_constant<int, 2>{}); break;
        case 3: one(std::integral_constant<int, 3>{}); break;
        case 4: one(std::integral_constant<int, 4>{}); break;
        case 5: one(std::integral_constant<int, 5>{}); break;
        case 6: one(std::integral_constant<int, 6>{}); break;
        case 7: one(std::integral_constant<int, 7>{}); break;
        default: one(std::integral_constant<int, 8>{}); break;
      }
    } else {
      chunk_partials<NV, C>(q, kv, table, seq_lens, b, b_end - b, h, H, G, row, BS, t0, scale, part, s);
    }
  };
  // Many rows (a prefill through this kernel): a task per (run, kv head) runs all its chunks into a
  // buffer of its own and combines them, rather than all partials going through one buffer too
  // big for the cache (a 1024-token prefill of 12 heads: 100 MiB). Each row's chunks and their
  // combination are the same, so is its result.
  if (static_cast<int64_t>(runs.size()) * Hkv >= 4 * at::get_num_threads() &&
      first[B] * H * stride * 4 > (8 << 20)) {
    at::parallel_for(0, static_cast<int64_t>(runs.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
      Scratch s;
      std::vector<float> local;
      for (int64_t task = begin; task < end; ++task) {
        // runs taken from both ends in turn: a prompt's later rows see more keys, and each thread
        // gets a contiguous range of tasks
        const int64_t i = task / Hkv, n = static_cast<int64_t>(runs.size());
        const auto [b, b_end] = runs[i % 2 ? n - 1 - i / 2 : i / 2];
        const int64_t h = task % Hkv;
        local.resize((first[b_end] - first[b]) * G * stride);
        Partials part{local.data(), first.data(), G, stride, first[b], h * G};
        for (int64_t c = 0; c < key_chunks(seq_lens[b_end - 1]); ++c)
          chunk(b, b_end, h, c * kKeyChunk, part, s);
        for (int64_t r = b; r < b_end; ++r)
          for (int64_t g = 0; g < G; ++g)
            combine_partials<NV>(out + (r * H + h * G + g) * D, part, r, h * G + g, key_chunks(seq_lens[r]));
      }
    });
    return;
  }
  std::unique_ptr<float[]> buf(new float[first[B] * H * stride]);
  Partials part{buf.get(), first.data(), H, stride};
  std::vector<int64_t> task_start{0};  // tasks of run i: (kv head, chunk) of its longest row
  for (auto [b, e] : runs) task_start.push_back(task_start.back() + Hkv * key_chunks(seq_lens[e - 1]));
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[B * Hkv]);
  for (int64_t i = 0; i < B * Hkv; ++i) done[i].store(0, std::memory_order_relaxed);
  for_tasks<Scratch>(task_start.back(), [&](int64_t task, Scratch& s) {
    const size_t ri = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
    const auto [b, b_end] = runs[ri];
    const int64_t local = task - task_start[ri], chunks = key_chunks(seq_lens[b_end - 1]);
    const int64_t h = local / chunks, t0 = local % chunks * kKeyChunk;
    chunk(b, b_end, h, t0, part, s);
    for (int64_t r = std::max<int64_t>(b, b + t0 - seq_lens[b] + 1); r < b_end; ++r) {
      const int64_t n = key_chunks(seq_lens[r]);
      if (done[r * Hkv + h].fetch_add(1, std::memory_order_acq_rel) + 1 == n)  // the row's last chunk: combine
        for (int64_t g = 0; g < G; ++g)
          combine_partials<NV>(out + (r * H + h * G + g) * D, part, r, h * G + g, n);
    }
  });
}
}  // namespace tm_paged
