// The read side of SnapshotStore: verifying and restoring a version, views of a
// committed one (pins a reader holds, revoked when the slot is needed), a version
// received from a peer into a slot, and the process index that lets a same-node
// peer read the store. The write side is snapshot_store.cc.
#include "store/snapshot_store.h"

#include "common/memory_copy.h"
#include "store/snapshot_slot.h"
#include "store/version_meta.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

namespace peerstate {
namespace {

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

}  // namespace

Status SnapshotStore::verify(const Slot& slot, const std::vector<char>* only) {
  if (slot.checksums.empty()) return Status::Ok();
  const Layout& layout = *slot.layout;
  std::mutex mutex;
  size_t bad = layout.chunks.size();
  uint32_t bad_crc = 0;
  pool_->run(layout.chunks.size(), [&](size_t c) {
    if (only != nullptr && !(*only)[c]) return;
    const uint32_t crc = chunk_checksum(layout, c, slot.region.data());
    if (crc != slot.checksums[c]) {
      std::lock_guard<std::mutex> lock(mutex);
      if (c < bad) {
        bad = c;
        bad_crc = crc;
      }
    }
  });
  if (bad == layout.chunks.size()) return Status::Ok();
  const ChunkPlacement& chunk = layout.chunks[bad];
  std::string names;
  for (uint32_t s = 0; s < chunk.segment_count && s < 4; s++)
    names += (s ? ", '" : "'") + layout.buffers[layout.segments[chunk.first_segment + s].buffer].name + "'";
  if (chunk.segment_count > 4) names += ", ...";
  return Status(StatusCode::kChecksumMismatch,
                "version " + std::to_string(slot.version) + " is corrupt: chunk " +
                    std::to_string(bad) + " (bytes " + std::to_string(chunk.offset) + ".." +
                    std::to_string(chunk.offset + chunk.nbytes) + " of the snapshot, buffers " +
                    names + ") has CRC32C " + hex32(bad_crc) + " but " +
                    hex32(slot.checksums[bad]) +
                    " was recorded when it was taken. The live buffers were not changed; "
                    "restore another version or pull this one from a replica.");
}

std::vector<char> SnapshotStore::chunks_differing_from_buffers(const Slot& slot) {
  const Layout& layout = *slot.layout;
  std::vector<char> differs(layout.chunks.size(), 1);
  pool_->run(layout.chunks.size(), [&](size_t c) {
    const ChunkPlacement& chunk = layout.chunks[c];
    if (chunk.device != kHostDevice) return;  // device memory is not compared: always copied
    for (uint32_t s = 0; s < chunk.segment_count; s++) {
      const Segment& seg = layout.segments[chunk.first_segment + s];
      if (std::memcmp(live_ptrs_[seg.buffer] + seg.buffer_offset, slot.region.data() + seg.region_offset,
                      seg.nbytes) != 0)
        return;
    }
    differs[c] = 0;
  });
  return differs;
}

Status SnapshotStore::copy_region_to_buffers(const Slot& slot, const std::vector<char>* only) {
  const Layout& layout = *slot.layout;
  // The caller checked that `layout` matches layout_, so live_ptrs_ lines up with it.
  const std::vector<unsigned char*>& targets = live_ptrs_;
  // Non-temporal stores, as the snapshot's copy: a restored state is larger than the
  // caches the next step would find it in, and skipping each line's read for
  // ownership is most of what a plain memcpy loses to the limit (bench/snapshot.py).
  pool_->run(layout.chunks.size(), [&](size_t c) {
    const ChunkPlacement& chunk = layout.chunks[c];
    if (chunk.device != kHostDevice || (only != nullptr && !(*only)[c])) return;
    for (uint32_t s = 0; s < chunk.segment_count; s++) {
      const Segment& seg = layout.segments[chunk.first_segment + s];
      copy_streaming(targets[seg.buffer] + seg.buffer_offset, slot.region.data() + seg.region_offset, seg.nbytes,
                     /*fence=*/false);
    }
    store_fence();  // before pool_->run returns: the caller's thread reads the buffers next
  });
  std::vector<DeviceCopy> copies;
  for (const ChunkPlacement& chunk : layout.chunks) {
    if (chunk.device == kHostDevice) continue;
    copies.clear();
    for (uint32_t s = 0; s < chunk.segment_count; s++) {
      const Segment& seg = layout.segments[chunk.first_segment + s];
      copies.push_back(DeviceCopy{slot.region.data() + seg.region_offset,
                                  targets[seg.buffer] + seg.buffer_offset, seg.nbytes});
    }
    PEERSTATE_RETURN_IF_ERROR(device_->to_device(chunk.device, copies.data(), copies.size()));
  }
  return Status::Ok();
}

Status SnapshotStore::restore(int64_t version, bool verify, size_t* bytes_written) {
  if (bytes_written != nullptr) *bytes_written = 0;
  if (closed_) return Status(StatusCode::kInvalidArgument, "the snapshot store is closed");
  Slot* slot = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string committed;
    for (const auto& s : slots_) {
      if (s->state == Slot::State::kCommitted && s->version == version) slot = s.get();
      if (s->state == Slot::State::kCommitted)
        committed += (committed.empty() ? "" : ", ") + std::to_string(s->version);
      if (s->state == Slot::State::kInFlight && s->version == version)
        return Status(StatusCode::kNotFound,
                      "version " + std::to_string(version) +
                          " is still in flight, not committed; wait() for it first");
    }
    if (slot == nullptr)
      return Status(StatusCode::kNotFound,
                    "version " + std::to_string(version) + " is not a committed snapshot (committed: " +
                        (committed.empty() ? std::string("none") : committed) + ")");
  }
  std::string diff = slot->layout->difference(*layout_);
  if (!diff.empty())
    return Status(StatusCode::kRegistrationMismatch,
                  "version " + std::to_string(version) +
                      " does not match the registered buffers: " + diff +
                      ". Register the same buffers (names, sizes, devices) to restore it; the "
                      "live buffers were not changed.");
  const std::vector<char> differs = chunks_differing_from_buffers(*slot);
  if (verify) PEERSTATE_RETURN_IF_ERROR(this->verify(*slot, &differs));
  cancel_in_flight();
  Status st = copy_region_to_buffers(*slot, &differs);
  if (bytes_written != nullptr)
    for (size_t c = 0; c < differs.size(); c++)
      if (differs[c]) *bytes_written += slot->layout->chunks[c].nbytes;
  if (!st.ok())
    return Status(st.code(), "restore of version " + std::to_string(version) +
                                 " failed part way; the registered buffers are inconsistent: " +
                                 st.message());
  return drop_newer(version);
}

void SnapshotStore::validated(size_t count) {
  std::shared_ptr<InFlight> job;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job = in_flight_;
  }
  if (!job || !job->gated) return;
  std::lock_guard<std::mutex> lock(job->mutex);
  if (count <= job->validated) return;
  job->validated = count;
  job->opened.notify_all();
}

void SnapshotStore::revoke_pins_locked(Slot& slot) {
  slot.draining = true;
  for (auto& entry : slot.revokers) entry.second();
  slot.revokers.clear();
}

Status SnapshotStore::view(int64_t version, VersionView* out, std::function<void()> revoke) const {
  out->pin.reset();  // a pin held there is released under the lock: not while it is held here
  std::lock_guard<std::mutex> lock(mutex_);
  if (version < 0)
    for (const auto& s : slots_)
      if (s->state == Slot::State::kCommitted) version = std::max(version, s->version);
  for (const auto& s : slots_) {
    if (s->state != Slot::State::kCommitted || s->version != version) continue;
    if (s->draining)
      return Status(StatusCode::kUnavailable, "version " + std::to_string(version) +
                                                  " is being replaced by a newer snapshot; ask for the newest");
    out->version = version;
    out->layout = s->layout;
    out->checksums = s->checksums;
    out->data = s->region.data();
    out->mutable_data = s->region.data();
    out->nbytes = s->layout->region_bytes;
    s->readers++;
    Slot* slot = s.get();
    const uint64_t id = slot->next_pin++;
    if (revoke) slot->revokers.emplace(id, std::move(revoke));
    out->pin = std::shared_ptr<const void>(slot, [this, slot, id](const void*) {
      std::lock_guard<std::mutex> relock(mutex_);
      slot->readers--;
      slot->revokers.erase(id);
      unpinned_.notify_all();
    });
    return Status::Ok();
  }
  return Status(StatusCode::kNotFound, version < 0 ? std::string("no committed snapshot here")
                                                  : "version " + std::to_string(version) + " is not a committed snapshot");
}

uintptr_t SnapshotStore::region_address(int64_t version) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& s : slots_)
    if (s->state != Slot::State::kEmpty && s->version == version)
      return reinterpret_cast<uintptr_t>(s->region.data());
  return 0;
}

Status SnapshotStore::begin_receive(int64_t version, std::shared_ptr<const Layout> layout, unsigned char** region) {
  if (closed_) return Status(StatusCode::kInvalidArgument, "the snapshot store is closed");
  PEERSTATE_RETURN_IF_ERROR(wait());
  std::string diff = layout->difference(*layout_);
  if (!diff.empty())
    return Status(StatusCode::kRegistrationMismatch,
                  "the incoming version " + std::to_string(version) + " does not match the registered buffers: " +
                      diff + ". Register the same buffers (names, sizes, devices) as the rank it came from.");
  if (layout->region_bytes * options_.max_versions > options_.budget_bytes)
    return Status(StatusCode::kBudgetExceeded, "the incoming version needs " + std::to_string(layout->region_bytes) +
                                                   " bytes per version, over this store's budget");
  size_t target = 0;
  PEERSTATE_RETURN_IF_ERROR(reserve_slot(version, std::move(layout), &target));
  *region = slots_[target]->region.data();
  return Status::Ok();
}

Status SnapshotStore::end_receive(int64_t version, const std::vector<uint32_t>& checksums, bool ok) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& s : slots_) {
    if (s->state != Slot::State::kInFlight || s->version != version || in_flight_) continue;
    if (ok && checksums.size() != s->layout->chunks.size())
      return Status(StatusCode::kInvalidArgument, "end_receive needs one checksum per chunk");
    s->checksums = checksums;
    s->state = ok ? Slot::State::kCommitted : Slot::State::kEmpty;
    if (ok) update_index_locked();
    return Status::Ok();
  }
  return Status(StatusCode::kNotFound, "no version " + std::to_string(version) + " is being received");
}

void SnapshotStore::index_into(std::shared_ptr<ProcessIndex> index, uint32_t tag, int32_t rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (index_) index_->set(index_tag_, {});
  index_ = std::move(index);
  index_tag_ = tag;
  index_rank_ = rank;
  update_index_locked();
}

void SnapshotStore::update_index_locked() {
  if (!index_) return;
  std::vector<ProcessIndex::Entry> entries;
  for (auto& s : slots_) {
    if (s->state != Slot::State::kCommitted || s->checksums.empty()) continue;
    if (s->indexed_version != s->version) {  // encoded once per committed version
      VersionMeta meta{index_rank_, s->version, s->layout->chunk_bytes, s->layout->buffers, s->checksums, s->layout};
      s->indexed_meta = encode_meta(meta);
      s->indexed_version = s->version;
    }
    entries.push_back({index_tag_, index_rank_, s->version, reinterpret_cast<uint64_t>(s->region.data()),
                       s->layout->region_bytes, s->indexed_meta});
  }
  index_->set(index_tag_, std::move(entries));
}

}  // namespace peerstate
