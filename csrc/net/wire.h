// The tcp transport's wire format: handshake and frames (the version metadata
// they carry is encoded by store/version_meta.h).
//
// After the handshake a connection carries frames: a fixed 40-byte header,
// then `length` payload bytes, then (unless the protection is kTrustedFabric)
// a 16-byte AES-256-GCM tag over the header and the payload, under a key of
// the connection and its direction and a nonce that counts the frames: a frame
// altered, injected, replayed or reordered on the path fails its tag and the
// connection is closed. kEncrypted also encrypts the payloads. All integers
// are little-endian (the only byte order peerstate builds for; checked at
// compile time). Everything a peer sends is validated before it is used:
// unknown types, lengths over a bound, metadata that does not describe a
// consistent layout are protocol errors.
//
// Handshake: each end shows its rank's certificate (net/credentials.h) and
// signs the exchange with its own key; fresh X25519 shares make the frame keys.
// No secret travels, and a worker can prove only the rank it was certified for.
//   server -> client  "PSAUTH03" | server_share[32]
//   client -> server  client_share[32] | protection:u8 | client certificate[100]
//                     | Ed25519(client key, "peerstate-client" | all bytes above, both ways)
//   server -> client  server certificate[100]
//                     | Ed25519(server key, "peerstate-server" | all bytes above, both ways)
// Frame keys: HMAC(X25519(shares), "peerstate-frames-to-server" | server_share | client_share) and
// "-to-client" (both ends must use the same protection: a mismatch fails the handshake).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/crypto.h"
#include "common/status.h"
#include "net/credentials.h"
#include "net/socket.h"
#include "store/version_meta.h"

namespace peerstate {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

constexpr uint32_t kFrameMagic = 0x31765350;  // "PSv1"
constexpr size_t kMaxMetadataBytes = 64u << 20;  // also bounded by the receiver's reservation

enum class FrameType : uint16_t {
  kPutBegin = 1,  // client: metadata of (source_rank, version) follows
  kPutChunk = 2,  // client: bytes of one chunk follow
  kPutCommit = 3, // client: every chunk was sent; commit when all arrived
  kGetMeta = 4,   // client: send metadata of (source_rank, version; kNewest in `status`: the newest)
  kGetChunk = 5,  // client: send one chunk
  kMeta = 6,      // server: metadata follows
  kChunk = 7,     // server: chunk bytes follow
  kAck = 8,       // server: done
  kError = 9,     // server: a message follows; the request failed
};

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t type = 0;
  uint16_t status = 0;  // StatusCode of a kError frame; kNewest in a kGetMeta
  int32_t source_rank = -1;
  uint32_t chunk = 0;
  int64_t version = -1;
  uint64_t length = 0;  // payload bytes after the header
  uint32_t crc = 0;     // CRC32C of a chunk's segments (kPutChunk, kChunk)
  // Which of the server's stores a get reads: 0 holds this rank's own state and
  // the replicas it keeps for others, 1.. the other stores it serves (a rank's
  // data-parallel shares; TcpServer::serve). Pushes go to store 0, or to kParityStore.
  uint32_t store = 0;
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader is a wire struct");
// A push's `store` for the pieces of a parity group (TcpServer::hold_parity).
constexpr uint32_t kParityStore = 0xFFFFFFFFu;
// A kGetMeta's `status`: send the newest version held (its `version` is then ignored).
constexpr uint16_t kNewest = 1;

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

// How the frames of a connection are protected after the handshake.
enum class FrameProtection : uint8_t {
  kAuthenticated = 1,  // every frame carries an AES-256-GCM tag over its header and payload (the default)
  kEncrypted = 2,      // the same, and payloads are encrypted
  kTrustedFabric = 3,  // no per-frame protection: an explicit opt-out for a network whose every host is trusted
};
const char* protection_name(FrameProtection protection);
Status parse_protection(const std::string& name, FrameProtection* out);

// One connection: its socket and its frames' protection. Frames are sent
// whole (send_frame); a received frame is read as its header (recv_header),
// its payload if any (recv_payload or recv_chunk, which may be called in
// pieces) and end_frame(), which checks its tag: until then nothing read from
// it may be acted on. Not thread-safe: one thread uses a channel at a time.
class Channel {
 public:
  Socket socket;

  // Called by the handshake: arms the protection with each direction's key.
  Status start(FrameProtection protection, const Digest& send_key, const Digest& receive_key);
  std::string peer_name() const { return socket.peer_name(); }

  Status send_frame(const FrameHeader& header, const void* payload, Deadline deadline);
  // Receives a header and checks its magic and type (kProtocolError otherwise).
  Status recv_header(FrameHeader* header, Deadline deadline);
  Status recv_payload(void* dst, size_t nbytes, Deadline deadline);
  // Receives chunk `c` (its nbytes) straight into `chunk_dst` (its place in a
  // region, or a staging buffer), checksumming each piece as it lands, while it
  // is still in cache: the CRC costs no second pass over memory. *crc gets the
  // chunk's CRC32C (of the plaintext).
  Status recv_chunk(const Layout& layout, size_t c, unsigned char* chunk_dst, Deadline deadline, uint32_t* crc);
  // Reads and checks the frame's tag: kAuthenticationError if it does not match.
  Status end_frame(Deadline deadline);

 private:
  Status absorb(unsigned char* data, size_t nbytes);  // the received bytes, into the frame's tag
  FrameProtection protection_ = FrameProtection::kTrustedFabric;  // before the handshake: nothing
  std::unique_ptr<Aead> seal_, open_;
  uint64_t sent_ = 0, received_ = 0;  // frames: the nonces
  std::vector<uint8_t> scratch_;      // kEncrypted: ciphertext of a payload being sent
};

// Sends a kError frame carrying `error`.
Status send_error(Channel& c, const Status& error, Deadline deadline);
// Receives a kAck, or turns a kError into its Status.
Status expect_ack(Channel& c, Deadline deadline);
// Reads the message of a kError whose header was received, and the frame's end;
// returns the error it carries.
Status read_error(Channel& c, const FrameHeader& header, Deadline deadline);

// The two ends of the handshake; on success the channel's frames are protected
// and *peer_rank is the rank the other end proved. kAuthenticationError: the
// peer is not certified by this job, or the protections differ; a connection
// that fails is not usable.
Status handshake_client(Channel& c, const Credentials& credentials, FrameProtection protection, int32_t* peer_rank,
                        Deadline deadline);
Status handshake_server(Channel& c, const Credentials& credentials, FrameProtection protection, int32_t* peer_rank,
                        Deadline deadline);

}  // namespace peerstate
