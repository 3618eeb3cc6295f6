// The tcp transport's wire format: handshake, frames, version metadata.
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

#include "core/layout.h"
#include "core/snapshot_store.h"
#include "core/sha256.h"
#include "core/socket.h"
#include "core/status.h"

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
  uint32_t reserved = 0;
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader is a wire struct");

Status send_frame(Socket& s, const FrameHeader& header, const void* payload, Deadline deadline);
// Receives a header and checks its magic and type (kProtocolError otherwise).
Status recv_header(Socket& s, FrameHeader* header, Deadline deadline);
// Sends a kError frame carrying `error`.
Status send_error(Socket& s, const Status& error, Deadline deadline);
// Receives a kAck, or turns a kError into its Status.
Status expect_ack(Socket& s, Deadline deadline);
// Reads the message of a kError whose header was received; returns it as a Status.
Status read_error(Socket& s, const FrameHeader& header, Deadline deadline);

// The description of one version that travels with it. The layout is rebuilt
// from buffers + chunk_bytes on arrival, never taken from the wire.
struct VersionMeta {
  int32_t source_rank = -1;
  int64_t version = -1;
  size_t chunk_bytes = 0;
  std::vector<BufferPlacement> buffers;  // name, nbytes, device, dtype (offsets from the layout)
  std::vector<uint32_t> checksums;       // one per chunk
  std::shared_ptr<const Layout> layout;
};

// The metadata of a committed snapshot of `source_rank`, as it travels.
VersionMeta meta_of(int32_t source_rank, const VersionView& view);

// Fills meta.layout from meta.buffers and meta.chunk_bytes; kProtocolError when
// the checksum count does not match the chunk count.
Status finish_meta(VersionMeta* meta);
std::string encode_meta(const VersionMeta& meta);
Status decode_meta(const std::string& bytes, VersionMeta* out);
// Receives chunk `c` (its nbytes) straight into `chunk_dst` (its place in a
// region, or a staging buffer), checksumming each piece as it lands, while it
// is still in cache: the CRC costs no second pass over memory. *crc gets the
// chunk's CRC32C.
Status recv_chunk(Socket& s, const Layout& layout, size_t c, unsigned char* chunk_dst, Deadline deadline,
                  uint32_t* crc);

Status handshake_client(Socket& s, const std::string& secret, int32_t rank, Deadline deadline);
Status handshake_server(Socket& s, const std::string& secret, int32_t* client_rank, Deadline deadline);

}  // namespace peerstate
