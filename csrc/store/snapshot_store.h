// SnapshotStore: versioned, checksummed in-memory copies of a rank's buffers.
//
// The store copies a fixed set of registered buffers (host or CUDA device
// memory, any dtype, treated as bytes) into host memory it owns, one "version"
// per snapshot, and copies a committed version back on restore.
//
// Layout. Registered buffers are laid end to end (64-byte aligned) in a
// per-version host region and cut into chunks of at most `chunk_bytes`; many
// small buffers share a chunk, a large one spans several. Host and device
// buffers never share a chunk. Each chunk carries a CRC32C of its bytes; the
// chunk is also the unit of replication to peers.
//
// Versions. A version is the training step whose optimizer update it follows;
// versions must increase. The store keeps `max_versions` slots (at least 2):
// the newest committed version is never overwritten by the next snapshot, so
// it stays restorable while that snapshot is in flight. At most one version is
// in flight. A version commits only when every chunk was copied (and, with
// checksums on, checksummed); a failed or cancelled version never becomes
// visible.
//
// Threading. Mutating calls (register_buffers, unregister, snapshot, wait,
// restore, close) must come from one thread at a time; the copies themselves
// run on the store's thread pool. Query calls may come from any thread.
//
// Memory. Registered buffers belong to the caller and must stay valid, and
// unchanged in size, until unregistered or the store is closed. Snapshot
// memory is owned by the store; its size is accounted against `budget_bytes`
// at registration, so a budget overrun is an error then, never mid-run.
// Regions are allocated on the first snapshot after the layout grows.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/host_memory.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "common/device_copy.h"
#include "store/layout.h"
#include "store/process_index.h"

namespace peerstate {

struct SnapshotStoreOptions {
  size_t threads = 0;             // copy threads (ThreadPool::shared); 0 = the cores available
  size_t chunk_bytes = 4u << 20;  // upper bound of a chunk
  size_t max_versions = 2;        // version slots kept, >= 2
  size_t budget_bytes = 0;        // bound on snapshot memory; 0 = half of physical memory
  bool checksums = true;          // CRC32C per chunk on snapshot, verified on restore
};

// A committed version as the store holds it: layout, checksums, and bytes.
struct VersionView {
  int64_t version = -1;
  std::shared_ptr<const Layout> layout;
  std::vector<uint32_t> checksums;  // per chunk; empty when checksums are off
  const unsigned char* data = nullptr;
  unsigned char* mutable_data = nullptr;  // for transports and fault-injection tests
  size_t nbytes = 0;
  // Holds the slot: no snapshot reuses it, and close() waits, while a copy of
  // this pin lives (a server sending its bytes), unless the pin was taken with
  // a revoke callback (see SnapshotStore::view). Release it promptly.
  std::shared_ptr<const void> pin;
};

struct MemoryReport {
  size_t registered_bytes = 0;     // bytes of the live registration
  size_t bytes_per_version = 0;    // region size of one version under that registration
  size_t held_bytes = 0;           // host memory the store holds now, all slots
  size_t budget_bytes = 0;
  std::vector<std::pair<int64_t, size_t>> versions;  // (version, bytes) of each occupied slot
};

class SnapshotStore {
 public:
  static Status create(const SnapshotStoreOptions& options, std::unique_ptr<SnapshotStore>* out);
  ~SnapshotStore();  // close(); may block until an in-flight copy drains
  SnapshotStore(const SnapshotStore&) = delete;
  SnapshotStore& operator=(const SnapshotStore&) = delete;

  // Adds buffers, or replaces those with the same name, all or nothing.
  // kBusy while a version is in flight; kBudgetExceeded if max_versions
  // regions of the new layout would exceed the budget; kUnavailable for a
  // device buffer in a build or on a machine without CUDA.
  Status register_buffers(const std::vector<BufferRegistration>& buffers);
  // Removes buffers by name (kNotFound names the first unknown one; nothing removed then).
  Status unregister(const std::vector<std::string>& names);

  // Starts copying every registered buffer into a free slot as `version` and
  // returns once the copies are queued. If a version is still in flight this
  // first waits for it (back-pressure) and returns its error, if any, without
  // starting. `after_stream` (CUDA builds, device buffers) is a cudaStream_t
  // whose queued work the device copies must follow; 0 means the default stream.
  //
  // `gated` true: host chunks are not copied until the caller has vouched for
  // their buffers with validated(). A caller that must check, before each
  // copy, that its buffers still own the registered memory (tensors can be
  // resized) checks in layout order and lets the copy of what it checked
  // start at once, instead of checking everything first. Device chunks are
  // queued by this call, so device buffers must be checked before it. A gated
  // version must be fully validated or cancelled: wait() on one that is not
  // cancels it and returns kInvalidArgument (it would otherwise never finish).
  Status snapshot(int64_t version, uintptr_t after_stream = 0, bool gated = false);
  // For the gated version in flight: the first `count` host buffers in layout
  // order (see buffer_names()) were checked; their chunks may be copied.
  // Counts only grow; a smaller count or no gated version in flight is ignored.
  // Does not block.
  void validated(size_t count);
  // Cancels the version in flight, if any, and waits for its copies to stop.
  // Committed versions and the registered buffers are not touched.
  void cancel();
  // Registered buffer names in layout order: host buffers first, each group in
  // registration order.
  std::vector<std::string> buffer_names() const;
  // Blocks until the in-flight version, if any, commits or fails; returns its outcome.
  Status wait();
  // Verifies every checksum of committed `version` and only then copies it into the
  // registered buffers. An in-flight snapshot is cancelled first (it would
  // read the buffers being overwritten) and versions newer than `version` are
  // dropped: training resumes from `version`. On any error the registered
  // buffers are untouched and every committed version is kept.
  // `verify` false skips the checksum pass: only for a version this process
  // received a moment ago, whose every chunk was verified as it arrived.
  // A host chunk whose bytes already equal the live buffers is neither verified
  // nor copied (restoring it would change nothing): a rank rolling back one
  // step mostly compares memory instead of checksumming and writing it.
  // `bytes_written` (optional) receives how many bytes were copied back.
  Status restore(int64_t version, bool verify = true, size_t* bytes_written = nullptr);
  // Cancels the in-flight version and forgets committed versions newer than
  // `version`, without touching the buffers: for state that was rolled back
  // by other means (a disk checkpoint of step `version`), so that the next
  // snapshot may be `version` + 1.
  Status drop_newer(int64_t version);
  // Allocates (and faults in) every version slot for the current registration
  // now, instead of on the first snapshots: a hot spare calls this before it is
  // needed, so a recovery does not wait for memory. kBusy while a version is in flight.
  Status allocate();
  // Cancels the in-flight version, waits for its copies, frees all memory.
  Status close();

  std::vector<int64_t> committed_versions() const;
  // The layout of the current registration (what the next snapshot is laid out as).
  // Like memory(), not to be called while buffers are being registered.
  std::shared_ptr<const Layout> current_layout() const { return layout_; }
  int64_t in_flight_version() const;  // -1 when none
  MemoryReport memory() const;
  // A committed version's bytes and layout (`version` -1: the newest; kNotFound
  // otherwise). The view stays valid while its pin is held; without the pin,
  // until the slot is reused by a later snapshot or the store closes.
  //
  // A pin taken with `revoke` does not hold up the owner: when a snapshot needs
  // its slot (no other is free) or close() runs, the store calls `revoke` once,
  // under the store's lock (it must not block nor call into the store), and waits
  // for the pin's release; the holder must then stop reading and drop the pin
  // promptly (a server shuts the reader's socket down: its send fails and the
  // reader gets an error, never bytes of two versions). From then on the slot
  // grants no new pin (kUnavailable) until it is reused. A pin without `revoke`
  // (a reader in this process) is waited for.
  Status view(int64_t version, VersionView* out, std::function<void()> revoke = nullptr) const;

  // Where `version` (committed or in flight) lies in this process's memory, for
  // a puller on this machine that reads it directly (process_memory.h); 0 when
  // no slot holds it. The bytes of a version in flight are complete only once
  // it commits; a reader verifies each chunk's checksum.
  uintptr_t region_address(int64_t version) const;

  // Receiving a version from a peer instead of copying it from the buffers:
  // begin_receive() reserves a slot for `version` laid out as `layout` (which
  // must match the registration: kRegistrationMismatch) and returns its region
  // for a transport to fill; end_receive(true) commits it with `checksums`
  // (the caller verified every chunk), end_receive(false) drops it. Like
  // snapshot(), at most one version is in flight, and the newest committed
  // version is never the slot given out.
  Status begin_receive(int64_t version, std::shared_ptr<const Layout> layout, unsigned char** region);
  Status end_receive(int64_t version, const std::vector<uint32_t>& checksums, bool ok);
  const SnapshotStoreOptions& options() const { return options_; }

  // From now on, keeps `index` listing this store's committed versions as store
  // `tag` of rank `rank` (see ProcessIndex: a replacement reads them from this
  // process's memory if it hangs). Null stops it. Any thread.
  void index_into(std::shared_ptr<ProcessIndex> index, uint32_t tag, int32_t rank);

 private:
  struct Slot;
  struct InFlight;
  explicit SnapshotStore(const SnapshotStoreOptions& options);

  void set_registration(std::vector<BufferRegistration> buffers, std::shared_ptr<const Layout> layout);
  Status ensure_device_engine();
  Status prepare_region(Slot& slot, const Layout& layout);
  // Picks the slot for `version` (never the newest committed one), marks it in
  // flight and readies its region for `layout`; on error the slot stays free.
  Status reserve_slot(int64_t version, std::shared_ptr<const Layout> layout, size_t* slot);
  void copy_chunk_to_region(InFlight& job, size_t chunk);
  // `only` (optional, one flag per chunk): the chunks to check or copy.
  Status verify(const Slot& slot, const std::vector<char>* only = nullptr);
  Status copy_region_to_buffers(const Slot& slot, const std::vector<char>* only = nullptr);
  // Per chunk: 1 unless it is a host chunk whose bytes equal the live buffers'.
  std::vector<char> chunks_differing_from_buffers(const Slot& slot);
  void finish_in_flight(InFlight& job);
  // After any slot left or entered kCommitted; mutex_ held.
  void update_index_locked();
  void cancel_in_flight();
  // Stops `slot` granting pins and revokes those held (see view()); mutex_ held.
  void revoke_pins_locked(Slot& slot);

  SnapshotStoreOptions options_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<DeviceCopyEngine> device_;

  std::vector<BufferRegistration> registered_;
  std::shared_ptr<const Layout> layout_;
  std::vector<unsigned char*> live_ptrs_;  // registered pointer of each layout_ buffer

  mutable std::mutex mutex_;  // guards slots_' states and in_flight_
  mutable std::condition_variable unpinned_;  // a view's pin was released
  std::vector<std::unique_ptr<Slot>> slots_;
  std::shared_ptr<InFlight> in_flight_;
  bool closed_ = false;
  std::shared_ptr<ProcessIndex> index_;  // guarded by mutex_
  uint32_t index_tag_ = 0;
  int32_t index_rank_ = -1;
};

}  // namespace peerstate
