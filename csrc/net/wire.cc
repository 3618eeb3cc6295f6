#include "net/wire.h"

#include <algorithm>
#include <cstring>

#include "common/crc32c.h"

namespace peerstate {
namespace {

constexpr char kAuthMagic[8] = {'P', 'S', 'A', 'U', 'T', 'H', '0', '3'};
constexpr size_t kMaxErrorBytes = 64 * 1024;
constexpr size_t kPiece = 256 * 1024;  // encryption and decryption work in pieces that stay in cache

void nonce_of(uint64_t counter, uint8_t nonce[Aead::kNonceBytes]) {
  std::memset(nonce, 0, Aead::kNonceBytes);
  std::memcpy(nonce + 4, &counter, sizeof(counter));
}

constexpr size_t kShareBytes = 32;
constexpr size_t kSignatureBytes = 64;
constexpr size_t kClientBytes = kShareBytes + 1 + kCertificateBytes;  // before its signature

// What one end signs: its label, then every byte of the handshake so far.
Status sign_exchange(const Credentials& own, const char* label, const std::string& exchange, Signature* out) {
  const std::string message = label + exchange;
  return ed25519_sign(own.private_key, message.data(), message.size(), out);
}

// The peer's certificate (from `bytes`) is the job's, and it signed the exchange with the certified key.
Status check_peer(const Credentials& own, const uint8_t* bytes, const char* label, const std::string& exchange,
                  const uint8_t* signature, Certificate* out) {
  *out = decode_certificate(bytes);
  PEERSTATE_RETURN_IF_ERROR(check_certificate(own.job_key, *out));
  Signature sig;
  std::memcpy(sig.data(), signature, sig.size());
  const std::string message = label + exchange;
  Status st = ed25519_verify(out->key, message.data(), message.size(), sig);
  if (!st.ok())
    return Status(StatusCode::kAuthenticationError, "the peer showed rank " + std::to_string(out->rank) +
                                                        "'s certificate without its key (" + st.message() + ")");
  return Status::Ok();
}

// The two frame keys of a connection, from the shared secret of both fresh shares.
Status frame_keys(const PrivateKey& own_share, const uint8_t* peer_share, const uint8_t* server_share,
                  const uint8_t* client_share, Digest* to_server, Digest* to_client) {
  PublicKey peer;
  std::memcpy(peer.data(), peer_share, peer.size());
  Digest shared;
  PEERSTATE_RETURN_IF_ERROR(x25519_shared(own_share, peer, &shared));
  std::string shares(reinterpret_cast<const char*>(server_share), kShareBytes);
  shares.append(reinterpret_cast<const char*>(client_share), kShareBytes);
  const std::string to_server_label = "peerstate-frames-to-server" + shares;
  const std::string to_client_label = "peerstate-frames-to-client" + shares;
  PEERSTATE_RETURN_IF_ERROR(
      hmac_sha256(shared.data(), shared.size(), to_server_label.data(), to_server_label.size(), to_server));
  return hmac_sha256(shared.data(), shared.size(), to_client_label.data(), to_client_label.size(), to_client);
}

Status fresh_share(PrivateKey* key, uint8_t public_share[kShareBytes]) {
  PEERSTATE_RETURN_IF_ERROR(random_bytes(key->data(), key->size()));
  PublicKey share;
  PEERSTATE_RETURN_IF_ERROR(x25519_public_key(*key, &share));
  std::memcpy(public_share, share.data(), kShareBytes);
  return Status::Ok();
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

Status handshake_client(Channel& c, const Credentials& credentials, FrameProtection protection, int32_t* peer_rank,
                        Deadline deadline) {
  Socket& s = c.socket;
  uint8_t hello[sizeof(kAuthMagic) + kShareBytes];
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(hello, sizeof(hello), deadline));
  if (std::memcmp(hello, kAuthMagic, sizeof(kAuthMagic)) != 0)
    return Status(StatusCode::kProtocolError, s.peer_name() + " is not a peerstate replication server of this "
                                                              "version");
  const uint8_t* server_share = hello + sizeof(kAuthMagic);
  PrivateKey own_share;
  uint8_t reply[kClientBytes + kSignatureBytes];
  PEERSTATE_RETURN_IF_ERROR(fresh_share(&own_share, reply));
  reply[kShareBytes] = static_cast<uint8_t>(protection);
  encode_certificate(credentials.certificate, reply + kShareBytes + 1);
  std::string exchange(reinterpret_cast<const char*>(hello), sizeof(hello));
  exchange.append(reinterpret_cast<const char*>(reply), kClientBytes);
  Signature signature;
  PEERSTATE_RETURN_IF_ERROR(sign_exchange(credentials, "peerstate-client", exchange, &signature));
  std::memcpy(reply + kClientBytes, signature.data(), signature.size());
  PEERSTATE_RETURN_IF_ERROR(s.send_all(reply, sizeof(reply), deadline));
  exchange.append(reinterpret_cast<const char*>(signature.data()), signature.size());

  uint8_t answer[kCertificateBytes + kSignatureBytes];
  Status st = s.recv_all(answer, sizeof(answer), deadline);
  if (!st.ok())
    return Status(StatusCode::kAuthenticationError,
                  s.peer_name() + " closed the connection during the handshake: not certified by the same job "
                                  "secret, or the frame protections differ? (" + st.message() + ")");
  exchange.append(reinterpret_cast<const char*>(answer), kCertificateBytes);
  Certificate server;
  st = check_peer(credentials, answer, "peerstate-server", exchange, answer + kCertificateBytes, &server);
  if (!st.ok()) return Status(st.code(), s.peer_name() + ": " + st.message());
  Digest to_server, to_client;
  PEERSTATE_RETURN_IF_ERROR(frame_keys(own_share, server_share, server_share, reply, &to_server, &to_client));
  *peer_rank = server.rank;
  return c.start(protection, to_server, to_client);
}

Status handshake_server(Channel& c, const Credentials& credentials, FrameProtection protection, int32_t* peer_rank,
                        Deadline deadline) {
  Socket& s = c.socket;
  PrivateKey own_share;
  uint8_t hello[sizeof(kAuthMagic) + kShareBytes];
  std::memcpy(hello, kAuthMagic, sizeof(kAuthMagic));
  PEERSTATE_RETURN_IF_ERROR(fresh_share(&own_share, hello + sizeof(kAuthMagic)));
  PEERSTATE_RETURN_IF_ERROR(s.send_all(hello, sizeof(hello), deadline));
  uint8_t reply[kClientBytes + kSignatureBytes];
  PEERSTATE_RETURN_IF_ERROR(s.recv_all(reply, sizeof(reply), deadline));
  std::string exchange(reinterpret_cast<const char*>(hello), sizeof(hello));
  exchange.append(reinterpret_cast<const char*>(reply), kClientBytes);
  Certificate client;
  Status st = check_peer(credentials, reply + kShareBytes + 1, "peerstate-client", exchange, reply + kClientBytes,
                         &client);
  if (!st.ok()) return Status(st.code(), "client failed the handshake: " + st.message());
  if (reply[kShareBytes] != static_cast<uint8_t>(protection))
    return Status(StatusCode::kAuthenticationError,
                  std::string("client asked for frame protection '") +
                      protection_name(static_cast<FrameProtection>(reply[kShareBytes])) + "', this server uses '" +
                      protection_name(protection) + "': every rank of a job must use the same");
  exchange.append(reinterpret_cast<const char*>(reply + kClientBytes), kSignatureBytes);
  uint8_t answer[kCertificateBytes + kSignatureBytes];
  encode_certificate(credentials.certificate, answer);
  exchange.append(reinterpret_cast<const char*>(answer), kCertificateBytes);
  Signature signature;
  PEERSTATE_RETURN_IF_ERROR(sign_exchange(credentials, "peerstate-server", exchange, &signature));
  std::memcpy(answer + kCertificateBytes, signature.data(), signature.size());
  PEERSTATE_RETURN_IF_ERROR(s.send_all(answer, sizeof(answer), deadline));
  Digest to_server, to_client;
  PEERSTATE_RETURN_IF_ERROR(frame_keys(own_share, reply, hello + sizeof(kAuthMagic), reply, &to_server, &to_client));
  *peer_rank = client.rank;
  return c.start(protection, to_client, to_server);
}

}  // namespace peerstate
