// ParityStore: the parity block this rank holds for its parity group.
//
// A holder is member h of a group of g ranks (one group per rank; the groups
// are placed by python/peerstate/replication/parity.py). Every other member
// pushes it one piece of each version (parity_piece() in store/parity.h); the
// holder XORs each chunk into the version's block as it arrives, after the
// chunk matched its CRC32C in a staging buffer, so a corrupt or forged chunk
// never enters the parity. The block of a version is committed when all g - 1
// pieces arrived; until then readers see the previous committed block. What
// the holder keeps beside the bytes: every contributor's metadata of the
// version (layout and checksums), which a rebuild needs to cut and verify the
// lost member's piece.
//
// Memory is bounded as in ReplicaStore: hold() accounts two blocks (the
// committed version's and the incoming one's) against the budget and
// allocates both; a piece larger than the block is refused on arrival.
//
// Members are coupled through the block: one member may begin version v + 1
// while another still pushes v. The holder then waits for v to be complete
// (kCompleteWaitMs at most) before it reuses the other block; v that stays
// incomplete (its member died or stalled) gets v + 1 refused with kBusy naming
// the members still missing, and a version a contributor failed (a bad chunk,
// two different states under one version number) is dropped by the next
// version at once. The version rules of ReplicaStore apply to every member:
// newer than the committed block, at most kMaxVersionStep ahead of it, and no
// newer than bound_versions() allows.
//
// A member that begins the version it is already pushing again (a retry after
// a broken connection) keeps what it folded: its chunks are folded once each,
// and a chunk sent again is read and dropped (ChunkFold::already_folded).
//
// Thread-safe: the tcp server's connection threads fold chunks of several
// members concurrently (disjoint stripes of the block are folded in
// parallel); readers hold committed blocks by shared_ptr.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/host_memory.h"
#include "common/status.h"
#include "store/parity.h"
#include "store/version_meta.h"

namespace peerstate {

// One member's piece of the version being assembled.
struct ParityContribution {
  VersionMeta meta;
  ParityPiece piece;
  std::vector<uint8_t> arrived;  // per chunk of the piece: 0 missing, 1 being folded, 2 folded
  size_t folded = 0;
  std::string failure;  // first chunk that failed verification, or a conflicting retry
};

struct ParityVersion {
  int64_t version = -1;
  HostRegion block;
  std::map<int, ParityContribution> contributions;  // by source rank
  bool complete = false;
  bool failed = false;  // a contribution failed: the version can never complete
  bool preparing = false;  // being emptied for its version (reset): no piece may begin in it yet
  uint64_t generation = 0;  // bumped whenever the block is reset: a fold of an older one is dropped
  size_t writers = 0;   // folds in progress (XOR into the block)
  size_t open_folds = 0;  // ChunkFolds holding the block (not readers)
  // Folds of disjoint stripes run concurrently; XOR is not atomic, so two
  // members' chunks that overlap in the block take their stripes in turn.
  std::array<std::mutex, 64> stripes;
};

// A lost member's piece of one version, rebuilt by this holder from its block
// and the survivors' pieces (Replicator::rebuild_piece) and verified against
// the member's checksums, for its replacement to pull.
struct RebuiltPiece {
  VersionMeta meta;  // the lost member's, as it pushed the version
  ParityPiece piece;
  HostRegion bytes;  // the piece's bytes, from its first chunk on
};

class ParityStore {
 public:
  static constexpr int64_t kMaxVersionStep = 1 << 16;
  static constexpr long kCompleteWaitMs = 2000;
  static constexpr size_t kStripeBytes = 256 << 10;

  // One chunk being folded (expect_chunk). Its destructor gives the chunk back
  // if fold() was not called (the connection failed mid-chunk).
  struct ChunkFold {
    ChunkFold() = default;
    ChunkFold(const ChunkFold&) = delete;
    ChunkFold& operator=(const ChunkFold&) = delete;
    ~ChunkFold();
    std::shared_ptr<ParityVersion> version;
    std::shared_ptr<const Layout> layout;  // the member's, to receive the chunk by
    int source_rank = -1;
    uint32_t chunk = 0;
    uint64_t generation = 0;
    bool already_folded = false;  // a retry's chunk: read it and drop it
    bool pending = false;          // the chunk is this fold's to fold (given back if it is not)
    ParityStore* store = nullptr;
  };

  // budget_bytes 0: half of physical memory.
  explicit ParityStore(size_t budget_bytes);

  // Holds the parity of the group `members` (ranks, in group order; at least
  // 3: a group of 2 is a mirror) as member `self`, in blocks of `block_bytes`
  // (the largest piece any member will send). Replaces an earlier group, and
  // forgets its blocks. kInvalidArgument for a bad group, kBudgetExceeded
  // (naming the totals) when two blocks do not fit, kOutOfMemory.
  Status hold(const std::vector<int>& members, size_t self, size_t block_bytes);

  // Starts receiving the piece of (meta.source_rank, meta.version) this
  // holder keeps. kNotFound for a rank that is not another member of the
  // group, kBudgetExceeded for a piece larger than the block,
  // kInvalidArgument for a version the rules above refuse or older than the
  // one being assembled, kBusy when the version being assembled stays
  // incomplete (see the top). Blocks only then, up to kCompleteWaitMs.
  Status begin(const VersionMeta& meta);
  // Checks that `chunk` is in the member's piece of the incoming `version`,
  // has exactly `length` bytes and is not being folded now (kProtocolError
  // otherwise), and hands out the fold.
  Status expect_chunk(int source_rank, int64_t version, uint32_t chunk, uint64_t length, ChunkFold* fold);
  // Ends the fold with the chunk's bytes as they arrived, laid out as at its
  // place in the member's region (`staged[0]` is the chunk's first byte), and
  // their CRC32C: folds them into the block when `crc` matches the metadata's;
  // else fails the version (kChecksumMismatch) and folds nothing.
  Status fold(ChunkFold* fold, const unsigned char* staged, uint32_t crc);
  // Waits until every chunk of the member's piece was folded, and then until
  // the version's block is complete (every member's piece in): a member's
  // round of pushes ends only when the version is covered at each of its
  // holders. That couples the members' rounds, which is what keeps a
  // recovery point: a member begins v + 1 only once v is complete at every
  // holder of its group (its own included, Replicator::push_pieces), so the
  // newest version complete at all of them is never the older of a holder's
  // two blocks when a third version needs one. kTimeout; kChecksumMismatch or
  // kInvalidArgument when a piece failed; kAborted when the version was dropped.
  Status commit(int source_rank, int64_t version, Deadline deadline);
  // Waits until the block of `version` is complete here, however long before
  // its first piece arrives (kTimeout; kAborted when it failed or
  // interrupt_waits() was called meanwhile; kNotFound when newer blocks replaced it).
  Status wait_complete(int64_t version, Deadline deadline) const;
  // Ends every wait_complete() in progress, and any begun before resume_waits(),
  // with kAborted (a recovery began: the versions being waited for will not be covered).
  void interrupt_waits();
  void resume_waits();

  // A committed block: the newest (`version` -1), or the one before it while
  // its block has not been reused. kNotFound otherwise.
  Status get(int64_t version, std::shared_ptr<const ParityVersion>* out) const;
  // The versions whose block is committed and readable, newest first.
  std::vector<int64_t> committed() const;
  // Forgets every block of a version newer than `version` (see ReplicaStore::drop_newer).
  void drop_newer(int64_t version);
  // The newest version any member may begin from now on (see ReplicaStore::bound_versions).
  void bound_versions(int64_t newest);

  // Keeps `piece` for its replacement to pull (replacing one of the same rank);
  // held until forget_rebuilt(), or until a newer version's block is complete
  // (which needs the replacement's own piece: it pulled what it needed).
  // kInvalidArgument for a rank not in the group.
  Status keep_rebuilt(std::shared_ptr<const RebuiltPiece> piece);
  // The rebuilt piece of (source_rank, version; -1: whichever is kept). kNotFound otherwise.
  Status rebuilt(int source_rank, int64_t version, std::shared_ptr<const RebuiltPiece>* out) const;
  // Drops every rebuilt piece (once the replacements pulled them).
  void forget_rebuilt();

  const std::vector<int>& members() const { return members_; }
  size_t self() const { return self_; }
  size_t block_bytes() const { return block_bytes_; }
  size_t held_bytes() const;
  size_t reserved_bytes() const;
  size_t budget_bytes() const { return budget_; }

 private:
  // The block being assembled (incomplete, version >= 0), or null; mutex_ held.
  ParityVersion* incoming_locked() const;
  // The newest complete block, or null; mutex_ held.
  ParityVersion* committed_locked() const;
  // Empties `block` for `version` (-1: unused) once no fold writes into it; mutex_ held (released while waiting).
  void reset_locked(std::unique_lock<std::mutex>& lock, ParityVersion* block, int64_t version);
  // Marks `block` complete once every other member's piece is folded; mutex_ held.
  void complete_if_done_locked(ParityVersion* block);
  std::string missing_locked(const ParityVersion& block) const;
  void release_fold(ChunkFold* fold);

  const size_t budget_;
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::vector<int> members_;
  size_t self_ = 0;
  size_t block_bytes_ = 0;
  // Two blocks at most: the newest complete version's, and the other (the
  // version being assembled, the complete one before, or unused).
  std::array<std::shared_ptr<ParityVersion>, 2> blocks_;
  std::map<int, std::shared_ptr<const RebuiltPiece>> rebuilt_;
  int64_t newest_allowed_ = -1;
  int64_t dropped_version_ = -1;  // the last version dropped after it failed, and why
  std::string dropped_why_;
  bool interrupted_ = false;  // between interrupt_waits() and resume_waits()
};

}  // namespace peerstate
