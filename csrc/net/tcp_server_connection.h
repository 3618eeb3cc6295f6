// What the tcp server's files share: the state of one connection and the
// rate-limited log a hostile peer cannot flood. Internal to csrc/net.
#pragma once

#include <atomic>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "common/deadline.h"
#include "common/host_memory.h"
#include "net/tcp_server.h"
#include "net/wire.h"

namespace peerstate {

// Log lines that a hostile peer could make a flood of: each kind at most once a
// second, with a count of what was left out.
class RateLimitedLog {
 public:
  void write(const std::string& kind, const std::string& line) {
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[kind];
    if (e.last != Clock::time_point() && now - e.last < std::chrono::seconds(1)) {
      e.suppressed++;
      return;
    }
    const std::string more = e.suppressed ? " (and " + std::to_string(e.suppressed) + " more like it)" : "";
    e.last = now;
    e.suppressed = 0;
    std::fprintf(stderr, "[peerstate] %s%s\n", line.c_str(), more.c_str());
  }

 private:
  struct Entry {
    Clock::time_point last;
    size_t suppressed = 0;
  };
  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

inline RateLimitedLog& server_log() {
  static RateLimitedLog instance;
  return instance;
}

// A version this server can serve, from its replicas, its own snapshots or a rebuilt parity piece.
struct ServedVersion {
  VersionMeta meta;
  const unsigned char* data = nullptr;
  int device = kHostDevice;  // where `data` is
  std::shared_ptr<const void> keep_alive;
  // `data` holds the chunks [first_chunk, end_chunk) only, from region offset `base` on (a rebuilt parity piece).
  size_t base = 0;
  uint32_t first_chunk = 0, end_chunk = UINT32_MAX;
};

struct TcpServer::Connection {
  Channel channel;
  std::thread thread;
  std::atomic<bool> done{false};
  std::atomic<bool> authenticated{false};
  std::atomic<bool> evicted{false};
  int32_t peer_rank = -1;
  std::string name;
  std::string source;  // the peer's address without its port
  Clock::time_point since = Clock::now();
  HostRegion staging;         // pinned; only for a device replica store
  HostRegion parity_staging;  // a parity piece's chunk lands here and is verified before it is folded
};

}  // namespace peerstate
