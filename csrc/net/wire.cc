#include "net/wire.h"

#include <algorithm>
#include <cstring>

#include "common/crc32c.h"

namespace peerstate {
namespace {

constexpr char kAuthMagic[8] = {'P', 'S', 'A', 'U', 'T', 'H', '0', '1'};
constexpr size_t kMaxErrorBytes = 64 * 1024;

Digest mac(const std::string& secret, const char* label, const uint8_t* a, const uint8_t* b, int32_t rank,
           bool with_rank) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(a), kNonceBytes);
  msg.append(reinterpret_cast<const char*>(b), kNonceBytes);
  if (with_rank) msg.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
  return hmac_sha256(secret.data(), secret.size(), msg.data(), msg.size());
}

}  // namespace

Status send_frame(Socket& s, const FrameHeader& header, const void* payload, Deadline deadline) {
  PEERSTATE_RETURN_IF_ERROR(s.send_all(&header, sizeof(header), deadline));
  if (header.length > 0 && payload != nullptr) PEERSTATE_RETURN_IF_ERROR(s.send_all(payload, header.length, deadline));
  return Status::Ok();
}

Status recv_header(Socket& s, FrameHeader* header, Deadline deadline) {
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(header, sizeof(*header), deadline));
  if (header->magic != kFrameMagic)
    return Status(StatusCode::kProtocolError, "bad frame magic from " + s.peer_name());
  if (header->type < static_cast<uint16_t>(FrameType::kPutBegin) || header->type > static_cast<uint16_t>(FrameType::kError))
    return Status(StatusCode::kProtocolError, "unknown frame type " + std::to_string(header->type));
  return Status::Ok();
}

Status send_error(Socket& s, const Status& error, Deadline deadline) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kError);
  h.status = static_cast<uint16_t>(error.code());
  std::string msg = error.message().substr(0, kMaxErrorBytes);
  h.length = msg.size();
  return send_frame(s, h, msg.data(), deadline);
}

Status read_error(Socket& s, const FrameHeader& header, Deadline deadline) {
  if (header.length > kMaxErrorBytes) return Status(StatusCode::kProtocolError, "oversized error frame");
  std::string msg(header.length, '\0');
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(msg.data(), msg.size(), deadline));
  StatusCode code = header.status > 0 && header.status <= static_cast<uint16_t>(StatusCode::kInternal)
                        ? static_cast<StatusCode>(header.status)
                        : StatusCode::kInternal;
  return Status(code, "peer " + s.peer_name() + ": " + msg);
}

Status expect_ack(Socket& s, Deadline deadline) {
  FrameHeader h;
  PEERSTATE_RETURN_IF_ERROR(recv_header(s, &h, deadline));
  if (h.type == static_cast<uint16_t>(FrameType::kError)) return read_error(s, h, deadline);
  if (h.type != static_cast<uint16_t>(FrameType::kAck) || h.length != 0)
    return Status(StatusCode::kProtocolError, "expected an acknowledgement from " + s.peer_name());
  return Status::Ok();
}

Status recv_chunk(Socket& s, const Layout& layout, size_t c, unsigned char* chunk_dst, Deadline deadline,
                  uint32_t* crc) {
  return fill_chunk(
      layout, c, chunk_dst,
      [&](unsigned char* dst, size_t max, size_t* got) { return s.recv_some(dst, max, got, deadline); }, crc);
}

Status handshake_client(Socket& s, const std::string& secret, int32_t rank, Deadline deadline) {
  char magic[8];
  uint8_t server_nonce[kNonceBytes], client_nonce[kNonceBytes];
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(magic, sizeof(magic), deadline));
  if (std::memcmp(magic, kAuthMagic, sizeof(magic)) != 0)
    return Status(StatusCode::kProtocolError, s.peer_name() + " is not a peerstate replication server");
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(server_nonce, sizeof(server_nonce), deadline));
  PEERSTATE_RETURN_IF_ERROR(random_bytes(client_nonce, sizeof(client_nonce)));
  Digest proof = mac(secret, "peerstate-client", server_nonce, client_nonce, rank, true);
  uint8_t reply[kNonceBytes + 32 + 4];
  std::memcpy(reply, client_nonce, kNonceBytes);
  std::memcpy(reply + kNonceBytes, proof.data(), 32);
  std::memcpy(reply + kNonceBytes + 32, &rank, 4);
  PEERSTATE_RETURN_IF_ERROR(s.send_all(reply, sizeof(reply), deadline));
  Digest answer;
  Status st = s.recv_all(answer.data(), answer.size(), deadline);
  if (!st.ok())
    return Status(StatusCode::kAuthenticationError,
                  s.peer_name() + " closed the connection during the handshake: the job secrets differ? (" +
                      st.message() + ")");
  if (!digests_equal(answer, mac(secret, "peerstate-server", client_nonce, server_nonce, 0, false)))
    return Status(StatusCode::kAuthenticationError, s.peer_name() + " does not know the job secret");
  return Status::Ok();
}

Status handshake_server(Socket& s, const std::string& secret, int32_t* client_rank, Deadline deadline) {
  uint8_t server_nonce[kNonceBytes];
  PEERSTATE_RETURN_IF_ERROR(random_bytes(server_nonce, sizeof(server_nonce)));
  PEERSTATE_RETURN_IF_ERROR(s.send_all(kAuthMagic, sizeof(kAuthMagic), deadline));
  PEERSTATE_RETURN_IF_ERROR(s.send_all(server_nonce, sizeof(server_nonce), deadline));
  uint8_t reply[kNonceBytes + 32 + 4];
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(reply, sizeof(reply), deadline));
  int32_t rank;
  std::memcpy(&rank, reply + kNonceBytes + 32, 4);
  Digest proof;
  std::memcpy(proof.data(), reply + kNonceBytes, 32);
  if (!digests_equal(proof, mac(secret, "peerstate-client", server_nonce, reply, rank, true)))
    return Status(StatusCode::kAuthenticationError, "client failed the job-secret challenge");
  Digest answer = mac(secret, "peerstate-server", reply, server_nonce, 0, false);
  PEERSTATE_RETURN_IF_ERROR(s.send_all(answer.data(), answer.size(), deadline));
  *client_rank = rank;
  return Status::Ok();
}

}  // namespace peerstate
