#include "net/credentials.h"

#include <cstring>

namespace peerstate {
namespace {

constexpr char kCertificateLabel[] = "peerstate-rank-certificate";
constexpr char kAuthorityLabel[] = "peerstate-job-authority-v1";

std::string certified_bytes(int32_t rank, const PublicKey& key) {
  std::string message(kCertificateLabel);
  message.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
  message.append(reinterpret_cast<const char*>(key.data()), key.size());
  return message;
}

}  // namespace

void encode_certificate(const Certificate& certificate, uint8_t out[kCertificateBytes]) {
  std::memcpy(out, &certificate.rank, 4);
  std::memcpy(out + 4, certificate.key.data(), 32);
  std::memcpy(out + 36, certificate.signature.data(), 64);
}

Certificate decode_certificate(const uint8_t in[kCertificateBytes]) {
  Certificate certificate;
  std::memcpy(&certificate.rank, in, 4);
  std::memcpy(certificate.key.data(), in + 4, 32);
  std::memcpy(certificate.signature.data(), in + 36, 64);
  return certificate;
}

Status check_certificate(const PublicKey& job_key, const Certificate& certificate) {
  const std::string message = certified_bytes(certificate.rank, certificate.key);
  Status st = ed25519_verify(job_key, message.data(), message.size(), certificate.signature);
  if (!st.ok() && st.code() == StatusCode::kAuthenticationError)
    return Status(StatusCode::kAuthenticationError,
                  "the certificate of rank " + std::to_string(certificate.rank) +
                      " is not this job's (another job's secret, or a forged or altered certificate)");
  return st;
}

Status Credentials::create(int32_t rank, const PrivateKey& private_key, const Signature& certificate,
                           const PublicKey& job_key, Credentials* out) {
  if (rank < 0) return Status(StatusCode::kInvalidArgument, "a rank's credentials need a rank >= 0");
  Credentials c;
  c.private_key = private_key;
  c.job_key = job_key;
  c.certificate.rank = rank;
  c.certificate.signature = certificate;
  PEERSTATE_RETURN_IF_ERROR(ed25519_public_key(private_key, &c.certificate.key));
  Status st = check_certificate(job_key, c.certificate);
  if (st.code() == StatusCode::kAuthenticationError)
    return Status(StatusCode::kInvalidArgument,
                  "the certificate does not certify this private key as rank " + std::to_string(rank) +
                      " of the job whose key is given: the agent that started this process issued them together; "
                      "was the environment changed?");
  PEERSTATE_RETURN_IF_ERROR(st);
  *out = c;
  return Status::Ok();
}

Status JobAuthority::from_secret(const std::string& secret, JobAuthority* out) {
  if (secret.size() < 16)
    return Status(StatusCode::kInvalidArgument, "the job secret must be at least 16 bytes (got " +
                                                    std::to_string(secret.size()) +
                                                    "); generate one per job, e.g. secrets.token_bytes(32)");
  JobAuthority authority;
  Digest seed;
  PEERSTATE_RETURN_IF_ERROR(hmac_sha256(secret.data(), secret.size(), kAuthorityLabel, sizeof(kAuthorityLabel) - 1,
                                        &seed));
  std::memcpy(authority.key_.data(), seed.data(), authority.key_.size());
  PEERSTATE_RETURN_IF_ERROR(ed25519_public_key(authority.key_, &authority.public_key_));
  *out = authority;
  return Status::Ok();
}

Status JobAuthority::certify(int32_t rank, const PrivateKey& private_key, Signature* out) const {
  if (rank < 0) return Status(StatusCode::kInvalidArgument, "a certificate needs a rank >= 0");
  PublicKey key;
  PEERSTATE_RETURN_IF_ERROR(ed25519_public_key(private_key, &key));
  const std::string message = certified_bytes(rank, key);
  return ed25519_sign(key_, message.data(), message.size(), out);
}

Status JobAuthority::issue(int32_t rank, Credentials* out) const {
  PrivateKey key;
  PEERSTATE_RETURN_IF_ERROR(random_bytes(key.data(), key.size()));
  Signature certificate;
  PEERSTATE_RETURN_IF_ERROR(certify(rank, key, &certificate));
  return Credentials::create(rank, key, certificate, public_key_, out);
}

}  // namespace peerstate
