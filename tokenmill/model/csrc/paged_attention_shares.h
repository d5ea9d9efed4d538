// How paged decode attention's tasks go to the threads, in both ISA paths.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tm_paged {

// Tasks [0, total) in one contiguous share per thread: a thread claims its own share's tasks in
// order, then what is left of the others' (a thread that started late, or whose tasks ran short,
// is not left waiting at the end). Which thread runs a task never changes its result.
class TaskShares {
 public:
  TaskShares(int64_t total, int64_t threads) : n_(std::max<int64_t>(1, std::min(total, threads))), s_(new Share[n_]) {
    for (int64_t t = 0; t < n_; ++t) {
      s_[t].next.store(t * total / n_, std::memory_order_relaxed);
      s_[t].end = (t + 1) * total / n_;
    }
  }
  int64_t count() const { return n_; }
  // the next task for the thread of share `own`, or -1 when none is left; `cursor` starts at 0
  int64_t claim(int64_t own, int64_t& cursor) {
    for (; cursor < n_; ++cursor) {
      Share& sh = s_[(own + cursor) % n_];
      const int64_t task = sh.next.fetch_add(1, std::memory_order_relaxed);
      if (task < sh.end) return task;
    }
    return -1;
  }

 private:
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  int64_t n_;
  std::unique_ptr<Share[]> s_;
};

}  // namespace tm_paged
