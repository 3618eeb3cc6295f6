// Version metadata as it travels: what is encoded decodes to the same
// description, and decode_meta() refuses, with kProtocolError and before
// allocating for it, every truncation of a valid encoding and every lie about
// counts and sizes. Under AddressSanitizer a read past the payload fails here.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "store/version_meta.h"

namespace peerstate {
namespace {

VersionMeta sample_meta(std::mt19937& gen) {
  VersionMeta meta;
  meta.source_rank = static_cast<int32_t>(gen() % 1000);
  meta.version = static_cast<int64_t>(gen() % 100000);
  meta.chunk_bytes = 4096;
  const size_t count = 1 + gen() % 6;
  for (size_t i = 0; i < count; i++) {
    BufferPlacement b;
    b.name = "layer" + std::to_string(i) + ".weight";
    b.nbytes = gen() % 20000;
    b.device = i % 2 ? kHostDevice : 0;
    b.dtype = "torch.float32[" + std::to_string(b.nbytes / 4) + "]";
    meta.buffers.push_back(b);
  }
  EXPECT_EQ(finish_meta(&meta).code(), StatusCode::kProtocolError);  // no checksums yet
  std::vector<BufferRegistration> regs;
  for (const auto& b : meta.buffers) regs.push_back(BufferRegistration{b.name, nullptr, b.nbytes, b.device, b.dtype});
  Layout layout;
  EXPECT_TRUE(build_layout(regs, meta.chunk_bytes, &layout).ok());
  meta.checksums.resize(layout.chunks.size());
  for (auto& c : meta.checksums) c = gen();
  EXPECT_TRUE(finish_meta(&meta).ok());
  return meta;
}

void put_u32(std::string& s, size_t at, uint32_t v) { std::memcpy(&s[at], &v, 4); }

TEST(VersionMeta, RoundTrips) {
  std::mt19937 gen(21);
  for (int round = 0; round < 50; round++) {
    const VersionMeta meta = sample_meta(gen);
    VersionMeta back;
    ASSERT_TRUE(decode_meta(encode_meta(meta), &back).ok());
    EXPECT_EQ(back.source_rank, meta.source_rank);
    EXPECT_EQ(back.version, meta.version);
    EXPECT_EQ(back.chunk_bytes, meta.chunk_bytes);
    EXPECT_EQ(back.checksums, meta.checksums);
    ASSERT_TRUE(back.layout);
    EXPECT_EQ(back.layout->difference(*meta.layout), "");
    EXPECT_EQ(back.layout->region_bytes, meta.layout->region_bytes);
  }
}

TEST(VersionMeta, EveryTruncationAndEveryTrailingByteIsRefused) {
  std::mt19937 gen(22);
  const std::string good = encode_meta(sample_meta(gen));
  for (size_t n = 0; n < good.size(); n++) {
    VersionMeta out;
    const Status st = decode_meta(good.substr(0, n), &out);
    ASSERT_EQ(st.code(), StatusCode::kProtocolError) << "a truncation to " << n << " bytes was accepted";
    ASSERT_NE(st.message().find("malformed version metadata"), std::string::npos) << st.message();
  }
  VersionMeta out;
  EXPECT_EQ(decode_meta(good + '\0', &out).code(), StatusCode::kProtocolError);
}

TEST(VersionMeta, LiesAboutCountsAndSizesAreRefused) {
  VersionMeta meta;
  meta.source_rank = 3;
  meta.version = 7;
  meta.chunk_bytes = 64;
  meta.buffers.push_back(BufferPlacement{"w", 100, kHostDevice, 0, "torch.uint8[100]"});
  meta.checksums = {1, 2};
  ASSERT_TRUE(finish_meta(&meta).ok());
  const std::string good = encode_meta(meta);
  // Offsets in the encoding: rank 0, version 4, chunk_bytes 12, buffer count 20,
  // then name length 24, name 26, nbytes 27, device 35, dtype length 39, dtype 41.
  const size_t checksum_count = 41 + meta.buffers[0].dtype.size();
  struct Lie {
    const char* what;
    std::string bytes;
    const char* says;
  };
  auto edited = [&](auto edit) {
    std::string s = good;
    edit(s);
    return s;
  };
  const std::vector<Lie> lies{
      {"a billion buffers", edited([](std::string& s) { put_u32(s, 20, 1000000000u); }), "buffer count exceeds"},
      {"chunks of 1 byte", edited([](std::string& s) { put_u32(s, 12, 1); }), "chunk_bytes out of range"},
      {"a billion checksums",
       edited([&](std::string& s) { put_u32(s, checksum_count, 1000000000u); }), "checksum count exceeds"},
      {"one checksum for two chunks",
       edited([&](std::string& s) { put_u32(s, checksum_count, 1); s.resize(s.size() - 4); }), "checksums for"},
      {"an empty name", edited([](std::string& s) { s[24] = 0; s[25] = 0; }), "invalid buffer entry 0"},
      {"device -2", edited([](std::string& s) { put_u32(s, 35, static_cast<uint32_t>(-2)); }), "invalid device"},
      {"a buffer of 2^50 bytes", edited([](std::string& s) { s[27 + 6] = 4; }), "out of range"},
  };
  for (const Lie& lie : lies) {
    VersionMeta out;
    const Status st = decode_meta(lie.bytes, &out);
    EXPECT_EQ(st.code(), StatusCode::kProtocolError) << lie.what;
    EXPECT_NE(st.message().find(lie.says), std::string::npos) << lie.what << ": " << st.message();
  }
  VersionMeta out;
  ASSERT_TRUE(decode_meta(good, &out).ok()) << "the edits above must start from an accepted encoding";
}

}  // namespace
}  // namespace peerstate
