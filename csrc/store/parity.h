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
#include "store/layout.h"

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

// A parity group of g members places its pieces by one rule, which the
// senders (Replicator::push_pieces), the holders (ParityStore) and the layout
// of python/peerstate/replication/parity.py all follow: member i cuts each
// version into g - 1 pieces of whole chunks, and piece t goes to member
// (i + 1 + t) mod g, so a holder receives one piece from every other member
// and none of its own. Whole chunks, because a chunk is the unit of transfer
// and of CRC32C: a piece arrives verified chunk by chunk, as a replica does.
struct ParityPiece {
  uint32_t first_chunk = 0;  // chunks [first_chunk, end_chunk) of the version's layout
  uint32_t end_chunk = 0;
  size_t region_offset = 0;  // where the first chunk sits in the version's region
  size_t nbytes = 0;         // from there to the end of the last chunk (0 for an empty piece)
};

// Piece `piece` (0 .. g - 2) of a version laid out as `layout`, in a group of
// `group_size` (>= 2): its chunks are those whose index c has
// floor(c (g - 1) / C) == piece, C the chunk count, so pieces differ by at most one chunk.
ParityPiece parity_piece(const Layout& layout, size_t group_size, size_t piece);
// Which member holds piece `piece` of member `member`, and which piece of
// `member` member `holder` holds (holder != member).
inline size_t parity_holder(size_t member, size_t piece, size_t group_size) {
  return (member + 1 + piece) % group_size;
}
inline size_t parity_piece_held(size_t member, size_t holder, size_t group_size) {
  return (holder + group_size - member - 1) % group_size;
}

}  // namespace peerstate
