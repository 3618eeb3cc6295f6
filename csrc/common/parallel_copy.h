// The yardstick for snapshot throughput: a plain parallel memcpy.
//
// Copies the given source ranges, back to back, into one region of the same
// total size with `threads` threads, each taking one contiguous share of the
// bytes (the best static split: no chunk bookkeeping, no checksum), with
// glibc's memcpy or, if `streaming`, with copy_streaming(). Blocks; returns
// the fastest of `repeats` runs in *best_seconds.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "common/status.h"

namespace peerstate {

Status measure_parallel_memcpy(const std::vector<std::pair<const void*, size_t>>& sources,
                               size_t threads, size_t repeats, bool streaming, double* best_seconds);

}  // namespace peerstate
