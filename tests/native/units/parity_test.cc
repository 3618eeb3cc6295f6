// The parity fold against a byte-by-byte XOR, over random lengths that end
// anywhere in a 64 KiB block and in a 64-byte line, 1 to 9 sources, 1 to 3
// threads, accumulating or not. Every source sits in a heap buffer of exactly
// its length, so an over-read past a short source is AddressSanitizer's to see.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "store/parity.h"

namespace peerstate {
namespace {

TEST(Parity, FoldsLikeBytewiseXorWithShortSourcesAsZeros) {
  std::mt19937 gen(40);
  const std::vector<size_t> lengths = {0, 1, 63, 64, 65, 4095, 65535, 65536, 65537, 200000, 300001};
  for (int round = 0; round < 200; round++) {
    const size_t nbytes = lengths[gen() % lengths.size()] + (gen() % 2 ? gen() % 130 : 0);
    const size_t count = gen() % 10;
    std::vector<std::unique_ptr<unsigned char[]>> sources;
    std::vector<ParitySource> spans;
    for (size_t s = 0; s < count; s++) {
      const size_t length = gen() % 3 == 0 ? nbytes : (nbytes ? gen() % (nbytes + 1) : 0);
      sources.emplace_back(new unsigned char[length]);
      for (size_t i = 0; i < length; i++) sources.back()[i] = static_cast<unsigned char>(gen());
      spans.emplace_back(sources.back().get(), length);
    }
    const bool accumulate = gen() % 2;
    std::unique_ptr<unsigned char[]> out(new unsigned char[nbytes]), expected(new unsigned char[nbytes]);
    for (size_t i = 0; i < nbytes; i++) out[i] = expected[i] = accumulate ? static_cast<unsigned char>(gen()) : 0xA5;
    for (size_t i = 0; i < nbytes; i++) {
      if (!accumulate) expected[i] = 0;
      for (const auto& [data, length] : spans)
        if (i < length) expected[i] ^= static_cast<const unsigned char*>(data)[i];
    }
    const ParityCoder coder(1 + gen() % 3);
    SCOPED_TRACE("round " + std::to_string(round) + ": " + std::to_string(nbytes) + " bytes, " +
                 std::to_string(count) + " sources, " + std::to_string(coder.threads()) + " threads");
    ASSERT_TRUE(coder.xor_blocks(out.get(), nbytes, spans, accumulate).ok());
    for (size_t i = 0; i < nbytes; i++) ASSERT_EQ(out[i], expected[i]) << "byte " << i;
  }
}

TEST(Parity, RefusesALongerSourceAnOverlapOrNoThreadsAndWritesNothing) {
  std::vector<unsigned char> out(1000, 7), longer(1001, 1);
  EXPECT_EQ(ParityCoder(1).xor_blocks(out.data(), out.size(), {{longer.data(), longer.size()}}, false).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityCoder(1).xor_blocks(out.data(), 500, {{out.data() + 499, 10}}, false).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityCoder(0).xor_blocks(out.data(), out.size(), {}, false).code(), StatusCode::kInvalidArgument);
  for (unsigned char byte : out) ASSERT_EQ(byte, 7);
}

}  // namespace
}  // namespace peerstate
