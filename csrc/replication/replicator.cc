#include "replication/replicator.h"

#include <algorithm>

#include "common/thread_name.h"
#include "replication/process_memory.h"

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
  std::lock_guard<std::mutex> lock(mutex_);
  if (round_) round_->join();  // back-pressure: one round in flight
  VersionView view;
  PEERSTATE_RETURN_IF_ERROR(store_->view(version, &view));
  if (view.checksums.empty())
    return Status(StatusCode::kInvalidArgument,
                  "replication needs per-chunk checksums: create the SnapshotStore with checksums on");
  auto round = std::make_shared<Round>();
  round->version = version;
  round->results.resize(holders.size());
  const VersionMeta meta = meta_of(rank_, view);
  for (size_t i = 0; i < holders.size(); i++) {
    round->results[i].holder = holders[i];
    // The pin keeps the slot from reuse until the send ends, whatever the caller snapshots meanwhile.
    round->threads.emplace_back([this, round = round.get(), i, meta, data = view.mutable_data, pin = view.pin] {
      name_this_thread("ps-push");
      ChunkQueue queue(meta.layout->chunks.size());
      TransferPlan plan{meta, data, &queue};
      round->results[i].status = transport_->send(round->results[i].holder, plan);
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

}  // namespace peerstate
