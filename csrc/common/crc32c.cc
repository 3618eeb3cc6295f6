#include "common/crc32c.h"

#include "common/memory_copy.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace peerstate {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // reflected Castagnoli polynomial

// The hardware loop runs several independent CRC lanes at once and joins them
// by "shifting" a CRC over a run of zero bytes, which a table per lane length
// does in 4 lookups. Long runs follow the streaming copies' page walk
// (memory_copy.h), one CRC chain per page lane: four chains also cover the
// crc32 instruction's 3-cycle latency. What is left goes three 256-byte lanes
// at a time.
constexpr size_t kPageLanes = kStreamLanes;
constexpr size_t kPageLane = kStreamLane;
static_assert(kPageLanes == 4, "page_lanes starts its lanes as {c0, 0, 0, 0}");
constexpr size_t kShortLanes = 3;
constexpr size_t kShortLane = 256;

struct Tables {
  uint32_t slice[8][256];        // slicing-by-8 software CRC
  uint32_t page_shift[4][256];   // multiply by x^(8 * kPageLane)
  uint32_t short_shift[4][256];  // multiply by x^(8 * kShortLane)

  Tables() {
    for (uint32_t n = 0; n < 256; n++) {
      uint32_t crc = n;
      for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ kPoly : crc >> 1;
      slice[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++) {
      uint32_t crc = slice[0][n];
      for (int k = 1; k < 8; k++) {
        crc = slice[0][crc & 0xff] ^ (crc >> 8);
        slice[k][n] = crc;
      }
    }
    fill_shift_table(page_shift, kPageLane);
    fill_shift_table(short_shift, kShortLane);
  }

  static uint32_t gf2_times(const uint32_t* matrix, uint32_t vector) {
    uint32_t sum = 0;
    for (; vector; vector >>= 1, matrix++)
      if (vector & 1) sum ^= *matrix;
    return sum;
  }
  static void gf2_square(uint32_t* square, const uint32_t* matrix) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(matrix, matrix[n]);
  }

  // Operator that advances a raw CRC register over `len` zero bytes (len a power of two).
  static void zeros_operator(uint32_t* even, size_t len) {
    uint32_t odd[32];
    odd[0] = kPoly;  // one zero bit
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd);  // two bits
    gf2_square(odd, even);  // four bits
    for (;;) {
      gf2_square(even, odd);  // first pass: one byte
      len >>= 1;
      if (len == 0) return;
      gf2_square(odd, even);
      len >>= 1;
      if (len == 0) break;
    }
    std::memcpy(even, odd, sizeof(odd));
  }

  static void fill_shift_table(uint32_t table[4][256], size_t len) {
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++)
      for (int k = 0; k < 4; k++) table[k][n] = gf2_times(op, n << (8 * k));
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

inline uint32_t shift(const uint32_t table[4][256], uint32_t crc) {
  return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
         table[3][crc >> 24];
}

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void store64(unsigned char* p, uint64_t v) { std::memcpy(p, &v, 8); }

uint32_t software_extend(uint32_t crc, const unsigned char* p, size_t n) {
  const Tables& t = tables();
  uint64_t c = ~crc & 0xffffffffu;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v = load64(p) ^ c;
    c = t.slice[7][v & 0xff] ^ t.slice[6][(v >> 8) & 0xff] ^ t.slice[5][(v >> 16) & 0xff] ^
        t.slice[4][(v >> 24) & 0xff] ^ t.slice[3][(v >> 32) & 0xff] ^
        t.slice[2][(v >> 40) & 0xff] ^ t.slice[1][(v >> 48) & 0xff] ^ t.slice[0][v >> 56];
  }
  for (; n; n--, p++) c = t.slice[0][(c ^ *p) & 0xff] ^ (c >> 8);
  return ~static_cast<uint32_t>(c);
}

#if defined(__x86_64__)
// kCopy selects the fused copy: every byte is loaded once into the cache, fed
// to the crc32 unit and stored, so the checksum costs no second pass over
// memory. The stores are non-temporal (movntdq): a snapshot is not read back
// soon, and bypassing the cache saves the read-for-ownership of every
// destination line, a third of a plain copy's memory traffic.

// Four page lanes, a 64-byte line of each per iteration; advances the cursors.
// Measured at 2 GiB on 2 threads: 0.97 of glibc's memcpy, against 0.86 for
// three 8 KiB lanes without prefetch.
template <bool kCopy>
__attribute__((target("sse4.2"))) void page_lanes(uint64_t& c0, unsigned char*& dst, const unsigned char*& src,
                                                   size_t& n, const uint32_t table[4][256]) {
  constexpr size_t kBlock = kPageLanes * kPageLane;
  for (; n >= kBlock; n -= kBlock, src += kBlock, dst += kCopy ? kBlock : 0) {
    uint64_t c[kPageLanes] = {c0, 0, 0, 0};  // fully unrolled below, so these stay in registers
    for (size_t i = 0; i < kPageLane; i += 64) {
#pragma GCC unroll 4
      for (size_t l = 0; l < kPageLanes; l++)
        _mm_prefetch(reinterpret_cast<const char*>(src + l * kPageLane + i + kStreamPrefetch), _MM_HINT_T0);
#pragma GCC unroll 8
      for (size_t w = 0; w < 64; w += 8)
#pragma GCC unroll 4
        for (size_t l = 0; l < kPageLanes; l++) c[l] = _mm_crc32_u64(c[l], load64(src + l * kPageLane + i + w));
      if (kCopy) {  // dst is 16-byte aligned here (see hardware_extend)
#pragma GCC unroll 4
        for (size_t l = 0; l < kPageLanes; l++)
#pragma GCC unroll 4
          for (size_t v = 0; v < 64; v += 16)
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + l * kPageLane + i + v),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + l * kPageLane + i + v)));
      }
    }
    c0 = c[0];
    for (size_t l = 1; l < kPageLanes; l++) c0 = shift(table, static_cast<uint32_t>(c0)) ^ c[l];
  }
}

// Three short lanes, 16 bytes of each per iteration; advances the cursors.
template <bool kCopy>
__attribute__((target("sse4.2"))) void short_lanes(uint64_t& c0, unsigned char*& dst, const unsigned char*& src,
                                                    size_t& n, const uint32_t table[4][256]) {
  constexpr size_t lane = kShortLane;
  for (; n >= kShortLanes * lane; n -= kShortLanes * lane, src += kShortLanes * lane,
                                   dst += kCopy ? kShortLanes * lane : 0) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < lane; i += 16) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + lane + i));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * lane + i));
      c0 = _mm_crc32_u64(c0, static_cast<uint64_t>(_mm_cvtsi128_si64(a)));
      c1 = _mm_crc32_u64(c1, static_cast<uint64_t>(_mm_cvtsi128_si64(b)));
      c2 = _mm_crc32_u64(c2, static_cast<uint64_t>(_mm_cvtsi128_si64(d)));
      c0 = _mm_crc32_u64(c0, static_cast<uint64_t>(_mm_extract_epi64(a, 1)));
      c1 = _mm_crc32_u64(c1, static_cast<uint64_t>(_mm_extract_epi64(b, 1)));
      c2 = _mm_crc32_u64(c2, static_cast<uint64_t>(_mm_extract_epi64(d, 1)));
      if (kCopy) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + lane + i), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 2 * lane + i), d);
      }
    }
    c0 = shift(table, static_cast<uint32_t>(c0)) ^ c1;
    c0 = shift(table, static_cast<uint32_t>(c0)) ^ c2;
  }
}

template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t hardware_extend(uint32_t crc, unsigned char* dst,
                                                            const unsigned char* src, size_t n) {
  const Tables& t = tables();
  uint64_t c0 = ~crc & 0xffffffffu;
  if (kCopy) {  // align the destination for the streaming stores; lanes keep it aligned
    for (size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15; head && n; head--, n--) {
      c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *src);
      *dst++ = *src++;
    }
  }
  page_lanes<kCopy>(c0, dst, src, n, t.page_shift);
  short_lanes<kCopy>(c0, dst, src, n, t.short_shift);
  for (; n >= 8; n -= 8, src += 8) {
    uint64_t v = load64(src);
    c0 = _mm_crc32_u64(c0, v);
    if (kCopy) {
      store64(dst, v);
      dst += 8;
    }
  }
  for (; n; n--, src++) {
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *src);
    if (kCopy) *dst++ = *src;
  }
  return ~static_cast<uint32_t>(c0);
}

bool cpu_has_crc32() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#else
bool cpu_has_crc32() { return false; }
#endif

bool use_hardware(Crc32cImplementation impl) {
  if (impl == Crc32cImplementation::kSoftware) return false;
  return cpu_has_crc32();  // kHardware on a CPU without it falls back, same result
}

}  // namespace

bool crc32c_hardware_available() { return cpu_has_crc32(); }

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t nbytes, Crc32cImplementation impl) {
  auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (use_hardware(impl)) return hardware_extend<false>(crc, nullptr, p, nbytes);
#else
  (void)impl;
#endif
  return software_extend(crc, p, nbytes);
}

uint32_t crc32c_copy(void* dst, const void* src, size_t nbytes, uint32_t crc,
                     Crc32cImplementation impl, bool fence) {
  auto* d = static_cast<unsigned char*>(dst);
  auto* s = static_cast<const unsigned char*>(src);
#if defined(__x86_64__)
  if (use_hardware(impl)) {
    crc = hardware_extend<true>(crc, d, s, nbytes);
    if (fence) store_fence();  // streamed stores are weakly ordered
    return crc;
  }
#else
  (void)fence;
  (void)impl;
#endif
  std::memcpy(d, s, nbytes);
  return software_extend(crc, d, nbytes);
}

}  // namespace peerstate
