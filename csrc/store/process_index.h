// ProcessIndex: where this process keeps its committed versions, readable by
// another process on the same machine while this one is stopped.
//
// A hung worker is frozen (SIGSTOP) before it is killed: its own snapshot and
// the replicas it holds for its buddies are intact in its memory, and its
// replacement on the same machine reads them with process_vm_readv(2)
// (replication/process_memory.h) before the kill. The index is how that reader
// finds them without the stopped process's help: the stores record each of
// their committed host versions here (store tag, source rank, version, region
// address, encoded VersionMeta), and the process publishes address() once
// (its progress file, python/peerstate/control/progress.py).
//
// Consistency. The process may stop at any instruction. The entries live in two
// buffers and a header names the current one: an update builds the other
// buffer, then switches the header with one aligned 64-bit store, so a reader
// of a stopped process always finds a complete buffer. An entry says where a
// committed version was; its region may have been reused since (the store
// removes the entry first, but a process can stop between the two), which
// the reader's per-chunk checksums catch.
//
// Threading: set() may be called from any thread; it serializes itself. The
// index must outlive every store that records into it (they hold it by
// shared_ptr).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace peerstate {

class ProcessIndex {
 public:
  // One committed version. `meta` is encode_meta()'s bytes; `region` and
  // `nbytes` are where its bytes lie in the indexed process.
  struct Entry {
    uint32_t store = 0;
    int32_t source_rank = -1;
    int64_t version = -1;
    uint64_t region = 0;
    uint64_t nbytes = 0;
    std::string meta;
  };

  ProcessIndex();
  ProcessIndex(const ProcessIndex&) = delete;
  ProcessIndex& operator=(const ProcessIndex&) = delete;

  // Replaces every entry of store `store` (a tag chosen per store) with `entries`.
  void set(uint32_t store, std::vector<Entry> entries);
  // The header's address in this process: what a reader is given.
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(&header_); }
  std::vector<Entry> entries() const;

 private:
  struct alignas(64) Header {
    uint64_t magic;
    std::atomic<uint64_t> current;  // which of data/size is complete
    uint64_t data[2];
    uint64_t size[2];
  };

  mutable std::mutex mutex_;
  std::map<uint32_t, std::vector<Entry>> by_store_;
  std::string buffers_[2];
  Header header_;
};

// Reads the index of process `pid` whose header is at `address`, and checks it
// (every count and size bounded by what was read; metadata is only carried,
// decode_meta() checks it). kUnavailable: not permitted to read that process;
// kConnectionError: it is gone or the address is not mapped; kProtocolError:
// what lies there is not an index.
Status read_process_index(pid_t pid, uintptr_t address, std::vector<ProcessIndex::Entry>* out);

}  // namespace peerstate
