// Who a connection speaks for: a rank's credentials, and the job's authority
// that issues them.
//
// Only agents hold the job secret. From it each derives the same Ed25519 key
// pair, the job's authority (JobAuthority), and certifies each of its workers:
// a certificate is the authority's signature over (rank, the worker's own
// public key). A worker holds its private key, its certificate and the job's
// public key (Credentials), never the secret. In the handshake (wire.h) each
// end shows its certificate and signs the exchange with its private key, so a
// worker can speak only as the rank it was certified for: a certificate is
// public, its private key is not, and no worker can make another.
//
// A spare is certified when a plan gives it a rank (its agent puts the
// certificate in the node channel before the plan). A certificate has no
// expiry: a rank's earlier holder keeps its own until it is gone (workers of a
// lost rank are killed; a partitioned one is fenced by the control plane).
#pragma once

#include <cstdint>
#include <string>

#include "common/crypto.h"
#include "common/status.h"

namespace peerstate {

struct Certificate {
  int32_t rank = -1;
  PublicKey key{};        // the rank's Ed25519 public key
  Signature signature{};  // the job authority's, over "peerstate-rank-certificate" | rank | key
};
constexpr size_t kCertificateBytes = 4 + 32 + 64;  // its wire form: rank:i32 | key | signature

void encode_certificate(const Certificate& certificate, uint8_t out[kCertificateBytes]);
Certificate decode_certificate(const uint8_t in[kCertificateBytes]);
// kAuthenticationError unless the job whose public key is `job_key` signed it.
Status check_certificate(const PublicKey& job_key, const Certificate& certificate);

// What one process proves in a handshake. Immutable once created; copied freely.
struct Credentials {
  PrivateKey private_key{};
  Certificate certificate;
  PublicKey job_key{};

  int32_t rank() const { return certificate.rank; }
  // kInvalidArgument unless the certificate is the job's, for this key and rank.
  static Status create(int32_t rank, const PrivateKey& private_key, const Signature& certificate,
                       const PublicKey& job_key, Credentials* out);
};

// The job's issuer of certificates, derived from the job secret (>= 16 bytes;
// kInvalidArgument otherwise): every agent of a job derives the same one.
class JobAuthority {
 public:
  static Status from_secret(const std::string& secret, JobAuthority* out);
  const PublicKey& public_key() const { return public_key_; }
  // The certificate of `rank` for the holder of `private_key`.
  Status certify(int32_t rank, const PrivateKey& private_key, Signature* out) const;
  // A fresh private key and its certificate for `rank`.
  Status issue(int32_t rank, Credentials* out) const;

 private:
  PrivateKey key_{};
  PublicKey public_key_{};
};

}  // namespace peerstate
