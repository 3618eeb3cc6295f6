#include "store/replica_store.h"

#include <algorithm>
#include <chrono>

namespace peerstate {

Status ReplicaMemory::allocate(size_t nbytes) {
  if (device_ == kHostDevice) return host_.allocate(nbytes);
  void* ptr = nullptr;
  PEERSTATE_RETURN_IF_ERROR(engine_->allocate_device(device_, nbytes, &ptr));
  release();
  device_data_ = static_cast<unsigned char*>(ptr);
  device_size_ = nbytes;
  return Status::Ok();
}

void ReplicaMemory::release() {
  if (device_data_ != nullptr) engine_->free_device(device_, device_data_);
  device_data_ = nullptr;
  device_size_ = 0;
  host_.release();
}

ReplicaStore::ReplicaStore(size_t budget_bytes, int device, std::shared_ptr<DeviceCopyEngine> engine)
    : budget_(budget_bytes != 0 ? budget_bytes : physical_memory_bytes() / 2), device_(device), engine_(std::move(engine)) {}

Status ReplicaStore::create(size_t budget_bytes, int device, std::unique_ptr<ReplicaStore>* out) {
  std::shared_ptr<DeviceCopyEngine> engine;
  if (device != kHostDevice) {
    if (device < 0) return Status(StatusCode::kInvalidArgument, "device must be -1 (host) or a CUDA device index");
    if (budget_bytes == 0)
      return Status(StatusCode::kInvalidArgument, "a device replica store needs an explicit budget_bytes");
    std::unique_ptr<DeviceCopyEngine> created;
    Status st = DeviceCopyEngine::create(&created);
    if (!st.ok()) return Status(st.code(), "cannot hold replicas on cuda:" + std::to_string(device) + ": " + st.message());
    engine = std::move(created);
  }
  out->reset(new ReplicaStore(budget_bytes, device, std::move(engine)));
  return Status::Ok();
}

Status ReplicaStore::reserve(int source_rank, size_t bytes_per_version) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t total = 2 * bytes_per_version;
    for (const auto& [rank, source] : sources_)
      if (rank != source_rank) total += 2 * source.reserved_per_version;
    if (total > budget_)
      return Status(StatusCode::kBudgetExceeded,
                    "holding 2 versions of rank " + std::to_string(source_rank) + " (" +
                        std::to_string(bytes_per_version) + " bytes each) brings this holder's replicas to " +
                        std::to_string(total) + " bytes, over its budget of " + std::to_string(budget_) +
                        " bytes; raise the replica budget or spread the buddies over more ranks");
  }
  // Two regions: the committed version's and the incoming one's.
  auto first = new_version();
  auto second = new_version();
  PEERSTATE_RETURN_IF_ERROR(first->region.allocate(bytes_per_version));
  PEERSTATE_RETURN_IF_ERROR(second->region.allocate(bytes_per_version));
  std::lock_guard<std::mutex> lock(mutex_);
  Source& source = sources_[source_rank];
  source.reserved_per_version = bytes_per_version;
  source.regions.push_back(first);
  if (!source.committed) {
    source.regions.push_back(second);
    source.spare = std::move(second);
  }
  source.incoming = std::move(first);
  return Status::Ok();
}

bool ReplicaStore::revoke_holders_locked(Source& source) {
  bool any = false;
  for (const auto& weak : source.regions) {
    std::shared_ptr<ReplicaVersion> region = weak.lock();
    if (!region || region == source.committed) continue;
    for (auto& entry : region->revokers) entry.second();
    any = any || !region->revokers.empty();
    region->revokers.clear();
  }
  return any;
}

Status ReplicaStore::begin(const VersionMeta& meta) {
  std::shared_ptr<ReplicaVersion> incoming;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = sources_.find(meta.source_rank);
    if (it == sources_.end())
      return Status(StatusCode::kNotFound,
                    "this holder has no reservation for rank " + std::to_string(meta.source_rank) +
                        "; set up replication (reserve) before sending versions");
    Source& source = it->second;
    if (meta.layout->region_bytes > source.reserved_per_version)
      return Status(StatusCode::kBudgetExceeded,
                    "version " + std::to_string(meta.version) + " of rank " + std::to_string(meta.source_rank) +
                        " needs " + std::to_string(meta.layout->region_bytes) + " bytes but " +
                        std::to_string(source.reserved_per_version) + " were reserved");
    if (meta.version < 0)
      return Status(StatusCode::kInvalidArgument, "version " + std::to_string(meta.version) + " is negative");
    if (newest_allowed_ >= 0 && meta.version > newest_allowed_)
      return Status(StatusCode::kInvalidArgument,
                    "version " + std::to_string(meta.version) + " of rank " + std::to_string(meta.source_rank) +
                        " is ahead of what this job has reached (at most " + std::to_string(newest_allowed_) +
                        " here: the holder's step plus a window)");
    if (meta.layout->chunks.empty() && source.reserved_per_version > 0)
      return Status(StatusCode::kInvalidArgument,
                    "version " + std::to_string(meta.version) + " of rank " + std::to_string(meta.source_rank) +
                        " has an empty layout, but the rank reserved " +
                        std::to_string(source.reserved_per_version) + " bytes per version");
    if (source.committed && meta.version <= source.committed->meta.version)
      return Status(StatusCode::kInvalidArgument,
                    "version " + std::to_string(meta.version) + " of rank " + std::to_string(meta.source_rank) +
                        " is not newer than the committed version " + std::to_string(source.committed->meta.version));
    if (source.committed && meta.version - source.committed->meta.version > kMaxVersionStep)
      return Status(StatusCode::kInvalidArgument,
                    "version " + std::to_string(meta.version) + " of rank " + std::to_string(meta.source_rank) +
                        " is more than " + std::to_string(kMaxVersionStep) + " ahead of the committed version " +
                        std::to_string(source.committed->meta.version));
    // Reuse an allocated region that nobody else holds (a reader of an old
    // committed version, or a connection still writing a dropped partial one).
    for (auto* candidate : {&source.incoming, &source.spare})
      if (!incoming && *candidate && candidate->use_count() == 1) incoming = std::move(*candidate);
    if (!source.spare && source.incoming && source.incoming.use_count() == 1) source.spare = std::move(source.incoming);
    source.incoming.reset();  // a partial version is dropped here, never committed
    if (incoming && incoming->complete) {
      incoming->complete = false;  // its region is about to be overwritten
      update_index_locked();
    }
    if (!incoming) {
      auto region_free = [&] {
        if (source.spare && source.spare.use_count() == 1) return true;
        source.regions.erase(std::remove_if(source.regions.begin(), source.regions.end(),
                                            [](const std::weak_ptr<ReplicaVersion>& r) { return r.expired(); }),
                             source.regions.end());
        return source.regions.size() < 2;
      };
      if (!region_free() && revoke_holders_locked(source))
        released_.wait_for(lock, std::chrono::milliseconds(kRevokeWaitMs), region_free);
      if (source.spare && source.spare.use_count() == 1) {
        incoming = std::move(source.spare);
        if (incoming->complete) {
          incoming->complete = false;
          update_index_locked();
        }
      } else if (region_free()) {
        incoming = new_version();
        source.regions.push_back(incoming);
      } else {
        return Status(StatusCode::kBusy, "both regions of rank " + std::to_string(meta.source_rank) +
                                             " are in use (a reader of an older version, or a push that stalled); "
                                             "version " + std::to_string(meta.version) + " is refused, not allocated");
      }
    }
  }
  // Allocation (and faulting in) of a large region takes a while: not under the lock.
  if (incoming->region.size() < meta.layout->region_bytes || incoming->region.data() == nullptr)
    PEERSTATE_RETURN_IF_ERROR(incoming->region.allocate(meta.layout->region_bytes));
  incoming->meta = meta;
  incoming->complete = false;
  incoming->encoded_meta.clear();
  incoming->arrived.assign(meta.layout->chunks.size(), 0);
  incoming->arrived_count = 0;
  incoming->writers = 0;
  incoming->failure.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  sources_[meta.source_rank].incoming = std::move(incoming);
  arrived_.notify_all();  // a commit waiting on the version this one replaces gives up
  return Status::Ok();
}

Status ReplicaStore::expect_chunk(int source_rank, int64_t version, uint32_t chunk, uint64_t length,
                                  ChunkWrite* write, std::function<void()> revoke) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sources_.find(source_rank);
  if (it == sources_.end() || !it->second.incoming || it->second.incoming->meta.version != version)
    return Status(StatusCode::kProtocolError, "chunk of rank " + std::to_string(source_rank) + " version " +
                                                  std::to_string(version) + " arrived without a matching begin");
  const std::shared_ptr<ReplicaVersion>& incoming = it->second.incoming;
  const Layout& layout = *incoming->meta.layout;
  if (chunk >= layout.chunks.size())
    return Status(StatusCode::kProtocolError, "chunk index " + std::to_string(chunk) + " out of range (" +
                                                  std::to_string(layout.chunks.size()) + " chunks)");
  if (length != layout.chunks[chunk].nbytes)
    return Status(StatusCode::kProtocolError, "chunk " + std::to_string(chunk) + " has " + std::to_string(length) +
                                                  " bytes, the layout says " +
                                                  std::to_string(layout.chunks[chunk].nbytes));
  if (incoming->arrived[chunk] != 0)
    return Status(StatusCode::kProtocolError, "chunk " + std::to_string(chunk) + " of version " +
                                                  std::to_string(version) + " was sent twice");
  incoming->arrived[chunk] = 1;
  incoming->writers++;
  write->version = incoming;
  write->chunk = chunk;
  write->store = write->owner = this;
  if (revoke) {
    write->hold = incoming->next_hold++;
    incoming->revokers.emplace(write->hold, std::move(revoke));
  }
  return Status::Ok();
}

ReplicaStore::ChunkWrite::~ChunkWrite() {
  if (store != nullptr) store->end_write(this, false, 0, nullptr);
  if (owner == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(owner->mutex_);  // begin() waits on the region's use count
    version.reset();
  }
  owner->released_.notify_all();
}

Status ReplicaStore::chunk_arrived(ChunkWrite* write, uint32_t crc) {
  Status result;
  end_write(write, true, crc, &result);
  return result;
}

void ReplicaStore::end_write(ChunkWrite* write, bool landed, uint32_t crc, Status* result) {
  ReplicaVersion& v = *write->version;
  std::lock_guard<std::mutex> lock(mutex_);
  write->store = nullptr;
  if (write->hold != kNoHold) v.revokers.erase(write->hold);
  v.writers--;
  if (!landed) {
    v.arrived[write->chunk] = 0;  // the chunk may come again, on another connection
  } else if (crc != v.meta.checksums[write->chunk]) {
    if (v.failure.empty()) v.failure = "chunk " + std::to_string(write->chunk) + " arrived corrupt (CRC32C mismatch)";
    *result = Status(StatusCode::kChecksumMismatch, v.failure);
  } else {
    v.arrived[write->chunk] = 2;
    v.arrived_count++;
  }
  arrived_.notify_all();
}

size_t ReplicaStore::reservation(int source_rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sources_.find(source_rank);
  return it == sources_.end() ? 0 : it->second.reserved_per_version;
}

Status ReplicaStore::commit(int source_rank, int64_t version, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = sources_.find(source_rank);
  auto current = [&]() -> std::shared_ptr<ReplicaVersion> {
    return it != sources_.end() && it->second.incoming && it->second.incoming->meta.version == version
               ? it->second.incoming
               : nullptr;
  };
  std::shared_ptr<ReplicaVersion> incoming = current();
  if (!incoming)
    return Status(StatusCode::kProtocolError, "commit of rank " + std::to_string(source_rank) + " version " +
                                                  std::to_string(version) + " without a matching begin");
  // No write may still be in progress when the version becomes visible.
  const bool complete = arrived_.wait_until(lock, deadline, [&] {
    return current() != incoming || !incoming->failure.empty() ||
           (incoming->arrived_count == incoming->arrived.size() && incoming->writers == 0);
  });
  if (current() != incoming)
    return Status(StatusCode::kAborted, "version " + std::to_string(version) + " was replaced before it committed");
  if (!incoming->failure.empty()) return Status(StatusCode::kChecksumMismatch, incoming->failure);
  if (!complete)
    return Status(StatusCode::kTimeout, "version " + std::to_string(version) + " of rank " +
                                            std::to_string(source_rank) + ": only " +
                                            std::to_string(incoming->arrived_count) + " of " +
                                            std::to_string(incoming->arrived.size()) + " chunks arrived");
  if (it->second.committed) it->second.spare = std::move(it->second.committed);  // serves a later version
  it->second.incoming.reset();
  incoming->complete = true;
  it->second.committed = std::move(incoming);
  update_index_locked();
  return Status::Ok();
}

Status ReplicaStore::get(int source_rank, int64_t version, std::shared_ptr<const ReplicaVersion>* out,
                         std::function<void()> revoke) const {
  out->reset();  // a reader's token held there is released under the lock: not while it is held here
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sources_.find(source_rank);
  if (it == sources_.end() || !it->second.committed)
    return Status(StatusCode::kNotFound, "no committed version of rank " + std::to_string(source_rank) + " here");
  const Source& source = it->second;
  std::shared_ptr<ReplicaVersion> held;
  if (version < 0 || source.committed->meta.version == version)
    held = source.committed;
  else if (source.spare && source.spare->complete && source.spare->meta.version == version)
    held = source.spare;
  if (held && !revoke) {
    *out = std::move(held);
    return Status::Ok();
  }
  if (held) {  // the reader holds the version through a token that withdraws its revoke when let go
    const uint64_t hold = held->next_hold++;
    held->revokers.emplace(hold, std::move(revoke));
    ReplicaVersion* raw = held.get();
    *out = std::shared_ptr<const ReplicaVersion>(raw, [this, held = std::move(held), hold](const ReplicaVersion*) mutable {
      {
        std::lock_guard<std::mutex> relock(mutex_);
        held->revokers.erase(hold);
        held.reset();
      }
      released_.notify_all();
    });
    return Status::Ok();
  }
  return Status(StatusCode::kNotFound, "version " + std::to_string(version) + " of rank " +
                                           std::to_string(source_rank) + " is not committed here (committed: " +
                                           std::to_string(source.committed->meta.version) + ")");
}

std::vector<std::pair<int, int64_t>> ReplicaStore::committed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<int, int64_t>> out;
  for (const auto& [rank, source] : sources_) {
    if (source.committed) out.emplace_back(rank, source.committed->meta.version);
    if (source.spare && source.spare->complete) out.emplace_back(rank, source.spare->meta.version);
  }
  return out;
}

void ReplicaStore::drop_newer(int64_t version) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [rank, source] : sources_) {
    if (source.incoming && source.incoming->meta.version > version) source.incoming.reset();
    if (source.spare && source.spare->complete && source.spare->meta.version > version) source.spare->complete = false;
    if (!source.committed || source.committed->meta.version <= version) continue;
    source.committed->complete = false;
    if (source.spare && source.spare->complete) {
      std::swap(source.committed, source.spare);
    } else {
      if (!source.spare) source.spare = std::move(source.committed);  // keep the region for the next version
      source.committed.reset();
    }
  }
  update_index_locked();
  arrived_.notify_all();  // a commit waiting on a dropped incoming version gives up
}

void ReplicaStore::bound_versions(int64_t newest) {
  std::lock_guard<std::mutex> lock(mutex_);
  newest_allowed_ = newest;
}

size_t ReplicaStore::held_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [rank, source] : sources_)
    for (const auto& region : source.regions)
      if (auto alive = region.lock()) total += alive->region.size();
  return total;
}

size_t ReplicaStore::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [rank, source] : sources_) total += 2 * source.reserved_per_version;
  return total;
}

void ReplicaStore::index_into(std::shared_ptr<ProcessIndex> index, uint32_t tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (index_) index_->set(index_tag_, {});
  index_ = std::move(index);
  index_tag_ = tag;
  update_index_locked();
}

void ReplicaStore::update_index_locked() {
  if (!index_ || device_ != kHostDevice) return;  // a device replica cannot be read from another process
  std::vector<ProcessIndex::Entry> entries;
  for (auto& [rank, source] : sources_)
    for (ReplicaVersion* v : {source.committed.get(), source.spare.get()}) {
      if (v == nullptr || !v->complete) continue;
      if (v->encoded_meta.empty()) v->encoded_meta = encode_meta(v->meta);
      entries.push_back({index_tag_, rank, v->meta.version, reinterpret_cast<uint64_t>(v->region.data()),
                         v->meta.layout->region_bytes, v->encoded_meta});
    }
  index_->set(index_tag_, std::move(entries));
}

}  // namespace peerstate
