// The handshake's primitives against the RFCs' published vectors (Ed25519:
// RFC 8032 section 7.1, test 2; X25519: RFC 7748 section 6.1), and the job
// authority's certificates: the same secret gives every agent the same key,
// and a certificate holds only for its own rank and key.
#include <gtest/gtest.h>

#include <string>

#include "net/credentials.h"

namespace peerstate {
namespace {

template <size_t N>
std::array<uint8_t, N> hex(const std::string& text) {
  std::array<uint8_t, N> out{};
  EXPECT_EQ(text.size(), 2 * N);
  for (size_t i = 0; i < N; i++) out[i] = static_cast<uint8_t>(std::stoi(text.substr(2 * i, 2), nullptr, 16));
  return out;
}

class CredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string origin;
    if (!crypto_library(&origin).ok()) GTEST_SKIP() << "no libcrypto on this machine";
  }
};

TEST_F(CredentialsTest, Ed25519MatchesRfc8032) {
  const PrivateKey key = hex<32>("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb");
  PublicKey public_key;
  ASSERT_TRUE(ed25519_public_key(key, &public_key).ok());
  EXPECT_EQ(public_key, hex<32>("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"));
  const uint8_t message = 0x72;
  Signature signature;
  ASSERT_TRUE(ed25519_sign(key, &message, 1, &signature).ok());
  EXPECT_EQ(signature, hex<64>("92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
                               "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"));
  EXPECT_TRUE(ed25519_verify(public_key, &message, 1, signature).ok());
  const uint8_t other = 0x73;
  EXPECT_EQ(ed25519_verify(public_key, &other, 1, signature).code(), StatusCode::kAuthenticationError);
}

TEST_F(CredentialsTest, X25519MatchesRfc7748AndRefusesASmallOrderValue) {
  const PrivateKey alice = hex<32>("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a");
  const PrivateKey bob = hex<32>("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb");
  PublicKey alice_public, bob_public;
  ASSERT_TRUE(x25519_public_key(alice, &alice_public).ok());
  ASSERT_TRUE(x25519_public_key(bob, &bob_public).ok());
  EXPECT_EQ(alice_public, hex<32>("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"));
  Digest a, b;
  ASSERT_TRUE(x25519_shared(alice, bob_public, &a).ok());
  ASSERT_TRUE(x25519_shared(bob, alice_public, &b).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, hex<32>("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"));
  const PublicKey zero{};  // of small order: the shared secret would be zero
  EXPECT_EQ(x25519_shared(alice, zero, &a).code(), StatusCode::kAuthenticationError);
}

TEST_F(CredentialsTest, OneSecretOneAuthorityAndACertificateHoldsOnlyForItsRankAndKey) {
  JobAuthority first, second, other;
  ASSERT_TRUE(JobAuthority::from_secret("the secret of this job, 32 bytes", &first).ok());
  ASSERT_TRUE(JobAuthority::from_secret("the secret of this job, 32 bytes", &second).ok());
  ASSERT_TRUE(JobAuthority::from_secret("the secret of another job, too..", &other).ok());
  EXPECT_EQ(first.public_key(), second.public_key());
  EXPECT_NE(first.public_key(), other.public_key());
  EXPECT_EQ(JobAuthority::from_secret("fifteen bytes..", &other).code(), StatusCode::kInvalidArgument);

  Credentials c;
  ASSERT_TRUE(first.issue(5, &c).ok());
  EXPECT_EQ(c.rank(), 5);
  EXPECT_TRUE(check_certificate(second.public_key(), c.certificate).ok());  // another agent's check
  EXPECT_EQ(check_certificate(other.public_key(), c.certificate).code(), StatusCode::kAuthenticationError);
  uint8_t wire[kCertificateBytes];
  encode_certificate(c.certificate, wire);
  const Certificate back = decode_certificate(wire);
  EXPECT_EQ(back.rank, 5);
  EXPECT_EQ(back.key, c.certificate.key);
  EXPECT_EQ(back.signature, c.certificate.signature);

  Credentials moved;
  EXPECT_EQ(Credentials::create(6, c.private_key, c.certificate.signature, c.job_key, &moved).code(),
            StatusCode::kInvalidArgument);
  PrivateKey stranger{};
  stranger[0] = 1;
  EXPECT_EQ(Credentials::create(5, stranger, c.certificate.signature, c.job_key, &moved).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(Credentials::create(5, c.private_key, c.certificate.signature, c.job_key, &moved).ok());
}

}  // namespace
}  // namespace peerstate
