// Cryptography from the system's libcrypto (OpenSSL 3 or 1.1.1), loaded at run
// time as NCCL is: never a link-time dependency, so `import peerstate` works
// where it is missing, and only the replication ports need it. Python's own
// `ssl` and `hashlib` modules load the same library.
//
// Loading: PEERSTATE_LIBCRYPTO if set, else the libcrypto already in the
// process (RTLD_DEFAULT: Python's _hashlib loaded it), else libcrypto.so.3,
// then libcrypto.so.1.1. crypto_library() says which, or kUnavailable naming
// what was tried. Every call is thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace peerstate {

using Digest = std::array<uint8_t, 32>;

// Where libcrypto was found ("already loaded", or the path), or why it was not.
Status crypto_library(std::string* origin);

Status hmac_sha256(const void* key, size_t key_bytes, const void* data, size_t nbytes, Digest* out);
// Constant-time comparison: how long it takes says nothing about where two digests differ.
bool digests_equal(const uint8_t* a, const uint8_t* b, size_t nbytes);
// Bytes from the kernel's CSPRNG (getrandom).
Status random_bytes(void* out, size_t nbytes);

// Ed25519 (RFC 8032) and X25519 (RFC 7748), for the handshake's certificates
// and its ephemeral key exchange. A private key is 32 random bytes (an Ed25519
// seed, or an X25519 scalar); signing is deterministic.
constexpr size_t kPrivateKeyBytes = 32;
using PrivateKey = std::array<uint8_t, kPrivateKeyBytes>;
using PublicKey = std::array<uint8_t, 32>;
using Signature = std::array<uint8_t, 64>;

Status ed25519_public_key(const PrivateKey& key, PublicKey* out);
Status ed25519_sign(const PrivateKey& key, const void* message, size_t nbytes, Signature* out);
// kAuthenticationError unless `signature` is `key`'s over the message.
Status ed25519_verify(const PublicKey& key, const void* message, size_t nbytes, const Signature& signature);
Status x25519_public_key(const PrivateKey& key, PublicKey* out);
// The shared secret of `key` and a peer's public value; kAuthenticationError
// for a value of small order (the secret would be zero, known to anyone).
Status x25519_shared(const PrivateKey& key, const PublicKey& peer, Digest* out);

// AES-256-GCM over one message at a time: begin() with a 96-bit nonce that is
// never used twice with one key, any number of aad() and update() calls (the
// additional data first), then seal() (sender: the 16-byte tag) or open()
// (receiver: kAuthenticationError unless the tag matches). update() encrypts
// (sealing) or decrypts (opening) in place or into `out`. Not thread-safe: one
// per direction of a connection.
class Aead {
 public:
  static constexpr size_t kKeyBytes = 32;
  static constexpr size_t kNonceBytes = 12;
  static constexpr size_t kTagBytes = 16;

  // `sealing`: this end sends. kUnavailable without libcrypto.
  static Status create(const uint8_t key[kKeyBytes], bool sealing, std::unique_ptr<Aead>* out);
  ~Aead();
  Aead(const Aead&) = delete;
  Aead& operator=(const Aead&) = delete;

  Status begin(const uint8_t nonce[kNonceBytes]);
  Status aad(const void* data, size_t nbytes);
  Status update(const uint8_t* in, uint8_t* out, size_t nbytes);
  Status seal(uint8_t tag[kTagBytes]);
  Status open(const uint8_t tag[kTagBytes]);

 private:
  Aead(void* context, bool sealing) : context_(context), sealing_(sealing) {}
  void* context_;  // EVP_CIPHER_CTX*
  const bool sealing_;
};

}  // namespace peerstate
