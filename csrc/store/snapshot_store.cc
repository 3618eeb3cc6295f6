// The write side of SnapshotStore: registration, slots, snapshots and their copies,
// and the store's life. The read side (restore, views, receives, the index) is in
// snapshot_store_read.cc; both share snapshot_slot.h.
#include "store/snapshot_store.h"

#include "common/memory_copy.h"
#include "store/snapshot_slot.h"
#include "store/version_meta.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>

namespace peerstate {

SnapshotStore::SnapshotStore(const SnapshotStoreOptions& options) : options_(options) {}

Status SnapshotStore::create(const SnapshotStoreOptions& options,
                             std::unique_ptr<SnapshotStore>* out) {
  SnapshotStoreOptions o = options;
  if (o.max_versions < 2)
    return Status(StatusCode::kInvalidArgument,
                  "max_versions must be at least 2 (got " + std::to_string(o.max_versions) +
                      "): the last committed version must survive while the next is taken");
  if (o.chunk_bytes < kLayoutAlignment)
    return Status(StatusCode::kInvalidArgument, "chunk_bytes must be at least " +
                                                    std::to_string(kLayoutAlignment) + " (got " +
                                                    std::to_string(o.chunk_bytes) + ")");
  if (o.threads == 0) o.threads = available_cores();
  if (o.budget_bytes == 0) o.budget_bytes = physical_memory_bytes() / 2;
  std::unique_ptr<SnapshotStore> store(new SnapshotStore(o));
  store->pool_ = ThreadPool::shared(o.threads);  // one pool per process, whatever the stores
  for (size_t i = 0; i < o.max_versions; i++) store->slots_.emplace_back(new Slot());
  store->layout_ = std::make_shared<Layout>();
  *out = std::move(store);
  return Status::Ok();
}

SnapshotStore::~SnapshotStore() { (void)close(); }

Status SnapshotStore::ensure_device_engine() {
  if (device_) return Status::Ok();
  return DeviceCopyEngine::create(&device_);
}

Status SnapshotStore::register_buffers(const std::vector<BufferRegistration>& buffers) {
  if (closed_) return Status(StatusCode::kInvalidArgument, "the snapshot store is closed");
  if (in_flight_version() >= 0)
    return Status(StatusCode::kBusy, "cannot change the registration while version " +
                                         std::to_string(in_flight_version()) +
                                         " is in flight; call wait() first");
  std::set<std::string> seen;
  for (const BufferRegistration& b : buffers) {
    if (b.name.empty())
      return Status(StatusCode::kInvalidArgument, "a buffer name must not be empty");
    if (!seen.insert(b.name).second)
      return Status(StatusCode::kInvalidArgument,
                    "buffer '" + b.name + "' appears twice in one registration");
    if (b.nbytes > 0 && b.ptr == nullptr)
      return Status(StatusCode::kInvalidArgument,
                    "buffer '" + b.name + "' has " + std::to_string(b.nbytes) +
                        " bytes but a null pointer");
    if (b.device < kHostDevice)
      return Status(StatusCode::kInvalidArgument,
                    "buffer '" + b.name + "' has device " + std::to_string(b.device) +
                        "; use -1 for host memory or a CUDA device index");
    if (b.device != kHostDevice) {
      Status st = ensure_device_engine();
      if (!st.ok())
        return Status(st.code(), "cannot register device buffer '" + b.name + "': " + st.message());
    }
  }

  std::vector<BufferRegistration> next = registered_;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < next.size(); i++) index[next[i].name] = i;
  for (const BufferRegistration& b : buffers) {
    auto it = index.find(b.name);
    if (it != index.end()) {
      next[it->second] = b;
    } else {
      index[b.name] = next.size();
      next.push_back(b);
    }
  }
  auto layout = std::make_shared<Layout>();
  PEERSTATE_RETURN_IF_ERROR(build_layout(next, options_.chunk_bytes, layout.get()));
  const size_t need = layout->region_bytes * options_.max_versions;
  if (need > options_.budget_bytes)
    return Status(StatusCode::kBudgetExceeded,
                  "registering these buffers needs " + std::to_string(layout->region_bytes) +
                      " bytes per version x " + std::to_string(options_.max_versions) +
                      " versions = " + std::to_string(need) +
                      " bytes of snapshot memory, over the budget of " +
                      std::to_string(options_.budget_bytes) +
                      " bytes; raise budget_bytes, lower max_versions (at least 2), or "
                      "register less state. Nothing was registered.");
  set_registration(std::move(next), std::move(layout));
  return Status::Ok();
}

void SnapshotStore::set_registration(std::vector<BufferRegistration> buffers,
                                     std::shared_ptr<const Layout> layout) {
  std::map<std::string, unsigned char*> by_name;
  for (const BufferRegistration& b : buffers) by_name[b.name] = static_cast<unsigned char*>(b.ptr);
  live_ptrs_.clear();
  for (const BufferPlacement& p : layout->buffers) live_ptrs_.push_back(by_name[p.name]);
  registered_ = std::move(buffers);
  layout_ = std::move(layout);
}

Status SnapshotStore::unregister(const std::vector<std::string>& names) {
  if (in_flight_version() >= 0)
    return Status(StatusCode::kBusy, "cannot change the registration while version " +
                                         std::to_string(in_flight_version()) +
                                         " is in flight; call wait() first");
  const std::set<std::string> remove(names.begin(), names.end());
  std::set<std::string> present;
  for (const BufferRegistration& r : registered_)
    if (remove.count(r.name)) present.insert(r.name);
  for (const std::string& name : names)
    if (!present.count(name))
      return Status(StatusCode::kNotFound,
                    "no buffer named '" + name + "' is registered; nothing was unregistered");
  std::vector<BufferRegistration> next;
  for (const BufferRegistration& r : registered_)
    if (!remove.count(r.name)) next.push_back(r);
  auto layout = std::make_shared<Layout>();
  PEERSTATE_RETURN_IF_ERROR(build_layout(next, options_.chunk_bytes, layout.get()));
  set_registration(std::move(next), std::move(layout));
  return Status::Ok();
}

Status SnapshotStore::prepare_region(Slot& slot, const Layout& layout) {
  const bool want_pinned = layout.has_device_buffers;
  if (slot.region.size() >= layout.region_bytes && slot.region.data() != nullptr &&
      slot.pinned == want_pinned)
    return Status::Ok();
  if (slot.pinned) {
    PEERSTATE_RETURN_IF_ERROR(device_->unpin(slot.region.data()));
    slot.pinned = false;
  }
  PEERSTATE_RETURN_IF_ERROR(slot.region.allocate(layout.region_bytes));
  if (want_pinned) {
    PEERSTATE_RETURN_IF_ERROR(device_->pin(slot.region.data(), slot.region.size()));
    slot.pinned = true;
  }
  return Status::Ok();
}

Status SnapshotStore::reserve_slot(int64_t version, std::shared_ptr<const Layout> layout, size_t* slot) {
  std::unique_lock<std::mutex> lock(mutex_);
  int64_t newest = -1;
  for (const auto& s : slots_)
    if (s->state == Slot::State::kCommitted) newest = std::max(newest, s->version);
  if (version <= newest)
    return Status(StatusCode::kInvalidArgument,
                  "version " + std::to_string(version) + " is not newer than committed version " +
                      std::to_string(newest) + "; versions are step numbers and must increase (restore() rolls back)");
  // An empty slot, else the oldest committed one; never the newest committed
  // version, and never a slot whose bytes a reader holds (wait for it).
  size_t target = slots_.size();
  for (;;) {
    for (size_t i = 0; i < slots_.size(); i++) {
      const Slot& s = *slots_[i];
      if (s.readers > 0 || s.state == Slot::State::kInFlight ||
          (s.state == Slot::State::kCommitted && s.version == newest))
        continue;
      if (s.state == Slot::State::kEmpty) {
        target = i;
        break;
      }
      if (target == slots_.size() || s.version < slots_[target]->version) target = i;
    }
    if (target != slots_.size()) break;
    // Every reusable slot is pinned: the owner does not wait on a peer's reading, so
    // the oldest one's revocable readers are cut (those in this process are waited for).
    Slot* oldest = nullptr;
    for (auto& s : slots_)
      if (s->state == Slot::State::kCommitted && s->version != newest && (!oldest || s->version < oldest->version))
        oldest = s.get();
    if (oldest != nullptr && !oldest->draining) revoke_pins_locked(*oldest);
    unpinned_.wait(lock);
  }
  for (auto& s : slots_) s->draining = false;
  Slot& chosen = *slots_[target];
  const bool was_committed = chosen.state == Slot::State::kCommitted;
  chosen.state = Slot::State::kInFlight;
  chosen.indexed_version = -1;
  if (was_committed) update_index_locked();  // before its region is overwritten
  lock.unlock();
  // Allocating can take a while (a new or grown region): not under the lock.
  Status st = prepare_region(chosen, *layout);
  if (!st.ok()) {
    std::lock_guard<std::mutex> relock(mutex_);
    chosen.state = Slot::State::kEmpty;
    return st;
  }
  chosen.version = version;
  chosen.layout = std::move(layout);
  chosen.checksums.clear();
  *slot = target;
  return Status::Ok();
}

Status SnapshotStore::snapshot(int64_t version, uintptr_t after_stream, bool gated) {
  if (closed_) return Status(StatusCode::kInvalidArgument, "the snapshot store is closed");
  PEERSTATE_RETURN_IF_ERROR(wait());
  if (layout_->buffers.empty())
    return Status(StatusCode::kInvalidArgument,
                  "nothing is registered; register buffers before taking a snapshot");
  if (version < 0)
    return Status(StatusCode::kInvalidArgument,
                  "version must be a step number >= 0 (got " + std::to_string(version) + ")");

  const std::shared_ptr<const Layout> layout = layout_;
  size_t target = 0;
  PEERSTATE_RETURN_IF_ERROR(reserve_slot(version, layout, &target));
  Slot& slot = *slots_[target];
  auto fail = [&](Status st) {
    std::lock_guard<std::mutex> lock(mutex_);
    slot.state = Slot::State::kEmpty;
    return st;
  };
  slot.checksums.assign(options_.checksums ? layout->chunks.size() : 0, 0);

  auto job = std::make_shared<InFlight>();
  job->slot = target;
  job->version = version;
  job->layout = layout;
  job->sources.assign(live_ptrs_.begin(), live_ptrs_.end());
  if (gated) {
    job->gated = true;
    job->gate.assign(layout->chunks.size(), 0);
    for (size_t c = 0; c < layout->chunks.size(); c++) {
      const ChunkPlacement& chunk = layout->chunks[c];
      job->gate[c] = layout->segments[chunk.first_segment + chunk.segment_count - 1].buffer;
    }
    while (job->host_buffers < layout->buffers.size() && layout->buffers[job->host_buffers].device == kHostDevice)
      job->host_buffers++;
  }

  if (layout->has_device_buffers) {
    // Device chunks are queued on the copy stream now; the pool's workers only
    // wait for each chunk's event and checksum the landed bytes.
    Status st = device_->reserve_tickets(layout->chunks.size());
    std::set<int> ordered;
    std::vector<DeviceCopy> copies;
    for (size_t c = 0; st.ok() && c < layout->chunks.size(); c++) {
      const ChunkPlacement& chunk = layout->chunks[c];
      if (chunk.device == kHostDevice) continue;
      if (ordered.insert(chunk.device).second) st = device_->order_after_stream(chunk.device, after_stream);
      if (!st.ok()) break;
      copies.clear();
      for (uint32_t s = 0; s < chunk.segment_count; s++) {
        const Segment& seg = layout->segments[chunk.first_segment + s];
        copies.push_back(DeviceCopy{slot.region.data() + seg.region_offset,
                                    const_cast<unsigned char*>(job->sources[seg.buffer]) + seg.buffer_offset,
                                    seg.nbytes});
      }
      st = device_->begin_to_host(chunk.device, copies.data(), copies.size(), c);
    }
    if (!st.ok()) {
      for (size_t c = 0; c < layout->chunks.size(); c++)
        if (layout->chunks[c].device != kHostDevice) (void)device_->wait_to_host(c);
      return fail(st);
    }
  }

  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_ = job;
  }
  // Host chunks go to the workers in long runs of consecutive chunks, eight per
  // thread and equal in chunk count (chunks are equal in size but for the last
  // of each buffer): each thread then streams through memory like one big
  // memcpy, measured ~10% faster than handing out 4 MiB chunks one by one,
  // while a thread slowed by a neighbour on its core leaves the others only a
  // short run to wait for (two per thread measured 0.83-1.00 of a plain copy
  // at 2 GiB on a shared VM, eight 0.98-1.03).
  // Device chunks stay one per item, so each is checksummed as soon as it lands.
  // The layout puts host chunks first, so they are chunks [0, host).
  size_t host = 0;
  while (host < layout->chunks.size() && layout->chunks[host].device == kHostDevice) host++;
  const size_t runs = std::min(host, 8 * pool_->size());
  for (size_t r = 0; r < runs; r++) job->work.emplace_back(r * host / runs, (r + 1) * host / runs);
  for (size_t c = host; c < layout->chunks.size(); c++) job->work.emplace_back(c, c + 1);
  InFlight* raw = job.get();
  job->job = pool_->submit(
      job->work.size(),
      [this, raw](size_t item) {
        for (size_t c = raw->work[item].first; c < raw->work[item].second; c++) copy_chunk_to_region(*raw, c);
      },
      [this, raw] { finish_in_flight(*raw); });
  return Status::Ok();
}

void SnapshotStore::copy_chunk_to_region(InFlight& job, size_t c) {
  Slot& slot = *slots_[job.slot];
  const Layout& layout = *job.layout;
  const ChunkPlacement& chunk = layout.chunks[c];
  unsigned char* region = slot.region.data();
  uint32_t crc = 0;
  if (job.cancelled.load(std::memory_order_acquire)) return;
  if (chunk.device == kHostDevice) {
    if (!job.wait_for_gate(c)) return;
    for (uint32_t s = 0; s < chunk.segment_count; s++) {
      const Segment& seg = layout.segments[chunk.first_segment + s];
      const unsigned char* src = job.sources[seg.buffer] + seg.buffer_offset;
      // One fence per chunk, not per segment: a fence drains the write-combining
      // buffers, which would stall a chunk of many small tensors at every one.
      if (options_.checksums)
        crc = crc32c_copy(region + seg.region_offset, src, seg.nbytes, crc, Crc32cImplementation::kAuto,
                          /*fence=*/false);
      else
        copy_streaming(region + seg.region_offset, src, seg.nbytes, /*fence=*/false);
    }
    store_fence();
  } else {
    Status st = device_->wait_to_host(c);
    if (!st.ok()) return job.record(st);
    if (options_.checksums) crc = chunk_checksum(layout, c, region);
  }
  if (options_.checksums) slot.checksums[c] = crc;
}

void SnapshotStore::finish_in_flight(InFlight& job) {
  bool keep;
  {
    std::lock_guard<std::mutex> lock(job.mutex);
    keep = job.error.ok() && !job.cancelled.load(std::memory_order_acquire);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Slot& slot = *slots_[job.slot];
  slot.state = keep ? Slot::State::kCommitted : Slot::State::kEmpty;
  if (keep) update_index_locked();
  job.finished.store(true, std::memory_order_release);
}

Status SnapshotStore::wait() {
  std::shared_ptr<InFlight> job;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job = in_flight_;
  }
  if (!job) return Status::Ok();
  bool unvalidated;
  {
    std::lock_guard<std::mutex> lock(job->mutex);
    unvalidated = job->gated && job->validated < job->host_buffers && !job->cancelled.load();
  }
  if (unvalidated) {
    cancel_in_flight();
    return Status(StatusCode::kInvalidArgument,
                  "snapshot of version " + std::to_string(job->version) +
                      " was waited for before all its buffers were validated; it was cancelled "
                      "(call validated() with every host buffer, or cancel())");
  }
  job->job->wait();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_flight_ == job) in_flight_.reset();
  }
  std::lock_guard<std::mutex> lock(job->mutex);
  if (!job->error.ok())
    return Status(job->error.code(),
                  "snapshot of version " + std::to_string(job->version) + " failed: " + job->error.message());
  if (job->cancelled.load())
    return Status(StatusCode::kAborted,
                  "snapshot of version " + std::to_string(job->version) + " was cancelled");
  return Status::Ok();
}

void SnapshotStore::cancel_in_flight() {
  std::shared_ptr<InFlight> job;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job = std::move(in_flight_);
  }
  if (!job) return;
  job->cancel();
  job->job->cancel();
  job->job->wait();
  // Skipped device chunks may still be landing in the slot's region: drain them
  // before anyone reuses it.
  for (size_t c = 0; c < job->layout->chunks.size(); c++)
    if (job->layout->chunks[c].device != kHostDevice) (void)device_->wait_to_host(c);
  // A version that committed before the cancel (nobody called wait() yet) stays committed.
  std::lock_guard<std::mutex> lock(mutex_);
  Slot& slot = *slots_[job->slot];
  if (slot.state == Slot::State::kInFlight) slot.state = Slot::State::kEmpty;
}

void SnapshotStore::cancel() { cancel_in_flight(); }

std::vector<std::string> SnapshotStore::buffer_names() const {
  std::vector<std::string> names;
  for (const BufferPlacement& b : layout_->buffers) names.push_back(b.name);
  return names;
}

Status SnapshotStore::drop_newer(int64_t version) {
  if (closed_) return Status(StatusCode::kInvalidArgument, "the snapshot store is closed");
  cancel_in_flight();
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& s : slots_)
    if (s->state == Slot::State::kCommitted && s->version > version) s->state = Slot::State::kEmpty;
  update_index_locked();
  return Status::Ok();
}

Status SnapshotStore::allocate() {
  if (closed_) return Status(StatusCode::kInvalidArgument, "the snapshot store is closed");
  PEERSTATE_RETURN_IF_ERROR(wait());
  for (auto& slot : slots_)
    if (slot->state == Slot::State::kEmpty) PEERSTATE_RETURN_IF_ERROR(prepare_region(*slot, *layout_));
  return Status::Ok();
}

Status SnapshotStore::close() {
  if (closed_) return Status::Ok();
  cancel_in_flight();
  closed_ = true;
  Status result;
  std::unique_lock<std::mutex> lock(mutex_);
  if (index_) index_->set(index_tag_, {});  // out of the index before the memory goes
  for (auto& s : slots_) revoke_pins_locked(*s);
  unpinned_.wait(lock, [&] {
    return std::all_of(slots_.begin(), slots_.end(), [](const std::unique_ptr<Slot>& s) { return s->readers == 0; });
  });
  for (auto& s : slots_) {
    if (s->pinned) {
      Status st = device_->unpin(s->region.data());
      if (result.ok()) result = st;
      s->pinned = false;
    }
    s->region.release();
    s->state = Slot::State::kEmpty;
  }
  return result;
}

std::vector<int64_t> SnapshotStore::committed_versions() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> out;
  for (const auto& s : slots_)
    if (s->state == Slot::State::kCommitted) out.push_back(s->version);
  std::sort(out.begin(), out.end());
  return out;
}

int64_t SnapshotStore::in_flight_version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_flight_ && !in_flight_->finished.load(std::memory_order_acquire)) return in_flight_->version;
  return -1;
}

MemoryReport SnapshotStore::memory() const {
  MemoryReport r;
  for (const BufferRegistration& b : registered_) r.registered_bytes += b.nbytes;
  r.bytes_per_version = layout_->region_bytes;
  r.budget_bytes = options_.budget_bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& s : slots_) {
    r.held_bytes += s->region.size();
    if (s->state != Slot::State::kEmpty) r.versions.emplace_back(s->version, s->region.size());
  }
  return r;
}

}  // namespace peerstate
