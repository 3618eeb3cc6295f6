// SnapshotStore's private state: a version slot, and the version in flight. Shared by
// snapshot_store.cc (the write side) and snapshot_store_read.cc (the read side);
// nothing outside the store includes it.
#pragma once

#include "store/snapshot_store.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>

namespace peerstate {

struct SnapshotStore::Slot {
  enum class State { kEmpty, kInFlight, kCommitted };
  State state = State::kEmpty;
  int64_t version = -1;
  std::shared_ptr<const Layout> layout;
  std::vector<uint32_t> checksums;
  HostRegion region;
  bool pinned = false;
  size_t readers = 0;  // views whose pin is held (guarded by the store's mutex)
  bool draining = false;  // its pins were revoked: it grants none until it is reused
  std::map<uint64_t, std::function<void()>> revokers;  // of the held pins that have one, by pin
  uint64_t next_pin = 0;
  int64_t indexed_version = -1;  // the version indexed_meta encodes
  std::string indexed_meta;
};

struct SnapshotStore::InFlight {
  size_t slot = 0;
  int64_t version = -1;
  std::shared_ptr<const Layout> layout;
  std::vector<const unsigned char*> sources;  // live pointer of each layout buffer
  std::vector<std::pair<size_t, size_t>> work;  // [first, last) chunk runs, one pool item each
  std::shared_ptr<ThreadPool::Job> job;  // set right after submission
  std::atomic<bool> cancelled{false};
  std::atomic<bool> finished{false};
  std::mutex mutex;
  Status error;  // the first chunk failure

  // Gated versions: host chunk c may be copied once validated > gate[c], the
  // highest buffer index among its segments.
  bool gated = false;
  std::vector<uint32_t> gate;
  size_t host_buffers = 0;
  size_t validated = 0;  // guarded by `mutex`
  std::condition_variable opened;

  void record(Status st) {
    std::lock_guard<std::mutex> lock(mutex);
    if (error.ok()) error = std::move(st);
  }
  void cancel() {
    std::lock_guard<std::mutex> lock(mutex);
    cancelled.store(true, std::memory_order_release);
    opened.notify_all();
  }
  // Blocks until chunk c may be copied; false if the version was cancelled meanwhile.
  bool wait_for_gate(size_t c) {
    if (!gated) return true;
    std::unique_lock<std::mutex> lock(mutex);
    opened.wait(lock, [&] { return validated > gate[c] || cancelled.load(std::memory_order_acquire); });
    return !cancelled.load(std::memory_order_acquire);
  }
};

}  // namespace peerstate
