#include "net/tcp_transport.h"

#include <algorithm>
#include <deque>
#include <thread>
#include <vector>

#include "common/thread_name.h"

namespace peerstate {

struct TcpTransport::Link {
  std::mutex mutex;  // one transfer step at a time per connection
  Channel channel;
  Clock::time_point used;  // the server closes a connection idle for its io timeout: reopen before that
};

struct TcpTransport::Peer {
  std::string host;
  int port = 0;
  std::vector<std::unique_ptr<Link>> links;
};

Status TcpTransport::create(const TcpOptions& options, std::unique_ptr<TcpTransport>* out) {
  if (options.credentials.rank() < 0)
    return Status(StatusCode::kInvalidArgument, "a transport needs its rank's credentials (Credentials)");
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

Status TcpTransport::links(int peer_rank, std::shared_ptr<Peer>* keep, std::vector<Link*>* out, size_t wanted) {
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
  const auto idle_limit = std::chrono::milliseconds(options_.io_timeout_ms / 2);
  wanted = std::max<size_t>(1, std::min(wanted, peer->links.size()));
  for (size_t i = 0; i < wanted; i++) {
    Link* l = peer->links[i].get();
    std::lock_guard<std::mutex> lock(l->mutex);
    if (l->channel.socket.valid() && (Clock::now() - l->used > idle_limit || l->channel.socket.stale()))
      l->channel.socket.close();  // the server closes idle connections: never send on one it may have closed
    if (!l->channel.socket.valid()) {
      Channel c;
      PEERSTATE_RETURN_IF_ERROR(checked(
          connect_to(peer->host, peer->port, deadline_after_ms(options_.connect_timeout_ms), &c.socket, &cancel_)));
      int32_t proved = -1;
      Status st = handshake_client(c, options_.credentials, options_.protection, &proved,
                                   deadline_after_ms(options_.connect_timeout_ms));
      if (st.ok() && proved != peer_rank)  // an address gone stale, or a peer posing as another rank
        st = Status(StatusCode::kAuthenticationError, peer->host + ":" + std::to_string(peer->port) +
                                                          " proved rank " + std::to_string(proved) + ", not the "
                                                          "rank it was given for");
      if (!st.ok())
        return checked(Status(st.code(), "rank " + std::to_string(peer_rank) + ": " + st.message()));
      l->channel = std::move(c);
    }
    l->used = Clock::now();
    out->push_back(l);
  }
  return Status::Ok();
}

namespace {

// Runs fn(link) on every link in its own thread; the first error wins.
template <typename Link, typename Fn>
Status on_every_link(const std::vector<Link*>& links, Fn fn) {
  std::vector<Status> results(links.size());
  std::vector<std::thread> threads;
  for (size_t i = 1; i < links.size(); i++) threads.emplace_back([&, i] {
    name_this_thread("ps-link");
    results[i] = fn(*links[i]);
  });
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
  PEERSTATE_RETURN_IF_ERROR(links(peer, &keep, &ls, plan.meta.layout->chunks.size()));
  const VersionMeta& meta = plan.meta;
  const Layout& layout = *meta.layout;
  auto fail = [&](Link& l, Status st) {
    l.channel.socket.close();  // the stream is in an unknown state: reconnect next time
    return checked(st);
  };
  {
    Link& l = *ls[0];
    std::lock_guard<std::mutex> lock(l.mutex);
    std::string bytes = encode_meta(meta);
    Deadline d = deadline_after_ms(options_.io_timeout_ms);
    Status st = l.channel.send_frame(
        make_header(FrameType::kPutBegin, meta.source_rank, meta.version, 0, bytes.size(), 0, plan.store),
        bytes.data(), d);
    if (st.ok()) st = expect_ack(l.channel, d);
    if (!st.ok()) return ends_stream(st) ? fail(l, st) : st;
  }
  Status st = on_every_link(ls, [&](Link& l) -> Status {
    std::lock_guard<std::mutex> lock(l.mutex);
    uint32_t c;
    while (plan.queue->take(&c)) {
      const ChunkPlacement& chunk = layout.chunks[c];
      Status s = l.channel.send_frame(make_header(FrameType::kPutChunk, meta.source_rank, meta.version, c,
                                                  chunk.nbytes, meta.checksums[c], plan.store),
                                      plan.region + chunk.offset - plan.region_base,
                                      deadline_after_ms(options_.io_timeout_ms));
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
  st = l.channel.send_frame(make_header(FrameType::kPutCommit, meta.source_rank, meta.version, 0, 0, 0, plan.store),
                            nullptr, d);
  if (st.ok()) st = expect_ack(l.channel, d);
  if (!st.ok() && ends_stream(st)) return fail(l, st);
  return st;
}

Status TcpTransport::describe(int peer, int source_rank, int64_t version, uint32_t store, VersionMeta* out) {
  std::shared_ptr<Peer> keep;
  std::vector<Link*> ls;
  PEERSTATE_RETURN_IF_ERROR(links(peer, &keep, &ls, 1));
  Link& l = *ls[0];
  std::lock_guard<std::mutex> lock(l.mutex);
  Deadline d = deadline_after_ms(options_.io_timeout_ms);
  FrameHeader h;
  FrameHeader request = make_header(FrameType::kGetMeta, source_rank, std::max<int64_t>(version, 0), 0, 0, 0, store);
  if (version < 0) request.status = kNewest;
  Status st = l.channel.send_frame(request, nullptr, d);
  if (st.ok()) st = l.channel.recv_header(&h, d);
  if (st.ok() && h.type == static_cast<uint16_t>(FrameType::kError)) return read_error(l.channel, h, d);
  if (st.ok() && (h.type != static_cast<uint16_t>(FrameType::kMeta) || h.length > kMaxMetadataBytes))
    st = Status(StatusCode::kProtocolError, "expected version metadata from rank " + std::to_string(peer));
  std::string bytes;
  if (st.ok()) {
    bytes.resize(h.length);
    st = l.channel.recv_payload(bytes.data(), bytes.size(), d);
  }
  if (st.ok()) st = l.channel.end_frame(d);
  if (st.ok()) st = decode_meta(bytes, out);
  if (st.ok() && out->source_rank != source_rank)
    st = Status(StatusCode::kProtocolError, "rank " + std::to_string(peer) + " described the wrong rank's state");
  if (!st.ok()) {
    l.channel.socket.close();
    return checked(st);
  }
  return Status::Ok();
}

Status TcpTransport::receive(int peer, const TransferPlan& plan) {
  std::shared_ptr<Peer> keep;
  std::vector<Link*> ls;
  PEERSTATE_RETURN_IF_ERROR(links(peer, &keep, &ls, plan.meta.layout->chunks.size()));
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
      l.channel.socket.close();
      return checked(st);
    };
    uint32_t c;
    for (;;) {
      // Top up without blocking; block for a chunk only with nothing requested,
      // since chunks this link holds would never come back to the queue.
      while (requested.size() < kRequestsInFlight &&
             (requested.empty() ? plan.queue->take(&c) : plan.queue->try_take(&c))) {
        requested.push_back(c);
        Status st = l.channel.send_frame(
            make_header(FrameType::kGetChunk, meta.source_rank, meta.version, c, 0, 0, plan.store), nullptr,
            deadline_after_ms(options_.io_timeout_ms));
        if (!st.ok()) return fail(st);
      }
      if (requested.empty()) return Status::Ok();
      c = requested.front();
      const ChunkPlacement& chunk = layout.chunks[c];
      Deadline d = deadline_after_ms(options_.io_timeout_ms);
      FrameHeader h;
      Status st = l.channel.recv_header(&h, d);
      if (st.ok() && h.type == static_cast<uint16_t>(FrameType::kError)) st = read_error(l.channel, h, d);
      else if (st.ok() && (h.type != static_cast<uint16_t>(FrameType::kChunk) || h.chunk != c ||
                           h.version != meta.version || h.length != chunk.nbytes))
        st = Status(StatusCode::kProtocolError, "rank " + std::to_string(peer) + " answered chunk " +
                                                    std::to_string(c) + " with a mismatched frame");
      uint32_t crc = 0;
      if (st.ok()) st = l.channel.recv_chunk(layout, c, plan.region + chunk.offset - plan.region_base, d, &crc);
      if (st.ok()) st = l.channel.end_frame(d);  // before the chunk counts: the tag covers it
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
