#include "common/memory_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

namespace peerstate {

#if defined(__x86_64__)
namespace {
// One 64-byte line with non-temporal stores; d is 16-byte aligned.
inline void stream_line(unsigned char* d, const unsigned char* s) {
  for (size_t v = 0; v < 64; v += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + v), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + v)));
}
}  // namespace
#endif

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
  constexpr size_t kBlock = kStreamLanes * kStreamLane;
  for (; nbytes >= kBlock; nbytes -= kBlock, d += kBlock, s += kBlock) {
    for (size_t i = 0; i < kStreamLane; i += 64) {
      for (size_t l = 0; l < kStreamLanes; l++)
        _mm_prefetch(reinterpret_cast<const char*>(s + l * kStreamLane + i + kStreamPrefetch), _MM_HINT_T0);
      for (size_t l = 0; l < kStreamLanes; l++) stream_line(d + l * kStreamLane + i, s + l * kStreamLane + i);
    }
  }
  for (; nbytes >= 64; nbytes -= 64, d += 64, s += 64) stream_line(d, s);
  std::memcpy(d, s, nbytes);
  if (fence) _mm_sfence();
#else
  (void)fence;
  std::memcpy(dst, src, nbytes);
#endif
}

}  // namespace peerstate
