// Transport: moves the chunks of one snapshot version between two ranks.
//
// Implementations: TcpTransport (tcp_transport.h; host memory, always built)
// and NcclTransport (csrc/device/nccl_transport.h; device memory, CUDA builds).
//
// The unit is a TransferPlan: a version's metadata (layout and per-chunk
// CRC32C), the memory holding the version's region, and a ChunkQueue saying
// which chunks to move. Workers of a transfer take chunks from the queue, so
// several transfers that share one queue (a pull from several holders) split
// the chunks between them as they go, and a chunk whose transfer failed is
// given back for another peer to take.
//
// Blocking: send(), receive() and describe() block the calling thread until
// the transfer completes, fails, times out (kTimeout) or abort() is called
// (kAborted). They release no locks of the caller's and may be called
// concurrently for different peers.
//
// Memory: the region belongs to the caller and must stay valid and unchanged
// (send) or untouched by others (receive) until the call returns. Received
// bytes land directly in the region, with no intermediate copy per chunk, and
// every chunk is verified against its CRC32C before it is counted as done.
//
// Errors: kConnectionError (peer unreachable or gone), kAuthenticationError
// (peer is not certified by this job), kProtocolError (peer sent garbage),
// kChecksumMismatch (bytes corrupted in transit), kNotFound (peer does not
// hold the version), kAborted, kTimeout.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/status.h"
#include "store/version_meta.h"

namespace peerstate {

// Chunks still to move, shared by the workers of one or more transfers.
class ChunkQueue {
 public:
  explicit ChunkQueue(size_t count);
  // Chunks [first, end) only (a parity piece).
  ChunkQueue(uint32_t first, uint32_t end);
  // Hands out a chunk. Blocks while none is free but some are still in
  // progress (they may be given back); false once every chunk is done.
  bool take(uint32_t* chunk);
  // Hands out a free chunk if there is one; never blocks.
  bool try_take(uint32_t* chunk);
  void complete(uint32_t chunk);
  void give_back(uint32_t chunk);
  bool finished() const;
  size_t done_count() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<uint32_t> free_;
  size_t in_progress_ = 0;
  size_t done_ = 0;
  const size_t count_;
};

struct TransferPlan {
  VersionMeta meta;
  // The version's bytes, laid out as meta.layout says, from region_base on: chunk
  // c is at region + chunk.offset - region_base (a parity piece's own buffer
  // starts at its first chunk; every chunk the queue hands out lies past it).
  unsigned char* region = nullptr;
  ChunkQueue* queue = nullptr;
  // tcp receive: which of the peer's stores to read (TcpServer::serve); tcp send:
  // 0 (the peer's replicas) or kParityStore (net/wire.h: a parity piece; the queue
  // then holds the piece's chunks only).
  uint32_t store = 0;
  size_t region_base = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;

  // tcp: pushes the plan's chunks into the peer's ReplicaStore as version
  //      (meta.source_rank, meta.version) and returns once the peer committed it.
  // nccl: sends the chunks; the peer must call receive() for this rank at the same time.
  virtual Status send(int peer, const TransferPlan& plan) = 0;
  // tcp: pulls the plan's chunks of a version the peer holds (a replica, or its own snapshot).
  // nccl: receives the chunks the peer is sending with send().
  virtual Status receive(int peer, const TransferPlan& plan) = 0;
  // Asks the peer for the metadata of (source_rank, version; -1 = newest) it holds
  // in its store `store` (tcp: see TcpServer; nccl: ignored).
  virtual Status describe(int peer, int source_rank, int64_t version, uint32_t store, VersionMeta* out) = 0;
  // Fails every pending and future call with kAborted; returns within a bounded time.
  virtual void abort() = 0;
};

}  // namespace peerstate
