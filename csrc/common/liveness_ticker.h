// A heartbeat that needs no Python: proof that a process is scheduled at all.
//
// A LivenessTicker maps a word of a shared file and stores an increasing count
// into it from a thread of its own, every `interval`. A process that is frozen
// (SIGSTOP, a cgroup freeze) stops it; a process whose interpreter is stuck
// holding the GIL does not: that is what the Python heartbeat beside it in the
// same file (peerstate.control.progress) is for. A watcher compares the two
// to bound each phase by what can stall it: torch's setup collectives hold the
// GIL while they wait for a slow peer, but never stop this thread.
//
// The count is stored with a relaxed atomic store, the only write to that word;
// readers load it as an aligned 64-bit word. Construction opens and maps the
// file and starts the thread; stop() (or destruction) ends it, blocking for at
// most one interval. Not copyable or movable: the thread holds `this`.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"

namespace peerstate {

class LivenessTicker {
 public:
  // Maps the 8 bytes at `offset` (a multiple of 8, inside the file) of the file at
  // `path` and ticks them every `interval_ms` (>= 1). kInvalidArgument for a bad
  // offset or interval, kNotFound when the file cannot be opened or mapped.
  static Status start(const std::string& path, size_t offset, int interval_ms,
                      std::unique_ptr<LivenessTicker>* out);
  ~LivenessTicker();
  LivenessTicker(const LivenessTicker&) = delete;
  LivenessTicker& operator=(const LivenessTicker&) = delete;

  // Ends the thread; the word keeps its last count. Idempotent.
  void stop();
  // The count in the word now.
  uint64_t count() const;

 private:
  LivenessTicker(void* map, size_t map_bytes, uint64_t* word, int interval_ms);
  void run();

  void* map_;
  size_t map_bytes_;
  uint64_t* word_;
  int interval_ms_;
  uint64_t count_ = 0;  // written by the thread only; read through the word
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace peerstate
