// The layout's invariants over random registrations: every buffer's bytes
// placed once, in order, 64-byte aligned; chunks that never exceed chunk_bytes
// of data nor mix memory kinds; the same layout from the same list; and the
// chunk filler's checksum, fed in pieces, equal to the chunk's own.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/crc32c.h"
#include "store/layout.h"

namespace peerstate {
namespace {

std::vector<BufferRegistration> random_registration(std::mt19937& gen) {
  std::vector<BufferRegistration> buffers(1 + gen() % 12);
  for (size_t i = 0; i < buffers.size(); i++) {
    buffers[i].name = "b" + std::to_string(i);
    const uint32_t kind = gen() % 4;
    buffers[i].nbytes = kind == 0 ? 0 : kind == 1 ? gen() % 100 : kind == 2 ? gen() % 5000 : gen() % 300000;
    buffers[i].device = static_cast<int>(gen() % 3) - 1;  // host, cuda:0, cuda:1
    buffers[i].dtype = "torch.uint8[" + std::to_string(buffers[i].nbytes) + "]";
  }
  return buffers;
}

TEST(Layout, PlacesEveryByteOnceInChunksOfOneDeviceAndAtMostChunkBytes) {
  std::mt19937 gen(11);
  for (int round = 0; round < 300; round++) {
    const auto buffers = random_registration(gen);
    const size_t chunk_bytes = std::vector<size_t>{64, 100, 4096, 65536, 1 << 20}[gen() % 5];
    Layout layout;
    ASSERT_TRUE(build_layout(buffers, chunk_bytes, &layout).ok());
    SCOPED_TRACE("round " + std::to_string(round) + ", chunk_bytes " + std::to_string(chunk_bytes));
    ASSERT_EQ(layout.buffers.size(), buffers.size());
    ASSERT_EQ(layout.chunk_bytes, chunk_bytes);

    // Host buffers first, then by device, each group in registration order.
    std::vector<size_t> order(buffers.size());
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return buffers[a].device < buffers[b].device; });
    size_t end = 0;
    for (size_t i = 0; i < order.size(); i++) {
      const BufferPlacement& p = layout.buffers[i];
      EXPECT_EQ(p.name, buffers[order[i]].name);
      EXPECT_EQ(p.nbytes, buffers[order[i]].nbytes);
      EXPECT_EQ(p.offset % kLayoutAlignment, 0u);
      EXPECT_GE(p.offset, end);
      end = p.offset + p.nbytes;
    }
    EXPECT_GE(layout.region_bytes, end);
    EXPECT_EQ(layout.region_bytes % kLayoutAlignment, 0u);

    // Each buffer's segments cover it exactly, in order, at its placement.
    std::vector<size_t> covered(layout.buffers.size(), 0);
    size_t chunk_end = 0;
    for (const ChunkPlacement& chunk : layout.chunks) {
      EXPECT_GE(chunk.offset, chunk_end);
      chunk_end = chunk.offset + chunk.nbytes;
      EXPECT_LE(chunk_end, layout.region_bytes);
      ASSERT_GT(chunk.segment_count, 0u);
      size_t data = 0;
      for (uint32_t s = 0; s < chunk.segment_count; s++) {
        const Segment& seg = layout.segments[chunk.first_segment + s];
        const BufferPlacement& p = layout.buffers[seg.buffer];
        EXPECT_EQ(p.device, chunk.device) << "a chunk mixes memory kinds";
        EXPECT_EQ(seg.buffer_offset, covered[seg.buffer]) << "segments of '" << p.name << "' out of order";
        EXPECT_EQ(seg.region_offset, p.offset + seg.buffer_offset);
        EXPECT_GE(seg.region_offset, chunk.offset);
        EXPECT_LE(seg.region_offset + seg.nbytes, chunk.offset + chunk.nbytes);
        covered[seg.buffer] += seg.nbytes;
        data += seg.nbytes;
      }
      EXPECT_LE(data, chunk_bytes);
      if (chunk.device != kHostDevice) {
        EXPECT_TRUE(layout.has_device_buffers);
      }
    }
    for (size_t b = 0; b < covered.size(); b++) EXPECT_EQ(covered[b], layout.buffers[b].nbytes) << layout.buffers[b].name;

    Layout again;
    ASSERT_TRUE(build_layout(buffers, chunk_bytes, &again).ok());
    EXPECT_EQ(again.difference(layout), "");
    EXPECT_EQ(again.chunks.size(), layout.chunks.size());
    EXPECT_EQ(again.region_bytes, layout.region_bytes);
  }
}

TEST(Layout, RefusesChunksSmallerThanTheAlignment) {
  Layout layout;
  const Status st = build_layout({BufferRegistration{"w", nullptr, 10, kHostDevice, ""}}, 63, &layout);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("at least 64"), std::string::npos) << st.message();
}

TEST(Layout, DifferenceNamesTheFirstBufferThatChanged) {
  const std::vector<BufferRegistration> base{{"w", nullptr, 128, kHostDevice, "torch.float32[32]"},
                                             {"m", nullptr, 256, kHostDevice, "torch.float32[64]"}};
  Layout a;
  ASSERT_TRUE(build_layout(base, 4096, &a).ok());
  struct Change {
    std::vector<BufferRegistration> buffers;
    std::string says;
  };
  auto with = [&](size_t i, auto edit) {
    auto b = base;
    edit(b[i]);
    return b;
  };
  const std::vector<Change> changes{
      {{base[0]}, "it holds 2 buffers, the registration has 1"},
      {with(1, [](BufferRegistration& b) { b.name = "v"; }), "buffer #1 is 'm' there and 'v' now"},
      {with(1, [](BufferRegistration& b) { b.nbytes = 512; }), "buffer 'm' had 256 bytes and now has 512"},
      {with(0, [](BufferRegistration& b) { b.dtype = "torch.bfloat16[64]"; }),
       "buffer 'w' held torch.float32[32] and now holds torch.bfloat16[64]"},
      {with(1, [](BufferRegistration& b) { b.device = 0; }), "buffer 'm' was on host and is now on cuda:0"},
  };
  for (const Change& change : changes) {
    Layout b;
    ASSERT_TRUE(build_layout(change.buffers, 4096, &b).ok());
    EXPECT_EQ(a.difference(b), change.says);
  }
}

TEST(Layout, FillChunkInPiecesChecksumsTheSegmentsAsChunkChecksumDoes) {
  std::mt19937 gen(12);
  for (int round = 0; round < 100; round++) {
    auto buffers = random_registration(gen);
    for (auto& b : buffers) b.device = kHostDevice;
    Layout layout;
    ASSERT_TRUE(build_layout(buffers, 1 << (6 + gen() % 12), &layout).ok());
    std::vector<unsigned char> source(layout.region_bytes), filled(layout.region_bytes, 0);
    for (auto& byte : source) byte = static_cast<unsigned char>(gen());
    for (size_t c = 0; c < layout.chunks.size(); c++) {
      const ChunkPlacement& chunk = layout.chunks[c];
      size_t at = 0;
      auto read = [&](unsigned char* dst, size_t max, size_t* got) {
        *got = std::min<size_t>(max, 1 + gen() % 3000);  // pieces of any size, as a socket delivers them
        std::memcpy(dst, source.data() + chunk.offset + at, *got);
        at += *got;
        return Status::Ok();
      };
      uint32_t crc = 0;
      ASSERT_TRUE(fill_chunk(layout, c, filled.data() + chunk.offset, read, &crc).ok());
      EXPECT_EQ(at, chunk.nbytes);
      EXPECT_EQ(crc, chunk_checksum(layout, c, source.data())) << "chunk " << c;
    }
    // Padding is never checksummed: bytes between segments change nothing.
    for (size_t c = 0; c < layout.chunks.size(); c++) {
      const uint32_t before = chunk_checksum(layout, c, source.data());
      const ChunkPlacement& chunk = layout.chunks[c];
      const Segment& last = layout.segments[chunk.first_segment + chunk.segment_count - 1];
      if (last.region_offset + last.nbytes < chunk.offset + chunk.nbytes) {
        source[last.region_offset + last.nbytes] ^= 0xff;
        EXPECT_EQ(chunk_checksum(layout, c, source.data()), before);
      }
    }
  }
}

TEST(Layout, FillChunkReturnsTheReadersError) {
  Layout layout;
  ASSERT_TRUE(build_layout({BufferRegistration{"w", nullptr, 10000, kHostDevice, ""}}, 4096, &layout).ok());
  std::vector<unsigned char> region(layout.region_bytes);
  int calls = 0;
  auto read = [&](unsigned char*, size_t max, size_t* got) {
    if (++calls == 2) return Status(StatusCode::kConnectionError, "peer went away");
    *got = std::min<size_t>(max, 1000);
    return Status::Ok();
  };
  uint32_t crc = 0;
  const Status st = fill_chunk(layout, 0, region.data(), read, &crc);
  EXPECT_EQ(st.code(), StatusCode::kConnectionError);
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace peerstate
