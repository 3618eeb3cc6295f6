// A heartbeat that needs no Python: proof that a process is scheduled at all.
//
// A LivenessTicker maps a word of a shared file and stores an increasing count
// into it from a thread of its own, every `interval`. A process that is frozen
// (SIGSTOP, a cgroup freeze) stops it; a process whose interpreter is stuck
// holding the GIL does not: that is what the Python heartbeat beside it in the
// same file (peerstate.control.progress) is for. A watcher compares the two
// to bound each phase by what can stall it: torch's setup collectives hold the
// GIL while they wait for a slow peer, but never stop this thread. A count
// that stands still is a reason to ask the kernel, not a verdict: a process
// that waits for a CPU (a starved node, a CFS quota) stops it too.
//
// The count is stored with a relaxed atomic store, the only write to that word;
// readers load it as an aligned 64-bit word. Construction opens and maps the
// file and starts the thread; stop() ends it, blocking for at most one
// interval. Destruction does NOT stop it: the thread is detached and ticks on
// until the process is gone, keeping the mapping and its state (a few hundred
// bytes, never freed); a stopped ticker's are freed with it. A worker's
// interpreter frees this object as it tears down, a second or more before the
// kernel ends the process; a count that stopped then would make an exiting
// process look frozen. Not copyable or movable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
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
  // Detaches a thread that was not stopped (see above).
  ~LivenessTicker();
  LivenessTicker(const LivenessTicker&) = delete;
  LivenessTicker& operator=(const LivenessTicker&) = delete;

  // Ends the thread; the word keeps its last count. Idempotent.
  void stop();
  // The count in the word now (the last one once stopped).
  uint64_t count() const;

 private:
  struct Tick;  // what the thread uses: shared with it, so it may outlive this object
  explicit LivenessTicker(std::shared_ptr<Tick> tick);

  std::shared_ptr<Tick> tick_;
  std::thread thread_;
};

}  // namespace peerstate
