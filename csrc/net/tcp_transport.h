// TcpTransport: the client side of the tcp transport (see transport.h for the
// contract; the holder side is tcp_server.h). It keeps
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

#include "net/socket.h"
#include "net/tcp_options.h"
#include "net/transport.h"
#include "net/wire.h"

namespace peerstate {

class TcpTransport final : public Transport {
 public:
  static Status create(const TcpOptions& options, std::unique_ptr<TcpTransport>* out);
  ~TcpTransport() override;

  // Where `rank` listens. Replaces an earlier address (closing its connections).
  void add_peer(int rank, const std::string& host, int port);

  const char* name() const override { return "tcp"; }
  Status send(int peer, const TransferPlan& plan) override;
  Status receive(int peer, const TransferPlan& plan) override;
  Status describe(int peer, int source_rank, int64_t version, uint32_t store, VersionMeta* out) override;
  void abort() override;

 private:
  struct Link;
  struct Peer;
  explicit TcpTransport(const TcpOptions& options) : options_(options) {}
  // Opens (or reuses) the first `wanted` connections to `peer` (at most
  // connections_per_peer); `keep` holds them alive for the call. A transfer of
  // fewer chunks than connections asks for fewer: a link with nothing to carry
  // would cost a thread a round, and, idle at the server, a reconnect and a
  // handshake every io timeout.
  Status links(int peer, std::shared_ptr<Peer>* keep, std::vector<Link*>* out, size_t wanted);
  Status checked(Status st) const;

  const TcpOptions options_;
  std::mutex mutex_;
  std::map<int, std::shared_ptr<Peer>> peers_;
  std::atomic<bool> aborted_{false};
  CancelSignal cancel_;  // watched by every socket: abort() wakes them all, connecting ones too
};

}  // namespace peerstate
