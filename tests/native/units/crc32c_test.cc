// CRC32C against published check values, the hardware lanes against the
// portable table at every length and alignment class they branch on, and the
// fused copy against a plain copy plus a separate checksum.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/crc32c.h"
#include "common/memory_copy.h"

namespace peerstate {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(gen());
  return v;
}

TEST(Crc32c, MatchesPublishedCheckValues) {
  // "123456789" is the catalogue's check input; the 32-byte vectors are RFC 3720's (iSCSI), B.4.
  const char* digits = "123456789";
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xff), up(32), down(32);
  std::iota(up.begin(), up.end(), 0);
  for (int i = 0; i < 32; i++) down[i] = static_cast<unsigned char>(31 - i);
  for (auto impl : {Crc32cImplementation::kSoftware, Crc32cImplementation::kAuto}) {
    EXPECT_EQ(crc32c_extend(0, digits, 9, impl), 0xE3069283u);
    EXPECT_EQ(crc32c_extend(0, zeros.data(), 32, impl), 0x8A9136AAu);
    EXPECT_EQ(crc32c_extend(0, ones.data(), 32, impl), 0x62A8AB43u);
    EXPECT_EQ(crc32c_extend(0, up.data(), 32, impl), 0x46DD794Eu);
    EXPECT_EQ(crc32c_extend(0, down.data(), 32, impl), 0x113FDB5Cu);
    EXPECT_EQ(crc32c_extend(0, digits, 0, impl), 0u);
  }
}

// The lengths around each path's boundaries: short lanes (3 x 256), page lanes
// (4 x 4096), and their tails.
std::vector<size_t> boundary_lengths() {
  std::vector<size_t> lengths;
  for (size_t base : {size_t{0}, size_t{768}, kStreamLanes * kStreamLane, 3 * kStreamLanes * kStreamLane})
    for (size_t d = 0; d < 20; d++) {
      lengths.push_back(base + d);
      if (base > d) lengths.push_back(base - d);
    }
  lengths.push_back(1 << 20);
  lengths.push_back((1 << 20) + 4097);
  return lengths;
}

TEST(Crc32c, HardwareEqualsSoftwareAtEveryBoundaryAndAlignment) {
  if (!crc32c_hardware_available()) GTEST_SKIP() << "no crc32 instruction on this CPU";
  const auto data = random_bytes((1 << 20) + 4097 + 64, 1);
  for (size_t n : boundary_lengths())
    for (size_t misalign : {0, 1, 7, 8, 13, 63}) {
      const unsigned char* p = data.data() + misalign;
      ASSERT_EQ(crc32c_extend(7, p, n, Crc32cImplementation::kHardware),
                crc32c_extend(7, p, n, Crc32cImplementation::kSoftware))
          << n << " bytes at offset " << misalign;
    }
}

TEST(Crc32c, ExtendingIsTheChecksumOfTheConcatenation) {
  const auto data = random_bytes(100000, 2);
  const uint32_t whole = crc32c_extend(0, data.data(), data.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{255}, size_t{16384}, size_t{99999}, data.size()})
    EXPECT_EQ(crc32c_extend(crc32c_extend(0, data.data(), cut), data.data() + cut, data.size() - cut), whole) << cut;
}

TEST(Crc32c, FusedCopyCopiesExactlyAndChecksumsTheBytes) {
  const auto src = random_bytes((1 << 20) + 4097 + 64, 3);
  for (auto impl : {Crc32cImplementation::kSoftware, Crc32cImplementation::kAuto})
    for (size_t n : boundary_lengths())
      for (size_t misalign : {0, 3, 16}) {
        // Guard bytes either side: the copy must write exactly [dst, dst + n).
        std::vector<unsigned char> dst(n + 2 * 64 + misalign, 0xA5);
        unsigned char* to = dst.data() + 64 + misalign;
        const uint32_t crc = crc32c_copy(to, src.data() + misalign, n, 5, impl);
        ASSERT_EQ(crc, crc32c_extend(5, src.data() + misalign, n, Crc32cImplementation::kSoftware))
            << n << " bytes at offset " << misalign;
        ASSERT_EQ(std::memcmp(to, src.data() + misalign, n), 0) << n;
        for (size_t i = 0; i < 64 + misalign; i++) ASSERT_EQ(dst[i], 0xA5) << "wrote before the destination";
        for (size_t i = 64 + misalign + n; i < dst.size(); i++) ASSERT_EQ(dst[i], 0xA5) << "wrote past the destination";
      }
}

TEST(Crc32c, EveryFlippedBitChangesTheChecksum) {
  auto data = random_bytes(4096, 4);
  const uint32_t good = crc32c_extend(0, data.data(), data.size());
  for (size_t bit = 0; bit < data.size() * 8; bit += 61) {
    data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    ASSERT_NE(crc32c_extend(0, data.data(), data.size()), good) << "bit " << bit;
    data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
  }
}

}  // namespace
}  // namespace peerstate
