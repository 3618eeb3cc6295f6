#include "core/tcp_transport.h"

#include <cstdio>
#include <deque>
#include <vector>

#include "core/crc32c.h"

namespace peerstate {
namespace {

void log_line(const std::string& line) { std::fprintf(stderr, "[peerstate] %s\n", line.c_str()); }

// A version this server can serve, from its replicas or its own snapshots.
struct ServedVersion {
  VersionMeta meta;
  const unsigned char* data = nullptr;
  int device = kHostDevice;  // where `data` is
  std::shared_ptr<const void> keep_alive;
};

FrameHeader header(FrameType type, int32_t source_rank, int64_t version, uint32_t chunk = 0, uint64_t length = 0,
                   uint32_t crc = 0) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.source_rank = source_rank;
  h.version = version;
  h.chunk = chunk;
  h.length = length;
  h.crc = crc;
  return h;
}

bool is_fatal(const Status& st) {
  // After these the byte stream can no longer be trusted or continued.
  switch (st.code()) {
    case StatusCode::kProtocolError:
    case StatusCode::kConnectionError:
    case StatusCode::kTimeout:
    case StatusCode::kAuthenticationError:
    case StatusCode::kAborted:
      return true;
    default:
      return false;
  }
}

}  // namespace

// ---------------------------------------------------------------- server ----

struct TcpServer::Connection {
  Socket socket;
  std::thread thread;
  std::atomic<bool> done{false};
  int32_t peer_rank = -1;
  std::string name;
  HostRegion staging;  // pinned; only for a device replica store
};

Status TcpServer::ensure_staging(Connection& c, size_t nbytes) {
  if (c.staging.size() >= nbytes) return Status::Ok();
  DeviceCopyEngine* engine = replicas_->engine();
  if (c.staging.data() != nullptr) PEERSTATE_RETURN_IF_ERROR(engine->unpin(c.staging.data()));
  PEERSTATE_RETURN_IF_ERROR(c.staging.allocate(nbytes));
  return engine->pin(c.staging.data(), c.staging.size());
}

TcpServer::TcpServer(const TcpOptions& options, ReplicaStore* replicas, SnapshotStore* own)
    : options_(options), replicas_(replicas), own_(own) {}

Status TcpServer::start(const TcpOptions& options, const std::string& host, int port, ReplicaStore* replicas,
                        SnapshotStore* own, std::unique_ptr<TcpServer>* out) {
  if (options.secret.size() < 16)
    return Status(StatusCode::kInvalidArgument,
                  "the job secret must be at least 16 bytes (got " + std::to_string(options.secret.size()) +
                      "); generate one per job, e.g. secrets.token_bytes(32)");
  if (host.empty())
    return Status(StatusCode::kInvalidArgument,
                  "give the address to listen on (e.g. 127.0.0.1 or this node's interface address); "
                  "listening on all interfaces must be asked for explicitly with 0.0.0.0");
  std::unique_ptr<TcpServer> server(new TcpServer(options, replicas, own));
  PEERSTATE_RETURN_IF_ERROR(listen_on(host, port, &server->listener_, &server->port_));
  server->acceptor_ = std::thread([s = server.get()] { s->accept_loop(); });
  *out = std::move(server);
  return Status::Ok();
}

TcpServer::~TcpServer() { stop(); }

void TcpServer::stop() {
  if (stopping_.exchange(true)) return;
  listener_.shutdown();
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& c : connections_) c->socket.shutdown();
  }
  reap(true);
  listener_.close();
}

TcpServerStats TcpServer::stats() const {
  TcpServerStats s;
  s.accepted = accepted_.load();
  s.rejected = rejected_.load();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& c : connections_)
    if (!c->done.load()) s.active++;
  return s;
}

void TcpServer::reap(bool all) {
  std::list<std::unique_ptr<Connection>> finished;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (all || (*it)->done.load()) {
        finished.push_back(std::move(*it));
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : finished)
    if (c->thread.joinable()) c->thread.join();
}

void TcpServer::accept_loop() {
  while (!stopping_.load()) {
    Socket socket;
    Status st = accept_from(listener_, deadline_after_ms(200), &socket);
    reap(false);
    if (!st.ok()) {
      if (st.code() != StatusCode::kTimeout && !stopping_.load()) log_line("accept failed: " + st.message());
      continue;
    }
    auto c = std::make_unique<Connection>();
    c->socket = std::move(socket);
    c->name = c->socket.peer_name();
    Connection* raw = c.get();
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_.load()) break;
    connections_.push_back(std::move(c));
    raw->thread = std::thread([this, raw] { serve(raw); });
  }
}

void TcpServer::serve(Connection* c) {
  // A client must finish the handshake quickly: a silent or slow one is not held open.
  Status st = handshake_server(c->socket, options_.secret, &c->peer_rank,
                               deadline_after_ms(std::min<long>(options_.io_timeout_ms, 5000)));
  if (!st.ok()) {
    if (!stopping_.load()) {
      rejected_++;
      log_line("closing connection from " + c->name + ": " + st.message());
    }
    c->socket.close();
    c->done = true;
    return;
  }
  accepted_++;
  for (;;) {
    FrameHeader h;
    // Idle between transfers is normal: wait for the next request without a deadline;
    // stop() wakes us through shutdown().
    st = recv_header(c->socket, &h, Deadline::max());
    if (st.ok()) st = handle(*c, h);
    if (!st.ok()) {
      const bool quiet = stopping_.load() || st.code() == StatusCode::kConnectionError;
      if (!quiet) {
        if (st.code() == StatusCode::kProtocolError) rejected_++;
        log_line("closing connection from rank " + std::to_string(c->peer_rank) + " (" + c->name +
                 "): " + st.message());
      }
      break;
    }
  }
  c->socket.close();
  if (c->staging.data() != nullptr) (void)replicas_->engine()->unpin(c->staging.data());
  c->done = true;
}

Status TcpServer::handle(Connection& c, const FrameHeader& h) {
  const Deadline deadline = deadline_after_ms(options_.io_timeout_ms);
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kPutBegin: {
      if (h.length > kMaxMetadataBytes)
        return Status(StatusCode::kProtocolError, "metadata of " + std::to_string(h.length) + " bytes is over the limit");
      std::string bytes(h.length, '\0');
      PEERSTATE_RETURN_IF_ERROR(c.socket.recv_all(bytes.data(), bytes.size(), deadline));
      VersionMeta meta;
      Status st = decode_meta(bytes, &meta);
      if (st.ok() && meta.source_rank != c.peer_rank)
        st = Status(StatusCode::kProtocolError, "rank " + std::to_string(c.peer_rank) +
                                                    " tried to push the state of rank " +
                                                    std::to_string(meta.source_rank));
      if (st.ok()) st = replicas_->begin(meta);
      if (is_fatal(st)) return st;
      if (!st.ok()) return send_error(c.socket, st, deadline);
      return send_frame(c.socket, header(FrameType::kAck, meta.source_rank, meta.version), nullptr, deadline);
    }
    case FrameType::kPutChunk: {
      std::shared_ptr<ReplicaVersion> incoming;
      if (h.source_rank != c.peer_rank)
        return Status(StatusCode::kProtocolError, "chunk for another rank's state");
      // Any mismatch here closes the connection: the payload that follows
      // cannot be skipped safely when its announced length is a lie.
      PEERSTATE_RETURN_IF_ERROR(replicas_->expect_chunk(h.source_rank, h.version, h.chunk, h.length, &incoming));
      const Layout& layout = *incoming->meta.layout;
      const ChunkPlacement& chunk = layout.chunks[h.chunk];
      unsigned char* place = incoming->region.data() + chunk.offset;
      uint32_t crc = 0;
      if (replicas_->device() == kHostDevice) {
        PEERSTATE_RETURN_IF_ERROR(recv_chunk(c.socket, layout, h.chunk, place, deadline, &crc));
      } else {  // device replica: land in pinned staging, verify there, then copy up
        PEERSTATE_RETURN_IF_ERROR(ensure_staging(c, chunk.nbytes));
        PEERSTATE_RETURN_IF_ERROR(recv_chunk(c.socket, layout, h.chunk, c.staging.data(), deadline, &crc));
        DeviceCopy copy{c.staging.data(), place, chunk.nbytes};
        PEERSTATE_RETURN_IF_ERROR(replicas_->engine()->to_device(replicas_->device(), &copy, 1));
      }
      Status st = replicas_->chunk_arrived(incoming, h.chunk, crc);
      if (!st.ok()) log_line("rank " + std::to_string(c.peer_rank) + ": " + st.message());
      return Status::Ok();  // a corrupt chunk fails the version at commit; the stream is intact
    }
    case FrameType::kPutCommit: {
      if (h.source_rank != c.peer_rank) return Status(StatusCode::kProtocolError, "commit of another rank's state");
      // Wait in slices, so that stop() is not held up by a commit that waits
      // for chunks which will never come.
      Status st;
      do {
        st = replicas_->commit(h.source_rank, h.version, std::min(deadline, deadline_after_ms(100)));
      } while (st.code() == StatusCode::kTimeout && Clock::now() < deadline && !stopping_.load());
      if (!st.ok()) return send_error(c.socket, st, deadline);
      return send_frame(c.socket, header(FrameType::kAck, h.source_rank, h.version), nullptr, deadline);
    }
    case FrameType::kGetMeta:
    case FrameType::kGetChunk:
      if (h.length != 0) return Status(StatusCode::kProtocolError, "request with a payload");
      return serve_get(c, h);
    default:
      return Status(StatusCode::kProtocolError, "unexpected frame type " + std::to_string(h.type) + " from a client");
  }
}

Status TcpServer::serve_get(Connection& c, const FrameHeader& h) {
  const Deadline deadline = deadline_after_ms(options_.io_timeout_ms);
  ServedVersion served;
  Status st;
  if (own_ != nullptr && h.source_rank == options_.rank) {
    VersionView view;
    st = own_->view(h.version, &view);
    if (st.ok() && view.checksums.empty())
      st = Status(StatusCode::kUnavailable, "this rank's snapshots have checksums off; they cannot be served");
    if (st.ok()) {
      served.meta = meta_of(options_.rank, view);
      served.data = view.data;
    }
  } else {
    std::shared_ptr<const ReplicaVersion> replica;
    st = replicas_->get(h.source_rank, h.version, &replica);
    if (st.ok()) {
      served.meta = replica->meta;
      served.data = replica->region.data();
      served.device = replica->region.device();
      served.keep_alive = replica;
    }
  }
  if (!st.ok()) return send_error(c.socket, st, deadline);

  if (static_cast<FrameType>(h.type) == FrameType::kGetMeta) {
    std::string bytes = encode_meta(served.meta);
    return send_frame(c.socket, header(FrameType::kMeta, h.source_rank, served.meta.version, 0, bytes.size()),
                      bytes.data(), deadline);
  }
  const Layout& layout = *served.meta.layout;
  if (h.chunk >= layout.chunks.size())
    return send_error(c.socket, Status(StatusCode::kInvalidArgument, "chunk " + std::to_string(h.chunk) + " out of range"),
                      deadline);
  const ChunkPlacement& chunk = layout.chunks[h.chunk];
  const unsigned char* payload = served.data + chunk.offset;
  if (served.device != kHostDevice) {  // device replica: down through pinned staging
    Status staged = ensure_staging(c, chunk.nbytes);
    DeviceCopy copy{c.staging.data(), const_cast<unsigned char*>(payload), chunk.nbytes};
    if (staged.ok()) staged = replicas_->engine()->to_host(served.device, &copy, 1);
    if (!staged.ok()) return send_error(c.socket, staged, deadline);
    payload = c.staging.data();
  }
  return send_frame(c.socket,
                    header(FrameType::kChunk, h.source_rank, served.meta.version, h.chunk, chunk.nbytes,
                           served.meta.checksums[h.chunk]),
                    payload, deadline);
}

// ---------------------------------------------------------------- client ----

struct TcpTransport::Link {
  std::mutex mutex;  // one transfer step at a time per connection
  Socket socket;
};

struct TcpTransport::Peer {
  std::string host;
  int port = 0;
  std::vector<std::unique_ptr<Link>> links;
};

Status TcpTransport::create(const TcpOptions& options, std::unique_ptr<TcpTransport>* out) {
  if (options.secret.size() < 16)
    return Status(StatusCode::kInvalidArgument, "the job secret must be at least 16 bytes");
  if (options.connections_per_peer == 0)
    return Status(StatusCode::kInvalidArgument, "connections_per_peer must be at least 1");
  out->reset(new TcpTransport(options));
  return Status::Ok();
}

TcpTransport::~TcpTransport() { abort(); }

void TcpTransport::add_peer(int rank, const std::string& host, int port) {
  auto peer = std::make_shared<Peer>();
  peer->host = host;
  peer->port = port;
  for (size_t i = 0; i < options_.connections_per_peer; i++) peer->links.push_back(std::make_unique<Link>());
  std::lock_guard<std::mutex> lock(mutex_);
  peers_[rank] = std::move(peer);  // links in use keep the old Peer alive until their calls end
}

void TcpTransport::abort() {
  aborted_ = true;
  cancel_.fire();
}

Status TcpTransport::checked(Status st) const {
  if (!st.ok() && aborted_.load()) return Status(StatusCode::kAborted, "transport aborted: " + st.message());
  return st;
}

Status TcpTransport::links(int peer_rank, std::shared_ptr<Peer>* keep, std::vector<Link*>* out) {
  if (aborted_.load()) return Status(StatusCode::kAborted, "transport aborted");
  std::shared_ptr<Peer>& peer = *keep;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peer_rank);
    if (it == peers_.end())
      return Status(StatusCode::kNotFound, "no address known for rank " + std::to_string(peer_rank));
    peer = it->second;
  }
  out->clear();
  for (auto& l : peer->links) {
    std::lock_guard<std::mutex> lock(l->mutex);
    if (!l->socket.valid()) {
      Socket s;
      PEERSTATE_RETURN_IF_ERROR(
          checked(connect_to(peer->host, peer->port, deadline_after_ms(options_.connect_timeout_ms), &s, &cancel_)));
      Status st = handshake_client(s, options_.secret, options_.rank, deadline_after_ms(options_.connect_timeout_ms));
      if (!st.ok())
        return checked(Status(st.code(), "rank " + std::to_string(peer_rank) + ": " + st.message()));
      l->socket = std::move(s);
    }
    out->push_back(l.get());
  }
  return Status::Ok();
}

namespace {

// Runs fn(link) on every link in its own thread; the first error wins.
template <typename Link, typename Fn>
Status on_every_link(const std::vector<Link*>& links, Fn fn) {
  std::vector<Status> results(links.size());
  std::vector<std::thread> threads;
  for (size_t i = 1; i < links.size(); i++) threads.emplace_back([&, i] { results[i] = fn(*links[i]); });
  results[0] = fn(*links[0]);
  for (auto& t : threads) t.join();
  for (const Status& st : results)
    if (!st.ok()) return st;
  return Status::Ok();
}

}  // namespace

Status TcpTransport::send(int peer, const TransferPlan& plan) {
  std::shared_ptr<Peer> keep;
  std::vector<Link*> ls;
  PEERSTATE_RETURN_IF_ERROR(links(peer, &keep, &ls));
  const VersionMeta& meta = plan.meta;
  const Layout& layout = *meta.layout;
  auto fail = [&](Link& l, Status st) {
    l.socket.close();  // the stream is in an unknown state: reconnect next time
    return checked(st);
  };
  {
    Link& l = *ls[0];
    std::lock_guard<std::mutex> lock(l.mutex);
    std::string bytes = encode_meta(meta);
    Deadline d = deadline_after_ms(options_.io_timeout_ms);
    Status st = send_frame(l.socket, header(FrameType::kPutBegin, meta.source_rank, meta.version, 0, bytes.size()),
                           bytes.data(), d);
    if (st.ok()) st = expect_ack(l.socket, d);
    if (!st.ok()) return is_fatal(st) ? fail(l, st) : st;
  }
  Status st = on_every_link(ls, [&](Link& l) -> Status {
    std::lock_guard<std::mutex> lock(l.mutex);
    uint32_t c;
    while (plan.queue->take(&c)) {
      const ChunkPlacement& chunk = layout.chunks[c];
      Status s = send_frame(l.socket,
                            header(FrameType::kPutChunk, meta.source_rank, meta.version, c, chunk.nbytes,
                                   meta.checksums[c]),
                            plan.region + chunk.offset, deadline_after_ms(options_.io_timeout_ms));
      if (!s.ok()) {
        plan.queue->give_back(c);
        return fail(l, s);
      }
      plan.queue->complete(c);
    }
    return Status::Ok();
  });
  if (!st.ok()) return st;
  Link& l = *ls[0];
  std::lock_guard<std::mutex> lock(l.mutex);
  Deadline d = deadline_after_ms(options_.io_timeout_ms);
  st = send_frame(l.socket, header(FrameType::kPutCommit, meta.source_rank, meta.version), nullptr, d);
  if (st.ok()) st = expect_ack(l.socket, d);
  if (!st.ok() && is_fatal(st)) return fail(l, st);
  return st;
}

Status TcpTransport::describe(int peer, int source_rank, int64_t version, VersionMeta* out) {
  std::shared_ptr<Peer> keep;
  std::vector<Link*> ls;
  PEERSTATE_RETURN_IF_ERROR(links(peer, &keep, &ls));
  Link& l = *ls[0];
  std::lock_guard<std::mutex> lock(l.mutex);
  Deadline d = deadline_after_ms(options_.io_timeout_ms);
  FrameHeader h;
  Status st = send_frame(l.socket, header(FrameType::kGetMeta, source_rank, version), nullptr, d);
  if (st.ok()) st = recv_header(l.socket, &h, d);
  if (st.ok() && h.type == static_cast<uint16_t>(FrameType::kError)) return read_error(l.socket, h, d);
  if (st.ok() && (h.type != static_cast<uint16_t>(FrameType::kMeta) || h.length > kMaxMetadataBytes))
    st = Status(StatusCode::kProtocolError, "expected version metadata from rank " + std::to_string(peer));
  std::string bytes;
  if (st.ok()) {
    bytes.resize(h.length);
    st = l.socket.recv_all(bytes.data(), bytes.size(), d);
  }
  if (st.ok()) st = decode_meta(bytes, out);
  if (st.ok() && out->source_rank != source_rank)
    st = Status(StatusCode::kProtocolError, "rank " + std::to_string(peer) + " described the wrong rank's state");
  if (!st.ok()) {
    l.socket.close();
    return checked(st);
  }
  return Status::Ok();
}

Status TcpTransport::receive(int peer, const TransferPlan& plan) {
  std::shared_ptr<Peer> keep;
  std::vector<Link*> ls;
  PEERSTATE_RETURN_IF_ERROR(links(peer, &keep, &ls));
  const VersionMeta& meta = plan.meta;
  const Layout& layout = *meta.layout;
  return on_every_link(ls, [&](Link& l) -> Status {
    std::lock_guard<std::mutex> lock(l.mutex);
    // Requests are pipelined, kRequestsInFlight per connection, so the peer
    // never waits for a round trip between chunks. The server answers in order.
    constexpr size_t kRequestsInFlight = 3;
    std::deque<uint32_t> requested;
    auto fail = [&](Status st) {
      for (uint32_t r : requested) plan.queue->give_back(r);
      l.socket.close();
      return checked(st);
    };
    uint32_t c;
    for (;;) {
      // Top up without blocking; block for a chunk only with nothing requested,
      // since chunks this link holds would never come back to the queue.
      while (requested.size() < kRequestsInFlight &&
             (requested.empty() ? plan.queue->take(&c) : plan.queue->try_take(&c))) {
        requested.push_back(c);
        Status st = send_frame(l.socket, header(FrameType::kGetChunk, meta.source_rank, meta.version, c), nullptr,
                               deadline_after_ms(options_.io_timeout_ms));
        if (!st.ok()) return fail(st);
      }
      if (requested.empty()) return Status::Ok();
      c = requested.front();
      const ChunkPlacement& chunk = layout.chunks[c];
      Deadline d = deadline_after_ms(options_.io_timeout_ms);
      FrameHeader h;
      Status st = recv_header(l.socket, &h, d);
      if (st.ok() && h.type == static_cast<uint16_t>(FrameType::kError)) st = read_error(l.socket, h, d);
      else if (st.ok() && (h.type != static_cast<uint16_t>(FrameType::kChunk) || h.chunk != c ||
                           h.version != meta.version || h.length != chunk.nbytes))
        st = Status(StatusCode::kProtocolError, "rank " + std::to_string(peer) + " answered chunk " +
                                                    std::to_string(c) + " with a mismatched frame");
      uint32_t crc = 0;
      if (st.ok()) st = recv_chunk(l.socket, layout, c, plan.region + chunk.offset, d, &crc);
      if (st.ok() && crc != meta.checksums[c])
        st = Status(StatusCode::kChecksumMismatch, "chunk " + std::to_string(c) + " from rank " +
                                                       std::to_string(peer) + " failed its CRC32C");
      if (!st.ok()) return fail(st);
      requested.pop_front();
      plan.queue->complete(c);
    }
  });
}

}  // namespace peerstate
