#include "common/crypto.h"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace peerstate {
namespace {

// The few libcrypto entry points peerstate uses; their C signatures are the
// same in OpenSSL 1.1 and 3.
constexpr int kGcmSetIvLength = 0x9;  // EVP_CTRL_GCM_SET_IVLEN
constexpr int kGcmGetTag = 0x10;      // EVP_CTRL_GCM_GET_TAG
constexpr int kGcmSetTag = 0x11;      // EVP_CTRL_GCM_SET_TAG
constexpr int kX25519 = 1034;         // EVP_PKEY_X25519 (NID_X25519)
constexpr int kEd25519 = 1087;        // EVP_PKEY_ED25519 (NID_ED25519)

struct Library {
  void* (*cipher_ctx_new)() = nullptr;
  void (*cipher_ctx_free)(void*) = nullptr;
  const void* (*aes_256_gcm)() = nullptr;
  int (*cipher_init)(void*, const void*, void*, const unsigned char*, const unsigned char*, int) = nullptr;
  int (*cipher_update)(void*, unsigned char*, int*, const unsigned char*, int) = nullptr;
  int (*cipher_final)(void*, unsigned char*, int*) = nullptr;
  int (*cipher_ctrl)(void*, int, int, void*) = nullptr;
  const void* (*sha256)() = nullptr;
  unsigned char* (*hmac)(const void*, const void*, int, const unsigned char*, size_t, unsigned char*,
                         unsigned int*) = nullptr;
  void* (*pkey_new_raw_private)(int, void*, const unsigned char*, size_t) = nullptr;
  void* (*pkey_new_raw_public)(int, void*, const unsigned char*, size_t) = nullptr;
  int (*pkey_get_raw_public)(const void*, unsigned char*, size_t*) = nullptr;
  void (*pkey_free)(void*) = nullptr;
  void* (*md_ctx_new)() = nullptr;
  void (*md_ctx_free)(void*) = nullptr;
  int (*digest_sign_init)(void*, void**, const void*, void*, void*) = nullptr;
  int (*digest_sign)(void*, unsigned char*, size_t*, const unsigned char*, size_t) = nullptr;
  int (*digest_verify_init)(void*, void**, const void*, void*, void*) = nullptr;
  int (*digest_verify)(void*, const unsigned char*, size_t, const unsigned char*, size_t) = nullptr;
  void* (*pkey_ctx_new)(void*, void*) = nullptr;
  void (*pkey_ctx_free)(void*) = nullptr;
  int (*derive_init)(void*) = nullptr;
  int (*derive_set_peer)(void*, void*) = nullptr;
  int (*derive)(void*, unsigned char*, size_t*) = nullptr;
  std::string origin;
  std::string error;
};

template <typename T>
bool resolve(void* handle, const char* name, T* out) {
  *out = reinterpret_cast<T>(dlsym(handle, name));
  return *out != nullptr;
}

const Library& library();

bool bind(void* handle, Library* lib) {
  return resolve(handle, "EVP_CIPHER_CTX_new", &lib->cipher_ctx_new) &&
         resolve(handle, "EVP_CIPHER_CTX_free", &lib->cipher_ctx_free) &&
         resolve(handle, "EVP_aes_256_gcm", &lib->aes_256_gcm) &&
         resolve(handle, "EVP_CipherInit_ex", &lib->cipher_init) &&
         resolve(handle, "EVP_CipherUpdate", &lib->cipher_update) &&
         resolve(handle, "EVP_CipherFinal_ex", &lib->cipher_final) &&
         resolve(handle, "EVP_CIPHER_CTX_ctrl", &lib->cipher_ctrl) && resolve(handle, "EVP_sha256", &lib->sha256) &&
         resolve(handle, "HMAC", &lib->hmac) &&
         resolve(handle, "EVP_PKEY_new_raw_private_key", &lib->pkey_new_raw_private) &&
         resolve(handle, "EVP_PKEY_new_raw_public_key", &lib->pkey_new_raw_public) &&
         resolve(handle, "EVP_PKEY_get_raw_public_key", &lib->pkey_get_raw_public) &&
         resolve(handle, "EVP_PKEY_free", &lib->pkey_free) && resolve(handle, "EVP_MD_CTX_new", &lib->md_ctx_new) &&
         resolve(handle, "EVP_MD_CTX_free", &lib->md_ctx_free) &&
         resolve(handle, "EVP_DigestSignInit", &lib->digest_sign_init) &&
         resolve(handle, "EVP_DigestSign", &lib->digest_sign) &&
         resolve(handle, "EVP_DigestVerifyInit", &lib->digest_verify_init) &&
         resolve(handle, "EVP_DigestVerify", &lib->digest_verify) &&
         resolve(handle, "EVP_PKEY_CTX_new", &lib->pkey_ctx_new) &&
         resolve(handle, "EVP_PKEY_CTX_free", &lib->pkey_ctx_free) &&
         resolve(handle, "EVP_PKEY_derive_init", &lib->derive_init) &&
         resolve(handle, "EVP_PKEY_derive_set_peer", &lib->derive_set_peer) &&
         resolve(handle, "EVP_PKEY_derive", &lib->derive);
}

// Owners of libcrypto's objects, freed on every path.
struct Key {
  void* p = nullptr;
  ~Key() {
    if (p != nullptr) library().pkey_free(p);
  }
};
struct DigestContext {
  void* p = nullptr;
  ~DigestContext() {
    if (p != nullptr) library().md_ctx_free(p);
  }
};
struct KeyContext {
  void* p = nullptr;
  ~KeyContext() {
    if (p != nullptr) library().pkey_ctx_free(p);
  }
};

const Library& library() {
  static Library lib;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* forced = std::getenv("PEERSTATE_LIBCRYPTO");
    if (forced != nullptr && *forced) {
      void* handle = dlopen(forced, RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr && bind(handle, &lib)) lib.origin = forced;
      else lib.error = std::string("PEERSTATE_LIBCRYPTO=") + forced + " is not a usable libcrypto";
      return;
    }
    if (bind(RTLD_DEFAULT, &lib)) {
      lib.origin = "already loaded";
      return;
    }
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1"}) {
      void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr && bind(handle, &lib)) {
        lib.origin = name;
        return;
      }
    }
    lib.error = "no libcrypto found (tried the process, libcrypto.so.3 and libcrypto.so.1.1): the replication "
                "ports authenticate with it; install OpenSSL's libcrypto or set PEERSTATE_LIBCRYPTO to its path";
  });
  return lib;
}

Status unavailable() { return Status(StatusCode::kUnavailable, library().error); }

Status public_key_of(int type, const PrivateKey& key, PublicKey* out) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  Key k{lib.pkey_new_raw_private(type, nullptr, key.data(), key.size())};
  size_t length = out->size();
  if (k.p == nullptr || lib.pkey_get_raw_public(k.p, out->data(), &length) != 1 || length != out->size())
    return Status(StatusCode::kInternal, "libcrypto refused a private key");
  return Status::Ok();
}

}  // namespace

Status crypto_library(std::string* origin) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  *origin = lib.origin;
  return Status::Ok();
}

Status hmac_sha256(const void* key, size_t key_bytes, const void* data, size_t nbytes, Digest* out) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  unsigned int length = 0;
  if (lib.hmac(lib.sha256(), key, static_cast<int>(key_bytes), static_cast<const unsigned char*>(data), nbytes,
               out->data(), &length) == nullptr || length != out->size())
    return Status(StatusCode::kInternal, "libcrypto's HMAC-SHA256 failed");
  return Status::Ok();
}

bool digests_equal(const uint8_t* a, const uint8_t* b, size_t nbytes) {
  uint8_t diff = 0;
  for (size_t i = 0; i < nbytes; i++) diff |= a[i] ^ b[i];
  return diff == 0;
}

Status random_bytes(void* out, size_t nbytes) {
  auto* p = static_cast<unsigned char*>(out);
  while (nbytes > 0) {
    ssize_t n = getrandom(p, nbytes, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status(StatusCode::kInternal, std::string("getrandom: ") + std::strerror(errno));
    }
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status ed25519_public_key(const PrivateKey& key, PublicKey* out) { return public_key_of(kEd25519, key, out); }

Status ed25519_sign(const PrivateKey& key, const void* message, size_t nbytes, Signature* out) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  Key k{lib.pkey_new_raw_private(kEd25519, nullptr, key.data(), key.size())};
  DigestContext context{lib.md_ctx_new()};
  size_t length = out->size();
  if (k.p == nullptr || context.p == nullptr ||
      lib.digest_sign_init(context.p, nullptr, nullptr, nullptr, k.p) != 1 ||
      lib.digest_sign(context.p, out->data(), &length, static_cast<const unsigned char*>(message), nbytes) != 1 ||
      length != out->size())
    return Status(StatusCode::kInternal, "libcrypto's Ed25519 signing failed");
  return Status::Ok();
}

Status ed25519_verify(const PublicKey& key, const void* message, size_t nbytes, const Signature& signature) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  Key k{lib.pkey_new_raw_public(kEd25519, nullptr, key.data(), key.size())};
  DigestContext context{lib.md_ctx_new()};
  if (k.p == nullptr || context.p == nullptr || lib.digest_verify_init(context.p, nullptr, nullptr, nullptr, k.p) != 1)
    return Status(StatusCode::kAuthenticationError, "not an Ed25519 public key");
  if (lib.digest_verify(context.p, signature.data(), signature.size(), static_cast<const unsigned char*>(message),
                        nbytes) != 1)
    return Status(StatusCode::kAuthenticationError, "a signature does not match its key");
  return Status::Ok();
}

Status x25519_public_key(const PrivateKey& key, PublicKey* out) { return public_key_of(kX25519, key, out); }

Status x25519_shared(const PrivateKey& key, const PublicKey& peer, Digest* out) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  Key own{lib.pkey_new_raw_private(kX25519, nullptr, key.data(), key.size())};
  Key theirs{lib.pkey_new_raw_public(kX25519, nullptr, peer.data(), peer.size())};
  if (own.p == nullptr || theirs.p == nullptr) return Status(StatusCode::kAuthenticationError, "not an X25519 key");
  KeyContext context{lib.pkey_ctx_new(own.p, nullptr)};
  size_t length = out->size();
  // libcrypto refuses a peer value whose shared secret would be all zeros (RFC 7748 section 6.1).
  if (context.p == nullptr || lib.derive_init(context.p) != 1 || lib.derive_set_peer(context.p, theirs.p) != 1 ||
      lib.derive(context.p, out->data(), &length) != 1 || length != out->size())
    return Status(StatusCode::kAuthenticationError, "the peer's X25519 value is refused (of small order?)");
  return Status::Ok();
}

Status Aead::create(const uint8_t key[kKeyBytes], bool sealing, std::unique_ptr<Aead>* out) {
  const Library& lib = library();
  if (lib.origin.empty()) return unavailable();
  void* context = lib.cipher_ctx_new();
  if (context == nullptr) return Status(StatusCode::kOutOfMemory, "EVP_CIPHER_CTX_new failed");
  std::unique_ptr<Aead> aead(new Aead(context, sealing));
  if (lib.cipher_init(context, lib.aes_256_gcm(), nullptr, nullptr, nullptr, sealing ? 1 : 0) != 1 ||
      lib.cipher_ctrl(context, kGcmSetIvLength, static_cast<int>(kNonceBytes), nullptr) != 1 ||
      lib.cipher_init(context, nullptr, nullptr, key, nullptr, sealing ? 1 : 0) != 1)
    return Status(StatusCode::kInternal, "libcrypto refused to set up AES-256-GCM");
  *out = std::move(aead);
  return Status::Ok();
}

Aead::~Aead() { library().cipher_ctx_free(context_); }

Status Aead::begin(const uint8_t nonce[kNonceBytes]) {
  if (library().cipher_init(context_, nullptr, nullptr, nullptr, nonce, sealing_ ? 1 : 0) != 1)
    return Status(StatusCode::kInternal, "AES-256-GCM: setting the nonce failed");
  return Status::Ok();
}

Status Aead::aad(const void* data, size_t nbytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (nbytes > 0) {  // the length is an int in libcrypto's API
    const int n = static_cast<int>(std::min<size_t>(nbytes, 1u << 30));
    int written = 0;
    if (library().cipher_update(context_, nullptr, &written, p, n) != 1)
      return Status(StatusCode::kInternal, "AES-256-GCM: additional data refused");
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status Aead::update(const uint8_t* in, uint8_t* out, size_t nbytes) {
  while (nbytes > 0) {
    const int n = static_cast<int>(std::min<size_t>(nbytes, 1u << 30));
    int written = 0;
    if (library().cipher_update(context_, out, &written, in, n) != 1 || written != n)
      return Status(StatusCode::kInternal, "AES-256-GCM: update failed");
    in += n;
    out += n;
    nbytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status Aead::seal(uint8_t tag[kTagBytes]) {
  int written = 0;
  unsigned char none[16];
  if (library().cipher_final(context_, none, &written) != 1 ||
      library().cipher_ctrl(context_, kGcmGetTag, static_cast<int>(kTagBytes), tag) != 1)
    return Status(StatusCode::kInternal, "AES-256-GCM: sealing failed");
  return Status::Ok();
}

Status Aead::open(const uint8_t tag[kTagBytes]) {
  int written = 0;
  unsigned char none[16];
  if (library().cipher_ctrl(context_, kGcmSetTag, static_cast<int>(kTagBytes), const_cast<uint8_t*>(tag)) != 1)
    return Status(StatusCode::kInternal, "AES-256-GCM: setting the tag failed");
  if (library().cipher_final(context_, none, &written) != 1)
    return Status(StatusCode::kAuthenticationError, "a frame failed its authentication tag (altered or injected "
                                                    "on the path)");
  return Status::Ok();
}

}  // namespace peerstate
