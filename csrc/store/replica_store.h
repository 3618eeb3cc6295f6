// ReplicaStore: the buddies' snapshots that this rank holds for them.
//
// For each source rank it serves, a holder keeps the last committed version
// and at most one incoming version; the version committed before the last stays
// readable until an incoming version needs its region. An incoming version becomes visible only
// when every chunk arrived and matched its CRC32C; until then readers see the
// previous committed version, and a partial version is simply discarded when
// the next one begins (e.g. after its sender died).
//
// Memory is bounded: reserve() accounts two versions of each source against
// the budget when replication is set up and allocates their two regions; a
// version larger than its reservation is refused on arrival; a slow reader or a
// stalled writer holding the region a new version needs is cut (begin()), and
// one that cannot be cut gets the new version refused: nothing is ever
// allocated beyond the two, and held_bytes() counts every region still alive.
//
// Versions cannot be forged by a member: a new version must be newer than the
// committed one and at most kMaxVersionStep ahead of it, and, once the holder
// said how far its job has got (bound_versions), no newer than that, whether
// or not anything is committed here; a source that reserved bytes cannot
// commit an empty layout (a version number without state). Every chunk is written
// under a writer count that commit() waits for, and a chunk may only be written
// once, into the version still incoming. Versions are held in host memory, or in
// the memory of one CUDA device (create() with a device index, GPU nodes): the
// tcp server then stages each chunk through pinned host memory.
//
// Thread-safe: the tcp server's connection threads write chunks of one
// incoming version concurrently, and readers hold committed versions by
// shared_ptr, so a commit never pulls memory out from under a reader.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/host_memory.h"
#include "common/status.h"
#include "common/device_copy.h"
#include "store/process_index.h"
#include "store/version_meta.h"

namespace peerstate {

// A replica's bytes: host memory, or device memory through a DeviceCopyEngine.
class ReplicaMemory {
 public:
  ReplicaMemory(std::shared_ptr<DeviceCopyEngine> engine, int device) : engine_(std::move(engine)), device_(device) {}
  ~ReplicaMemory() { release(); }
  ReplicaMemory(const ReplicaMemory&) = delete;
  ReplicaMemory& operator=(const ReplicaMemory&) = delete;

  Status allocate(size_t nbytes);
  void release();
  unsigned char* data() const { return device_ == kHostDevice ? host_.data() : device_data_; }
  size_t size() const { return device_ == kHostDevice ? host_.size() : device_size_; }
  int device() const { return device_; }

 private:
  std::shared_ptr<DeviceCopyEngine> engine_;  // null for host memory
  int device_;
  HostRegion host_;
  unsigned char* device_data_ = nullptr;
  size_t device_size_ = 0;
};

struct ReplicaVersion {
  ReplicaVersion(std::shared_ptr<DeviceCopyEngine> engine, int device) : region(std::move(engine), device) {}
  VersionMeta meta;
  ReplicaMemory region;
  std::vector<uint8_t> arrived;  // per chunk: 0 missing, 1 being written, 2 verified
  size_t arrived_count = 0;
  size_t writers = 0;            // chunks being written into the region now
  std::string failure;           // first chunk that failed verification
  bool complete = false;         // committed once, and not reused for a newer version since
  std::string encoded_meta;      // the meta's encoding for a ProcessIndex, made at commit
  // Of the connections writing or reading it that can be cut (see begin()), by hold;
  // guarded by the store's mutex.
  std::map<uint64_t, std::function<void()>> revokers;
  uint64_t next_hold = 0;
};

class ReplicaStore {
 public:
  // How far ahead of the committed version a new one may be (steps advance by
  // one, or by snapshot_every): a member cannot poison its replica with a
  // version no real step will ever pass.
  static constexpr int64_t kMaxVersionStep = 1 << 16;

  // One chunk being written (expect_chunk). Its destructor gives the chunk back
  // if chunk_arrived() was not called (the connection failed mid-chunk).
  struct ChunkWrite {
    ChunkWrite() = default;
    ChunkWrite(const ChunkWrite&) = delete;
    ChunkWrite& operator=(const ChunkWrite&) = delete;
    ~ChunkWrite();
    std::shared_ptr<ReplicaVersion> version;
    uint32_t chunk = 0;
    ReplicaStore* store = nullptr;  // while the write is open
    ReplicaStore* owner = nullptr;  // told when `version` is let go
    uint64_t hold = kNoHold;
  };
  static constexpr uint64_t kNoHold = ~uint64_t{0};

  // device kHostDevice: replicas in host memory (budget_bytes 0: half of
  // physical memory). Else a CUDA device index, with an explicit budget
  // (kUnavailable without CUDA or a GPU).
  static Status create(size_t budget_bytes, int device, std::unique_ptr<ReplicaStore>* out);
  explicit ReplicaStore(size_t budget_bytes) : ReplicaStore(budget_bytes, kHostDevice, nullptr) {}

  // Accounts 2 x bytes_per_version for `source_rank` (replacing an earlier
  // reservation for it) and allocates both regions now, so that the first
  // versions do not pay for faulting in memory. kBudgetExceeded, naming the
  // totals, when it does not fit; kOutOfMemory when the memory is not there.
  Status reserve(int source_rank, size_t bytes_per_version);

  // Starts receiving (meta.source_rank, meta.version); drops any partial
  // incoming version of that source. kBudgetExceeded beyond the reservation,
  // kNotFound for a source with no reservation, kInvalidArgument for a version
  // not newer than the committed one or too far ahead of it, kBusy when both
  // regions are still held by a reader or a stalled writer that cannot be cut.
  // A holder that can (a connection that took its hold with a revoke callback)
  // is: its callback runs, under the store's lock (it must not block nor call
  // into the store), and begin() waits for its release, up to kRevokeWaitMs:
  // a stuck reader of an old version, or a writer of a dropped one, never keeps
  // the source's next version out. Blocks only then.
  Status begin(const VersionMeta& meta);
  static constexpr long kRevokeWaitMs = 2000;
  // Checks that chunk `chunk` belongs to the incoming version, has exactly
  // `length` bytes and was not written yet (kProtocolError otherwise), and
  // hands out the write: the version, held alive and counted as written to
  // while the chunk lands in its place in the region. `revoke` (optional): how
  // begin() cuts the write if the region is needed (see begin()).
  Status expect_chunk(int source_rank, int64_t version, uint32_t chunk, uint64_t length, ChunkWrite* write,
                      std::function<void()> revoke = nullptr);
  // Ends a write whose chunk landed with CRC32C `crc` (kChecksumMismatch,
  // failing the version, when it differs from the metadata's).
  Status chunk_arrived(ChunkWrite* write, uint32_t crc);
  // Bytes per version reserved for `source_rank` (0: none).
  size_t reservation(int source_rank) const;
  // Waits until every chunk of the incoming version arrived, then makes it the
  // committed one. kTimeout, or kChecksumMismatch when a chunk failed.
  Status commit(int source_rank, int64_t version, Deadline deadline);

  // A committed version of `source_rank`: the newest, or the one before it while
  // its region has not been reused for an incoming version (`version` -1: the newest).
  // `revoke` (optional): how begin() cuts this read if the region is needed (see begin()).
  Status get(int source_rank, int64_t version, std::shared_ptr<const ReplicaVersion>* out,
             std::function<void()> revoke = nullptr) const;
  // (source rank, version) for every committed version held, newest first per source:
  // after a failure, holders of different sources may be one round apart, and the
  // recovery point must be a version every source still has.
  std::vector<std::pair<int, int64_t>> committed() const;
  // Forgets every version newer than `version` of every source (a partial
  // incoming one included): after the job rolled back to `version`, they are of
  // the abandoned run of those steps, and the re-run's versions, which carry the
  // same numbers, must be accepted. The version before a dropped newest one
  // becomes the newest again if it is still readable. Readers keep what they hold.
  void drop_newer(int64_t version);
  // The newest version any source may begin from now on: the job's own record
  // (the holder's step plus a window), not the sender's. Replaces the previous
  // bound, so it moves back with a rollback. Until the first call, only the
  // rules relative to the committed version apply.
  void bound_versions(int64_t newest);
  size_t held_bytes() const;
  size_t reserved_bytes() const;
  // From now on, keeps `index` listing the committed host versions held here as
  // store `tag` (see ProcessIndex); null stops it. Any thread.
  void index_into(std::shared_ptr<ProcessIndex> index, uint32_t tag);
  size_t budget_bytes() const { return budget_; }
  int device() const { return device_; }
  // The engine of a device replica store (null for host memory).
  DeviceCopyEngine* engine() const { return engine_.get(); }

 private:
  ReplicaStore(size_t budget_bytes, int device, std::shared_ptr<DeviceCopyEngine> engine);
  std::shared_ptr<ReplicaVersion> new_version() const {
    return std::make_shared<ReplicaVersion>(engine_, device_);
  }

  void end_write(ChunkWrite* write, bool landed, uint32_t crc, Status* result);
  // After a version of any source became or stopped being readable; mutex_ held.
  void update_index_locked();

  struct Source {
    size_t reserved_per_version = 0;
    std::vector<std::weak_ptr<ReplicaVersion>> regions;  // every region allocated for it and still alive
    std::shared_ptr<ReplicaVersion> committed;
    std::shared_ptr<ReplicaVersion> incoming;
    std::shared_ptr<ReplicaVersion> spare;  // the region for the next version; until then it may still
                                            // hold the previous committed version (complete)
  };
  // Cuts every revocable holder of `source`'s regions other than the committed
  // version's; whether there was any. mutex_ held.
  bool revoke_holders_locked(Source& source);

  const size_t budget_;
  const int device_;
  const std::shared_ptr<DeviceCopyEngine> engine_;
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  mutable std::condition_variable released_;  // a revocable hold was let go
  std::map<int, Source> sources_;
  int64_t newest_allowed_ = -1;  // bound_versions(); -1: none yet
  std::shared_ptr<ProcessIndex> index_;  // guarded by mutex_
  uint32_t index_tag_ = 0;
};

}  // namespace peerstate
