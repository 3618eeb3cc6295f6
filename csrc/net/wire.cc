#include "net/wire.h"

#include <algorithm>
#include <cstring>

#include "common/crc32c.h"

namespace peerstate {
namespace {

constexpr char kAuthMagic[8] = {'P', 'S', 'A', 'U', 'T', 'H', '0', '2'};
constexpr size_t kMaxErrorBytes = 64 * 1024;
constexpr size_t kPiece = 256 * 1024;  // encryption and decryption work in pieces that stay in cache

Status keyed(const std::string& secret, const char* label, const uint8_t* a, const uint8_t* b, const void* extra,
             size_t extra_bytes, Digest* out) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(a), kNonceBytes);
  msg.append(reinterpret_cast<const char*>(b), kNonceBytes);
  msg.append(static_cast<const char*>(extra), extra_bytes);
  return hmac_sha256(secret.data(), secret.size(), msg.data(), msg.size(), out);
}

void nonce_of(uint64_t counter, uint8_t nonce[Aead::kNonceBytes]) {
  std::memset(nonce, 0, Aead::kNonceBytes);
  std::memcpy(nonce + 4, &counter, sizeof(counter));
}

// The two frame keys of a connection, from both nonces (the client's makes them fresh).
Status frame_keys(const std::string& secret, const uint8_t* server_nonce, const uint8_t* client_nonce,
                  Digest* to_server, Digest* to_client) {
  PEERSTATE_RETURN_IF_ERROR(keyed(secret, "peerstate-frames-to-server", server_nonce, client_nonce, "", 0, to_server));
  return keyed(secret, "peerstate-frames-to-client", server_nonce, client_nonce, "", 0, to_client);
}

}  // namespace

const char* protection_name(FrameProtection protection) {
  switch (protection) {
    case FrameProtection::kAuthenticated:
      return "authenticated";
    case FrameProtection::kEncrypted:
      return "encrypted";
    case FrameProtection::kTrustedFabric:
      return "trusted-fabric";
  }
  return "unknown";
}

Status parse_protection(const std::string& name, FrameProtection* out) {
  for (FrameProtection p : {FrameProtection::kAuthenticated, FrameProtection::kEncrypted,
                            FrameProtection::kTrustedFabric})
    if (name == protection_name(p)) {
      *out = p;
      return Status::Ok();
    }
  return Status(StatusCode::kInvalidArgument, "frame protection must be 'authenticated' (the default), 'encrypted' "
                                              "or 'trusted-fabric' (no per-frame protection), not '" + name + "'");
}

Status Channel::start(FrameProtection protection, const Digest& send_key, const Digest& receive_key) {
  protection_ = protection;
  sent_ = received_ = 0;
  seal_.reset();
  open_.reset();
  if (protection == FrameProtection::kTrustedFabric) return Status::Ok();
  PEERSTATE_RETURN_IF_ERROR(Aead::create(send_key.data(), true, &seal_));
  return Aead::create(receive_key.data(), false, &open_);
}

Status Channel::send_frame(const FrameHeader& header, const void* payload, Deadline deadline) {
  const size_t length = payload != nullptr ? header.length : 0;
  if (!seal_) {
    PEERSTATE_RETURN_IF_ERROR(socket.send_all(&header, sizeof(header), deadline));
    return length > 0 ? socket.send_all(payload, length, deadline) : Status::Ok();
  }
  uint8_t nonce[Aead::kNonceBytes];
  nonce_of(sent_++, nonce);
  PEERSTATE_RETURN_IF_ERROR(seal_->begin(nonce));
  PEERSTATE_RETURN_IF_ERROR(seal_->aad(&header, sizeof(header)));
  PEERSTATE_RETURN_IF_ERROR(socket.send_all(&header, sizeof(header), deadline));
  // Piece by piece, so that the tag's pass and the send's read the same bytes while they are in cache.
  const auto* bytes = static_cast<const uint8_t*>(payload);
  if (protection_ == FrameProtection::kEncrypted) scratch_.resize(std::min(length, kPiece));
  for (size_t at = 0; at < length; at += kPiece) {
    const size_t n = std::min(kPiece, length - at);
    if (protection_ == FrameProtection::kAuthenticated) {
      PEERSTATE_RETURN_IF_ERROR(seal_->aad(bytes + at, n));
      PEERSTATE_RETURN_IF_ERROR(socket.send_all(bytes + at, n, deadline));
    } else {
      PEERSTATE_RETURN_IF_ERROR(seal_->update(bytes + at, scratch_.data(), n));
      PEERSTATE_RETURN_IF_ERROR(socket.send_all(scratch_.data(), n, deadline));
    }
  }
  uint8_t tag[Aead::kTagBytes];
  PEERSTATE_RETURN_IF_ERROR(seal_->seal(tag));
  return socket.send_all(tag, sizeof(tag), deadline);
}

Status Channel::recv_header(FrameHeader* header, Deadline deadline) {
  PEERSTATE_RETURN_IF_ERROR(socket.recv_all(header, sizeof(*header), deadline));
  if (header->magic != kFrameMagic)
    return Status(StatusCode::kProtocolError, "bad frame magic from " + socket.peer_name());
  if (header->type < static_cast<uint16_t>(FrameType::kPutBegin) || header->type > static_cast<uint16_t>(FrameType::kError))
    return Status(StatusCode::kProtocolError, "unknown frame type " + std::to_string(header->type));
  if (!open_) return Status::Ok();
  uint8_t nonce[Aead::kNonceBytes];
  nonce_of(received_++, nonce);
  PEERSTATE_RETURN_IF_ERROR(open_->begin(nonce));
  return open_->aad(header, sizeof(*header));
}

Status Channel::absorb(unsigned char* data, size_t nbytes) {
  if (!open_ || nbytes == 0) return Status::Ok();
  if (protection_ == FrameProtection::kAuthenticated) return open_->aad(data, nbytes);
  return open_->update(data, data, nbytes);  // decrypted in place
}

Status Channel::recv_payload(void* dst, size_t nbytes, Deadline deadline) {
  auto* bytes = static_cast<unsigned char*>(dst);
  for (size_t at = 0; at < nbytes; at += kPiece) {
    const size_t n = std::min(kPiece, nbytes - at);
    PEERSTATE_RETURN_IF_ERROR(socket.recv_all(bytes + at, n, deadline));
    PEERSTATE_RETURN_IF_ERROR(absorb(bytes + at, n));
  }
  return Status::Ok();
}

Status Channel::recv_chunk(const Layout& layout, size_t c, unsigned char* chunk_dst, Deadline deadline,
                           uint32_t* crc) {
  return fill_chunk(
      layout, c, chunk_dst,
      [&](unsigned char* dst, size_t max, size_t* got) {
        PEERSTATE_RETURN_IF_ERROR(socket.recv_some(dst, max, got, deadline));
        return absorb(dst, *got);
      },
      crc);
}

Status Channel::end_frame(Deadline deadline) {
  if (!open_) return Status::Ok();
  uint8_t tag[Aead::kTagBytes];
  PEERSTATE_RETURN_IF_ERROR(socket.recv_all(tag, sizeof(tag), deadline));
  Status st = open_->open(tag);
  if (!st.ok()) return Status(st.code(), socket.peer_name() + ": " + st.message());
  return Status::Ok();
}

Status send_error(Channel& c, const Status& error, Deadline deadline) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kError);
  h.status = static_cast<uint16_t>(error.code());
  std::string msg = error.message().substr(0, kMaxErrorBytes);
  h.length = msg.size();
  return c.send_frame(h, msg.data(), deadline);
}

Status read_error(Channel& c, const FrameHeader& header, Deadline deadline) {
  if (header.length > kMaxErrorBytes) return Status(StatusCode::kProtocolError, "oversized error frame");
  std::string msg(header.length, '\0');
  PEERSTATE_RETURN_IF_ERROR(c.recv_payload(msg.data(), msg.size(), deadline));
  PEERSTATE_RETURN_IF_ERROR(c.end_frame(deadline));
  StatusCode code = header.status > 0 && header.status <= static_cast<uint16_t>(StatusCode::kInternal)
                        ? static_cast<StatusCode>(header.status)
                        : StatusCode::kInternal;
  return Status(code, "peer " + c.peer_name() + ": " + msg);
}

Status expect_ack(Channel& c, Deadline deadline) {
  FrameHeader h;
  PEERSTATE_RETURN_IF_ERROR(c.recv_header(&h, deadline));
  if (h.type == static_cast<uint16_t>(FrameType::kError)) return read_error(c, h, deadline);
  if (h.type != static_cast<uint16_t>(FrameType::kAck) || h.length != 0)
    return Status(StatusCode::kProtocolError, "expected an acknowledgement from " + c.peer_name());
  return c.end_frame(deadline);
}

Status handshake_client(Channel& c, const std::string& secret, int32_t rank, FrameProtection protection,
                        Deadline deadline) {
  Socket& s = c.socket;
  char magic[8];
  uint8_t server_nonce[kNonceBytes], client_nonce[kNonceBytes];
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(magic, sizeof(magic), deadline));
  if (std::memcmp(magic, kAuthMagic, sizeof(magic)) != 0)
    return Status(StatusCode::kProtocolError, s.peer_name() + " is not a peerstate replication server of this "
                                                              "version");
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(server_nonce, sizeof(server_nonce), deadline));
  PEERSTATE_RETURN_IF_ERROR(random_bytes(client_nonce, sizeof(client_nonce)));
  uint8_t bound[5];  // rank and protection, covered by the proof
  std::memcpy(bound, &rank, 4);
  bound[4] = static_cast<uint8_t>(protection);
  Digest proof;
  PEERSTATE_RETURN_IF_ERROR(keyed(secret, "peerstate-client", server_nonce, client_nonce, bound, 5, &proof));
  uint8_t reply[kNonceBytes + 32 + 5];
  std::memcpy(reply, client_nonce, kNonceBytes);
  std::memcpy(reply + kNonceBytes, proof.data(), 32);
  std::memcpy(reply + kNonceBytes + 32, bound, 5);
  PEERSTATE_RETURN_IF_ERROR(s.send_all(reply, sizeof(reply), deadline));
  Digest answer, expected;
  Status st = s.recv_all(answer.data(), answer.size(), deadline);
  if (!st.ok())
    return Status(StatusCode::kAuthenticationError,
                  s.peer_name() + " closed the connection during the handshake: the job secrets or the frame "
                                  "protections differ? (" + st.message() + ")");
  PEERSTATE_RETURN_IF_ERROR(keyed(secret, "peerstate-server", client_nonce, server_nonce, bound + 4, 1, &expected));
  if (!digests_equal(answer.data(), expected.data(), answer.size()))
    return Status(StatusCode::kAuthenticationError, s.peer_name() + " does not know the job secret");
  Digest to_server, to_client;
  PEERSTATE_RETURN_IF_ERROR(frame_keys(secret, server_nonce, client_nonce, &to_server, &to_client));
  return c.start(protection, to_server, to_client);
}

Status handshake_server(Channel& c, const std::string& secret, FrameProtection protection, int32_t* client_rank,
                        Deadline deadline) {
  Socket& s = c.socket;
  uint8_t server_nonce[kNonceBytes];
  PEERSTATE_RETURN_IF_ERROR(random_bytes(server_nonce, sizeof(server_nonce)));
  PEERSTATE_RETURN_IF_ERROR(s.send_all(kAuthMagic, sizeof(kAuthMagic), deadline));
  PEERSTATE_RETURN_IF_ERROR(s.send_all(server_nonce, sizeof(server_nonce), deadline));
  uint8_t reply[kNonceBytes + 32 + 5];
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(reply, sizeof(reply), deadline));
  const uint8_t* bound = reply + kNonceBytes + 32;
  Digest expected;
  PEERSTATE_RETURN_IF_ERROR(keyed(secret, "peerstate-client", server_nonce, reply, bound, 5, &expected));
  if (!digests_equal(reply + kNonceBytes, expected.data(), expected.size()))
    return Status(StatusCode::kAuthenticationError, "client failed the job-secret challenge");
  if (bound[4] != static_cast<uint8_t>(protection))
    return Status(StatusCode::kAuthenticationError,
                  std::string("client asked for frame protection '") +
                      protection_name(static_cast<FrameProtection>(bound[4])) + "', this server uses '" +
                      protection_name(protection) + "': every rank of a job must use the same");
  Digest answer;
  PEERSTATE_RETURN_IF_ERROR(keyed(secret, "peerstate-server", reply, server_nonce, bound + 4, 1, &answer));
  PEERSTATE_RETURN_IF_ERROR(s.send_all(answer.data(), answer.size(), deadline));
  std::memcpy(client_rank, bound, 4);
  Digest to_server, to_client;
  PEERSTATE_RETURN_IF_ERROR(frame_keys(secret, server_nonce, reply, &to_server, &to_client));
  return c.start(protection, to_client, to_server);
}

}  // namespace peerstate
