// TcpServer: the holder side of the tcp transport.
//
// It accepts connections on the configured address (loopback by default; never
// all interfaces unless asked), has each peer prove its rank's credentials
// (net/credentials.h) before reading anything else, checks every frame's tag after that (net/wire.h),
// stores pushed versions in a ReplicaStore and serves pulls from it or from
// this rank's own SnapshotStores. A peer that sends garbage, a wrong certificate, a
// truncated or altered frame or an out-of-range chunk gets its connection
// closed and a rate-limited log line on stderr; the server keeps running and
// writes nothing outside the target region (every length is checked against
// the layout before any byte lands, and nothing is allocated for a length that
// has not arrived).
//
// Bounded in number and time: at most TcpOptions::max_handshaking connections
// in their handshake (max_handshaking_per_source from one source address),
// max_per_peer per authenticated rank and max_connections in all; a handshake
// has 5 s at most, and an authenticated connection that sends nothing for
// io_timeout_ms is closed. A connection's thread that cannot be created closes
// the connection; accept errors (descriptors exhausted) back off up to a second.
//
// Without credentials, a connection in its handshake is all a peer can hold, so
// the handshake caps never turn a newcomer away: the newcomer is admitted, and
// the oldest handshake of its own source (when that source is at its share) or
// of the source holding most (when all are taken) is closed. An honest peer
// answers the handshake within a round trip, long before its handshake is the
// oldest of its source's share or of the busiest source's; any number of silent
// or trickling connections only evict each other. When accept finds no
// descriptor, the oldest handshake of the busiest source is closed to free one. So an honest peer is
// admitted at its first accept, however many connections an attacker keeps
// open or reopens from other addresses (tests/replication/test_hostile_connections.py).
//
// One server per rank serves every store the rank keeps: store 0 is the one
// given to start() (the rank's own state; pushes of other ranks' state land in
// the ReplicaStore), and serve() adds more under indices 1.. (the rank's
// data-parallel shares), which a get names in FrameHeader::store. Pushes name
// store 0 (the ReplicaStore) or kParityStore: a parity group's pieces, which
// are folded into the ParityStore given to hold_parity().
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/host_memory.h"
#include "net/socket.h"
#include "net/tcp_options.h"
#include "net/wire.h"
#include "store/parity_store.h"
#include "store/replica_store.h"
#include "store/snapshot_store.h"

namespace peerstate {

struct ServedVersion;  // tcp_server_connection.h

struct TcpServerStats {
  size_t accepted = 0;  // connections that passed the handshake
  size_t rejected = 0;  // connections closed for a failed handshake or a protocol violation
  size_t refused = 0;   // connections closed at once: over a limit, or no thread to serve them
  size_t evicted = 0;   // handshakes closed to make room for a newer connection
  size_t active = 0;
};

class TcpServer {
 public:
  // Listens on host:port (port 0: any free port). `replicas` must outlive the
  // server; `own` (may be null) serves pulls of this rank's own state as store 0.
  static Status start(const TcpOptions& options, const std::string& host, int port, ReplicaStore* replicas,
                      SnapshotStore* own, std::unique_ptr<TcpServer>* out);
  ~TcpServer();  // stop()

  // Serves pulls of this rank's state kept in `snapshots` as store `index`
  // (>= 1). Thread-safe, never blocks; `snapshots` must outlive the server.
  // kInvalidArgument for index 0 or an index already served.
  Status serve(uint32_t index, SnapshotStore* snapshots);

  // Folds the parity pieces other ranks push (FrameHeader::store kParityStore)
  // into `parity`, which must outlive the server. Once; kInvalidArgument after that.
  Status hold_parity(ParityStore* parity);

  int port() const { return port_; }
  // Closes the listener and every connection and joins their threads. Blocks
  // at most for the threads to notice (they are woken by shutdown).
  void stop();
  TcpServerStats stats() const;

 private:
  struct Connection;
  TcpServer(const TcpOptions& options, ReplicaStore* replicas, SnapshotStore* own);
  void accept_loop();
  // Whether one more connection may be served now, and why not.
  bool admit(std::string* why);
  // The handshake to close for a newcomer from `*source` (see the top), or null; with
  // no newcomer (null), the oldest of the busiest source's, if any. mutex_ held.
  Connection* handshake_to_evict(const std::string* source) const;
  void evict(Connection* victim, const std::string& why);
  void serve_connection(Connection* connection);
  Status handle(Connection& c, const FrameHeader& h);
  Status serve_get(Connection& c, const FrameHeader& h);
  // Reads a kPutBegin's metadata, bounded by the sender's reservation. A refusal the
  // stream survives is sent to the peer and returns ok with meta->layout null.
  Status read_put_meta(Connection& c, const FrameHeader& h, size_t reserved_bytes, Deadline deadline,
                       VersionMeta* meta);
  // Ends a push (kPutCommit): waits for `commit` in slices up to the io timeout, then acks or sends its error.
  Status commit_put(Connection& c, const FrameHeader& h, const std::function<Status(Deadline)>& commit);
  // The put frames of parity pieces, and the rebuilt pieces this rank serves (tcp_server_parity.cc).
  Status handle_parity_put(Connection& c, const FrameHeader& h);
  Status serve_rebuilt(int source_rank, int64_t version, ServedVersion* out) const;
  Status ensure_staging(Connection& c, size_t nbytes);
  SnapshotStore* own_store(uint32_t index) const;
  void reap(bool all);

  const TcpOptions options_;
  ReplicaStore* const replicas_;
  Socket listener_;
  int port_ = 0;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::mutex decode_mutex_;
  std::map<uint32_t, SnapshotStore*> own_;  // guarded by mutex_
  ParityStore* parity_ = nullptr;           // guarded by mutex_
  std::list<std::unique_ptr<Connection>> connections_;
  std::atomic<size_t> accepted_{0}, rejected_{0}, refused_{0}, evicted_{0};
};

}  // namespace peerstate
