#include "net/tcp_server.h"

#include "net/tcp_server_connection.h"

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <system_error>
#include <vector>

#include "common/crc32c.h"
#include "common/thread_name.h"

namespace peerstate {
namespace {

constexpr long kHandshakeMs = 5000;
constexpr size_t kMetadataFloorBytes = 1u << 20;  // metadata may also take 1/64 of a version's bytes
constexpr size_t kMetadataPieceBytes = 64u << 10;

}  // namespace

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

Status TcpServer::hold_parity(ParityStore* parity) {
  if (parity == nullptr) return Status(StatusCode::kInvalidArgument, "hold_parity() takes a parity store");
  std::lock_guard<std::mutex> lock(mutex_);
  if (parity_ != nullptr) return Status(StatusCode::kInvalidArgument, "this server already holds a parity store");
  parity_ = parity;
  return Status::Ok();
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
  if (options.credentials.rank() < 0)
    return Status(StatusCode::kInvalidArgument, "a server needs its rank's credentials (Credentials)");
  if (host.empty())
    return Status(StatusCode::kInvalidArgument,
                  "give the address to listen on (e.g. 127.0.0.1 or this node's interface address); "
                  "listening on all interfaces must be asked for explicitly with 0.0.0.0");
  std::unique_ptr<TcpServer> server(new TcpServer(options, replicas, own));
  PEERSTATE_RETURN_IF_ERROR(listen_on(host, port, &server->listener_, &server->port_));
  server->acceptor_ = std::thread([s = server.get()] {
    name_this_thread("ps-accept");
    s->accept_loop();
  });
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
    for (auto& c : connections_) c->channel.socket.shutdown();
  }
  reap(true);
  listener_.close();
}

TcpServerStats TcpServer::stats() const {
  TcpServerStats s;
  s.accepted = accepted_.load();
  s.rejected = rejected_.load();
  s.refused = refused_.load();
  s.evicted = evicted_.load();
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

bool TcpServer::admit(std::string* why) {
  size_t total = 0;
  for (const auto& c : connections_)
    if (!c->done.load() && !c->evicted.load()) total++;
  if (total >= options_.max_connections) *why = std::to_string(total) + " connections are open already";
  return why->empty();
}

TcpServer::Connection* TcpServer::handshake_to_evict(const std::string* source) const {
  std::map<std::string, std::vector<Connection*>> by_source;  // each in accept order: oldest first
  size_t total = 0;
  for (const auto& c : connections_) {
    if (c->done.load() || c->authenticated.load() || c->evicted.load()) continue;
    by_source[c->source].push_back(c.get());
    total++;
  }
  if (source != nullptr) {
    auto own = by_source.find(*source);
    if (own != by_source.end() && own->second.size() >= options_.max_handshaking_per_source)
      return own->second.front();
    if (total < options_.max_handshaking) return nullptr;
  }
  if (by_source.empty()) return nullptr;
  auto busiest = std::max_element(by_source.begin(), by_source.end(), [](const auto& a, const auto& b) {
    return a.second.size() < b.second.size();
  });
  return busiest->second.front();
}

void TcpServer::evict(Connection* victim, const std::string& why) {
  victim->evicted = true;
  victim->channel.socket.shutdown();  // its handshake fails at once; its thread ends and is reaped
  evicted_++;
  const long held_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - victim->since).count();
  server_log().write("evicted", "closing a connection from " + victim->name + " still in its handshake after " +
                             std::to_string(held_ms) + " ms: " + why);
}

void TcpServer::accept_loop() {
  long backoff_ms = 0;
  while (!stopping_.load()) {
    Socket socket;
    Status st = accept_from(listener_, deadline_after_ms(200), &socket);
    reap(false);
    if (!st.ok()) {
      if (st.code() == StatusCode::kTimeout || stopping_.load()) continue;
      // Descriptors exhausted, say: accepting again at once would fail at once. A
      // handshake that holds one gives it up, so that the next in the backlog gets it.
      bool freed = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (Connection* victim = handshake_to_evict(nullptr)) {
          evict(victim, "accept found no free descriptor");
          freed = true;
        }
      }
      backoff_ms = freed ? 10 : std::min<long>(1000, backoff_ms ? 2 * backoff_ms : 10);
      server_log().write("accept", "accept failed: " + st.message() + "; retrying in " + std::to_string(backoff_ms) + " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      continue;
    }
    backoff_ms = 0;
    auto c = std::make_unique<Connection>();
    c->channel.socket = std::move(socket);
    c->name = c->channel.peer_name();
    c->source = c->name.substr(0, c->name.rfind(':'));
    Connection* raw = c.get();
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_.load()) break;
    std::string why;
    if (!admit(&why)) {
      refused_++;
      server_log().write("refused", "refusing a connection from " + raw->name + ": " + why);
      continue;  // closed as it goes out of scope
    }
    if (Connection* victim = handshake_to_evict(&raw->source))
      evict(victim, "room for a newer one from " + raw->name);
    try {
      raw->thread = std::thread([this, raw] {
        name_this_thread("ps-serve");
        serve_connection(raw);
      });
    } catch (const std::system_error& error) {  // threads exhausted (pids.max, RLIMIT_NPROC): refuse, never abort
      refused_++;
      server_log().write("thread", "refusing a connection from " + raw->name + ": no thread to serve it (" + error.what() +
                                ")");
      continue;
    }
    connections_.push_back(std::move(c));
  }
}

void TcpServer::serve_connection(Connection* c) {
  // A client must finish the handshake quickly: a silent or slow one is not held open.
  Status st = handshake_server(c->channel, options_.credentials, options_.protection, &c->peer_rank,
                               deadline_after_ms(std::min<long>(options_.io_timeout_ms, kHandshakeMs)));
  if (st.ok() && c->evicted.load()) st = Status(StatusCode::kBusy, "evicted at the end of its handshake");
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t same_peer = 0;
    for (const auto& other : connections_)
      if (other.get() != c && !other->done.load() && other->authenticated.load() && other->peer_rank == c->peer_rank)
        same_peer++;
    if (same_peer >= options_.max_per_peer) {
      refused_++;
      st = Status(StatusCode::kBusy, "rank " + std::to_string(c->peer_rank) + " already has " +
                                         std::to_string(same_peer) + " connections here");
    } else {
      c->authenticated = true;
    }
  }
  if (!st.ok()) {
    if (!stopping_.load() && !c->evicted.load()) {  // an eviction was counted and logged by evict()
      if (st.code() != StatusCode::kBusy) rejected_++;
      server_log().write("handshake", "closing connection from " + c->name + ": " + st.message());
    }
    c->channel.socket.close();
    c->done = true;
    return;
  }
  accepted_++;
  for (;;) {
    FrameHeader h;
    // An idle connection is closed after the io timeout (clients reopen theirs
    // before that); stop() wakes the wait through shutdown().
    st = c->channel.recv_header(&h, deadline_after_ms(options_.io_timeout_ms));
    if (st.ok()) st = handle(*c, h);
    if (!st.ok()) {
      const bool quiet = stopping_.load() || st.code() == StatusCode::kConnectionError;
      if (!quiet) {
        if (st.code() == StatusCode::kProtocolError || st.code() == StatusCode::kAuthenticationError) rejected_++;
        server_log().write("connection", "closing connection from rank " + std::to_string(c->peer_rank) + " (" + c->name +
                                      "): " + st.message());
      }
      break;
    }
  }
  c->channel.socket.close();
  if (c->staging.data() != nullptr) (void)replicas_->engine()->unpin(c->staging.data());
  c->done = true;
}

Status TcpServer::read_put_meta(Connection& c, const FrameHeader& h, size_t reserved_bytes, Deadline deadline,
                                VersionMeta* meta) {
  // Metadata is bounded by what the sender's reservation allows, and read in pieces
  // of kMetadataPieceBytes: what is allocated follows what arrived, not what was
  // announced (a connection that announces the bound and sends nothing holds one piece).
  const size_t limit = std::min(kMaxMetadataBytes, std::max(kMetadataFloorBytes, reserved_bytes / 64));
  if (h.length > limit)
    return Status(StatusCode::kProtocolError, "metadata of " + std::to_string(h.length) + " bytes is over the " +
                                                  std::to_string(limit) + " this holder allows rank " +
                                                  std::to_string(c.peer_rank));
  std::string bytes;
  while (bytes.size() < h.length) {
    const size_t at = bytes.size();
    bytes.resize(at + std::min<size_t>(h.length - at, kMetadataPieceBytes));
    PEERSTATE_RETURN_IF_ERROR(c.channel.recv_payload(bytes.data() + at, bytes.size() - at, deadline));
  }
  PEERSTATE_RETURN_IF_ERROR(c.channel.end_frame(deadline));
  Status st;
  {
    // One decode at a time: a layout costs several times its metadata's bytes.
    std::lock_guard<std::mutex> lock(decode_mutex_);
    st = decode_meta(bytes, meta);
  }
  if (st.ok() && meta->source_rank != c.peer_rank)
    st = Status(StatusCode::kProtocolError, "rank " + std::to_string(c.peer_rank) +
                                                " tried to push the state of rank " + std::to_string(meta->source_rank));
  if (st.ok()) return st;
  // The frame was read whole: the stream goes on, and the sender gets the error.
  meta->layout.reset();
  return ends_stream(st) ? st : send_error(c.channel, st, deadline);
}

Status TcpServer::commit_put(Connection& c, const FrameHeader& h, const std::function<Status(Deadline)>& commit) {
  if (h.source_rank != c.peer_rank) return Status(StatusCode::kProtocolError, "commit of another rank's state");
  const Deadline deadline = deadline_after_ms(options_.io_timeout_ms);
  PEERSTATE_RETURN_IF_ERROR(c.channel.end_frame(deadline));
  // Wait in slices, so that stop() is not held up by a commit that waits for
  // chunks (or, in a parity block, other members' pieces) which will never come.
  Status st;
  do {
    st = commit(std::min(deadline, deadline_after_ms(100)));
  } while (st.code() == StatusCode::kTimeout && Clock::now() < deadline && !stopping_.load());
  if (!st.ok()) return send_error(c.channel, st, deadline);
  return c.channel.send_frame(make_header(FrameType::kAck, h.source_rank, h.version), nullptr, deadline);
}

Status TcpServer::handle(Connection& c, const FrameHeader& h) {
  const Deadline deadline = deadline_after_ms(options_.io_timeout_ms);
  Channel& channel = c.channel;
  const auto type = static_cast<FrameType>(h.type);
  const bool put = type == FrameType::kPutBegin || type == FrameType::kPutChunk || type == FrameType::kPutCommit;
  if (put && h.store == kParityStore) return handle_parity_put(c, h);
  if (put && h.store != 0)
    return Status(StatusCode::kProtocolError, "a push names store " + std::to_string(h.store) +
                                                  " (pushes go to store 0, the replicas, or to the parity store)");
  switch (type) {
    case FrameType::kPutBegin: {
      VersionMeta meta;
      PEERSTATE_RETURN_IF_ERROR(read_put_meta(c, h, replicas_->reservation(c.peer_rank), deadline, &meta));
      if (!meta.layout) return Status::Ok();  // refused, and the sender told
      Status st = replicas_->begin(meta);
      if (ends_stream(st)) return st;
      if (!st.ok()) return send_error(channel, st, deadline);
      return channel.send_frame(make_header(FrameType::kAck, meta.source_rank, meta.version), nullptr, deadline);
    }
    case FrameType::kPutChunk: {
      if (h.source_rank != c.peer_rank)
        return Status(StatusCode::kProtocolError, "chunk for another rank's state");
      // Any mismatch here closes the connection: the payload that follows
      // cannot be skipped safely when its announced length is a lie.
      ReplicaStore::ChunkWrite write;
      // A write that stalls is cut when the source's next version needs its region (see ReplicaStore::begin).
      PEERSTATE_RETURN_IF_ERROR(replicas_->expect_chunk(h.source_rank, h.version, h.chunk, h.length, &write,
                                                        [&c] { c.channel.socket.shutdown(); }));
      const Layout& layout = *write.version->meta.layout;
      const ChunkPlacement& chunk = layout.chunks[h.chunk];
      unsigned char* place = write.version->region.data() + chunk.offset;
      uint32_t crc = 0;
      if (replicas_->device() == kHostDevice) {
        PEERSTATE_RETURN_IF_ERROR(channel.recv_chunk(layout, h.chunk, place, deadline, &crc));
        PEERSTATE_RETURN_IF_ERROR(channel.end_frame(deadline));
      } else {  // device replica: land in pinned staging, verify there, then copy up
        PEERSTATE_RETURN_IF_ERROR(ensure_staging(c, chunk.nbytes));
        PEERSTATE_RETURN_IF_ERROR(channel.recv_chunk(layout, h.chunk, c.staging.data(), deadline, &crc));
        PEERSTATE_RETURN_IF_ERROR(channel.end_frame(deadline));
        DeviceCopy copy{c.staging.data(), place, chunk.nbytes};
        PEERSTATE_RETURN_IF_ERROR(replicas_->engine()->to_device(replicas_->device(), &copy, 1));
      }
      Status st = replicas_->chunk_arrived(&write, crc);
      if (!st.ok()) server_log().write("chunk", "rank " + std::to_string(c.peer_rank) + ": " + st.message());
      return Status::Ok();  // a corrupt chunk fails the version at commit; the stream is intact
    }
    case FrameType::kPutCommit:
      return commit_put(c, h, [&](Deadline until) { return replicas_->commit(h.source_rank, h.version, until); });
    case FrameType::kGetMeta:
    case FrameType::kGetChunk:
      if (h.length != 0) return Status(StatusCode::kProtocolError, "request with a payload");
      PEERSTATE_RETURN_IF_ERROR(channel.end_frame(deadline));
      if (h.version < 0 && !(h.type == static_cast<uint16_t>(FrameType::kGetMeta) && h.status == kNewest))
        return Status(StatusCode::kProtocolError, "request for version " + std::to_string(h.version) +
                                                      " (the newest is asked for explicitly)");
      return serve_get(c, h);
    default:
      return Status(StatusCode::kProtocolError, "unexpected frame type " + std::to_string(h.type) + " from a client");
  }
}

Status TcpServer::serve_get(Connection& c, const FrameHeader& h) {
  const Deadline deadline = deadline_after_ms(options_.io_timeout_ms);
  const int64_t version = h.status == kNewest ? -1 : h.version;
  ServedVersion served;
  Status st;
  const int32_t rank = options_.credentials.rank();
  if (h.source_rank == rank && h.store != kParityStore) {
    SnapshotStore* own = own_store(h.store);
    VersionView view;
    st = own == nullptr ? Status(StatusCode::kNotFound, "rank " + std::to_string(rank) + " serves no store " +
                                                            std::to_string(h.store) + " of its own state")
                        : own->view(version, &view, [&c] { c.channel.socket.shutdown(); });
    if (st.ok() && view.checksums.empty())
      st = Status(StatusCode::kUnavailable, "this rank's snapshots have checksums off; they cannot be served");
    if (st.ok()) {
      served.meta = meta_of(options_.credentials.rank(), view);
      served.data = view.data;
      // The slot is not reused while its bytes are sent, unless the owner needs it: then
      // the socket is shut down (the revoke above), the send fails and the reader gets an error.
      served.keep_alive = view.pin;
    }
  } else if (h.store == kParityStore) {
    st = serve_rebuilt(h.source_rank, version, &served);
  } else if (h.store != 0) {
    st = Status(StatusCode::kNotFound, "replicas of other ranks are kept in store 0 only (asked for store " +
                                           std::to_string(h.store) + ")");
  } else {
    std::shared_ptr<const ReplicaVersion> replica;
    st = replicas_->get(h.source_rank, version, &replica, [&c] { c.channel.socket.shutdown(); });
    if (st.ok()) {
      served.meta = replica->meta;
      served.data = replica->region.data();
      served.device = replica->region.device();
      served.keep_alive = replica;
    }
  }
  if (!st.ok()) return send_error(c.channel, st, deadline);

  if (static_cast<FrameType>(h.type) == FrameType::kGetMeta) {
    std::string bytes = encode_meta(served.meta);
    return c.channel.send_frame(
        make_header(FrameType::kMeta, h.source_rank, served.meta.version, 0, bytes.size(), 0, h.store), bytes.data(),
        deadline);
  }
  const Layout& layout = *served.meta.layout;
  if (h.chunk >= layout.chunks.size())
    return send_error(c.channel,
                      Status(StatusCode::kInvalidArgument, "chunk " + std::to_string(h.chunk) + " out of range"),
                      deadline);
  if (h.chunk < served.first_chunk || h.chunk >= served.end_chunk)
    return send_error(c.channel,
                      Status(StatusCode::kNotFound, "chunk " + std::to_string(h.chunk) + " of rank " +
                                                        std::to_string(h.source_rank) + " is not in the piece held here"),
                      deadline);
  const ChunkPlacement& chunk = layout.chunks[h.chunk];
  const unsigned char* payload = served.data + chunk.offset - served.base;
  if (served.device != kHostDevice) {  // device replica: down through pinned staging
    Status staged = ensure_staging(c, chunk.nbytes);
    DeviceCopy copy{c.staging.data(), const_cast<unsigned char*>(payload), chunk.nbytes};
    if (staged.ok()) staged = replicas_->engine()->to_host(served.device, &copy, 1);
    if (!staged.ok()) return send_error(c.channel, staged, deadline);
    payload = c.staging.data();
  }
  return c.channel.send_frame(make_header(FrameType::kChunk, h.source_rank, served.meta.version, h.chunk, chunk.nbytes,
                                          served.meta.checksums[h.chunk], h.store),
                              payload, deadline);
}

}  // namespace peerstate
