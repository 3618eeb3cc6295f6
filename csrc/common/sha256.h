// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for the job-secret
// handshake of the tcp transport. Small inputs only; not a hot path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace peerstate {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t nbytes);
Digest hmac_sha256(const void* key, size_t key_bytes, const void* data, size_t nbytes);
// Constant-time comparison: how long it takes says nothing about where two digests differ.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace peerstate
