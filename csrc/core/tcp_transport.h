// The tcp transport: host-memory replication over authenticated TCP.
//
// TcpServer is the holder side: it accepts connections on the configured
// address (loopback by default; never all interfaces unless asked), proves
// each peer knows the job secret before reading anything else, stores pushed
// versions in a ReplicaStore and serves pulls from it or from this rank's own
// SnapshotStore. A peer that sends garbage, a wrong secret, a truncated frame
// or an out-of-range chunk gets its connection closed and a log line on
// stderr; the server keeps running and writes nothing outside the target
// region (every length is checked against the layout before any byte lands).
//
// TcpTransport is the client side (see transport.h for the contract). It keeps
// `connections_per_peer` authenticated connections to each peer, opened on
// first use and reopened after a failure, and spreads a transfer's chunks over
// them; chunks are pipelined (no per-chunk acknowledgement).
#pragma once

#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/replica_store.h"
#include "core/snapshot_store.h"
#include "core/socket.h"
#include "core/transport.h"

namespace peerstate {

struct TcpOptions {
  std::string secret;               // the job secret; required, at least 16 bytes
  int rank = -1;                    // this rank
  size_t connections_per_peer = 4;  // client side
  long connect_timeout_ms = 5000;
  long io_timeout_ms = 30000;       // per transfer step; also the handshake bound x 1/6
};

struct TcpServerStats {
  size_t accepted = 0;  // connections that passed the handshake
  size_t rejected = 0;  // connections closed for a failed handshake or a protocol violation
  size_t active = 0;
};

class TcpServer {
 public:
  // Listens on host:port (port 0: any free port). `replicas` must outlive the
  // server; `own` (may be null) serves pulls of this rank's own state.
  static Status start(const TcpOptions& options, const std::string& host, int port, ReplicaStore* replicas,
                      SnapshotStore* own, std::unique_ptr<TcpServer>* out);
  ~TcpServer();  // stop()

  int port() const { return port_; }
  // Closes the listener and every connection and joins their threads. Blocks
  // at most for the threads to notice (they are woken by shutdown).
  void stop();
  TcpServerStats stats() const;

 private:
  struct Connection;
  TcpServer(const TcpOptions& options, ReplicaStore* replicas, SnapshotStore* own);
  void accept_loop();
  void serve(Connection* connection);
  Status handle(Connection& c, const FrameHeader& h);
  Status serve_get(Connection& c, const FrameHeader& h);
  Status ensure_staging(Connection& c, size_t nbytes);
  void reap(bool all);

  const TcpOptions options_;
  ReplicaStore* const replicas_;
  SnapshotStore* const own_;
  Socket listener_;
  int port_ = 0;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::list<std::unique_ptr<Connection>> connections_;
  std::atomic<size_t> accepted_{0}, rejected_{0};
};

class TcpTransport final : public Transport {
 public:
  static Status create(const TcpOptions& options, std::unique_ptr<TcpTransport>* out);
  ~TcpTransport() override;

  // Where `rank` listens. Replaces an earlier address (closing its connections).
  void add_peer(int rank, const std::string& host, int port);

  const char* name() const override { return "tcp"; }
  Status send(int peer, const TransferPlan& plan) override;
  Status receive(int peer, const TransferPlan& plan) override;
  Status describe(int peer, int source_rank, int64_t version, VersionMeta* out) override;
  void abort() override;

 private:
  struct Link;
  struct Peer;
  explicit TcpTransport(const TcpOptions& options) : options_(options) {}
  // Opens (or reuses) the connections to `peer`; `keep` holds them alive for the call.
  Status links(int peer, std::shared_ptr<Peer>* keep, std::vector<Link*>* out);
  Status checked(Status st) const;

  const TcpOptions options_;
  std::mutex mutex_;
  std::map<int, std::shared_ptr<Peer>> peers_;
  std::atomic<bool> aborted_{false};
  CancelSignal cancel_;  // watched by every socket: abort() wakes them all, connecting ones too
};

}  // namespace peerstate
