// A parity holder, driven through the calls the tcp server makes (begin,
// expect_chunk, fold, commit): the block of a version is the XOR of the other
// members' pieces and becomes visible only when every piece is in; what it
// holds rebuilds a lost member's piece; a corrupt chunk, a chunk outside the
// piece, a member outside the group, a version the rules refuse never enter
// it; a retry folds nothing twice; a version left incomplete holds the next
// one back (kBusy naming who is missing), a failed one does not, nor one that a
// member gave up on; a fold that a rollback overtakes ends cleanly.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <map>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "store/parity_store.h"

namespace peerstate {
namespace {

constexpr size_t kChunk = 4096;
const std::vector<int> kGroup = {10, 11, 12, 13};  // this holder is member 0, rank 10
const std::map<int, size_t> kSizes = {{11, 30000}, {12, 25000}, {13, 41000}};

struct Version {
  VersionMeta meta;
  std::vector<unsigned char> region;  // laid out as meta.layout says
  ParityPiece piece;                  // the one this holder keeps
};

Version version_of(int rank, int64_t version, size_t nbytes = 0, size_t chunk_bytes = kChunk) {
  if (nbytes == 0) nbytes = kSizes.at(rank);
  Version v;
  v.meta.source_rank = rank;
  v.meta.version = version;
  v.meta.chunk_bytes = chunk_bytes;
  v.meta.buffers.push_back(BufferPlacement{"w", nbytes, kHostDevice, 0, "torch.uint8"});
  Layout layout;
  EXPECT_TRUE(build_layout({BufferRegistration{"w", nullptr, nbytes, kHostDevice, "torch.uint8"}}, chunk_bytes,
                           &layout).ok());
  v.region.assign(layout.region_bytes, 0);
  for (size_t i = 0; i < nbytes; i++) v.region[i] = static_cast<unsigned char>(i * 131 + rank * 7 + version);
  for (size_t c = 0; c < layout.chunks.size(); c++) v.meta.checksums.push_back(chunk_checksum(layout, c, v.region.data()));
  EXPECT_TRUE(finish_meta(&v.meta).ok());
  const size_t member = std::find(kGroup.begin(), kGroup.end(), rank) - kGroup.begin();
  v.piece = parity_piece(*v.meta.layout, kGroup.size(), parity_piece_held(member, 0, kGroup.size()));
  return v;
}

size_t block_bytes() {
  size_t most = 0;
  for (const auto& [rank, n] : kSizes) most = std::max(most, version_of(rank, 0).piece.nbytes);
  return most;
}

// Folds chunks [from, to) of the piece (all: to = -1); chunk `corrupt` arrives with a flipped byte.
Status fold_chunks(ParityStore& store, const Version& v, uint32_t from = 0, long to = -1, long corrupt = -1) {
  const uint32_t end = to < 0 ? v.piece.end_chunk : v.piece.first_chunk + static_cast<uint32_t>(to);
  for (uint32_t c = v.piece.first_chunk + from; c < end; c++) {
    const ChunkPlacement& chunk = v.meta.layout->chunks[c];
    ParityStore::ChunkFold fold;
    PEERSTATE_RETURN_IF_ERROR(store.expect_chunk(v.meta.source_rank, v.meta.version, c, chunk.nbytes, &fold));
    std::vector<unsigned char> staged(v.region.begin() + chunk.offset, v.region.begin() + chunk.offset + chunk.nbytes);
    if (c == corrupt) staged[3] ^= 1;
    uint32_t crc = crc32c_extend(0, staged.data(), std::min(chunk.nbytes, kSizes.at(v.meta.source_rank) - chunk.offset));
    Status folded = store.fold(&fold, staged.data(), crc);
    (void)folded;  // a mismatch fails the piece at commit, as the server lets it
  }
  return Status::Ok();
}

// A member's piece sent, not committed (a commit waits for every member's piece).
Status send(ParityStore& store, const Version& v, long corrupt = -1) {
  PEERSTATE_RETURN_IF_ERROR(store.begin(v.meta));
  return fold_chunks(store, v, 0, -1, corrupt);
}

Status commit(ParityStore& store, const Version& v, long ms = 5000) {
  return store.commit(v.meta.source_rank, v.meta.version, deadline_after_ms(ms));
}

// Every member's piece sent, then each committed.
Status push_all(ParityStore& store, const std::vector<Version>& members) {
  for (const Version& v : members) PEERSTATE_RETURN_IF_ERROR(send(store, v));
  for (const Version& v : members) PEERSTATE_RETURN_IF_ERROR(commit(store, v));
  return Status::Ok();
}

// The block a version's pieces must make, by plain byte XOR.
std::vector<unsigned char> expected_block(const std::vector<Version>& pieces, size_t nbytes) {
  std::vector<unsigned char> out(nbytes, 0);
  for (const Version& v : pieces)
    for (size_t i = 0; i < v.piece.nbytes; i++) out[i] ^= v.region[v.piece.region_offset + i];
  return out;
}

std::vector<unsigned char> block_of(const ParityStore& store, int64_t version) {
  std::shared_ptr<const ParityVersion> held;
  EXPECT_TRUE(store.get(version, &held).ok());
  if (!held) return {};
  return std::vector<unsigned char>(held->block.data(), held->block.data() + store.block_bytes());
}

std::vector<Version> versions(int64_t version) {
  return {version_of(11, version), version_of(12, version), version_of(13, version)};
}

std::unique_ptr<ParityStore> held_store() {
  auto store = std::make_unique<ParityStore>(1 << 20);
  EXPECT_TRUE(store->hold(kGroup, 0, block_bytes()).ok());
  return store;
}

TEST(ParityStore, PiecesAreWholeChunksThatCoverTheVersionOnce) {
  const Version v = version_of(13, 1);
  uint32_t next = 0;
  for (size_t t = 0; t + 1 < kGroup.size(); t++) {
    const ParityPiece p = parity_piece(*v.meta.layout, kGroup.size(), t);
    EXPECT_EQ(p.first_chunk, next);
    EXPECT_LE(p.end_chunk - p.first_chunk, (v.meta.layout->chunks.size() + 2) / 3);
    next = p.end_chunk;
  }
  EXPECT_EQ(next, v.meta.layout->chunks.size());
  for (size_t member = 0; member < 4; member++) {  // every other member holds one piece of it
    std::vector<size_t> holders;
    for (size_t t = 0; t < 3; t++) {
      const size_t holder = parity_holder(member, t, 4);
      EXPECT_NE(holder, member);
      EXPECT_EQ(parity_piece_held(member, holder, 4), t);
      holders.push_back(holder);
    }
    std::sort(holders.begin(), holders.end());
    EXPECT_EQ(std::adjacent_find(holders.begin(), holders.end()), holders.end());
  }
}

TEST(ParityStore, FoldsEveryMembersPieceIntoOneBlockThatRebuildsALostOne) {
  ParityStore store(1 << 20);
  ASSERT_TRUE(store.hold(kGroup, 0, block_bytes()).ok());
  const std::vector<Version> v1 = versions(1);
  std::vector<std::thread> members;
  std::vector<Status> results(v1.size());
  for (size_t i = 0; i < v1.size(); i++) members.emplace_back([&, i] {
    results[i] = send(store, v1[i]);
    if (results[i].ok()) results[i] = commit(store, v1[i]);  // returns once all three are in
  });
  for (auto& t : members) t.join();
  for (const Status& st : results) ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(store.committed(), std::vector<int64_t>{1});
  const std::vector<unsigned char> block = block_of(store, 1);
  EXPECT_EQ(block, expected_block(v1, store.block_bytes()));
  // Rank 12 lost: its piece is the block XOR the survivors' pieces.
  std::vector<unsigned char> rebuilt = block;
  for (const Version& v : {v1[0], v1[2]})
    for (size_t i = 0; i < v.piece.nbytes; i++) rebuilt[i] ^= v.region[v.piece.region_offset + i];
  const Version& lost = v1[1];
  EXPECT_EQ(0, std::memcmp(rebuilt.data(), lost.region.data() + lost.piece.region_offset, lost.piece.nbytes));
  EXPECT_EQ(store.held_bytes() >= 2 * store.block_bytes(), true);
}

// Version 1 complete; ranks 11 and 12 have sent all of version 2, rank 13 none of it.
std::vector<Version> version_2_lacking_13(ParityStore& store) {
  EXPECT_TRUE(push_all(store, versions(1)).ok());
  std::vector<Version> v2 = versions(2);
  EXPECT_TRUE(send(store, v2[0]).ok());
  EXPECT_TRUE(send(store, v2[1]).ok());
  return v2;
}

TEST(ParityStore, AnIncompleteVersionStaysInvisibleAndHoldsTheNextBackNamingWhoIsMissing) {
  std::unique_ptr<ParityStore> held = held_store();
  ParityStore& store = *held;
  const std::vector<Version> v2 = version_2_lacking_13(store);
  // A member's round ends only when the whole version is covered here.
  Status waiting = commit(store, v2[0], 100);
  EXPECT_EQ(waiting.code(), StatusCode::kTimeout);
  EXPECT_NE(waiting.message().find("rank 13"), std::string::npos) << waiting.message();
  EXPECT_EQ(store.wait_complete(2, deadline_after_ms(50)).code(), StatusCode::kTimeout);
  EXPECT_EQ(store.committed(), std::vector<int64_t>{1});
  std::shared_ptr<const ParityVersion> got;
  EXPECT_EQ(store.get(2, &got).code(), StatusCode::kNotFound);
  EXPECT_EQ(block_of(store, 1), expected_block(versions(1), store.block_bytes()));
  Status busy = store.begin(version_of(11, 3).meta);
  EXPECT_EQ(busy.code(), StatusCode::kBusy);
  EXPECT_NE(busy.message().find("rank 13"), std::string::npos) << busy.message();
  ASSERT_TRUE(send(store, v2[2]).ok());
  for (const Version& v : v2) EXPECT_TRUE(commit(store, v).ok());
  EXPECT_TRUE(store.wait_complete(2, deadline_after_ms(50)).ok());
  EXPECT_EQ(store.committed(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(block_of(store, 2), expected_block(v2, store.block_bytes()));
  EXPECT_TRUE(store.begin(version_of(11, 3).meta).ok());  // reuses version 1's block
  EXPECT_EQ(store.committed(), std::vector<int64_t>{2});
  EXPECT_EQ(store.wait_complete(1, deadline_after_ms(50)).code(), StatusCode::kNotFound);
}

TEST(ParityStore, AMemberThatMovesOnWithoutItsPieceFailsTheVersionSoTheGroupIsNotHeldBackForGood) {
  // Members push in version order and never resend a version whose round ended: a
  // member that begins version 3 without all of its piece of 2 (its round of 2 gave up
  // on this holder) means 2 can never complete here. Waiting for it would hold every
  // member back for good (each newer begin kBusy); it fails instead, naming who moved
  // on, and the members still waiting in commit are told.
  for (const long sent_of_13 : {0L, 1L}) {  // none of its piece, or part of it
    std::unique_ptr<ParityStore> held = held_store();
    ParityStore& store = *held;
    const std::vector<Version> v2 = version_2_lacking_13(store);
    if (sent_of_13) {
      ASSERT_TRUE(store.begin(v2[2].meta).ok());
      ASSERT_TRUE(fold_chunks(store, v2[2], 0, sent_of_13).ok());
    }
    const std::vector<Version> v3 = versions(3);
    ASSERT_TRUE(store.begin(v3[2].meta).ok());  // rank 13, on to version 3
    Status told = commit(store, v2[0], 100);
    EXPECT_EQ(told.code(), StatusCode::kAborted) << told.message();
    EXPECT_NE(told.message().find("rank 13 moved on to version 3 without all of its piece of version 2"),
              std::string::npos) << told.message();
    ASSERT_TRUE(fold_chunks(store, v3[2]).ok());
    ASSERT_TRUE(send(store, v3[0]).ok());
    ASSERT_TRUE(send(store, v3[1]).ok());
    for (const Version& v : v3) EXPECT_TRUE(commit(store, v).ok());
    EXPECT_EQ(store.committed(), (std::vector<int64_t>{3, 1}));
    EXPECT_EQ(block_of(store, 3), expected_block(v3, store.block_bytes()));
  }
}

TEST(ParityStore, ACorruptChunkFoldsNothingFailsItsVersionAndTheNextOneReplacesIt) {
  std::unique_ptr<ParityStore> held = held_store();
  ParityStore& store = *held;
  ASSERT_TRUE(push_all(store, versions(1)).ok());
  const std::vector<Version> v2 = versions(2);
  ASSERT_TRUE(send(store, v2[0]).ok());
  ASSERT_TRUE(send(store, v2[1], v2[1].piece.first_chunk + 1).ok());
  EXPECT_EQ(commit(store, v2[1]).code(), StatusCode::kChecksumMismatch);
  EXPECT_EQ(commit(store, v2[0]).code(), StatusCode::kAborted);  // its version can never be covered
  EXPECT_EQ(store.begin(v2[2].meta).code(), StatusCode::kInvalidArgument);  // the version is dead
  EXPECT_EQ(store.committed(), std::vector<int64_t>{1});
  EXPECT_EQ(block_of(store, 1), expected_block(versions(1), store.block_bytes()));
  const std::vector<Version> v3 = versions(3);
  ASSERT_TRUE(push_all(store, v3).ok());  // no wait for the failed version
  EXPECT_EQ(block_of(store, 3), expected_block(v3, store.block_bytes()));
}

TEST(ParityStore, RefusesWhatIsNotThisHoldersToFold) {
  std::unique_ptr<ParityStore> held = held_store();
  ParityStore& store = *held;
  Version v = version_of(11, 1);
  EXPECT_EQ(store.begin(version_of(11, -1).meta).code(), StatusCode::kInvalidArgument);
  Version self = version_of(11, 1);
  self.meta.source_rank = 10;  // the holder's own rank: it keeps no parity of itself
  EXPECT_EQ(store.begin(self.meta).code(), StatusCode::kNotFound);
  self.meta.source_rank = 42;
  EXPECT_EQ(store.begin(self.meta).code(), StatusCode::kNotFound);
  ASSERT_TRUE(store.begin(v.meta).ok());
  ParityStore::ChunkFold fold;
  const uint32_t outside = v.piece.end_chunk % v.meta.layout->chunks.size();
  EXPECT_EQ(store.expect_chunk(11, 1, outside, v.meta.layout->chunks[outside].nbytes, &fold).code(),
            StatusCode::kProtocolError);
  EXPECT_EQ(store.expect_chunk(11, 1, v.piece.first_chunk, 7, &fold).code(), StatusCode::kProtocolError);
  EXPECT_EQ(store.expect_chunk(11, 2, v.piece.first_chunk, kChunk, &fold).code(), StatusCode::kProtocolError);
  ParityStore small(1 << 20);
  ASSERT_TRUE(small.hold(kGroup, 0, 1024).ok());
  EXPECT_EQ(small.begin(v.meta).code(), StatusCode::kBudgetExceeded);
  EXPECT_EQ(ParityStore(1000).hold(kGroup, 0, 600).code(), StatusCode::kBudgetExceeded);
  EXPECT_EQ(ParityStore(0).hold({1, 2}, 0, 64).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParityStore(0).hold({1, 2, 2}, 0, 64).code(), StatusCode::kInvalidArgument);
  // Versions: newer than the committed block, within the job's bound.
  std::unique_ptr<ParityStore> bounded_store = held_store();
  ParityStore& bounded = *bounded_store;
  ASSERT_TRUE(push_all(bounded, versions(5)).ok());
  EXPECT_EQ(bounded.begin(version_of(12, 5).meta).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bounded.begin(version_of(12, 4).meta).code(), StatusCode::kInvalidArgument);
  bounded.bound_versions(7);
  EXPECT_EQ(bounded.begin(version_of(12, 8).meta).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(bounded.begin(version_of(12, 7).meta).ok());
}

TEST(ParityStore, ARetryFoldsNothingTwiceAndAConflictingOneFailsTheVersion) {
  std::unique_ptr<ParityStore> held = held_store();
  ParityStore& store = *held;
  const std::vector<Version> v1 = versions(1);
  ASSERT_TRUE(store.begin(v1[0].meta).ok());
  ASSERT_TRUE(fold_chunks(store, v1[0], 0, 1).ok());  // the connection broke after one chunk
  ASSERT_TRUE(push_all(store, v1).ok());               // the retry sends them all again
  EXPECT_EQ(block_of(store, 1), expected_block(v1, store.block_bytes()));
  const std::vector<Version> v2 = versions(2);
  ASSERT_TRUE(send(store, v2[0]).ok());
  Version other = version_of(11, 2);
  other.meta.checksums[0] ^= 1;  // another state under the same number
  EXPECT_EQ(store.begin(other.meta).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(commit(store, v2[0], 1000).code(), StatusCode::kInvalidArgument);
}

TEST(ParityStore, ARollbackDropsTheAbandonedVersionsAndLetsTheRerunsNumbersIn) {
  std::unique_ptr<ParityStore> held = held_store();
  ParityStore& store = *held;
  ASSERT_TRUE(push_all(store, versions(1)).ok());
  ASSERT_TRUE(push_all(store, versions(2)).ok());
  store.drop_newer(1);
  EXPECT_EQ(store.committed(), std::vector<int64_t>{1});
  std::vector<Version> rerun = versions(2);
  for (Version& v : rerun) {  // the re-run's state differs from the abandoned one's
    v.region[0] ^= 0xff;
    v.meta.checksums[0] = chunk_checksum(*v.meta.layout, 0, v.region.data());
  }
  ASSERT_TRUE(push_all(store, rerun).ok());
  EXPECT_EQ(block_of(store, 2), expected_block(rerun, store.block_bytes()));
}

TEST(ParityStore, AFoldUnderWayWhenARollbackDropsItsVersionEndsAbortedAndTheRerunFolds) {
  // The tcp server XORs a chunk into the block outside the lock; a recovery's
  // drop_newer resets that block meanwhile, waiting for the fold to finish writing.
  // The fold then finds its version gone and says so (kAborted). It used to look its
  // member up in the cleared block (std::out_of_range, thrown on a server thread:
  // std::terminate, a survivor lost; seen once in bench/recovery.py). Which of the two
  // comes first is the scheduler's: each round takes either order. The rounds start
  // the rollback later and later (0 to 4 ms, an 8 MiB chunk's XOR taking a few), so
  // that some land inside the XOR on any machine; no round asserts a time.
  constexpr size_t kBigChunk = 8 << 20;
  const Version sample = version_of(11, 1, 3 * kBigChunk, kBigChunk);  // 3 chunks: one per holder
  ParityStore store(256 << 20);
  ASSERT_TRUE(store.hold(kGroup, 0, sample.piece.nbytes).ok());
  int aborted = 0;
  for (int64_t v = 1; v <= 40; v++) {
    const Version member = version_of(11, v, 3 * kBigChunk, kBigChunk);
    ASSERT_TRUE(store.begin(member.meta).ok());
    const uint32_t c = member.piece.first_chunk;
    const ChunkPlacement& chunk = member.meta.layout->chunks[c];
    const std::vector<unsigned char> staged(member.region.begin() + chunk.offset,
                                            member.region.begin() + chunk.offset + chunk.nbytes);
    ParityStore::ChunkFold fold;
    ASSERT_TRUE(store.expect_chunk(11, v, c, chunk.nbytes, &fold).ok());
    Status folded;
    const uint32_t crc = crc32c_extend(0, staged.data(), chunk.nbytes);
    std::thread server([&] { folded = store.fold(&fold, staged.data(), crc); });
    const auto later = std::chrono::steady_clock::now() + std::chrono::microseconds(100 * (v - 1));
    while (std::chrono::steady_clock::now() < later) std::this_thread::yield();
    store.drop_newer(v - 1);  // the rollback: version v is abandoned
    server.join();
    ASSERT_TRUE(folded.ok() || folded.code() == StatusCode::kAborted) << folded.message();
    aborted += folded.code() == StatusCode::kAborted;
  }
  EXPECT_TRUE(store.committed().empty());  // nothing of an abandoned version became visible
  RecordProperty("aborted_folds", aborted);
  ASSERT_TRUE(push_all(store, versions(41)).ok());  // the re-run's version folds and completes
  EXPECT_EQ(store.committed(), std::vector<int64_t>{41});
}

TEST(ParityStore, ARebuiltPieceIsServedUntilANewerVersionIsCoveredWhichNeedsItsReplacement) {
  std::unique_ptr<ParityStore> held = held_store();
  ParityStore& store = *held;
  ASSERT_TRUE(push_all(store, versions(1)).ok());
  auto piece = std::make_shared<RebuiltPiece>();
  piece->meta = version_of(12, 1).meta;
  piece->piece = version_of(12, 1).piece;
  ASSERT_TRUE(piece->bytes.allocate(store.block_bytes()).ok());
  ASSERT_TRUE(store.keep_rebuilt(piece).ok());
  std::shared_ptr<const RebuiltPiece> got;
  EXPECT_TRUE(store.rebuilt(12, 1, &got).ok());
  EXPECT_EQ(store.rebuilt(12, 2, &got).code(), StatusCode::kNotFound);
  EXPECT_EQ(store.rebuilt(11, 1, &got).code(), StatusCode::kNotFound);
  ASSERT_TRUE(push_all(store, versions(2)).ok());  // rank 12's replacement pushed version 2
  EXPECT_EQ(store.rebuilt(12, 1, &got).code(), StatusCode::kNotFound);
  auto stranger = std::make_shared<RebuiltPiece>();
  stranger->meta = version_of(12, 1).meta;
  stranger->meta.source_rank = 42;
  EXPECT_EQ(store.keep_rebuilt(stranger).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace peerstate
