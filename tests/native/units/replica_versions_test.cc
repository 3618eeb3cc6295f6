// A holder's version rules, driven through the calls the tcp server makes
// (begin, expect_chunk, chunk_arrived, commit): versions only increase and by a
// bounded step, never past the job's own bound, never as an empty layout from a
// rank that reserved bytes; a corrupt or partial version never becomes visible
// and leaves the committed one readable; a rollback lets the re-run's numbers in.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/crc32c.h"
#include "store/replica_store.h"

namespace peerstate {
namespace {

constexpr int kRank = 3;
constexpr size_t kBytes = 10000;  // three chunks of 4096

VersionMeta meta_for(int64_t version, const std::vector<unsigned char>& bytes, size_t nbytes = kBytes) {
  VersionMeta meta;
  meta.source_rank = kRank;
  meta.version = version;
  meta.chunk_bytes = 4096;
  if (nbytes > 0) meta.buffers.push_back(BufferPlacement{"w", nbytes, kHostDevice, 0, "torch.uint8"});
  std::vector<BufferRegistration> regs;
  for (const auto& b : meta.buffers) regs.push_back(BufferRegistration{b.name, nullptr, b.nbytes, b.device, b.dtype});
  Layout layout;
  EXPECT_TRUE(build_layout(regs, meta.chunk_bytes, &layout).ok());
  for (size_t c = 0; c < layout.chunks.size(); c++) meta.checksums.push_back(chunk_checksum(layout, c, bytes.data()));
  EXPECT_TRUE(finish_meta(&meta).ok());
  return meta;
}

std::vector<unsigned char> state_of(int64_t version) {
  std::vector<unsigned char> bytes(kBytes);
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<unsigned char>(i * 31 + version);
  return bytes;
}

// Pushes `version` as a sender would; chunk `corrupt` (if any) lands with a flipped byte.
Status push(ReplicaStore& store, int64_t version, long corrupt = -1) {
  const std::vector<unsigned char> bytes = state_of(version);
  const VersionMeta meta = meta_for(version, bytes);
  PEERSTATE_RETURN_IF_ERROR(store.begin(meta));
  for (uint32_t c = 0; c < meta.layout->chunks.size(); c++) {
    const ChunkPlacement& chunk = meta.layout->chunks[c];
    ReplicaStore::ChunkWrite write;
    PEERSTATE_RETURN_IF_ERROR(store.expect_chunk(kRank, version, c, chunk.nbytes, &write));
    unsigned char* place = write.version->region.data() + chunk.offset;
    std::memcpy(place, bytes.data() + chunk.offset, std::min(chunk.nbytes, kBytes - chunk.offset));
    if (c == corrupt) place[5] ^= 1;
    Status arrived = store.chunk_arrived(&write, chunk_checksum(*meta.layout, c, write.version->region.data()));
    (void)arrived;  // a mismatch fails the version at commit, as the server lets it
  }
  return store.commit(kRank, version, deadline_after_ms(5000));
}

int64_t newest(ReplicaStore& store, std::vector<unsigned char>* bytes = nullptr) {
  std::shared_ptr<const ReplicaVersion> held;
  if (!store.get(kRank, -1, &held).ok()) return -1;
  if (bytes) bytes->assign(held->region.data(), held->region.data() + kBytes);
  return held->meta.version;
}

class ReplicaVersions : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(store.reserve(kRank, 16384).ok()); }
  ReplicaStore store{64 << 20};
};

TEST_F(ReplicaVersions, OnlyNewerVersionsWithinTheStepAreTaken) {
  ASSERT_TRUE(push(store, 5).ok());
  const Status again = push(store, 5);
  EXPECT_EQ(again.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.message().find("not newer than the committed version 5"), std::string::npos) << again.message();
  EXPECT_EQ(push(store, 4).code(), StatusCode::kInvalidArgument);
  const Status leap = push(store, 5 + ReplicaStore::kMaxVersionStep + 1);
  EXPECT_EQ(leap.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(leap.message().find("ahead of the committed version 5"), std::string::npos) << leap.message();
  EXPECT_EQ(newest(store), 5);
  ASSERT_TRUE(push(store, 5 + ReplicaStore::kMaxVersionStep).ok());
  EXPECT_EQ(newest(store), 5 + ReplicaStore::kMaxVersionStep);
}

TEST_F(ReplicaVersions, TheJobsBoundHoldsEvenWithNothingCommitted) {
  store.bound_versions(10);
  const Status ahead = push(store, 11);
  EXPECT_EQ(ahead.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ahead.message().find("ahead of what this job has reached"), std::string::npos) << ahead.message();
  EXPECT_EQ(newest(store), -1);
  ASSERT_TRUE(push(store, 10).ok());
  store.bound_versions(20);
  ASSERT_TRUE(push(store, 20).ok());
}

TEST_F(ReplicaVersions, AnEmptyLayoutFromARankThatReservedBytesIsRefused) {
  const VersionMeta empty = meta_for(9, {}, 0);
  ASSERT_TRUE(empty.layout->chunks.empty());
  const Status st = store.begin(empty);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("empty layout"), std::string::npos) << st.message();
}

TEST_F(ReplicaVersions, ACorruptVersionNeverBecomesVisible) {
  ASSERT_TRUE(push(store, 1).ok());
  EXPECT_EQ(push(store, 2, /*corrupt=*/1).code(), StatusCode::kChecksumMismatch);
  std::vector<unsigned char> held;
  EXPECT_EQ(newest(store, &held), 1);
  EXPECT_EQ(held, state_of(1));
  ASSERT_TRUE(push(store, 2).ok()) << "the failed version's number is still free";
  EXPECT_EQ(newest(store, &held), 2);
  EXPECT_EQ(held, state_of(2));
}

TEST_F(ReplicaVersions, APartialVersionIsDroppedByTheNextBegin) {
  ASSERT_TRUE(push(store, 1).ok());
  const auto bytes = state_of(2);
  const VersionMeta partial = meta_for(2, bytes);
  ASSERT_TRUE(store.begin(partial).ok());
  EXPECT_EQ(store.commit(kRank, 2, deadline_after_ms(50)).code(), StatusCode::kTimeout);
  EXPECT_EQ(newest(store), 1);
  ASSERT_TRUE(push(store, 3).ok());
  EXPECT_EQ(store.commit(kRank, 2, deadline_after_ms(50)).code(), StatusCode::kProtocolError);
  EXPECT_EQ(newest(store), 3);
}

TEST_F(ReplicaVersions, ChunksOfTheWrongSizeTwiceOrUnannouncedAreProtocolErrors) {
  const auto bytes = state_of(4);
  const VersionMeta meta = meta_for(4, bytes);
  ReplicaStore::ChunkWrite none;
  EXPECT_EQ(store.expect_chunk(kRank, 4, 0, 4096, &none).code(), StatusCode::kProtocolError);  // no begin
  ASSERT_TRUE(store.begin(meta).ok());
  ReplicaStore::ChunkWrite wrong;
  EXPECT_EQ(store.expect_chunk(kRank, 4, 0, 4095, &wrong).code(), StatusCode::kProtocolError);
  EXPECT_EQ(store.expect_chunk(kRank, 4, 3, 4096, &wrong).code(), StatusCode::kProtocolError);
  {
    ReplicaStore::ChunkWrite first;
    ASSERT_TRUE(store.expect_chunk(kRank, 4, 0, 4096, &first).ok());
    ReplicaStore::ChunkWrite twice;
    EXPECT_EQ(store.expect_chunk(kRank, 4, 0, 4096, &twice).code(), StatusCode::kProtocolError);
  }  // `first` dropped without chunk_arrived: the connection failed mid-chunk
  ReplicaStore::ChunkWrite retry;
  EXPECT_TRUE(store.expect_chunk(kRank, 4, 0, 4096, &retry).ok()) << "a chunk given back may be sent again";
}

TEST_F(ReplicaVersions, ARollbackLetsTheRerunsNumbersIn) {
  ASSERT_TRUE(push(store, 7).ok());
  ASSERT_TRUE(push(store, 8).ok());
  store.drop_newer(7);
  EXPECT_EQ(newest(store), 7);
  ASSERT_TRUE(push(store, 8).ok()) << "the re-run of step 8 carries the dropped version's number";
  std::vector<unsigned char> held;
  EXPECT_EQ(newest(store, &held), 8);
  EXPECT_EQ(held, state_of(8));
}

TEST(ReplicaBudget, VersionsBeyondTheReservationOrWithoutOneAreRefused) {
  ReplicaStore store(64 << 20);
  const auto bytes = state_of(1);
  EXPECT_EQ(store.begin(meta_for(1, bytes)).code(), StatusCode::kNotFound);
  ASSERT_TRUE(store.reserve(kRank, 4096).ok());
  const Status st = store.begin(meta_for(1, bytes));
  EXPECT_EQ(st.code(), StatusCode::kBudgetExceeded);
  EXPECT_NE(st.message().find("but 4096 were reserved"), std::string::npos) << st.message();
  EXPECT_EQ(store.reserve(kRank + 1, 64 << 20).code(), StatusCode::kBudgetExceeded) << "two versions of 64 MiB";
}

}  // namespace
}  // namespace peerstate
