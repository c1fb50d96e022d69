// Work split between threads with stealing: items [0, n) start as equal contiguous
// shares, one a thread, each walked front to back; a thread whose share runs out takes
// the back half of the largest share left and walks that, and so on. A static split
// waits at its end on whichever core ran slowest in that call (the hypervisor,
// interrupts, memory); on a 2-core Zen 3 that was ~10% of the panel linear layers' time
// at batch 1, 16 and 64 alike. Halves, not single items, so that every thread keeps
// reading forward through memory.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem_cpu {

// One thread's range [next, end) in one word: its owner takes `next` from the front and a
// thief cuts `end` back, each by compare-and-swap, so no item is handed out twice.
struct alignas(64) StealRange {
  std::atomic<uint64_t> word{0};

  static uint64_t pack(int64_t next, int64_t end) {
    return static_cast<uint64_t>(next) << 32 | static_cast<uint64_t>(end);
  }
  static int64_t next_of(uint64_t w) { return static_cast<int64_t>(w >> 32); }
  static int64_t end_of(uint64_t w) { return static_cast<int64_t>(w & 0xFFFFFFFFu); }
  int64_t left() const {
    const uint64_t w = word.load(std::memory_order_relaxed);
    return end_of(w) - next_of(w);
  }
  // The front item, or false when the range is empty; `end`: the range's end as seen then.
  bool take_front(int64_t& item, int64_t& end) {
    uint64_t w = word.load(std::memory_order_relaxed);
    while (next_of(w) < end_of(w)) {
      if (word.compare_exchange_weak(w, pack(next_of(w) + 1, end_of(w)), std::memory_order_acq_rel)) {
        item = next_of(w);
        end = end_of(w);
        return true;
      }
    }
    return false;
  }
  // The back half of what is left (at least one item) as [begin, end), or false when empty.
  bool take_back_half(int64_t& begin, int64_t& end) {
    uint64_t w = word.load(std::memory_order_relaxed);
    while (next_of(w) < end_of(w)) {
      const int64_t mid = next_of(w) + (end_of(w) - next_of(w)) / 2;
      if (word.compare_exchange_weak(w, pack(next_of(w), mid), std::memory_order_acq_rel)) {
        begin = mid;
        end = end_of(w);
        return true;
      }
    }
    return false;
  }
};

// body(take) runs once on each of up to `shares` threads (n < 2^32 items); take(item, end)
// hands it its next item and the end of the range that item came from (for prefetching
// the item after it), or returns false when no item is left anywhere. One share, or a call
// from inside a parallel region, runs every item in order on the calling thread.
template <typename Body>
void parallel_steal(int64_t n, int64_t shares, const Body& body) {
  shares = std::min(shares, n);
  if (shares <= 1 || at::in_parallel_region()) {
    int64_t i = 0;
    body([&](int64_t& item, int64_t& end) {
      if (i >= n) return false;
      item = i++;
      end = n;
      return true;
    });
    return;
  }
  std::vector<StealRange> ranges(shares);
  for (int64_t s = 0; s < shares; ++s)
    ranges[s].word.store(StealRange::pack(n * s / shares, n * (s + 1) / shares), std::memory_order_relaxed);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t own = begin; own < end; ++own) {
      body([&](int64_t& item, int64_t& range_end) {
        for (;;) {
          if (ranges[own].take_front(item, range_end)) return true;
          int64_t victim = -1, most = 0;
          for (int64_t s = 0; s < shares; ++s) {
            const int64_t left = ranges[s].left();
            if (left > most) {
              most = left;
              victim = s;
            }
          }
          if (victim < 0) return false;
          int64_t first, last;
          if (ranges[victim].take_back_half(first, last))
            ranges[own].word.store(StealRange::pack(first, last), std::memory_order_release);
        }
      });
    }
  });
}

}  // namespace tandem_cpu
