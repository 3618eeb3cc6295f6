#include "replication/process_memory.h"

#include <string>

#include "common/process_memory_read.h"

namespace peerstate {
namespace {

// Reads the bytes of chunk `c` of a version laid out as `layout` from `remote_region`
// in `pid` into `dst` (the chunk's place in a local region); sets *crc.
Status read_chunk(pid_t pid, uintptr_t remote_region, const Layout& layout, uint32_t c, unsigned char* dst,
                  uint32_t* crc) {
  uintptr_t from = remote_region + layout.chunks[c].offset;
  auto read = [&](unsigned char* to, size_t max, size_t* got) {
    PEERSTATE_RETURN_IF_ERROR(read_process_memory(pid, from, to, max, got));
    from += *got;
    return Status::Ok();
  };
  return fill_chunk(layout, c, dst, read, crc);
}

Status corrupt_chunk(pid_t pid, uint32_t c) {
  return Status(StatusCode::kChecksumMismatch,
                "chunk " + std::to_string(c) + " read from process " + std::to_string(pid) + " failed its CRC32C");
}

}  // namespace

Status receive_from_process(pid_t pid, uintptr_t remote_region, const TransferPlan& plan) {
  const Layout& layout = *plan.meta.layout;
  uint32_t c;
  while (plan.queue->take(&c)) {
    uint32_t crc = 0;
    unsigned char* place = plan.region + layout.chunks[c].offset - plan.region_base;
    Status st = read_chunk(pid, remote_region, layout, c, place, &crc);
    if (st.ok() && crc != plan.meta.checksums[c]) st = corrupt_chunk(pid, c);
    if (!st.ok()) {
      plan.queue->give_back(c);
      return st;
    }
    plan.queue->complete(c);
  }
  return Status::Ok();
}

Status adopt_replica_from_process(pid_t pid, uintptr_t remote_region, const VersionMeta& meta, ReplicaStore* store) {
  if (store->device() != kHostDevice)
    return Status(StatusCode::kUnavailable, "a replica held in device memory cannot be adopted from another process");
  const Layout& layout = *meta.layout;
  if (store->reservation(meta.source_rank) < layout.region_bytes)
    PEERSTATE_RETURN_IF_ERROR(store->reserve(meta.source_rank, layout.region_bytes));
  PEERSTATE_RETURN_IF_ERROR(store->begin(meta));
  for (uint32_t c = 0; c < layout.chunks.size(); c++) {
    ReplicaStore::ChunkWrite write;
    PEERSTATE_RETURN_IF_ERROR(store->expect_chunk(meta.source_rank, meta.version, c, layout.chunks[c].nbytes, &write));
    uint32_t crc = 0;
    PEERSTATE_RETURN_IF_ERROR(
        read_chunk(pid, remote_region, layout, c, write.version->region.data() + layout.chunks[c].offset, &crc));
    if (crc != meta.checksums[c]) {
      (void)store->chunk_arrived(&write, crc);  // fails the incoming version: it never commits
      return corrupt_chunk(pid, c);
    }
    PEERSTATE_RETURN_IF_ERROR(store->chunk_arrived(&write, crc));
  }
  // Every chunk is in: the commit does not wait.
  return store->commit(meta.source_rank, meta.version, deadline_after_ms(1000));
}

}  // namespace peerstate
