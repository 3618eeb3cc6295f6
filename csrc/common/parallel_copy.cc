#include "common/parallel_copy.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/host_memory.h"
#include "common/memory_copy.h"
#include "common/thread_pool.h"

namespace peerstate {

Status measure_parallel_memcpy(const std::vector<std::pair<const void*, size_t>>& sources,
                               size_t threads, size_t repeats, bool streaming, double* best_seconds) {
  if (threads == 0 || repeats == 0)
    return Status(StatusCode::kInvalidArgument, "threads and repeats must be at least 1");
  size_t total = 0;
  for (const auto& s : sources) total += s.second;
  HostRegion destination;
  PEERSTATE_RETURN_IF_ERROR(destination.allocate(total));
  ThreadPool pool(threads);
  const size_t share = (total + threads - 1) / threads;

  auto copy_share = [&](size_t t) {
    size_t begin = t * share, end = std::min(total, begin + share), position = 0;
    for (const auto& s : sources) {
      size_t lo = std::max(begin, position), hi = std::min(end, position + s.second);
      if (lo < hi) {
        unsigned char* to = destination.data() + lo;
        const unsigned char* from = static_cast<const unsigned char*>(s.first) + (lo - position);
        if (streaming)
          copy_streaming(to, from, hi - lo);
        else
          std::memcpy(to, from, hi - lo);
      }
      position += s.second;
      if (position >= end) break;
    }
  };
  double best = 1e300;
  for (size_t r = 0; r < repeats; r++) {
    auto start = std::chrono::steady_clock::now();
    pool.run(threads, copy_share);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  *best_seconds = best;
  return Status::Ok();
}

}  // namespace peerstate
