#include "replication/replicator.h"

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "common/crc32c.h"
#include "common/host_memory.h"
#include "common/thread_name.h"
#include "net/wire.h"
#include "replication/process_memory.h"
#include "store/parity.h"

namespace peerstate {

struct Replicator::Round {
  int64_t version = -1;
  std::vector<HolderResult> results;
  std::vector<std::thread> threads;
  bool joined = false;

  void join() {
    if (joined) return;
    for (auto& t : threads) t.join();
    joined = true;
  }
};

Replicator::Replicator(SnapshotStore* store, Transport* transport, int rank)
    : store_(store), transport_(transport), rank_(rank) {}

Replicator::~Replicator() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (round_) round_->join();
}

Status Replicator::replicate(int64_t version, const std::vector<int>& holders) {
  std::vector<Target> targets;
  for (int holder : holders) targets.push_back(Target{holder, 0, 0, UINT32_MAX});
  return start_round(version, targets, nullptr);
}

Status Replicator::push_pieces(int64_t version, const std::vector<int>& members, size_t self,
                               const ParityStore* own, long wait_ms) {
  if (members.size() < 3 || self >= members.size())
    return Status(StatusCode::kInvalidArgument, "push_pieces: member " + std::to_string(self) + " of a group of " +
                                                    std::to_string(members.size()) + " (groups have 3 or more)");
  if (members[self] != rank_)
    return Status(StatusCode::kInvalidArgument, "push_pieces: member " + std::to_string(self) + " is rank " +
                                                    std::to_string(members[self]) + ", not this rank (" +
                                                    std::to_string(rank_) + ")");
  const size_t g = members.size();
  return start_round(version, {}, [&](const Layout& layout) {
    std::vector<Target> targets;
    for (size_t piece = 0; piece + 1 < g; piece++) {
      const ParityPiece p = parity_piece(layout, g, piece);
      targets.push_back(
          Target{members[parity_holder(self, piece, g)], kParityStore, p.first_chunk, p.end_chunk, nullptr, wait_ms});
    }
    if (own != nullptr) targets.push_back(Target{rank_, 0, 0, 0, own, wait_ms});
    return targets;
  });
}

Status Replicator::start_round(int64_t version, std::vector<Target> targets,
                               const std::function<std::vector<Target>(const Layout&)>& targets_of) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (round_) round_->join();  // back-pressure: one round in flight
  VersionView view;
  PEERSTATE_RETURN_IF_ERROR(store_->view(version, &view));
  if (view.checksums.empty())
    return Status(StatusCode::kInvalidArgument,
                  "replication needs per-chunk checksums: create the SnapshotStore with checksums on");
  const VersionMeta meta = meta_of(rank_, view);
  if (targets_of) targets = targets_of(*meta.layout);
  auto round = std::make_shared<Round>();
  round->version = version;
  round->results.resize(targets.size());
  for (size_t i = 0; i < targets.size(); i++) {
    round->results[i].holder = targets[i].holder;
    const Target target = targets[i];
    // The pin keeps the slot from reuse until the send ends, whatever the caller snapshots meanwhile.
    round->threads.emplace_back([this, round = round.get(), i, meta, target, data = view.mutable_data, pin = view.pin] {
      name_this_thread("ps-push");
      if (target.own != nullptr) {
        round->results[i].status = target.own->wait_complete(meta.version, deadline_after_ms(target.wait_ms));
        return;
      }
      const uint32_t end = std::min<uint32_t>(target.end_chunk, static_cast<uint32_t>(meta.layout->chunks.size()));
      ChunkQueue queue(target.first_chunk, end);
      TransferPlan plan{meta, data, &queue, target.store};
      Status& st = round->results[i].status;
      st = transport_->send(target.holder, plan);
      // A parity holder that has not joined its group yet refuses the begin (nothing was
      // sent): it is about to (a member at its first step, a replacement after its pull),
      // and its block of this version needs the piece, so ask again, up to wait_ms.
      const Deadline deadline = deadline_after_ms(target.wait_ms);
      for (long pause = 5; target.store == kParityStore && st.code() == StatusCode::kNotFound &&
                           Clock::now() + std::chrono::milliseconds(pause) < deadline;
           pause = std::min(2 * pause, 200L)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(pause));
        ChunkQueue again(target.first_chunk, end);
        plan.queue = &again;
        st = transport_->send(target.holder, plan);
      }
    });
  }
  round_ = std::move(round);
  return Status::Ok();
}

Status Replicator::wait(int64_t version, std::vector<HolderResult>* results) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!round_ || round_->version != version)
    return Status(StatusCode::kNotFound, "no replication round of version " + std::to_string(version) +
                                             (round_ ? " (the latest is " + std::to_string(round_->version) + ")"
                                                     : std::string(" (none started)")));
  round_->join();
  *results = round_->results;
  return Status::Ok();
}

int64_t Replicator::in_flight_version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return round_ && !round_->joined ? round_->version : -1;
}

Status Replicator::pull(const std::vector<PullSource>& sources, int64_t version, int64_t* pulled,
                        PullStats* stats, const VersionMeta* known) {
  if (stats != nullptr) *stats = PullStats();
  if (sources.empty()) return Status(StatusCode::kNotFound, "no source to pull from");
  // One metadata round trip to the first source that answers; then every
  // source serves chunks. One that lacks the version fails its first chunk
  // and gives it back, so asking them all costs nothing.
  VersionMeta meta = known != nullptr ? *known : VersionMeta();
  std::string failures;
  bool only_not_found = true;
  for (size_t i = 0; known == nullptr && i < sources.size(); i++) {
    const PullSource& s = sources[i];
    Status st = transport_->describe(s.peer, s.rank, version, s.store, &meta);
    if (st.ok()) break;
    only_not_found &= st.code() == StatusCode::kNotFound;
    failures += "; rank " + std::to_string(s.peer) + ": " + st.message();
  }
  const std::string what = (version < 0 ? std::string("the newest version") : "version " + std::to_string(version)) +
                           " of rank " + std::to_string(sources[0].rank);
  if (!meta.layout)
    return only_not_found ? Status(StatusCode::kNotFound, "no source holds " + what + failures)
                          : Status(StatusCode::kConnectionError, "pull of " + what + " failed: no source left" + failures);
  unsigned char* region = nullptr;
  PEERSTATE_RETURN_IF_ERROR(store_->drop_newer(meta.version - 1));
  PEERSTATE_RETURN_IF_ERROR(store_->begin_receive(meta.version, meta.layout, &region));
  ChunkQueue queue(meta.layout->chunks.size());
  std::vector<Status> results(sources.size());
  auto run = [&](bool from_memory) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < sources.size(); i++) {
      const PullSource& s = sources[i];
      if (from_memory && (s.pid <= 0 || s.region == 0 || meta.version != version)) continue;
      threads.emplace_back([&, i, from_memory] {
        name_this_thread("ps-pull");
        TransferPlan plan{meta, region, &queue};
        plan.meta.source_rank = sources[i].rank;
        plan.store = sources[i].store;
        results[i] = from_memory ? receive_from_process(sources[i].pid, sources[i].region, plan)
                                 : transport_->receive(sources[i].peer, plan);
      });
    }
    for (auto& t : threads) t.join();
  };
  run(/*from_memory=*/true);
  if (stats != nullptr) *stats = PullStats{meta.layout->chunks.size(), queue.done_count()};
  if (!queue.finished()) run(/*from_memory=*/false);
  if (!queue.finished()) {
    (void)store_->end_receive(meta.version, meta.checksums, false);
    std::string why;
    for (size_t i = 0; i < sources.size(); i++)
      why += "; rank " + std::to_string(sources[i].peer) + ": " + (results[i].ok() ? "ok" : results[i].message());
    return Status(StatusCode::kConnectionError,
                  "pull of " + what + " failed with " + std::to_string(meta.layout->chunks.size() - queue.done_count()) +
                      " of " + std::to_string(meta.layout->chunks.size()) + " chunks missing: no source left" + why);
  }
  PEERSTATE_RETURN_IF_ERROR(store_->end_receive(meta.version, meta.checksums, true));
  *pulled = meta.version;
  return Status::Ok();
}

Status Replicator::rebuild_piece(ParityStore* parity, int lost_rank, int64_t version) {
  std::shared_ptr<const ParityVersion> block;
  PEERSTATE_RETURN_IF_ERROR(parity->get(version, &block));
  auto lost = block->contributions.find(lost_rank);
  if (lost == block->contributions.end())
    return Status(StatusCode::kInvalidArgument, "rank " + std::to_string(lost_rank) +
                                                    " sends no piece to this holder (not another member of its group)");
  std::vector<std::pair<int, const ParityContribution*>> survivors;
  for (const auto& [rank, contribution] : block->contributions)
    if (rank != lost_rank) survivors.emplace_back(rank, &contribution);
  std::vector<HostRegion> pieces(survivors.size());
  std::vector<Status> results(survivors.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < survivors.size(); i++) {
    threads.emplace_back([&, i] {
      name_this_thread("ps-rebuild");
      const auto& [rank, c] = survivors[i];
      if (c->piece.nbytes == 0) return;
      results[i] = pieces[i].allocate(c->piece.nbytes);
      if (!results[i].ok()) return;
      ChunkQueue queue(c->piece.first_chunk, c->piece.end_chunk);
      TransferPlan plan{c->meta, pieces[i].data(), &queue, 0, c->piece.region_offset};
      results[i] = transport_->receive(rank, plan);
      if (results[i].ok() && !queue.finished())
        results[i] = Status(StatusCode::kConnectionError, "its piece did not arrive whole");
    });
  }
  for (auto& t : threads) t.join();
  std::string failed;
  StatusCode code = StatusCode::kOk;
  for (size_t i = 0; i < survivors.size(); i++) {
    if (results[i].ok()) continue;
    failed += "; rank " + std::to_string(survivors[i].first) + ": " + results[i].message();
    // A survivor whose bytes failed their checksum served another state: that, not its connection, is the news.
    if (code == StatusCode::kOk || results[i].code() == StatusCode::kChecksumMismatch) code = results[i].code();
  }
  const std::string what = "version " + std::to_string(version) + " of rank " + std::to_string(lost_rank);
  if (!failed.empty()) {
    if (code != StatusCode::kChecksumMismatch) code = StatusCode::kConnectionError;
    return Status(code, "cannot rebuild the piece of " + what + " held here" + failed);
  }

  auto out = std::make_shared<RebuiltPiece>();
  out->meta = lost->second.meta;
  out->piece = lost->second.piece;
  PEERSTATE_RETURN_IF_ERROR(out->bytes.allocate(parity->block_bytes()));
  std::vector<ParitySource> sources{{block->block.data(), parity->block_bytes()}};
  for (size_t i = 0; i < survivors.size(); i++)
    sources.emplace_back(pieces[i].data(), survivors[i].second->piece.nbytes);
  // On the store's copy threads (their shared pool): a recovery takes no snapshot while it rebuilds,
  // and the XOR of g - 1 pieces is memory-bound, which one thread leaves at a fraction of a host's bandwidth.
  PEERSTATE_RETURN_IF_ERROR(
      ParityCoder(store_->options().threads).xor_blocks(out->bytes.data(), parity->block_bytes(), sources, false));
  // Every chunk against the checksum its member sent: a survivor that served
  // another state under that version number cannot slip a wrong rebuild through.
  const Layout& layout = *out->meta.layout;
  for (uint32_t c = out->piece.first_chunk; c < out->piece.end_chunk; c++) {
    const ChunkPlacement& chunk = layout.chunks[c];
    uint32_t crc = 0;
    for (uint32_t s = chunk.first_segment; s < chunk.first_segment + chunk.segment_count; s++) {
      const Segment& seg = layout.segments[s];
      crc = crc32c_extend(crc, out->bytes.data() + seg.region_offset - out->piece.region_offset, seg.nbytes);
    }
    if (crc != out->meta.checksums[c])
      return Status(StatusCode::kChecksumMismatch,
                    "the rebuilt chunk " + std::to_string(c) + " of " + what +
                        " does not match its checksum: a survivor's snapshot of that version is not the one it pushed");
  }
  return parity->keep_rebuilt(std::move(out));
}

Status Replicator::pull_pieces(const std::vector<int>& members, size_t lost, int64_t version, int64_t* pulled) {
  const size_t g = members.size();
  if (g < 3 || lost >= g)
    return Status(StatusCode::kInvalidArgument, "pull_pieces: member " + std::to_string(lost) + " of a group of " +
                                                    std::to_string(g) + " (groups have 3 or more)");
  const int rank = members[lost];
  const std::string what = "version " + std::to_string(version) + " of rank " + std::to_string(rank);
  // Every holder must have rebuilt its piece before any chunk is asked for: a
  // holder still rebuilding answers kNotFound here, which the caller may retry,
  // rather than failing the transfer halfway.
  VersionMeta meta;
  std::string failures;
  bool only_not_found = true;
  for (size_t t = 0; t + 1 < g; t++) {
    const int holder = members[parity_holder(lost, t, g)];
    VersionMeta described;
    Status st = transport_->describe(holder, rank, version, kParityStore, &described);
    if (!st.ok()) {
      failures += "; rank " + std::to_string(holder) + ": " + st.message();
      only_not_found &= st.code() == StatusCode::kNotFound;
    } else if (!meta.layout) {
      meta = std::move(described);
    }
  }
  if (!failures.empty())
    return Status(only_not_found ? StatusCode::kNotFound : StatusCode::kConnectionError,
                  "not every holder of the parity group has rebuilt its piece of " + what + failures);
  PEERSTATE_RETURN_IF_ERROR(store_->drop_newer(meta.version - 1));
  unsigned char* region = nullptr;
  PEERSTATE_RETURN_IF_ERROR(store_->begin_receive(meta.version, meta.layout, &region));
  std::vector<Status> results(g - 1);
  std::vector<std::unique_ptr<ChunkQueue>> queues;
  std::vector<std::thread> threads;
  for (size_t t = 0; t + 1 < g; t++) {
    const ParityPiece piece = parity_piece(*meta.layout, g, t);
    queues.push_back(std::make_unique<ChunkQueue>(piece.first_chunk, piece.end_chunk));
    threads.emplace_back([&, t, queue = queues.back().get()] {
      name_this_thread("ps-pull");
      TransferPlan plan{meta, region, queue, kParityStore};
      results[t] = transport_->receive(members[parity_holder(lost, t, g)], plan);
    });
  }
  for (auto& t : threads) t.join();
  std::string missing;
  for (size_t t = 0; t + 1 < g; t++)
    if (!queues[t]->finished())
      missing += "; piece " + std::to_string(t) + " from rank " + std::to_string(members[parity_holder(lost, t, g)]) +
                 ": " + (results[t].ok() ? std::string("incomplete") : results[t].message());
  if (!missing.empty()) {
    (void)store_->end_receive(meta.version, meta.checksums, false);
    return Status(StatusCode::kConnectionError, "pull of " + what + " from its parity group failed" + missing);
  }
  PEERSTATE_RETURN_IF_ERROR(store_->end_receive(meta.version, meta.checksums, true));
  *pulled = meta.version;
  return Status::Ok();
}

}  // namespace peerstate
