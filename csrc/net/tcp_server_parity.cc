// The holder side of a parity group's pushes: the same three frames as a
// replica's (kPutBegin, kPutChunk, kPutCommit), with FrameHeader::store
// kParityStore, folded into the ParityStore instead of landing in a region.
#include "net/tcp_server.h"

#include "net/tcp_server_connection.h"

namespace peerstate {

Status TcpServer::handle_parity_put(Connection& c, const FrameHeader& h) {
  const Deadline deadline = deadline_after_ms(options_.io_timeout_ms);
  Channel& channel = c.channel;
  ParityStore* parity = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    parity = parity_;
  }
  // A chunk or a commit cannot be checked without a store (and follows a begin it refused).
  if (parity == nullptr && static_cast<FrameType>(h.type) != FrameType::kPutBegin)
    return Status(StatusCode::kProtocolError, "rank " + std::to_string(c.peer_rank) +
                                                  " pushed a parity piece to a rank that holds no parity");
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kPutBegin: {
      VersionMeta meta;
      // The metadata describes the member's whole version, g - 1 pieces of at most a block each:
      // bounded by twice the two blocks (groups of up to 5; larger ones have smaller pieces).
      PEERSTATE_RETURN_IF_ERROR(read_put_meta(c, h, parity ? 2 * parity->reserved_bytes() : 0, deadline, &meta));
      if (!meta.layout) return Status::Ok();
      // A member that has not joined its group yet (starting, or a replacement) will: the
      // sender is told, with the stream intact, and asks again (Replicator::push_pieces).
      Status st = parity ? parity->begin(meta)
                         : Status(StatusCode::kNotFound, "rank " + std::to_string(options_.credentials.rank()) +
                                                             " holds no parity group yet");
      if (ends_stream(st)) return st;
      if (!st.ok()) return send_error(channel, st, deadline);
      return channel.send_frame(make_header(FrameType::kAck, meta.source_rank, meta.version), nullptr, deadline);
    }
    case FrameType::kPutChunk: {
      if (h.source_rank != c.peer_rank) return Status(StatusCode::kProtocolError, "chunk for another rank's state");
      ParityStore::ChunkFold fold;
      PEERSTATE_RETURN_IF_ERROR(parity->expect_chunk(h.source_rank, h.version, h.chunk, h.length, &fold));
      const Layout& layout = *fold.layout;
      if (c.parity_staging.size() < h.length) PEERSTATE_RETURN_IF_ERROR(c.parity_staging.allocate(h.length));
      uint32_t crc = 0;
      PEERSTATE_RETURN_IF_ERROR(channel.recv_chunk(layout, h.chunk, c.parity_staging.data(), deadline, &crc));
      PEERSTATE_RETURN_IF_ERROR(channel.end_frame(deadline));
      Status st = parity->fold(&fold, c.parity_staging.data(), crc);
      if (!st.ok()) server_log().write("parity", "rank " + std::to_string(c.peer_rank) + ": " + st.message());
      return Status::Ok();  // a corrupt chunk fails the version at commit; the stream is intact
    }
    case FrameType::kPutCommit:  // once the whole block is complete (ParityStore::commit)
      return commit_put(c, h, [&](Deadline until) { return parity->commit(h.source_rank, h.version, until); });
    default:
      return Status(StatusCode::kProtocolError, "unexpected frame type " + std::to_string(h.type));
  }
}

Status TcpServer::serve_rebuilt(int source_rank, int64_t version, ServedVersion* out) const {
  ParityStore* parity = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    parity = parity_;
  }
  if (parity == nullptr) return Status(StatusCode::kNotFound, "this rank holds no parity");
  std::shared_ptr<const RebuiltPiece> piece;
  PEERSTATE_RETURN_IF_ERROR(parity->rebuilt(source_rank, version, &piece));
  out->meta = piece->meta;
  out->data = piece->bytes.data();
  out->base = piece->piece.region_offset;
  out->first_chunk = piece->piece.first_chunk;
  out->end_chunk = piece->piece.end_chunk;
  out->keep_alive = piece;
  return Status::Ok();
}

}  // namespace peerstate
