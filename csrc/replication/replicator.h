// Replicator: streams a rank's committed snapshots to its buddies, and pulls
// a rank's state back from whoever holds it.
//
// replicate() returns at once and sends the version to every holder in the
// background, one thread per holder, each spreading chunks over its
// connections; at most one round is in flight per rank, so replicate() first
// waits for the previous round (back-pressure). Because the SnapshotStore
// never overwrites its newest committed version, the version being sent stays
// intact while the next snapshot is taken.
//
// pull() fetches (source_rank, version) from several sources at once: their
// transfers share one ChunkQueue, so chunks are split between them as they go
// and the chunks of a source that dies move to the others. The version lands
// in the local SnapshotStore as a committed version (every chunk verified),
// ready for restore(); on failure nothing is committed and the registered
// buffers are untouched.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "net/transport.h"
#include "store/parity_store.h"
#include "store/snapshot_store.h"

namespace peerstate {

// A peer to pull from, and whose state to ask it for: a buddy holds a replica
// of the lost rank; a replica-group member serves its own, identical, state.
struct PullSource {
  int peer = -1;
  int rank = -1;
  // Which of the peer's stores holds it (TcpServer::serve): 0 for a replica or
  // the peer's own state, 1.. for the peer's data-parallel shares.
  uint32_t store = 0;
  // A holder on this machine may also name its process and the address of the
  // version's region there: its chunks are then read straight from its memory
  // (process_memory.h), and only what that cannot provide goes over the transport.
  int pid = 0;
  uintptr_t region = 0;
};

// What a pull moved: every chunk of the version, and how many of them were
// read straight from a same-machine holder's memory.
struct PullStats {
  size_t chunks = 0;
  size_t chunks_from_memory = 0;
};

struct HolderResult {
  int holder = -1;
  Status status;
};

class Replicator {
 public:
  // `store` and `transport` must outlive the replicator.
  Replicator(SnapshotStore* store, Transport* transport, int rank);
  ~Replicator();  // waits for the round in flight

  // Starts sending committed `version` to `holders`. Waits for the previous
  // round first. kNotFound if `version` is not committed locally.
  Status replicate(int64_t version, const std::vector<int>& holders);
  // Starts sending committed `version` to this rank's parity group instead:
  // `members` (ranks, in group order; this rank is member `self`) each get the
  // piece they hold (store/parity.h), which their ParityStore folds. A round
  // like replicate()'s: wait() reports each holder's outcome, which is ok once
  // the version's block is complete there (ParityStore::commit), and this
  // rank's own outcome: its `own` block of the version complete, waited for up
  // to `wait_ms`. So the round ends when the version is covered at every
  // member, and the next round cannot begin before. kInvalidArgument for a
  // group of fewer than 3 or a `self` that is not this rank.
  Status push_pieces(int64_t version, const std::vector<int>& members, size_t self, const ParityStore* own,
                     long wait_ms);

  // At a parity holder, after member `lost_rank` of its group was lost:
  // rebuilds the lost member's piece of `version` from the committed block of
  // that version in `parity` and the pieces of the other survivors, pulled at
  // once from their own snapshots of that version (store 0 of their servers),
  // verifies every chunk of it against the lost member's checksums, and keeps
  // it in `parity` for the replacement (pull_pieces). Blocks until done.
  // kNotFound when `parity` holds no complete block of `version`;
  // kConnectionError naming the survivors that could not serve their piece;
  // kChecksumMismatch when the result does not match (a survivor no longer
  // holds that version as it pushed it). Memory: the survivors' pieces while it
  // runs, and the rebuilt piece until ParityStore::forget_rebuilt().
  Status rebuild_piece(ParityStore* parity, int lost_rank, int64_t version);
  // At a replacement for member `lost` of the parity group `members`: pulls
  // `version` of its state as g - 1 pieces from the g - 1 holders that rebuilt
  // them (rebuild_piece), all at once, into the local store as a committed
  // version, as pull() does. kNotFound, pulling nothing, while some holder has
  // not rebuilt its piece yet (each is asked first); kConnectionError naming
  // each piece that did not arrive and its holder.
  Status pull_pieces(const std::vector<int>& members, size_t lost, int64_t version, int64_t* pulled);
  // Blocks until the round of `version` ends (kNotFound if there was none
  // such: only the latest round is remembered) and reports each holder's
  // outcome. The call itself fails only for a missing round.
  Status wait(int64_t version, std::vector<HolderResult>* results);
  int64_t in_flight_version() const;

  // Pulls committed `version` (-1: the newest the first source that answers
  // has) of one rank's state from `sources` into the local store, all of them
  // serving chunks at once. Returns the version pulled. kNotFound when no
  // source has it; kConnectionError, naming each source's failure, when the
  // sources died before every chunk arrived. Sources with a pid and region are
  // read first, all at once; the transport then carries what is left, if any.
  // The pulled version replaces any copy of it, and any newer version, that the
  // local store holds: a recovery superseded after its pull pulls the same
  // version again in the next epoch.
  // `stats` (optional) receives how many chunks came, and how many of them that way.
  // `known` (optional): the version's metadata, when the caller has it (from a
  // stopped holder's ProcessIndex, which cannot answer): no source is asked for it.
  Status pull(const std::vector<PullSource>& sources, int64_t version, int64_t* pulled,
              PullStats* stats = nullptr, const VersionMeta* known = nullptr);

 private:
  struct Round;
  // One holder of a round: which store of its server, which chunks.
  struct Target {
    int holder = -1;
    uint32_t store = 0;
    uint32_t first_chunk = 0, end_chunk = 0;
    const ParityStore* own = nullptr;  // not a push: wait for this rank's own block of the version
    long wait_ms = 0;
  };
  // `targets`, or those `targets_of` makes from the version's layout.
  Status start_round(int64_t version, std::vector<Target> targets,
                     const std::function<std::vector<Target>(const Layout&)>& targets_of);
  SnapshotStore* const store_;
  Transport* const transport_;
  const int rank_;
  mutable std::mutex mutex_;
  std::shared_ptr<Round> round_;
};

}  // namespace peerstate
