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
  // Nothing of the frame can be trusted without a store to check it against.
  if (parity == nullptr)
    return Status(StatusCode::kProtocolError, "rank " + std::to_string(c.peer_rank) +
                                                  " pushed a parity piece to a rank that holds no parity");
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kPutBegin: {
      VersionMeta meta;
      // The metadata describes the member's whole version; a piece is 1/(g - 1) of it.
      const size_t pieces = parity->members().size() > 1 ? parity->members().size() - 1 : 1;
      PEERSTATE_RETURN_IF_ERROR(read_put_meta(c, h, parity->block_bytes() * pieces, deadline, &meta));
      if (!meta.layout) return Status::Ok();
      Status st = parity->begin(meta);
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
