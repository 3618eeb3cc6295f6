// Parity by XOR: the erasure code of parity groups that tolerate one loss
// each (m = 1).
//
// Of the blocks {parity, piece_1 .. piece_n} with parity = piece_1 ^ .. ^ piece_n,
// any one is the XOR of the others, so one call both encodes (a holder's
// parity from the pieces its group's members sent it) and rebuilds (a lost
// member's piece from that parity and the survivors' pieces).
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"

namespace peerstate {

// One source block: `nbytes` bytes at `data`; the bytes from nbytes to the
// destination's length count as zeros (members' shards differ in size, and a
// shard's last piece is short: nothing is padded in memory).
using ParitySource = std::pair<const void*, size_t>;

// Folds blocks into parity on a pool of threads it shares with the process's
// other users of that many threads (its snapshot stores'). Thread-safe: calls
// from several threads share the pool.
class ParityCoder {
 public:
  // kInvalidArgument for threads == 0 (create), through xor_blocks.
  explicit ParityCoder(size_t threads);

  // destination[0, nbytes) = XOR of every source (accumulate = false), or
  // destination ^= XOR of every source (accumulate = true). Blocks until done.
  // The caller owns every buffer and keeps it alive for the call; no source may
  // overlap the destination. kInvalidArgument, writing nothing, for a source
  // longer than the destination, a null pointer with bytes, or an overlap. With
  // no source the destination is zeroed (or left as is, accumulating).
  Status xor_blocks(void* destination, size_t nbytes, const std::vector<ParitySource>& sources,
                    bool accumulate) const;

  size_t threads() const { return threads_; }

 private:
  size_t threads_;
  std::shared_ptr<ThreadPool> pool_;  // null for one thread: the caller's
};

}  // namespace peerstate
