// The wire's handshake and frames between two real sockets, through a relay
// that can alter or replay what the client sends: a frame arrives intact under
// every protection; another job's certificate, a certificate altered in
// transit or shown without its key, and a protection mismatch fail the
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

// The client's handshake bytes: its X25519 share, protection, certificate and signature.
constexpr size_t kClientHello = 32 + 1 + kCertificateBytes + 64;
constexpr size_t kClientCertificateAt = 32 + 1;
const std::string kSecret = "a job secret of thirty-two bytes";

JobAuthority authority(const std::string& secret = kSecret) {
  JobAuthority a;
  EXPECT_TRUE(JobAuthority::from_secret(secret, &a).ok());
  return a;
}

Credentials issued(int32_t rank, const std::string& secret = kSecret) {
  Credentials c;
  EXPECT_TRUE(authority(secret).issue(rank, &c).ok());
  return c;
}

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
  int32_t rank = -1;         // the client's, as the server found it
  int32_t server_rank = -1;  // the server's, as the client found it
};

// A handshake between a client with `client` credentials and a server of rank 3 of kSecret's job.
Handshake shake(Relay& relay, const Credentials& client, FrameProtection client_protection,
                FrameProtection server_protection = FrameProtection::kAuthenticated) {
  Handshake h;
  const Credentials server_credentials = issued(3);
  std::thread server([&] {
    h.server = handshake_server(relay.server, server_credentials, server_protection, &h.rank,
                                deadline_after_ms(10000));
    if (!h.server.ok()) relay.server.socket.shutdown();  // as the server closes a refused connection
  });
  h.client = handshake_client(relay.client, client, client_protection, &h.server_rank, deadline_after_ms(10000));
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
  const Handshake h = shake(relay, issued(7), GetParam(), GetParam());
  ASSERT_TRUE(h.client.ok()) << h.client.message();
  ASSERT_TRUE(h.server.ok()) << h.server.message();
  EXPECT_EQ(h.rank, 7);
  EXPECT_EQ(h.server_rank, 3);
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
    const Handshake h = shake(relay, issued(7), GetParam(), GetParam());
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
  const Handshake h = shake(relay, issued(7), GetParam(), GetParam());
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

class HandshakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string origin;
    if (!crypto_library(&origin).ok()) GTEST_SKIP() << "no libcrypto on this machine";
  }
};

TEST_F(HandshakeTest, AnotherJobsCertificateIsRefusedAndNoSecretTravels) {
  Relay relay;
  relay.start();
  const Credentials other = issued(7, "another job's secret, as long");
  const Handshake h = shake(relay, other, FrameProtection::kAuthenticated);
  EXPECT_EQ(h.server.code(), StatusCode::kAuthenticationError) << h.server.message();
  EXPECT_NE(h.server.message().find("not this job's"), std::string::npos) << h.server.message();
  EXPECT_FALSE(h.client.ok());
  const std::string sent = relay.client_bytes();
  EXPECT_EQ(sent.find("another job's secret"), std::string::npos);
  EXPECT_EQ(sent.find(std::string(reinterpret_cast<const char*>(other.private_key.data()), 32)), std::string::npos);
}

// A worker certified as rank 7 that writes rank 2 into the certificate it shows.
TEST_F(HandshakeTest, ACertificateClaimingAnotherRankIsRefused) {
  Relay relay;
  relay.flip_at = static_cast<long>(kClientCertificateAt);  // rank 7 becomes 7 ^ 0x10 = 23
  relay.start();
  const Handshake h = shake(relay, issued(7), FrameProtection::kAuthenticated);
  EXPECT_EQ(h.server.code(), StatusCode::kAuthenticationError) << h.server.message();
  EXPECT_NE(h.server.message().find("certificate of rank 23 is not this job's"), std::string::npos)
      << h.server.message();
  EXPECT_FALSE(h.client.ok());
}

// Another rank's certificate (public: every handshake shows it) without that rank's key.
TEST_F(HandshakeTest, ACertificateShownWithoutItsKeyIsRefused) {
  Relay relay;
  relay.start();
  Credentials stolen = issued(2);
  stolen.private_key = issued(7).private_key;
  const Handshake h = shake(relay, stolen, FrameProtection::kAuthenticated);
  EXPECT_EQ(h.server.code(), StatusCode::kAuthenticationError) << h.server.message();
  EXPECT_NE(h.server.message().find("rank 2's certificate without its key"), std::string::npos)
      << h.server.message();
  EXPECT_FALSE(h.client.ok());
}

TEST_F(HandshakeTest, BothEndsMustUseTheSameProtection) {
  Relay relay;
  relay.start();
  const Handshake h = shake(relay, issued(7), FrameProtection::kTrustedFabric, FrameProtection::kAuthenticated);
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
