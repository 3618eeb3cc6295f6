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
  std::string origin;
  std::string error;
};

template <typename T>
bool resolve(void* handle, const char* name, T* out) {
  *out = reinterpret_cast<T>(dlsym(handle, name));
  return *out != nullptr;
}

bool bind(void* handle, Library* lib) {
  return resolve(handle, "EVP_CIPHER_CTX_new", &lib->cipher_ctx_new) &&
         resolve(handle, "EVP_CIPHER_CTX_free", &lib->cipher_ctx_free) &&
         resolve(handle, "EVP_aes_256_gcm", &lib->aes_256_gcm) &&
         resolve(handle, "EVP_CipherInit_ex", &lib->cipher_init) &&
         resolve(handle, "EVP_CipherUpdate", &lib->cipher_update) &&
         resolve(handle, "EVP_CipherFinal_ex", &lib->cipher_final) &&
         resolve(handle, "EVP_CIPHER_CTX_ctrl", &lib->cipher_ctrl) && resolve(handle, "EVP_sha256", &lib->sha256) &&
         resolve(handle, "HMAC", &lib->hmac);
}

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
