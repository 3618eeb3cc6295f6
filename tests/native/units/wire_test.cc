// The wire's handshake and frames between two real sockets, through a relay
// that can alter or replay what the client sends: a frame arrives intact under
// every protection; a wrong secret or a protection mismatch fails the
// handshake; a flipped bit, in a header or a payload, and a replayed frame fail
// the frame's tag; an encrypted payload never crosses the wire in the clear.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/wire.h"

namespace peerstate {
namespace {

constexpr size_t kClientHello = kNonceBytes + 32 + 4 + 1;  // nonce, HMAC, rank, protection
const std::string kSecret = "a job secret of thirty-two bytes";

// Client <-> relay <-> server over two socket pairs. The relay forwards both
// directions and may flip one bit of the client's stream at byte `flip_at`, or
// send the client's bytes [replay_from, replay_to) a second time right after them.
class Relay {
 public:
  long flip_at = -1;
  long replay_from = -1, replay_to = -1;
  Channel client, server;

  Relay() {
    int a[2], b[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, a), 0);
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, b), 0);
    client.socket = Socket(a[0]);
    server.socket = Socket(b[1]);
    near_ = a[1];
    far_ = b[0];
  }
  ~Relay() {
    client.socket.shutdown();
    server.socket.shutdown();
    ::shutdown(near_, SHUT_RDWR);
    ::shutdown(far_, SHUT_RDWR);
    for (auto& t : threads_) t.join();
    ::close(near_);
    ::close(far_);
  }
  void start() {
    threads_.emplace_back([this] { forward(near_, far_, true); });
    threads_.emplace_back([this] { forward(far_, near_, false); });
  }
  std::string client_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }

 private:
  void forward(int from, int to, bool from_client) {
    std::vector<char> buffer(4096);
    for (;;) {
      const ssize_t n = ::read(from, buffer.data(), buffer.size());
      if (n <= 0) break;
      std::string piece(buffer.data(), static_cast<size_t>(n));
      std::string extra;
      if (from_client) {
        std::lock_guard<std::mutex> lock(mutex_);
        const long at = static_cast<long>(seen_.size());
        if (flip_at >= at && flip_at < at + n) piece[flip_at - at] ^= 0x10;
        seen_ += piece;
        if (replay_to > at && replay_to <= at + n) extra = seen_.substr(replay_from, replay_to - replay_from);
      }
      piece += extra;
      if (::write(to, piece.data(), piece.size()) != static_cast<ssize_t>(piece.size())) break;
    }
    ::shutdown(to, SHUT_WR);
  }
  int near_ = -1, far_ = -1;
  std::mutex mutex_;
  std::string seen_;
  std::vector<std::thread> threads_;
};

struct Handshake {
  Status client, server;
  int32_t rank = -1;
};

Handshake shake(Relay& relay, const std::string& client_secret, FrameProtection client_protection,
                FrameProtection server_protection = FrameProtection::kAuthenticated) {
  Handshake h;
  std::thread server([&] {
    h.server = handshake_server(relay.server, kSecret, server_protection, &h.rank, deadline_after_ms(10000));
    if (!h.server.ok()) relay.server.socket.shutdown();  // as the server closes a refused connection
  });
  h.client = handshake_client(relay.client, client_secret, 7, client_protection, deadline_after_ms(10000));
  server.join();
  return h;
}

const std::string kPayload = std::string(3000, 'x') + "the plaintext of a chunk" + std::string(3000, 'y');

Status send_payload(Channel& c) {
  const FrameHeader header = make_header(FrameType::kPutChunk, 7, 42, 1, kPayload.size(), 0);
  return c.send_frame(header, kPayload.data(), deadline_after_ms(10000));
}

// Receives one frame; its payload into *payload; the status of the first step that failed.
Status receive(Channel& c, std::string* payload, FrameHeader* header = nullptr) {
  FrameHeader h;
  PEERSTATE_RETURN_IF_ERROR(c.recv_header(&h, deadline_after_ms(10000)));
  if (h.length > (1 << 20)) return Status(StatusCode::kProtocolError, "length");
  payload->assign(h.length, '\0');
  PEERSTATE_RETURN_IF_ERROR(c.recv_payload(payload->data(), h.length, deadline_after_ms(10000)));
  if (header) *header = h;
  return c.end_frame(deadline_after_ms(10000));
}

class Wire : public ::testing::TestWithParam<FrameProtection> {
 protected:
  void SetUp() override {
    std::string origin;
    if (!crypto_library(&origin).ok()) GTEST_SKIP() << "no libcrypto on this machine";
  }
};

class ProtectedWire : public Wire {};  // the protections that tag each frame

TEST_P(Wire, AFrameArrivesIntact) {
  Relay relay;
  relay.start();
  const Handshake h = shake(relay, kSecret, GetParam(), GetParam());
  ASSERT_TRUE(h.client.ok()) << h.client.message();
  ASSERT_TRUE(h.server.ok()) << h.server.message();
  EXPECT_EQ(h.rank, 7);
  for (int frame = 0; frame < 3; frame++) ASSERT_TRUE(send_payload(relay.client).ok());
  for (int frame = 0; frame < 3; frame++) {
    std::string payload;
    FrameHeader header;
    const Status st = receive(relay.server, &payload, &header);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(payload, kPayload);
    EXPECT_EQ(header.version, 42);
    EXPECT_EQ(header.chunk, 1u);
  }
  const bool clear = relay.client_bytes().find("the plaintext of a chunk") != std::string::npos;
  EXPECT_EQ(clear, GetParam() != FrameProtection::kEncrypted);
}

// One bit flipped in transit, in a payload or in a header (version 42 becomes 58).
TEST_P(ProtectedWire, AFlippedBitFailsTheFrame) {
  for (const size_t at : {kClientHello + sizeof(FrameHeader) + 3100, kClientHello + offsetof(FrameHeader, version)}) {
    SCOPED_TRACE("bit flipped in byte " + std::to_string(at));
    Relay relay;
    relay.flip_at = static_cast<long>(at);
    relay.start();
    const Handshake h = shake(relay, kSecret, GetParam(), GetParam());
    ASSERT_TRUE(h.server.ok()) << h.server.message();
    ASSERT_TRUE(send_payload(relay.client).ok());
    std::string payload;
    EXPECT_EQ(receive(relay.server, &payload).code(), StatusCode::kAuthenticationError);
  }
}

TEST_P(ProtectedWire, AReplayedFrameFailsItsTag) {
  Relay relay;
  relay.replay_from = kClientHello;
  relay.replay_to = kClientHello + sizeof(FrameHeader) + kPayload.size() + Aead::kTagBytes;
  relay.start();
  const Handshake h = shake(relay, kSecret, GetParam(), GetParam());
  ASSERT_TRUE(h.server.ok()) << h.server.message();
  ASSERT_TRUE(send_payload(relay.client).ok());
  std::string payload;
  ASSERT_TRUE(receive(relay.server, &payload).ok());
  EXPECT_EQ(receive(relay.server, &payload).code(), StatusCode::kAuthenticationError);
}

std::string protection_test_name(const ::testing::TestParamInfo<FrameProtection>& info) {
  std::string name = protection_name(info.param);
  name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
  return name;
}
INSTANTIATE_TEST_SUITE_P(Protections, Wire,
                         ::testing::Values(FrameProtection::kAuthenticated, FrameProtection::kEncrypted,
                                           FrameProtection::kTrustedFabric),
                         protection_test_name);
// kTrustedFabric has no per-frame protection, by choice: nothing to tamper with there.
INSTANTIATE_TEST_SUITE_P(Protections, ProtectedWire,
                         ::testing::Values(FrameProtection::kAuthenticated, FrameProtection::kEncrypted),
                         protection_test_name);

TEST(Handshake, AWrongSecretIsRefusedAndTheSecretNeverTravels) {
  std::string origin;
  if (!crypto_library(&origin).ok()) GTEST_SKIP() << "no libcrypto on this machine";
  Relay relay;
  relay.start();
  const Handshake h = shake(relay, "not the job's secret, same length", FrameProtection::kAuthenticated);
  EXPECT_EQ(h.server.code(), StatusCode::kAuthenticationError) << h.server.message();
  EXPECT_FALSE(h.client.ok());
  EXPECT_EQ(relay.client_bytes().find("not the job's secret"), std::string::npos);
}

TEST(Handshake, BothEndsMustUseTheSameProtection) {
  std::string origin;
  if (!crypto_library(&origin).ok()) GTEST_SKIP() << "no libcrypto on this machine";
  Relay relay;
  relay.start();
  const Handshake h = shake(relay, kSecret, FrameProtection::kTrustedFabric, FrameProtection::kAuthenticated);
  EXPECT_FALSE(h.server.ok());
  EXPECT_FALSE(h.client.ok());
}

TEST(Protection, NamesParseAndAnUnknownOneSaysWhatIsAccepted) {
  FrameProtection p;
  ASSERT_TRUE(parse_protection("encrypted", &p).ok());
  EXPECT_EQ(p, FrameProtection::kEncrypted);
  const Status st = parse_protection("tls", &p);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'authenticated' (the default)"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace peerstate
