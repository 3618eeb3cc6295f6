// The tcp transport's wire format: handshake and frames (the version metadata
// they carry is encoded by store/version_meta.h).
//
// After the handshake a connection carries frames: a fixed 40-byte header,
// then `length` payload bytes. All integers are little-endian (the only byte
// order peerstate builds for; checked at compile time). Everything a peer
// sends is validated before it is used: unknown types, lengths over a bound,
// metadata that does not describe a consistent layout are protocol errors.
//
// Handshake (mutual HMAC-SHA256 over fresh nonces; the secret never travels):
//   server -> client  "PSAUTH01" | server_nonce[32]
//   client -> server  client_nonce[32] | HMAC(secret, "peerstate-client" | server_nonce | client_nonce | rank) | rank:i32
//   server -> client  HMAC(secret, "peerstate-server" | client_nonce | server_nonce)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "common/status.h"
#include "net/socket.h"
#include "store/version_meta.h"

namespace peerstate {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

constexpr uint32_t kFrameMagic = 0x31765350;  // "PSv1"
constexpr size_t kMaxMetadataBytes = 256u << 20;
constexpr size_t kNonceBytes = 32;

enum class FrameType : uint16_t {
  kPutBegin = 1,  // client: metadata of (source_rank, version) follows
  kPutChunk = 2,  // client: bytes of one chunk follow
  kPutCommit = 3, // client: every chunk was sent; commit when all arrived
  kGetMeta = 4,   // client: send metadata of (source_rank, version or -1 = newest)
  kGetChunk = 5,  // client: send one chunk
  kMeta = 6,      // server: metadata follows
  kChunk = 7,     // server: chunk bytes follow
  kAck = 8,       // server: done
  kError = 9,     // server: a message follows; the request failed
};

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t type = 0;
  uint16_t status = 0;  // StatusCode of a kError frame
  int32_t source_rank = -1;
  uint32_t chunk = 0;
  int64_t version = -1;
  uint64_t length = 0;  // payload bytes after the header
  uint32_t crc = 0;     // CRC32C of a chunk's segments (kPutChunk, kChunk)
  // Which of the server's stores a get reads: 0 holds this rank's own state and
  // the replicas it keeps for others, 1.. the other stores it serves (a rank's
  // data-parallel shares; TcpServer::serve). Pushes always go to store 0.
  uint32_t store = 0;
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader is a wire struct");

inline FrameHeader make_header(FrameType type, int32_t source_rank, int64_t version, uint32_t chunk = 0,
                               uint64_t length = 0, uint32_t crc = 0, uint32_t store = 0) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.source_rank = source_rank;
  h.version = version;
  h.chunk = chunk;
  h.length = length;
  h.crc = crc;
  h.store = store;
  return h;
}

// After an error with one of these codes the byte stream can no longer be
// trusted or continued: the connection must be closed.
inline bool ends_stream(const Status& st) {
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

Status send_frame(Socket& s, const FrameHeader& header, const void* payload, Deadline deadline);
// Receives a header and checks its magic and type (kProtocolError otherwise).
Status recv_header(Socket& s, FrameHeader* header, Deadline deadline);
// Sends a kError frame carrying `error`.
Status send_error(Socket& s, const Status& error, Deadline deadline);
// Receives a kAck, or turns a kError into its Status.
Status expect_ack(Socket& s, Deadline deadline);
// Reads the message of a kError whose header was received; returns it as a Status.
Status read_error(Socket& s, const FrameHeader& header, Deadline deadline);

// Receives chunk `c` (its nbytes) straight into `chunk_dst` (its place in a
// region, or a staging buffer), checksumming each piece as it lands, while it
// is still in cache: the CRC costs no second pass over memory. *crc gets the
// chunk's CRC32C.
Status recv_chunk(Socket& s, const Layout& layout, size_t c, unsigned char* chunk_dst, Deadline deadline,
                  uint32_t* crc);

Status handshake_client(Socket& s, const std::string& secret, int32_t rank, Deadline deadline);
Status handshake_server(Socket& s, const std::string& secret, int32_t* client_rank, Deadline deadline);

}  // namespace peerstate
