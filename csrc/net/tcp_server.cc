#include "net/tcp_server.h"

#include <cstdio>

#include "common/crc32c.h"

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

}  // namespace

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
    : options_(options), replicas_(replicas) {
  if (own != nullptr) own_[0] = own;
}

Status TcpServer::serve(uint32_t index, SnapshotStore* snapshots) {
  if (index == 0 || snapshots == nullptr)
    return Status(StatusCode::kInvalidArgument, "serve() takes a store and an index >= 1 (store 0 is given to start())");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!own_.emplace(index, snapshots).second)
    return Status(StatusCode::kInvalidArgument, "store " + std::to_string(index) + " is already served");
  return Status::Ok();
}

SnapshotStore* TcpServer::own_store(uint32_t index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = own_.find(index);
  return it == own_.end() ? nullptr : it->second;
}

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
    raw->thread = std::thread([this, raw] { serve_connection(raw); });
  }
}

void TcpServer::serve_connection(Connection* c) {
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
      if (ends_stream(st)) return st;
      if (!st.ok()) return send_error(c.socket, st, deadline);
      return send_frame(c.socket, make_header(FrameType::kAck, meta.source_rank, meta.version), nullptr, deadline);
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
      return send_frame(c.socket, make_header(FrameType::kAck, h.source_rank, h.version), nullptr, deadline);
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
  if (h.source_rank == options_.rank) {
    SnapshotStore* own = own_store(h.store);
    VersionView view;
    st = own == nullptr ? Status(StatusCode::kNotFound, "rank " + std::to_string(options_.rank) + " serves no store " +
                                                            std::to_string(h.store) + " of its own state")
                        : own->view(h.version, &view);
    if (st.ok() && view.checksums.empty())
      st = Status(StatusCode::kUnavailable, "this rank's snapshots have checksums off; they cannot be served");
    if (st.ok()) {
      served.meta = meta_of(options_.rank, view);
      served.data = view.data;
    }
  } else if (h.store != 0) {
    st = Status(StatusCode::kNotFound, "replicas of other ranks are kept in store 0 only (asked for store " +
                                           std::to_string(h.store) + ")");
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
    return send_frame(c.socket, make_header(FrameType::kMeta, h.source_rank, served.meta.version, 0, bytes.size(), 0, h.store),
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
                    make_header(FrameType::kChunk, h.source_rank, served.meta.version, h.chunk, chunk.nbytes,
                                served.meta.checksums[h.chunk], h.store),
                    payload, deadline);
}

}  // namespace peerstate
