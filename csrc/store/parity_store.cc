#include "store/parity_store.h"

#include <algorithm>
#include <cstring>
#include <iterator>

namespace peerstate {

namespace {

std::string rank_name(int rank) { return "rank " + std::to_string(rank); }

// dst ^= src over n bytes.
void xor_into(unsigned char* dst, const unsigned char* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t d, s;
    std::memcpy(&d, dst + i, 8);
    std::memcpy(&s, src + i, 8);
    d ^= s;
    std::memcpy(dst + i, &d, 8);
  }
  for (; i < n; i++) dst[i] ^= src[i];
}

bool same_state(const VersionMeta& a, const VersionMeta& b) {
  return a.checksums == b.checksums && a.layout->difference(*b.layout).empty();
}

std::string failure_of(const ParityVersion& v) {
  for (const auto& [rank, c] : v.contributions)
    if (!c.failure.empty()) return c.failure;
  return "a member's piece failed";
}

}  // namespace

ParityStore::ChunkFold::~ChunkFold() {
  if (store != nullptr) store->release_fold(this);
}

ParityStore::ParityStore(size_t budget_bytes)
    : budget_(budget_bytes != 0 ? budget_bytes : physical_memory_bytes() / 2) {}

Status ParityStore::hold(const std::vector<int>& members, size_t self, size_t block_bytes) {
  if (members.size() < 3)
    return Status(StatusCode::kInvalidArgument, "a parity group needs at least 3 members (" +
                                                    std::to_string(members.size()) +
                                                    " given; a group of 2 is a mirror: use buddies)");
  if (self >= members.size())
    return Status(StatusCode::kInvalidArgument, "member " + std::to_string(self) + " of a group of " +
                                                    std::to_string(members.size()));
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() || sorted.front() < 0)
    return Status(StatusCode::kInvalidArgument, "a parity group's members must be distinct ranks >= 0");
  if (2 * block_bytes > budget_)
    return Status(StatusCode::kBudgetExceeded,
                  "holding 2 parity blocks of " + std::to_string(block_bytes) + " bytes needs " +
                      std::to_string(2 * block_bytes) + " bytes, over this holder's budget of " +
                      std::to_string(budget_) + " bytes; raise the budget or make the groups larger");
  std::array<std::shared_ptr<ParityVersion>, 2> blocks;
  for (auto& block : blocks) {
    block = std::make_shared<ParityVersion>();
    PEERSTATE_RETURN_IF_ERROR(block->block.allocate(block_bytes));
  }
  std::unique_lock<std::mutex> lock(mutex_);
  // Folds still open on the old blocks keep them alive and find their generation gone.
  for (auto& old : blocks_)
    if (old) old->generation++;
  blocks_ = std::move(blocks);
  rebuilt_.clear();
  members_ = members;
  self_ = self;
  block_bytes_ = block_bytes;
  changed_.notify_all();
  return Status::Ok();
}

ParityVersion* ParityStore::incoming_locked() const {
  for (const auto& b : blocks_)
    if (b && b->version >= 0 && !b->complete) return b.get();
  return nullptr;
}

ParityVersion* ParityStore::committed_locked() const {
  ParityVersion* newest = nullptr;
  for (const auto& b : blocks_)
    if (b && b->complete && (newest == nullptr || b->version > newest->version)) newest = b.get();
  return newest;
}

std::string ParityStore::missing_locked(const ParityVersion& block) const {
  std::string out;
  for (size_t i = 0; i < members_.size(); i++) {
    if (i == self_) continue;
    auto it = block.contributions.find(members_[i]);
    if (it != block.contributions.end() && it->second.folded == it->second.arrived.size()) continue;
    out += (out.empty() ? "" : ", ") + rank_name(members_[i]);
  }
  return out;
}

void ParityStore::reset_locked(std::unique_lock<std::mutex>& lock, ParityVersion* block, int64_t version) {
  // It is the new version's at once (other members' begin() see it), but no piece
  // begins in it until the folds still writing into it have finished and it is zeroed.
  if (block->failed) {  // what a member still waiting in commit() is told
    dropped_version_ = block->version;
    dropped_why_ = failure_of(*block);
  }
  block->generation++;  // folds not yet writing give up
  block->version = version;
  block->complete = false;
  block->failed = false;
  block->contributions.clear();
  block->preparing = true;
  changed_.wait(lock, [&] { return block->writers == 0; });
  if (version >= 0) std::memset(block->block.data(), 0, block->block.size());
  block->preparing = false;
  changed_.notify_all();
}

Status ParityStore::begin(const VersionMeta& meta) {
  const int source = meta.source_rank;
  const int64_t v = meta.version;
  const std::string what = "version " + std::to_string(v) + " of " + rank_name(source);
  std::unique_lock<std::mutex> lock(mutex_);
  const auto member = std::find(members_.begin(), members_.end(), source);
  if (member == members_.end() || static_cast<size_t>(member - members_.begin()) == self_)
    return Status(StatusCode::kNotFound, "this holder keeps no parity for " + rank_name(source) +
                                             "; set up its parity group (hold) before sending versions");
  const size_t index = member - members_.begin();
  const size_t g = members_.size();
  const ParityPiece piece = parity_piece(*meta.layout, g, parity_piece_held(index, self_, g));
  if (piece.nbytes > block_bytes_)
    return Status(StatusCode::kBudgetExceeded, what + ": its piece for this holder has " +
                                                   std::to_string(piece.nbytes) + " bytes, over the group's block of " +
                                                   std::to_string(block_bytes_));
  if (v < 0) return Status(StatusCode::kInvalidArgument, what + ": negative");
  const Deadline deadline = deadline_after_ms(kCompleteWaitMs);
  for (;;) {
    const bool preparing = std::any_of(blocks_.begin(), blocks_.end(), [](const auto& b) { return b && b->preparing; });
    if (preparing) {  // another member's begin() is emptying a block: see what it becomes
      if (changed_.wait_until(lock, deadline) == std::cv_status::timeout)
        return Status(StatusCode::kBusy, what + " cannot begin: a block is still being emptied");
      continue;
    }
    if (newest_allowed_ >= 0 && v > newest_allowed_)
      return Status(StatusCode::kInvalidArgument, what + " is ahead of what this job has reached (at most " +
                                                      std::to_string(newest_allowed_) + " here)");
    ParityVersion* committed = committed_locked();
    if (committed && v <= committed->version)
      return Status(StatusCode::kInvalidArgument, what + " is not newer than the committed parity version " +
                                                      std::to_string(committed->version));
    if (committed && v - committed->version > kMaxVersionStep)
      return Status(StatusCode::kInvalidArgument, what + " is more than " + std::to_string(kMaxVersionStep) +
                                                      " ahead of the committed parity version " +
                                                      std::to_string(committed->version));
    ParityVersion* incoming = incoming_locked();
    if (incoming && incoming->version > v)
      return Status(StatusCode::kInvalidArgument,
                    what + " is older than version " + std::to_string(incoming->version) + ", being assembled");
    if (incoming && incoming->version == v) {
      if (incoming->failed)
        return Status(StatusCode::kInvalidArgument, "the parity of version " + std::to_string(v) + " failed (" +
                                                        failure_of(*incoming) + "); the next version replaces it");
      auto [it, added] = incoming->contributions.try_emplace(source);
      ParityContribution& c = it->second;
      if (added) {
        c.meta = meta;
        c.piece = piece;
        c.arrived.assign(piece.end_chunk - piece.first_chunk, 0);
        complete_if_done_locked(incoming);  // an empty piece is complete at once
      } else if (!same_state(c.meta, meta)) {
        c.failure = rank_name(source) + " sent two different states as version " + std::to_string(v);
        incoming->failed = true;
        changed_.notify_all();
        return Status(StatusCode::kInvalidArgument, c.failure);
      }
      return Status::Ok();
    }
    // A newer version. A member pushes in version order and never sends a version
    // again once its round of it ended: if its piece of the version being assembled
    // is not all in, that version can never complete, and holding the newer one back
    // for it would hold every member back for good (seen with a group of 8 whose
    // first round outlasted the members' waits for a late holder).
    if (incoming && !incoming->failed) {
      auto own = incoming->contributions.find(source);
      if (own == incoming->contributions.end() || own->second.folded != own->second.arrived.size()) {
        ParityContribution& c = incoming->contributions[source];
        c.failure = rank_name(source) + " moved on to version " + std::to_string(v) + " without all of its piece of " +
                    "version " + std::to_string(incoming->version);
        incoming->failed = true;
        changed_.notify_all();
      }
    }
    // It needs the block that is not the newest complete one.
    ParityVersion* reuse = incoming;
    if (reuse == nullptr)
      for (const auto& b : blocks_)
        if (b && b.get() != committed) reuse = b.get();
    if (reuse == nullptr) return Status(StatusCode::kNotFound, "this holder keeps no parity blocks; call hold()");
    const bool waiting_for_members = reuse == incoming && !incoming->failed;
    const bool read_now = !waiting_for_members && [&] {
      for (const auto& b : blocks_)  // what holds it beside blocks_ and open folds reads it
        if (b.get() == reuse) return static_cast<size_t>(b.use_count()) > 1 + reuse->open_folds;
      return false;
    }();
    if (!waiting_for_members && !read_now) {
      reset_locked(lock, reuse, v);
      continue;  // adds this member's piece above
    }
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (waiting_for_members)
        return Status(StatusCode::kBusy, what + " cannot begin: version " + std::to_string(incoming->version) +
                                             " still lacks the pieces of " + missing_locked(*incoming));
      return Status(StatusCode::kBusy, what + " cannot begin: a reader holds the block it needs");
    }
  }
}

Status ParityStore::expect_chunk(int source_rank, int64_t version, uint32_t chunk, uint64_t length,
                                 ChunkFold* fold) {
  std::lock_guard<std::mutex> lock(mutex_);
  ParityVersion* incoming = incoming_locked();
  if (incoming == nullptr || incoming->version != version)
    return Status(StatusCode::kProtocolError, "chunk of version " + std::to_string(version) + " of " +
                                                  rank_name(source_rank) + ", which is not being received");
  auto it = incoming->contributions.find(source_rank);
  if (it == incoming->contributions.end())
    return Status(StatusCode::kProtocolError, "chunk of " + rank_name(source_rank) + " before its version began");
  ParityContribution& c = it->second;
  if (chunk < c.piece.first_chunk || chunk >= c.piece.end_chunk)
    return Status(StatusCode::kProtocolError, "chunk " + std::to_string(chunk) + " of " + rank_name(source_rank) +
                                                  " is not in the piece this holder keeps (chunks " +
                                                  std::to_string(c.piece.first_chunk) + " to " +
                                                  std::to_string(c.piece.end_chunk) + ")");
  if (length != c.meta.layout->chunks[chunk].nbytes)
    return Status(StatusCode::kProtocolError, "chunk " + std::to_string(chunk) + " announced with " +
                                                  std::to_string(length) + " bytes; its layout says " +
                                                  std::to_string(c.meta.layout->chunks[chunk].nbytes));
  uint8_t& state = c.arrived[chunk - c.piece.first_chunk];
  if (state == 1) return Status(StatusCode::kProtocolError, "chunk " + std::to_string(chunk) + " sent twice at once");
  for (const auto& b : blocks_)
    if (b.get() == incoming) fold->version = b;
  fold->layout = c.meta.layout;
  fold->source_rank = source_rank;
  fold->chunk = chunk;
  fold->generation = incoming->generation;
  fold->already_folded = state == 2;
  fold->pending = state == 0;
  if (state == 0) state = 1;
  fold->store = this;
  incoming->open_folds++;
  return Status::Ok();
}

void ParityStore::release_fold(ChunkFold* fold) {
  std::lock_guard<std::mutex> lock(mutex_);
  ParityVersion& v = *fold->version;
  v.open_folds--;
  if (fold->pending && v.generation == fold->generation) {
    auto it = v.contributions.find(fold->source_rank);
    if (it != v.contributions.end()) it->second.arrived[fold->chunk - it->second.piece.first_chunk] = 0;
  }
  changed_.notify_all();
}

Status ParityStore::fold(ChunkFold* fold, const unsigned char* staged, uint32_t crc) {
  if (fold->already_folded) return Status::Ok();
  ParityVersion& v = *fold->version;
  const Layout* layout = nullptr;
  size_t piece_offset = 0;
  int64_t version = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fold->pending = false;
    if (v.generation != fold->generation)
      return Status(StatusCode::kAborted,
                    "version " + std::to_string(v.version) + " was dropped while its chunk arrived");
    ParityContribution& c = v.contributions.at(fold->source_rank);
    if (crc != c.meta.checksums[fold->chunk]) {
      c.arrived[fold->chunk - c.piece.first_chunk] = 0;
      if (c.failure.empty())
        c.failure = "chunk " + std::to_string(fold->chunk) + " of " + rank_name(fold->source_rank) +
                    " failed its CRC32C check";
      v.failed = true;
      changed_.notify_all();
      return Status(StatusCode::kChecksumMismatch, c.failure);
    }
    layout = fold->layout.get();
    piece_offset = c.piece.region_offset;
    version = v.version;
    v.writers++;
  }
  const ChunkPlacement& placed = layout->chunks[fold->chunk];
  for (uint32_t s = placed.first_segment; s < placed.first_segment + placed.segment_count; s++) {
    const Segment& seg = layout->segments[s];
    const unsigned char* from = staged + (seg.region_offset - placed.offset);
    size_t at = seg.region_offset - piece_offset, left = seg.nbytes;
    while (left > 0) {  // stripe by stripe: members' pieces overlap in the block
      const size_t n = std::min(left, kStripeBytes - at % kStripeBytes);
      std::lock_guard<std::mutex> stripe(v.stripes[(at / kStripeBytes) % v.stripes.size()]);
      xor_into(v.block.data() + at, from, n);
      from += n;
      at += n;
      left -= n;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  v.writers--;
  if (v.generation != fold->generation) {  // reset while it wrote (a rollback): the reset waits for it
    changed_.notify_all();
    return Status(StatusCode::kAborted,
                  "version " + std::to_string(version) + " of " + rank_name(fold->source_rank) +
                      " was dropped while its chunk was folded");
  }
  ParityContribution& c = v.contributions.at(fold->source_rank);
  c.arrived[fold->chunk - c.piece.first_chunk] = 2;
  c.folded++;
  complete_if_done_locked(&v);
  changed_.notify_all();
  return Status::Ok();
}

void ParityStore::complete_if_done_locked(ParityVersion* block) {
  if (block->failed || block->complete || block->contributions.size() + 1 != members_.size()) return;
  for (const auto& [rank, c] : block->contributions)
    if (c.folded != c.arrived.size()) return;
  block->complete = true;
  for (auto it = rebuilt_.begin(); it != rebuilt_.end();)  // its replacement has pushed since: it has pulled
    it = it->second->meta.version < block->version ? rebuilt_.erase(it) : std::next(it);
  changed_.notify_all();
}

Status ParityStore::commit(int source_rank, int64_t version, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::string what = "version " + std::to_string(version) + " of " + rank_name(source_rank);
  const auto dropped = [&] {
    return Status(StatusCode::kAborted, what + " was dropped before its block was complete" +
                                            (version == dropped_version_ ? " (" + dropped_why_ + ")" : ""));
  };
  for (;;) {
    const ParityVersion* block = nullptr;
    for (const auto& b : blocks_)
      if (b && b->version == version) block = b.get();
    if (block == nullptr || block->contributions.count(source_rank) == 0) return dropped();
    const ParityContribution& c = block->contributions.at(source_rank);
    if (!c.failure.empty())
      return Status(c.failure.find("CRC32C") != std::string::npos ? StatusCode::kChecksumMismatch
                                                                   : StatusCode::kInvalidArgument,
                    c.failure);
    if (block->failed)
      return Status(StatusCode::kAborted, "the parity of version " + std::to_string(version) + " failed (" +
                                              failure_of(*block) + ")");
    if (block->complete) return Status::Ok();
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      // Looked up again: a rollback may have reset the block while this waited.
      if (block->version != version || block->contributions.count(source_rank) == 0) return dropped();
      const ParityContribution& now = block->contributions.at(source_rank);
      if (now.folded != now.arrived.size())
        return Status(StatusCode::kTimeout, what + ": " + std::to_string(now.arrived.size() - now.folded) +
                                                " of " + std::to_string(now.arrived.size()) +
                                                " chunks of its piece missing");
      return Status(StatusCode::kTimeout,
                    what + " is folded, but the version still lacks the pieces of " + missing_locked(*block));
    }
  }
}

void ParityStore::interrupt_waits() {
  std::lock_guard<std::mutex> lock(mutex_);
  interrupted_ = true;
  changed_.notify_all();
}

void ParityStore::resume_waits() {
  std::lock_guard<std::mutex> lock(mutex_);
  interrupted_ = false;
}

Status ParityStore::wait_complete(int64_t version, Deadline deadline) const {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (interrupted_)
      return Status(StatusCode::kAborted, "the wait for version " + std::to_string(version) + " was interrupted");
    const ParityVersion* block = nullptr;
    int64_t newest = -1;
    for (const auto& b : blocks_) {
      if (b && b->version == version) block = b.get();
      if (b) newest = std::max(newest, b->version);
    }
    if (block != nullptr && block->complete) return Status::Ok();
    if (block != nullptr && block->failed)
      return Status(StatusCode::kAborted, "the parity of version " + std::to_string(version) + " failed (" +
                                              failure_of(*block) + ")");
    if (block == nullptr && newest > version)
      return Status(StatusCode::kNotFound,
                    "this holder has no block of version " + std::to_string(version) + " (newer versions replaced it)");
    // Not begun here yet (no other member's piece arrived), or still incomplete.
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout)
      return Status(StatusCode::kTimeout, "version " + std::to_string(version) + " is not complete here" +
                                              (block ? ": it lacks the pieces of " + missing_locked(*block)
                                                     : std::string(": no member's piece of it arrived")));
  }
}

Status ParityStore::get(int64_t version, std::shared_ptr<const ParityVersion>* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const ParityVersion* committed = committed_locked();
  for (const auto& b : blocks_)
    if (b && b->complete && (version < 0 ? b.get() == committed : b->version == version)) {
      *out = b;
      return Status::Ok();
    }
  return Status(StatusCode::kNotFound,
                "this holder has no complete parity of " +
                    (version < 0 ? std::string("any version") : "version " + std::to_string(version)));
}

std::vector<int64_t> ParityStore::committed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> out;
  for (const auto& b : blocks_)
    if (b && b->complete) out.push_back(b->version);
  std::sort(out.rbegin(), out.rend());
  return out;
}

void ParityStore::drop_newer(int64_t version) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (const auto& b : blocks_)
    if (b && b->version > version) reset_locked(lock, b.get(), -1);
}

void ParityStore::bound_versions(int64_t newest) {
  std::lock_guard<std::mutex> lock(mutex_);
  newest_allowed_ = newest;
}

Status ParityStore::keep_rebuilt(std::shared_ptr<const RebuiltPiece> piece) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int rank = piece->meta.source_rank;
  if (std::find(members_.begin(), members_.end(), rank) == members_.end())
    return Status(StatusCode::kInvalidArgument, rank_name(rank) + " is not in this holder's parity group");
  rebuilt_[rank] = std::move(piece);
  return Status::Ok();
}

Status ParityStore::rebuilt(int source_rank, int64_t version, std::shared_ptr<const RebuiltPiece>* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = rebuilt_.find(source_rank);
  if (it == rebuilt_.end() || (version >= 0 && it->second->meta.version != version))
    return Status(StatusCode::kNotFound,
                  "this holder has rebuilt no piece of " +
                      (version < 0 ? std::string("any version") : "version " + std::to_string(version)) + " of " +
                      rank_name(source_rank));
  *out = it->second;
  return Status::Ok();
}

void ParityStore::forget_rebuilt() {
  std::lock_guard<std::mutex> lock(mutex_);
  rebuilt_.clear();
}

size_t ParityStore::held_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& b : blocks_)
    if (b) total += b->block.size();
  for (const auto& [rank, piece] : rebuilt_) total += piece->bytes.size();
  return total;
}

size_t ParityStore::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return members_.empty() ? 0 : 2 * block_bytes_;
}

}  // namespace peerstate
