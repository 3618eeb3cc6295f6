#include "core/memory_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace peerstate {

void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

void copy_streaming(void* dst, const void* src, size_t nbytes, bool fence) {
#if defined(__x86_64__)
  constexpr size_t kMinimum = 4096;  // below this the fence costs more than it saves
  auto* d = static_cast<unsigned char*>(dst);
  auto* s = static_cast<const unsigned char*>(src);
  if (nbytes < kMinimum) {
    std::memcpy(d, s, nbytes);
    return;
  }
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  nbytes -= head;
  for (; nbytes >= 64; nbytes -= 64, d += 64, s += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, nbytes);
  if (fence) _mm_sfence();
#else
  (void)fence;
  std::memcpy(dst, src, nbytes);
#endif
}

}  // namespace peerstate
